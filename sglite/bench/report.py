"""Text tables and JSON result files for the sglite benchmarks (serving, sweep, offline)."""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

def jsonable(obj: Any) -> Any:
    """``obj`` with NaN/inf floats turned into None (strict JSON) and tuples/sets into lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def environment() -> dict:
    """Facts about the machine a result was measured on (host, CPUs, load, time)."""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "load_avg": load,
            "time": datetime.datetime.now().isoformat(timespec="seconds")}


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    """Write ``payload`` (plus an ``environment`` entry) as indented strict JSON; returns the path.

    Parent folders are created. NaN becomes null.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = dict(payload)
    data.setdefault("environment", environment())
    p.write_text(json.dumps(jsonable(data), indent=2, allow_nan=False) + "\n")
    return p


def fmt(value: Any, digits: int = 2) -> str:
    """A number for a table: ``-`` for None/NaN, integers as is, floats with ``digits`` decimals."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.{digits}f}"
    return str(value)


# (nested key of compute_metrics, section title, row name) in the order SGLang prints them
LATENCY_SECTIONS = (("e2e_ms", "End-to-End Latency", "E2E Latency"), ("ttft_ms", "Time to First Token", "TTFT"),
                    ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                    ("itl_ms", "Inter-Token Latency", "ITL"))
SERVING_WIDTH = 50


def format_serving(metrics: dict, title: str = "Serving Benchmark Result", extra: Optional[dict] = None) -> str:
    """The result block printed by ``sglite bench serving``, laid out as SGLang's ``bench_serving``.

    One ``label: value`` line each (label padded to 40 columns): ``extra`` rows first (e.g.
    ``Backend:``, ``Traffic request rate:``), then counts, duration (s), throughputs (req/s,
    tok/s), goodput and SLO attainment, then per latency (E2E, TTFT, TPOT, ITL) a ``----`` section
    with Mean / Median / P95 / P99 rows in milliseconds (ITL adds Max). ``metrics`` is a
    :func:`sglite.bench.stats.compute_metrics` dict; missing or NaN values print ``-``.
    """
    lines = [f" {title} ".center(SERVING_WIDTH, "=")]

    def row(label, value, digits=2):
        lines.append(f"{label:<40} {fmt(value, digits)}")

    for k, v in (extra or {}).items():
        row(k, v)
    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    row("Benchmark duration (s):", metrics["duration_s"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"])
    row("Input token throughput (tok/s):", metrics["input_throughput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Total token throughput (tok/s):", metrics["total_token_throughput"])
    if "concurrency" in metrics:
        row("Concurrency:", metrics["concurrency"])
    slo = [f"TTFT<={fmt(metrics.get('slo_ttft_ms'), 0)}ms" if metrics.get("slo_ttft_ms") is not None else "",
           f"TPOT<={fmt(metrics.get('slo_tpot_ms'), 0)}ms" if metrics.get("slo_tpot_ms") is not None else ""]
    row("Goodput (req/s):", metrics["goodput"])
    row("Goodput SLO:", " ".join(s for s in slo if s) or "none")
    row("SLO attainment:", metrics["slo_attainment"], 3)
    if "cache_hit_rate" in metrics:
        row("Cache hit rate (server):", metrics["cache_hit_rate"], 3)
    for key, section, name in LATENCY_SECTIONS:
        s = metrics.get(key) or {}
        lines.append(section.center(SERVING_WIDTH, "-"))
        row(f"Mean {name} (ms):", s.get("mean"))
        row(f"Median {name} (ms):", s.get("median", s.get("p50")))
        for q in (95, 99):
            row(f"P{q} {name} (ms):", s.get(f"p{q}"))
        if key == "itl_ms":
            row(f"Max {name} (ms):", s.get("max"))
    lines.append("=" * SERVING_WIDTH)
    return "\n".join(lines)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` of the ``sglite bench`` sub-commands: descriptions kept as written, and every
    option's help ends with ``(default: X)`` (``(default: none)`` for an empty string) unless its
    default is None or it is an on/off flag (or the help already names the default)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or isinstance(action.default, bool) or action.default is argparse.SUPPRESS:
            return text
        if action.default == "" and "%(default)" not in text:
            return text + " (default: none)"
        return super()._get_help_string(action)


def format_table(rows: Sequence[dict], columns: Iterable[tuple[str, str]], digits: int = 2) -> str:
    """A Markdown table of ``rows``; ``columns`` are ``(key, header)`` pairs (missing keys show ``-``).

    A key may be dotted (``"ttft_ms.p95"``) to reach into nested dicts.
    """
    cols = list(columns)

    def get(row, key):
        cur: Any = row
        for part in key.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        return cur

    out = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        out.append("| " + " | ".join(fmt(get(r, k), digits) for k, _ in cols) + " |")
    return "\n".join(out)


def at_least(low: int):
    """An argparse ``type``: an int >= ``low`` (else argparse's own "error: argument --x: ..." and
    exit 2, before any work)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    parse.__name__ = f"int >= {low}"
    return parse


def positive_rate(text: str) -> float:
    """An argparse ``type``: a float > 0, or ``inf`` (a request rate)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0 or inf, got {text!r}") from None
    if not v > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return v


positive_rate.__name__ = "float > 0 or inf"
