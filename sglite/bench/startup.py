"""``sglite bench startup``: how long a fresh process takes to import sglite, build an Engine and generate.

    sglite bench startup [--repeats 3] [--warmup 0] [--model-path P] [--max-total-tokens 16384] [--dtype bfloat16]
                         [--engine-args="--disable-radix-cache"] [--new-tokens 8] [--output-json startup.json]

Each repeat is a new Python process (``python -c``, so nothing is imported before the clock
starts) that times, in wall-clock seconds:

* ``import_s`` – ``import sglite`` (light: no torch);
* ``engine_import_s`` – the first ``sglite.Engine`` attribute access (torch, the model code);
* ``engine_init_s`` – ``sglite.Engine(**opts)`` until it returns, ready for requests
  (checkpoint load, weights, KV pool, scheduler thread);
* ``engine_ready_s`` – ``engine_import_s + engine_init_s``: ``sglite.Engine(**opts)`` in a fresh process;
* ``first_generate_s`` – the first ``generate`` of ``--new-tokens`` greedy tokens (ignore EOS);
* ``total_s`` – from the child's first line to the end of that generate;
* ``interpreter_s`` – from the parent spawning the child to the child's first line (Python start-up);
* ``process_wall_s`` – spawn to exit as the parent sees it (includes shutdown).

Before the repeats the parent resolves the checkpoint once (``load_checkpoint``), so no repeat
pays the one-time GGUF conversion of the default model: the numbers are for the *cached* model.
The C++ CPU kernels are built on first use into the same cache; a fresh cache makes the first
process pay that build inside ``engine_init_s`` (``--warmup 1`` runs one untimed child first).
Output: a table (mean / median / min / max over the repeats) and ``--output-json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from .report import HelpFormatter, format_table, write_json

PHASES = ("interpreter_s", "import_s", "engine_import_s", "engine_init_s", "engine_ready_s", "first_generate_s",
          "total_s", "process_wall_s")
COLUMNS = (("phase", "phase"), ("mean", "mean (s)"), ("median", "median (s)"), ("min", "min (s)"),
           ("max", "max (s)"))

# Runs in the child. Kept free of sglite imports until the clock has started.
_CHILD = r"""
import time
_t0, _w0 = time.perf_counter(), time.time()
import json, sys
import sglite
_t1 = time.perf_counter()
cls = sglite.Engine
_t2 = time.perf_counter()
opts, prompt, params, out_path = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
engine = cls(**opts)
_t3 = time.perf_counter()
out = engine.generate(prompt, params)
_t4 = time.perf_counter()
engine.shutdown()
with open(out_path, "w") as f:
    json.dump({"child_start_wall": _w0, "import_s": _t1 - _t0, "engine_import_s": _t2 - _t1,
               "engine_init_s": _t3 - _t2, "engine_ready_s": _t3 - _t1, "first_generate_s": _t4 - _t3,
               "total_s": _t4 - _t0, "output_tokens": out["meta_info"]["completion_tokens"]}, f)
"""


def measure_once(engine_kwargs: dict, prompt: str = "Hello", new_tokens: int = 8, timeout_s: float = 900.0,
                 env: Optional[dict] = None) -> dict:
    """One fresh child process; returns its phase times (seconds, keys of :data:`PHASES`) and
    ``output_tokens`` (tokens the first generate produced).

    Raises:
        RuntimeError: the child failed (its exit code and stderr tail in the message) or ran
            past ``timeout_s`` seconds.
    """
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    with tempfile.TemporaryDirectory(prefix="sglite-bench-startup-") as tmp:
        out_path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-c", _CHILD, json.dumps(engine_kwargs), prompt, json.dumps(params), out_path]
        w0, t0 = time.time(), time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                  env=env if env is not None else os.environ.copy(), cwd=tmp)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"startup child ran past --timeout-s {timeout_s:g} s") from exc
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"startup child exited with code {proc.returncode}:\n{proc.stderr[-3000:]}")
        with open(out_path) as f:
            res = json.load(f)
    res["interpreter_s"] = max(0.0, res.pop("child_start_wall") - w0)
    res["process_wall_s"] = wall
    return res


def summarize_runs(runs: Sequence[dict]) -> dict:
    """``{phase: {"mean", "median", "min", "max"}}`` (seconds) over ``runs``."""
    from .stats import percentile

    out = {}
    for ph in PHASES:
        vals = [r[ph] for r in runs]
        out[ph] = {"mean": sum(vals) / len(vals), "median": percentile(vals, 50), "min": min(vals), "max": max(vals)}
    return out


def engine_kwargs(a: argparse.Namespace) -> dict:
    """Engine keyword arguments: ``--engine-args`` (flags of ``sglite serve``) overridden by the
    explicit ``--model-path``, ``--dtype``, ``--max-total-tokens``, ``--num-threads``.

    Raises:
        ValueError: naming ``--engine-args`` when it has flags ``sglite serve`` does not know,
            or the option whose value the engine config rejects.
    """
    from sglite.runtime.engine_config import engine_config
    from sglite.launch_server import build_parser as server_parser, engine_kwargs as server_engine_kwargs

    try:
        kw = server_engine_kwargs(server_parser().parse_args(shlex.split(a.engine_args)))
    except SystemExit as exc:
        raise ValueError(f"--engine-args: not valid engine flags of `sglite serve`: {a.engine_args!r}") from exc
    for name in ("model_path", "dtype", "max_total_tokens", "num_threads"):
        if getattr(a, name) is not None:
            kw[name] = getattr(a, name)
    if kw.get("model_path"):
        kw["model_path"] = os.path.abspath(kw["model_path"])   # the children run in a temporary folder
    engine_config(**kw)   # bad values fail here, before any child starts
    return kw


def run(a: argparse.Namespace) -> dict:
    """Measure ``a.repeats`` fresh processes; returns the ``--output-json`` payload
    (``engine_kwargs``, ``runs``, ``summary`` per phase, ``median_<phase>`` flat keys)."""
    from sglite.runtime.model_loader import load_checkpoint

    kw = engine_kwargs(a)
    load_checkpoint(kw.get("model_path"))   # convert a GGUF once, outside the timed children
    for i in range(a.warmup):
        print(f"[bench startup] warm-up {i + 1}/{a.warmup} (untimed)", file=sys.stderr, flush=True)
        measure_once(kw, a.prompt, a.new_tokens, a.timeout_s)
    runs = []
    for i in range(a.repeats):
        print(f"[bench startup] repeat {i + 1}/{a.repeats}", file=sys.stderr, flush=True)
        runs.append(measure_once(kw, a.prompt, a.new_tokens, a.timeout_s))
    summary = summarize_runs(runs)
    return {"repeats": a.repeats, "warmup": a.warmup, "engine_kwargs": kw, "prompt": a.prompt,
            "new_tokens": a.new_tokens,
            "python": sys.executable, **{f"median_{ph}": summary[ph]["median"] for ph in PHASES},
            "summary": summary, "runs": runs}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglite bench startup", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="fresh processes measured")
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed fresh processes run first (e.g. to leave out a one-time kernel build)")
    p.add_argument("--model-path", default=None, help="HF folder or .gguf (default: the cached default model)")
    p.add_argument("--dtype", default=None, help="engine dtype (default: the engine's, auto)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool size in tokens (default: the engine's sizing)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads of the engine (default: the engine's, cores - 1)")
    p.add_argument("--engine-args", default="",
                   help='more engine flags of `sglite serve`, e.g. --engine-args="--disable-radix-cache"')
    p.add_argument("--prompt", default="Hello", help="prompt of the first generate")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens of the first generate")
    p.add_argument("--timeout-s", type=float, default=900.0, help="seconds one child may run")
    p.add_argument("--output-json", default=None, help="write runs and summary here (default: none)")
    return p


def check_args(a: argparse.Namespace) -> None:
    """Raises ValueError naming the flag: ``--repeats`` < 1, ``--warmup`` < 0, ``--new-tokens`` < 1,
    ``--timeout-s`` <= 0."""
    if a.repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {a.repeats}")
    if a.warmup < 0:
        raise ValueError(f"--warmup: must be >= 0, got {a.warmup}")
    if a.new_tokens < 1:
        raise ValueError(f"--new-tokens: must be >= 1, got {a.new_tokens}")
    if not a.timeout_s > 0:
        raise ValueError(f"--timeout-s: must be > 0, got {a.timeout_s}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``sglite bench startup``."""
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        check_args(a)
        out = run(a)
    except ValueError as exc:
        parser.error(str(exc))
    rows = [{"phase": ph, **out["summary"][ph]} for ph in PHASES]
    print(format_table(rows, COLUMNS, digits=3))
    if a.output_json:
        write_json(a.output_json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
