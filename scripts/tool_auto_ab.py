"""A/B: constrained vs unconstrained "auto" tool calls, in-process engine (default model, float32).

    python scripts/tool_auto_ab.py --rounds 5 --batch 8

A few-shot prompt makes the default model call ``get_weather`` under "auto" (every output of the
batch is a call). The arms run alternately (free, constrained, constrained without jump-forward;
the reverse order on odd rounds), each on a flushed cache with the prompts prefilled first, so the
timed part is the decode. Prints each arm's median wall time per batch, calls/s and the
constrained/free ratio of calls/s. The machine's load moves every number: compare the ratio of
alternated runs, never one run.
"""
import argparse
import statistics
import time

from sglite import Engine
from sglite.server.tool_calls import ToolPlan, parse_tool_calls, render_prompt
from sglite.server.tool_constraint import apply_constraint
from sglite.server.tool_parsers.formats import get_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city"]}}}
CITIES = ["Paris", "Lima", "Oslo", "Tokyo", "Cairo", "Quito", "Rome", "Seoul", "Dakar", "Hanoi", "Lagos", "Delhi",
          "Perth", "Austin", "Bern", "Riga"]


def shots(city: str) -> list[dict]:
    """Two worked calls, then the question about ``city``."""
    m: list[dict] = []
    for ex in ("Berlin", "Madrid"):
        m += [{"role": "user", "content": f"What is the weather in {ex}?"},
              {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                               '{"city": "%s", "unit": "celsius"}}\n</tool_call>' % ex},
              {"role": "user", "content": "It is 20 degrees and sunny. Next question."}]
    return m[:-1] + [{"role": "user", "content": f"Thanks. What is the weather in {city}?"}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    eng = Engine(dtype="float32")
    plan = ToolPlan("auto", [WEATHER], fmt=get_format("qwen25"))
    prompts = [render_prompt(eng, shots(CITIES[i % len(CITIES)]), plan) for i in range(a.batch)]
    base = {"temperature": 0, "max_new_tokens": 64}
    con = dict(base)
    apply_constraint(con, {}, plan, engine=eng)

    def run(sp: dict, jump: bool = True) -> tuple[float, int, int]:
        eng.scheduler.out.enable_jump_forward = jump
        eng.flush_cache()
        eng.generate(prompts, [dict(base, max_new_tokens=1)] * len(prompts))  # prefill: decode is what differs
        t0 = time.perf_counter()
        outs = eng.generate(prompts, [sp] * len(prompts))
        dt = time.perf_counter() - t0
        toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
        return dt, toks, sum(len(parse_tool_calls(o["text"], plan)[1]) for o in outs)

    run(base)
    run(con)  # warm-up (the grammar is compiled and cached)
    arms = [("free", base, True), ("constrained", con, True), ("constrained-nojump", con, False)]
    res: dict = {name: [] for name, _, _ in arms}
    for r in range(a.rounds):
        for name, sp, jump in (arms if r % 2 == 0 else arms[::-1]):
            res[name].append(run(sp, jump))
    med = {}
    for name, rows in res.items():
        med[name] = statistics.median(d for d, _, _ in rows)
        print(f"{name:18s} wall/batch median {med[name]:.3f} s, all {[round(d, 3) for d, _, _ in rows]}; "
              f"tokens {rows[0][1]}, calls {rows[0][2]}, calls/s {rows[0][2] / med[name]:.2f}")
    print(f"constrained/free calls/s: {med['free'] / med['constrained']:.3f}; "
          f"without jump-forward: {med['free'] / med['constrained-nojump']:.3f}")
    eng.shutdown()


if __name__ == "__main__":
    main()
