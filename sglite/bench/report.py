"""Text tables and JSON result files for the sglite benchmarks (serving, sweep, offline)."""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

LATENCY_KEYS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency"))


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


def format_serving(metrics: dict, title: str = "Serving Benchmark Result", extra: Optional[dict] = None) -> str:
    """The result block printed by ``sglite bench serving`` (one ``label: value`` line each)."""
    width = 62
    lines = [f" {title} ".center(width, "=")]

    def row(label, value, digits=2):
        lines.append(f"{label:<46}{fmt(value, digits):>16}")

    for k, v in (extra or {}).items():
        row(k, v)
    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    row("Benchmark duration (s):", metrics["duration_s"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total output tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"], 3)
    row("Input token throughput (tok/s):", metrics["input_throughput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Total token throughput (tok/s):", metrics["total_token_throughput"])
    slo = [f"TTFT<={fmt(metrics.get('slo_ttft_ms'), 0)}ms" if metrics.get("slo_ttft_ms") is not None else "",
           f"TPOT<={fmt(metrics.get('slo_tpot_ms'), 0)}ms" if metrics.get("slo_tpot_ms") is not None else ""]
    row(f"Goodput (req/s) [{' '.join(s for s in slo if s) or 'no SLO'}]:", metrics["goodput"], 3)
    row("SLO attainment:", metrics["slo_attainment"], 3)
    if "cache_hit_rate" in metrics:
        row("Cache hit rate (server):", metrics["cache_hit_rate"], 3)
    for key, name in LATENCY_KEYS:
        s = metrics.get(key) or {}
        lines.append(f" {name} (ms) ".center(width, "-"))
        row(f"Mean {name} (ms):", s.get("mean"))
        for q in (50, 95, 99):
            row(f"P{q} {name} (ms):", s.get(f"p{q}"))
    lines.append("=" * width)
    return "\n".join(lines)


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
