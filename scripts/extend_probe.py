import time, sys
from sglite import Engine
from sglite.testing import word_prompts
e = Engine(max_total_tokens=16384) if len(sys.argv) < 2 else Engine(model_path=sys.argv[1], max_total_tokens=16384)
tok = e.tokenizer
base = " ".join(["The history of the conversation goes on and on."] * 80)
sp = {"max_new_tokens": 1, "temperature": 0}
for k in range(3):
    pre = base + f" variant {k}."
    e.generate(pre, sp)  # cache it
    t = time.perf_counter(); e.generate(pre + " And a new question about the weather in Paris today?" * 4, sp); t1 = time.perf_counter() - t
    t = time.perf_counter(); e.generate(f"A fresh {k} prompt about something " * 12, sp); t2 = time.perf_counter() - t
    t = time.perf_counter(); outs = e.generate([pre + f" q{j} about the weather in city {j}?" * 3 for j in range(8)], [sp]*8); t3 = time.perf_counter() - t
    print(f"extend-60-over-700 {t1*1e3:.0f} ms; fresh-100 {t2*1e3:.0f} ms; 8x extend {t3*1e3:.0f} ms", [o["meta_info"]["cached_tokens"] for o in outs][:3], len(tok.encode(pre)))
e.shutdown()
