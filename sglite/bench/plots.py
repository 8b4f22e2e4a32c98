"""Benchmark pictures (matplotlib, Agg canvas: no display, no pyplot global state).

* :func:`plot_serving` – latency CDFs (TTFT, TPOT, ITL, E2E) and throughput bars of one or
  more serving runs.
* :func:`plot_sweep` – goodput, P95 TTFT and P95 TPOT against request rate, one line per
  server configuration.
* :func:`plot_bars` – grouped bars (the offline benchmark's comparisons).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

from .stats import RequestOutcome


def _figure(ncols: int, nrows: int = 1, width: float = 4.6, height: float = 3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _save(fig, path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(os.fspath(p), dpi=110)
    return p


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:
    vals = sorted(v for v in values_ms if not math.isnan(v))
    if not vals:
        return
    ys = [(i + 1) / len(vals) for i in range(len(vals))]
    ax.step(vals, ys, where="post", label=label)


def plot_serving(runs: Sequence[tuple[str, Sequence[RequestOutcome], dict]], path, title: str = "") -> Path:
    """Latency CDFs (ms) and throughput bars (req/s, tok/s) of serving runs; writes a PNG at
    ``path`` and returns it.

    Args:
        runs: ``(label, outcomes, metrics)`` per run (metrics from :func:`stats.compute_metrics`).
        title: figure title (``sglite bench serving`` names model, dataset and request rate).
    """
    fig, axes = _figure(3, 2)
    if title:
        fig.suptitle(title)
    series = (("TTFT", lambda o: [o.ttft]), ("TPOT", lambda o: [o.tpot]),
              ("ITL", lambda o: list(o.itl)), ("E2E latency", lambda o: [o.e2e]))
    for ax, (name, get) in zip(axes.flat, series):
        for label, outcomes, _ in runs:
            _cdf(ax, [v * 1000 for o in outcomes if o.success for v in get(o)], label)
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    bars = (("request_throughput", "requests/s"), ("goodput", "goodput (req/s)"))
    _grouped(axes[1][1], runs, bars, "Request throughput and goodput")
    _grouped(axes[1][2], runs, (("output_throughput", "output tok/s"), ("input_throughput", "input tok/s")),
             "Token throughput")
    return _save(fig, path)


def _grouped(ax, runs, bars, title) -> None:
    n = max(len(runs), 1)
    width = 0.8 / n
    for i, (label, _, metrics) in enumerate(runs):
        xs = [j + i * width for j in range(len(bars))]
        ys = [metrics.get(k) or 0.0 for k, _ in bars]
        rects = ax.bar(xs, ys, width, label=label)
        ax.bar_label(rects, fmt="%.2f", fontsize=7)
    ax.set_xticks([j + width * (n - 1) / 2 for j in range(len(bars))], [h for _, h in bars])
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    if n > 1:
        ax.legend(fontsize=8)


def plot_sweep(series: dict[str, Sequence[dict]], path, title: str = "", percentile: str = "p95") -> Path:
    """Goodput, TTFT and TPOT (``percentile``: ``p50`` | ``p95`` | ``p99``) against request rate,
    one line per configuration.

    Args:
        series: ``{config label: [point, ...]}``, a point being ``{"request_rate": float,
            "metrics": compute_metrics dict}``; an ``inf`` rate is drawn at 1.5 × the largest
            finite rate and labelled ``inf``.
    """
    fig, axes = _figure(3)
    finite = [p["request_rate"] for pts in series.values() for p in pts if math.isfinite(p["request_rate"])]
    inf_x = 1.5 * max(finite) if finite else 1.0
    pct = percentile.upper()
    panels = (("goodput", None, "goodput (req/s)"), ("ttft_ms", percentile, f"{pct} TTFT (ms)"),
              ("tpot_ms", percentile, f"{pct} TPOT (ms)"))
    for ax, (key, sub, ylabel) in zip(axes[0], panels):
        for label, pts in series.items():
            pts = sorted(pts, key=lambda p: p["request_rate"])
            xs = [p["request_rate"] if math.isfinite(p["request_rate"]) else inf_x for p in pts]
            ys = [(p["metrics"].get(key) or {}).get(sub) if sub else p["metrics"].get(key) for p in pts]
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=label)
        if len(finite) != sum(len(pts) for pts in series.values()):
            ticks = sorted(set(finite)) + [inf_x]
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks[:-1]] + ["inf"])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_bars(groups: Sequence[tuple[str, dict[str, float]]], path, ylabel: str = "", title: str = "") -> Path:
    """Bar panels, one per ``(name, {series: value})``, four to a row; writes a PNG at ``path``."""
    ncols = min(4, max(1, len(groups)))
    nrows = max(1, -(-len(groups) // ncols))
    fig, axes = _figure(ncols, nrows, width=3.6, height=3.0)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    for ax, (name, vals) in zip(axes.flat, groups):
        rects = ax.bar(list(vals), [0.0 if v is None else v for v in vals.values()],
                       color=[f"C{i}" for i in range(len(vals))])
        ax.bar_label(rects, fmt="%.3g", fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title)
    return _save(fig, path)
