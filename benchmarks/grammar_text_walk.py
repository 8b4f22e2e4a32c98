"""Benchmark: walking text through a grammar matcher (``accept_string``), CPU µs per byte (issue 13).

    python benchmarks/grammar_text_walk.py [--repeats 3] [--checkout PATH]

Each case compiles a fresh grammar (no cached DFA rows: the cold walk a request pays when a client
forces a long prefix, or a jump-forward string crosses a long bounded field) and walks one text
through it with ``GrammarMatcher.accept_string``. Times are ``time.process_time`` (CPU of this
process) so that other load on a shared machine inflates them less; the minimum over ``--repeats``
fresh compiles is reported. ``--checkout PATH`` runs the same cases again with another checkout's
``sglite`` (e.g. ``main``) in a child process and prints both, for side-by-side ratios.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time


def cases():
    body = "hello wörld, \\\"quoted\\\" "
    nested = json.dumps({"a": [body * 20, {"b": body * 20}], "c": {"d": [1, 2.5, None, True]}}, separators=(",", ":"))
    string_schema = lambda n: {"type": "object", "properties": {"s": {"type": "string", "maxLength": n}},  # noqa: E731
                               "required": ["s"], "additionalProperties": False}
    return {
        "regex_free_1k": ("regex", r"[a-z ]*", ("hello world " * 90)[:1000]),
        "regex_bounded_1k": ("regex", r"[a-z ]{0,4000}", ("hello world " * 90)[:1000]),
        "json_string_1k": ("json_schema", string_schema(None) | {"properties": {"s": {"type": "string"}}},
                           '{"s":"' + (body * 50)[:1000] + '"}'),
        "json_string_max65536_1k": ("json_schema", string_schema(65536), '{"s":"' + (body * 50)[:1000] + '"}'),
        "json_string_max65536_full": ("json_schema", string_schema(65536),
                                      '{"s":"' + ("hello world " * 6000)[:65536] + '"}'),
        "json_object_nested": ("json_object", None, nested),
    }


def measure(repeats: int) -> dict:
    from sglite.constrained import GrammarBackend, TokenizerInfo

    info = TokenizerInfo([bytes([i]) for i in range(256)], {0}, 256)  # accept_string never reads the vocab
    GrammarBackend(info).compile("regex", "ab").matcher().accept_string("ab")  # one-time imports
    out = {}
    for name, (kind, spec, text) in cases().items():
        data = text.encode()
        best = None
        for _ in range(repeats):
            m = GrammarBackend(info).compile(kind, spec).matcher()
            gc.collect()  # start each walk without a pending full collection (torch's objects)
            t0 = time.process_time()
            ok = m.accept_string(data)
            dt = time.process_time() - t0
            assert ok, name
            best = dt if best is None else min(best, dt)
        out[name] = {"bytes": len(data), "us_per_byte": round(best / len(data) * 1e6, 2)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--checkout", default=None, help="another checkout whose sglite to run the same cases with")
    p.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    mine = measure(args.repeats)
    if args.json_only:
        print(json.dumps(mine))
        return 0
    rows = {"this": mine}
    if args.checkout:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.checkout))
        res = subprocess.run([sys.executable, __file__, "--repeats", str(args.repeats), "--json-only"],
                             env=env, capture_output=True, text=True, cwd=args.checkout, check=True)
        rows["other"] = json.loads(res.stdout.strip().splitlines()[-1])
    for name in mine:
        line = {"case": name, **{f"{k}_us_per_byte": v[name]["us_per_byte"] for k, v in rows.items()},
                "bytes": mine[name]["bytes"]}
        if "other" in rows:
            line["speedup"] = round(rows["other"][name]["us_per_byte"] / max(mine[name]["us_per_byte"], 1e-3), 1)
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
