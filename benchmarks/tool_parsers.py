"""Benchmark: what streaming the output through the tool-call and reasoning parsers costs, per family.

    python benchmarks/tool_parsers.py [--chars 20000] [--chunk 4] [--repeats 3]

Each case feeds one output to a fresh parser in ``--chunk``-character pieces (the server feeds the
text so far on every engine event), best of ``--repeats``, and prints one JSON line: the case, the
total milliseconds and the microseconds per character. Target: linear in the output (the per-character
cost stays flat as ``--chars`` grows): a parser that rescans what it has seen shows up as a per-character
cost that doubles with ``--chars``.
"""
from __future__ import annotations

import argparse
import json
import time

from sglite.server.reasoning import REASONING_FORMATS, ReasoningStreamer
from sglite.server.tool_calls import ToolPlan
from sglite.server.tool_parsers import FORMATS, get_format
from sglite.server.tool_stream import ToolCallStreamer

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def stream_tools(family: str, text: str, chunk: int) -> None:
    s = ToolCallStreamer(ToolPlan("auto", [TOOL], fmt=get_format(family)))
    for j in range(chunk, len(text), chunk):
        s.feed(text[:j])
    s.finish(text, "stop")


def stream_reasoning(text: str, chunk: int) -> None:
    s = ReasoningStreamer(REASONING_FORMATS["qwen3"])
    for j in range(0, len(text), chunk):
        s.feed(text[j:j + chunk])
    s.finish()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=20000)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    plain = ("The quick brown fox jumps over the lazy dog. " * (a.chars // 45 + 1))[:a.chars]
    cases = {f"{f} plain answer": (lambda f=f: stream_tools(f, plain, a.chunk)) for f in sorted(FORMATS)}
    for f in sorted(FORMATS):
        call = get_format(f).render_calls([("get_time", {"tz": "x" * a.chars})])
        cases[f"{f} one call, long argument"] = lambda f=f, call=call: stream_tools(f, call, a.chunk)
    think = "<think>" + ("hmm " * (a.chars // 4)) + "</think>answer"
    cases["qwen3 reasoning"] = lambda: stream_reasoning(think, a.chunk)
    for name, fn in cases.items():
        best = float("inf")
        for _ in range(a.repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        print(json.dumps({"case": name, "ms": round(best * 1e3, 2), "us_per_char": round(best * 1e6 / a.chars, 3)}))


if __name__ == "__main__":
    main()
