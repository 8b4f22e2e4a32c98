"""``sglite bench sweep``: one workload at several request rates against server configurations in turn.

    sglite bench sweep --dataset shared-prefix --request-rates 0.5,1,2,4 \\
        --config "radix=" --config "no-radix=--disable-radix-cache" \\
        --server-args "--dtype bfloat16" --slo-ttft-ms 2000 --slo-tpot-ms 150 \\
        --output-json sweep.json --plot sweep.png

Each ``--config LABEL=FLAGS`` starts its own server (``--server-args`` + ``FLAGS``; see
:mod:`sglite.server.launcher`), runs the workload once per rate (the prefix cache flushed before
each), and stops it. ``LABEL=--pd-disaggregation FLAGS`` starts a prefill server, a decode server
and the P/D router instead, ``LABEL=@URL`` uses a running deployment (:mod:`sglite.bench.deploy`).
The chart has goodput, TTFT and TPOT (``--percentile``, P95 by default) against request rate with
one line per configuration; the table adds DistServe's goodput (the highest rate whose SLO
attainment is ≥ ``--attainment-target``), the P/D router's KV transfers and fallbacks per run, and
how many requests produced the same text as the first configuration at the same rate (the
workload is the same at a given rate; with ``--temperature 0`` outputs are expected equal).

    sglite bench sweep --dataset random --input-len 1500 --request-rates 0.1,0.3 \\
        --server-args "--dtype bfloat16" --config "colocated=" --config "pd=--pd-disaggregation" \\
        --config "dp2=--dp-size 2" --percentile p99 --output-json pd.json --plot pd.png
"""
from __future__ import annotations

import argparse
import math
from typing import Optional, Sequence

from .deploy import Deployment
from .report import HelpFormatter, format_table, write_json
from .serving import add_workload_args, check_args, run_dataset, server_argv
from .stats import flat_metrics, max_rate_meeting_attainment
from .workloads import load_sharegpt

COLUMNS = (("config", "config"), ("request_rate", "rate (req/s)"), ("request_throughput", "req/s"),
           ("goodput", "goodput (req/s)"), ("slo_attainment", "SLO attainment"),
           ("ttft_ms.p50", "P50 TTFT ms"), ("ttft_ms.p95", "P95 TTFT ms"), ("tpot_ms.p50", "P50 TPOT ms"),
           ("tpot_ms.p95", "P95 TPOT ms"), ("tpot_ms.p99", "P99 TPOT ms"), ("output_throughput", "out tok/s"),
           ("cache_hit_rate", "cache hit"))
PD_COLUMNS = (("ttft_ms.p99", "P99 TTFT ms"), ("kv_transfers", "KV transfers"), ("kv_fallbacks", "KV fallbacks"),
              ("same_output", "same output as first"))


def compare_outputs(series: dict[str, list[dict]]) -> None:
    """Set each point's ``same_output`` to ``"k/n"``: requests (in workload order) whose text equals
    the first configuration's at the same rate (the first configuration itself: ``n/n``)."""
    labels = list(series)
    if not labels:
        return
    ref = {p["request_rate"]: p.get("outputs") or [] for p in series[labels[0]]}
    for label in labels:
        for p in series[label]:
            want, got = ref.get(p["request_rate"]) or [], p.get("outputs") or []
            n = max(len(want), len(got))
            p["same_output"] = f"{sum(a == b for a, b in zip(want, got))}/{n}"


def pd_delta(before: dict, after: dict) -> dict:
    """KV transfers / fallbacks of one run from the router's counters before and after it (``{}``
    for deployments without a P/D router)."""
    if not after:
        return {}
    return {"kv_transfers": after.get("transfers", 0) - before.get("transfers", 0),
            "kv_fallbacks": after.get("failures", 0) - before.get("failures", 0),
            "kv_transferred_tokens": after.get("transferred_tokens", 0) - before.get("transferred_tokens", 0)}


def parse_config(text: str) -> tuple[str, str]:
    """``"LABEL=FLAGS"`` → ``(LABEL, FLAGS)``.

    Raises:
        ValueError: no ``=`` or an empty label.
    """
    label, sep, flags = text.partition("=")
    if not sep or not label.strip():
        raise ValueError(f"config: expected LABEL=FLAGS (e.g. 'no-radix=--disable-radix-cache'), got {text!r}")
    return label.strip(), flags.strip()


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,inf"`` → ``[0.5, 1.0, inf]``.

    Raises:
        ValueError: an empty list or a rate that is not > 0.
    """
    rates = [float(x) for x in text.split(",") if x.strip()]  # float() reads inf / infinity
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"request_rates: need one or more rates > 0 (or inf), got {text!r}")
    return rates


def sweep_rows(series: dict[str, list[dict]]) -> list[dict]:
    """Flatten ``{label: [point]}`` into table rows (``config`` + ``request_rate`` + metrics)."""
    return [{"config": label, **p["metrics"], "request_rate": p["request_rate"],
             **{k: p[k] for k in ("kv_transfers", "kv_fallbacks", "same_output") if k in p}}
            for label, pts in series.items() for p in pts]


def distserve_goodput(series: dict[str, list[dict]], target: float) -> dict[str, Optional[float]]:
    """Per configuration, the highest swept rate with SLO attainment ≥ ``target`` (None if none)."""
    return {label: max_rate_meeting_attainment(((p["request_rate"], p["metrics"]["slo_attainment"]) for p in pts),
                                               target) for label, pts in series.items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglite bench sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--request-rates", default="1,2,4", help="comma-separated rates (req/s); 'inf' allowed")
    p.add_argument("--config", action="append", default=None, metavar="LABEL=FLAGS",
                   help="a server configuration (repeat; default: radix cache on vs off)")
    p.add_argument("--server-args", default="", help="flags of `sglite serve` common to every configuration")
    p.add_argument("--attainment-target", type=float, default=0.9,
                   help="DistServe goodput: highest rate whose SLO attainment (0-1) reaches this")
    p.add_argument("--output-json", default=None,
                   help="write every point here (SGLang's flat keys + nested metrics; default: none)")
    p.add_argument("--plot", default=None, help="PNG: goodput, TTFT and TPOT percentiles vs rate (default: none)")
    p.add_argument("--percentile", default="p95", choices=("p50", "p95", "p99"),
                   help="the TTFT/TPOT percentile of the chart")
    add_workload_args(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``sglite bench sweep``; returns 0 when every run completed some request."""
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        check_args(a)
        pairs = load_sharegpt(a.dataset_path) if a.dataset == "sharegpt" else None
        rates = parse_rates(a.request_rates)
        configs = [parse_config(c) for c in (a.config or ["radix=", "no-radix=--disable-radix-cache"])]
    except ValueError as exc:
        parser.error(str(exc))
    series: dict[str, list[dict]] = {}
    for label, flags in configs:
        try:
            dep = Deployment(flags, server_argv(a, a.server_args), a.launch_mode)
        except ValueError as exc:
            parser.error(str(exc))
        with dep:
            for rate in rates:
                before = dep.pd_counters()
                res = run_dataset(a, dep.url, rate, f"{label} @ {rate}", pairs)
                extra = pd_delta(before, dep.pd_counters())
                series.setdefault(label, []).append({
                    **flat_metrics(res.metrics), "request_rate": rate, "metrics": res.metrics,
                    "server_args": dep.server_args, "deployment": dep.kind, **extra,
                    "requests": [{"ttft": o.ttft, "tpot": o.tpot, "success": o.success} for o in res.outcomes],
                    "outputs": [o.output_text for o in res.outcomes]})
                pct = a.percentile.upper()
                print(f"{label} @ {rate} req/s: goodput {res.metrics['goodput']:.3f} req/s, "
                      f"{pct} TTFT {res.metrics['ttft_ms'][a.percentile]:.1f} ms, "
                      f"{pct} TPOT {res.metrics['tpot_ms'][a.percentile]:.1f} ms"
                      + (f", KV transfers {extra['kv_transfers']} (fallbacks {extra['kv_fallbacks']})"
                         if extra else ""), flush=True)
    compare_outputs(series)
    print(format_table(sweep_rows(series), COLUMNS + PD_COLUMNS))
    good = distserve_goodput(series, a.attainment_target)
    for label, g in good.items():
        shown = "none of the rates" if g is None else ("inf" if math.isinf(g) else f"{g:g} req/s")
        print(f"DistServe goodput ({label}, attainment >= {a.attainment_target:.0%}): {shown}")
    if a.output_json:
        write_json(a.output_json, {"dataset": a.dataset, "args": vars(a), "series": series,
                                   "distserve_goodput": good})
    if a.plot:
        from .plots import plot_sweep

        slo = f"SLO TTFT<={a.slo_ttft_ms} ms, TPOT<={a.slo_tpot_ms} ms"
        plot_sweep(series, a.plot, title=f"{a.dataset}: {' vs '.join(series)} ({slo})", percentile=a.percentile)
    return 0 if all(p["metrics"]["completed"] for pts in series.values() for p in pts) else 1
