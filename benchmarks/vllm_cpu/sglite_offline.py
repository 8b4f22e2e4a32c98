"""sglite's side of the vLLM comparison: the same 48 prompts x 64 tokens through ``Engine.generate``.

    .venv/bin/python benchmarks/vllm_cpu/sglite_offline.py [--model-path P] [--num-threads N]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline import prompts  # noqa: E402  (the same prompt generator as vLLM's side)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="model (default: the default GGUF)")
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads (default: the engine's)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    a = ap.parse_args()
    from sglite.runtime.engine import Engine

    kw = {"num_threads": a.num_threads} if a.num_threads else {}
    eng = Engine(model_path=a.model_path, **kw)
    sp = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    ps = prompts(a.seed)
    eng.generate(ps[:2], sp)
    t = time.perf_counter()
    outs = eng.generate(ps, sp)
    dt = time.perf_counter() - t
    n = sum(o["meta_info"]["completion_tokens"] for o in outs)
    print(f"engine=sglite model={a.model_path or 'default'} tokens={n} {dt:.2f}s {n / dt:.1f} tok/s")
    eng.shutdown()


if __name__ == "__main__":
    main()
