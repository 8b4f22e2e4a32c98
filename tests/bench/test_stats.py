"""sglite.bench.stats / report on synthetic timelines: values checked against hand computation."""
import json
import math
import random

import pytest

from sglite.bench.report import format_serving, format_table, jsonable, write_json
from sglite.bench.serving import arrival_times
from sglite.bench.stats import (RequestOutcome, compute_metrics, flat_metrics, max_rate_meeting_attainment,
                                outcome_from_timeline, percentile, summarize)


def test_percentile_linear_interpolation_by_hand():
    vals = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4, n-1 = 3
    assert percentile(vals, 50) == pytest.approx(2.5)      # rank 1.5
    assert percentile(vals, 95) == pytest.approx(3.85)     # rank 2.85 -> 3 + 0.85
    assert percentile(vals, 99) == pytest.approx(3.97)     # rank 2.97
    assert percentile(vals, 0) == 1.0 and percentile(vals, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50)) and percentile([1.0, math.nan, 3.0], 50) == 2.0
    with pytest.raises(ValueError, match="q"):
        percentile(vals, 101)


def test_summarize_scales_and_drops_nan():
    s = summarize([0.010, 0.020, math.nan, 0.030], scale=1000)
    assert s["count"] == 3 and s["mean"] == pytest.approx(20.0)
    assert s["p50"] == pytest.approx(20.0) and s["p99"] == pytest.approx(29.8)
    assert (s["min"], s["max"]) == (pytest.approx(10.0), pytest.approx(30.0))
    assert math.isnan(summarize([])["p95"]) and summarize([])["count"] == 0
    assert s["median"] == s["p50"] and s["std"] == pytest.approx(math.sqrt(200 / 3))   # population std
    assert math.isnan(summarize([])["std"]) and summarize([5.0])["std"] == 0.0


def test_timeline_gives_ttft_itl_tpot_e2e():
    o = outcome_from_timeline(10.0, [10.5, 10.6, 10.8, 11.1], prompt_tokens=7, output_tokens=4)
    assert o.ttft == pytest.approx(0.5) and o.e2e == pytest.approx(1.1)
    assert o.itl == pytest.approx([0.1, 0.2, 0.3])
    assert o.tpot == pytest.approx(0.6 / 3)
    # a chunk carrying 3 tokens (jump-forward) is one gap; TPOT still divides by tokens
    j = outcome_from_timeline(0.0, [0.2, 0.3, 0.6], prompt_tokens=5, output_tokens=6, end=0.7)
    assert j.itl == pytest.approx([0.1, 0.3]) and j.e2e == pytest.approx(0.7)
    assert j.tpot == pytest.approx((0.7 - 0.2) / 5)
    assert math.isnan(outcome_from_timeline(0.0, [0.1], 3, 1).tpot)
    with pytest.raises(ValueError, match="chunk_times"):
        outcome_from_timeline(1.0, [1.5, 1.2], 1, 2)


def _o(ttft, e2e, out, prompt=10, cached=0, ok=True):
    return RequestOutcome(ok, prompt, out, cached, ttft=ttft, e2e=e2e)


def test_compute_metrics_goodput_and_throughput_by_hand():
    outs = [_o(0.1, 1.1, 11, cached=5),    # TPOT 100 ms
            _o(0.3, 0.8, 6),               # TTFT 300 ms (misses the 250 ms SLO), TPOT 100 ms
            _o(0.2, 2.2, 11),              # TPOT 200 ms (misses the 150 ms SLO)
            _o(0.05, 0.05, 1),             # one token: no TPOT, meets the TPOT SLO
            RequestOutcome(False, error="boom")]
    m = compute_metrics(outs, duration_s=2.0, slo_ttft_ms=250, slo_tpot_ms=150)
    assert (m["completed"], m["failed"]) == (4, 1)
    assert m["goodput"] == pytest.approx(2 / 2.0) and m["slo_attainment"] == pytest.approx(2 / 5)
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(29 / 2.0) and m["input_throughput"] == pytest.approx(20.0)
    assert m["total_token_throughput"] == pytest.approx((40 + 29) / 2.0)
    assert m["tpot_ms"]["count"] == 3 and m["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(400 / 3)
    assert m["ttft_ms"]["p50"] == pytest.approx(150.0)   # 50, 100, 200, 300
    assert m["cache_hit_rate_client"] == pytest.approx(5 / 40)
    no_slo = compute_metrics(outs, 2.0)
    assert no_slo["goodput"] == pytest.approx(no_slo["request_throughput"])
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics(outs, 0.0)


def test_itl_statistics_from_known_gaps():
    a = outcome_from_timeline(0.0, [0.1, 0.11, 0.13, 0.16], 1, 4)   # gaps 10, 20, 30 ms
    b = outcome_from_timeline(0.0, [0.2, 0.24], 1, 2)               # gap 40 ms
    m = compute_metrics([a, b], 1.0)
    assert m["itl_ms"]["count"] == 4 and m["itl_ms"]["mean"] == pytest.approx(25.0)
    assert m["itl_ms"]["p50"] == pytest.approx(25.0) and m["itl_ms"]["max"] == pytest.approx(40.0)


def test_distserve_goodput_is_highest_rate_meeting_attainment():
    pts = [(1, 0.99), (2, 0.95), (4, 0.85), (8, 0.5)]
    assert max_rate_meeting_attainment(pts) == 2
    assert max_rate_meeting_attainment(pts, target=0.8) == 4
    assert max_rate_meeting_attainment([(1, 0.5)]) is None
    assert max_rate_meeting_attainment([(math.inf, 1.0), (2, 0.2)]) == math.inf
    with pytest.raises(ValueError, match="target"):
        max_rate_meeting_attainment(pts, 1.5)


def test_poisson_arrivals_are_seeded_with_the_right_mean():
    a = arrival_times(4000, 4.0, random.Random(1))
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.25, rel=0.08)
    assert a == arrival_times(4000, 4.0, random.Random(1)) != arrival_times(4000, 4.0, random.Random(2))
    assert arrival_times(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]


def test_report_json_is_strict_and_tables_render(tmp_path):
    m = compute_metrics([_o(0.1, 0.5, 5)], 1.0, slo_ttft_ms=100)
    assert m["goodput"] == 1.0  # TTFT exactly at the SLO meets it
    m["cache_hit_rate"] = math.nan
    p = write_json(tmp_path / "sub" / "r.json", {"metrics": m, "t": (1, 2)})
    data = json.loads(p.read_text())
    assert data["metrics"]["cache_hit_rate"] is None and data["t"] == [1, 2] and "environment" in data
    assert jsonable({"x": math.inf}) == {"x": None}
    text = format_serving(m)
    assert "P99 TPOT (ms):" in text and "100.00" in text and "TTFT<=100ms" in text
    t = format_table([{"a": 1.234, "b": {"c": None}}], [("a", "A"), ("b.c", "C")])
    assert t.splitlines()[2] == "| 1.23 | - |"


def test_flat_keys_are_sglangs_and_equal_the_nested_values():
    outs = [_o(0.1, 1.1, 11), _o(0.3, 0.8, 6), _o(0.2, 2.2, 11)]
    m = compute_metrics(outs, 2.0, slo_ttft_ms=250)
    m["cache_hit_rate"], m["request_rate"] = 0.5, 4.0
    f = flat_metrics(m)
    assert (f["completed"], f["failed"], f["duration"]) == (3, 0, 2.0)
    assert (f["total_input_tokens"], f["total_output_tokens"]) == (30, 28)
    assert f["request_throughput"] == pytest.approx(1.5) and f["output_throughput"] == pytest.approx(14.0)
    assert f["input_throughput"] == pytest.approx(15.0) and f["total_throughput"] == pytest.approx(29.0)
    assert f["mean_ttft_ms"] == pytest.approx(200.0) and f["median_ttft_ms"] == pytest.approx(200.0)
    assert f["p99_ttft_ms"] == pytest.approx(298.0)                        # 100, 200, 300: rank 1.98
    assert f["median_tpot_ms"] == pytest.approx(100.0) and f["p99_tpot_ms"] == pytest.approx(198.0)
    assert f["mean_e2e_latency_ms"] == pytest.approx(1366.6667) and f["median_e2e_latency_ms"] == pytest.approx(1100.0)
    assert f["concurrency"] == pytest.approx((1.1 + 0.8 + 2.2) / 2.0)       # Σ E2E / duration
    assert math.isnan(f["mean_itl_ms"])                                     # no streamed gaps here
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        for stat in ("mean", "median", "std", "p95", "p99"):
            assert f"{stat}_{name}_ms" in f
    assert f["cache_hit_rate"] == 0.5 and f["request_rate"] == 4.0 and f["goodput"] == pytest.approx(1.0)
    assert not any(isinstance(v, dict) for v in f.values())


def test_serving_table_has_sglangs_layout():
    a = outcome_from_timeline(0.0, [0.1, 0.11, 0.13, 0.16], 10, 4)
    b = outcome_from_timeline(0.0, [0.2, 0.24], 12, 2)
    text = format_serving(compute_metrics([a, b], 2.0), extra={"Backend:": "sglite", "Traffic request rate:": math.inf})
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============" and lines[-1] == "=" * 50
    rows = {line[:40].rstrip(): line[41:] for line in lines if line[40:41] == " " and ":" in line[:40]}
    assert rows["Backend:"] == "sglite" and rows["Traffic request rate:"] == "inf"
    assert rows["Successful requests:"] == "2" and rows["Benchmark duration (s):"] == "2.00"
    assert rows["Total input tokens:"] == "22" and rows["Total generated tokens:"] == "6"
    assert rows["Request throughput (req/s):"] == "1.00" and rows["Output token throughput (tok/s):"] == "3.00"
    assert rows["Mean TTFT (ms):"] == "150.00" and rows["Median TTFT (ms):"] == "150.00"
    assert rows["P99 TTFT (ms):"] == "199.00" and rows["Max ITL (ms):"] == "40.00"
    assert rows["Median ITL (ms):"] == "25.00" and rows["Mean E2E Latency (ms):"] == "200.00"
    for name in ("E2E Latency", "TTFT", "TPOT", "ITL"):
        for stat in ("Mean", "Median", "P99"):
            assert f"{stat} {name} (ms):" in rows, f"{stat} {name}"
    sections = [line for line in lines if line.startswith("-")]
    assert [s.strip("-") for s in sections] == ["End-to-End Latency", "Time to First Token",
                                                "Time per Output Token (excl. 1st token)", "Inter-Token Latency"]
    assert all(len(s) == 50 for s in sections)
