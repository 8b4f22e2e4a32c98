"""Constrained "auto" tool calls vs unconstrained "auto": output-token throughput (issue 34 target:
constrained >= 0.95x unconstrained, the grammar engine's cost in the noise).

    .venv/bin/python benchmarks/constrained_auto.py [--model-path P] [--batch 8] [--max-new-tokens 96]
                                                    [--pairs 3] [--disable-jump-forward]
                                                    [--speculative-algorithm NGRAM] [--dtype float32]

Both runs send the same chat prompts (a weather tool shown through the chat template, or the
Hermes system prompt when the template ignores tools, and two example calls earlier in the
conversation so that a small model writes calls too) to one engine, greedy, and count output
tokens per second over the whole batch; the constrained run adds the structural tag the server
builds for "auto" (:func:`sglite.server.tool_constraint.auto_tools_format`). Runs alternate A/B
``--pairs`` times (the first pair also warms the grammar caches) and the report gives each
pair's ratio and the median; it also counts the calls each run produced and how many parse.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from sglite import Engine
from sglite.server.tool_calls import ToolPlan, parse_tool_calls, render_prompt
from sglite.server.tool_constraint import auto_tools_format
from sglite.server.tool_parsers.formats import get_format

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Accra", "Hanoi", "Perth", "Bern", "Riga"]


def run(engine, prompts, sp):
    t = time.perf_counter()
    outs = engine.generate(prompts, [dict(sp) for _ in prompts])
    dt = time.perf_counter() - t
    toks = sum(len(o["output_ids"]) for o in outs)
    plan = ToolPlan("auto", TOOLS)
    calls = [parse_tool_calls(o["text"], plan)[1] for o in outs]
    opened = sum(o["text"].count("<tool_call>") for o in outs)
    return toks / dt, toks, opened, sum(len(c) for c in calls)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--disable-jump-forward", action="store_true",
                    help="engine without jump-forward (forced text generated token by token)")
    ap.add_argument("--speculative-algorithm", default=None, help="e.g. NGRAM (6 draft tokens)")
    ap.add_argument("--dtype", default=None, help="engine dtype (default: the engine's; float32 as constrained_e2e)")
    args = ap.parse_args()
    kw = {"enable_jump_forward": False} if args.disable_jump_forward else {}
    if args.dtype:
        kw["dtype"] = args.dtype
    if args.speculative_algorithm:
        kw.update(speculative_algorithm=args.speculative_algorithm, speculative_num_draft_tokens=6)
    engine = Engine(args.model_path, **kw) if args.model_path else Engine(**kw)
    try:
        shot = [{"role": "user", "content": "What is the weather in Berlin? Use the tool."},
                {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                 '{"city": "Berlin", "unit": "celsius"}}\n</tool_call>'},
                {"role": "user", "content": "And in Madrid?"},
                {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                 '{"city": "Madrid", "unit": "celsius"}}\n</tool_call>'}]
        msgs = [shot + [{"role": "user", "content": f"And in {c}?"}] for c in CITIES[:args.batch]]
        prompts = [render_prompt(engine, m, ToolPlan("auto", TOOLS)) for m in msgs]
        tag = json.dumps({"type": "structural_tag", "format": auto_tools_format(TOOLS, get_format(None), True)})
        base = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
        ratios = []
        for i in range(args.pairs):
            order = [("free", base), ("constrained", dict(base, structural_tag=tag))]
            if i % 2:
                order.reverse()  # alternate which goes first
            res = {name: run(engine, prompts, sp) for name, sp in order}
            r = res["constrained"][0] / res["free"][0]
            ratios.append(r)
            print(f"pair {i}: " + "  ".join(f"{n}: {v[0]:.1f} tok/s ({v[1]} tokens, {v[2]} calls opened, "
                                             f"{v[3]} parsed)" for n, v in res.items()) + f"  ratio {r:.3f}")
        print(f"median constrained/free throughput ratio: {statistics.median(ratios):.3f} "
              f"(pairs after the first: {', '.join(f'{r:.3f}' for r in ratios[1:])})")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
