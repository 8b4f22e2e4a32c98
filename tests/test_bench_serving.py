"""Smoke runs of `sglite bench serving` / `sweep` against a live server on the tiny random model."""
import json
import math

import pytest

from sglite.bench import serving, sweep
from sglite.bench.launcher import LaunchedServer

PNG = b"\x89PNG\r\n\x1a\n"


def _numbers(d, path=""):
    """Every numeric leaf of a nested metrics dict, as (path, value)."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _numbers(v, f"{path}{k}.")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield f"{path}{k}", v


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with LaunchedServer(["--model-path", str(tiny_model_dir), "--max-total-tokens", "16384"], mode="thread") as srv:
        yield srv


def test_serving_smoke_16_requests_every_metric_finite(server, tmp_path):
    out, png = tmp_path / "res.json", tmp_path / "res.png"
    rc = serving.main(["--base-url", server.url, "--dataset", "random", "--num-prompts", "16", "--input-len", "24",
                       "--output-len", "8", "--range-ratio", "0.5", "--request-rate", "50", "--seed", "3",
                       "--slo-ttft-ms", "5000", "--slo-tpot-ms", "1000", "--disable-tqdm",
                       "--output-json", str(out), "--plot", str(png), "--output-details"])
    assert rc == 0
    data = json.loads(out.read_text())
    m = data["metrics"]
    assert m["completed"] == 16 and m["failed"] == 0 and len(data["requests"]) == 16
    for key in ("request_throughput", "input_throughput", "output_throughput", "goodput", "slo_attainment",
                "cache_hit_rate", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert key in m, key
    values = dict(_numbers(m))
    for stat in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for q in ("mean", "p50", "p95", "p99"):
            assert f"{stat}.{q}" in values, f"{stat}.{q} missing or not finite"
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    assert not bad
    assert m["total_output_tokens"] == sum(r["output_tokens"] for r in data["requests"])
    assert all(4 <= r["output_tokens"] <= 8 for r in data["requests"])   # ignore_eos: exact lengths
    assert m["ttft_ms"]["p50"] <= m["e2e_ms"]["p50"] and m["tpot_ms"]["p99"] >= m["tpot_ms"]["p50"]
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000


def test_agent_workload_runs_through_the_frontend(server):
    res = serving.run_dataset(serving.build_parser().parse_args(
        ["--dataset", "agent", "--num-prompts", "3", "--system-len", "40", "--disable-tqdm"]),
        server.url, math.inf, "agent")
    m = res.metrics
    assert m["programs"] == 3 and m["completed"] == 3 * 5 and m["failed"] == 0   # 2 steps × 2 gens + answer
    assert m["program_throughput"] > 0 and m["cache_hit_rate"] > 0.5   # shared system prompt is reused


def test_sweep_two_configs_one_chart(tiny_model_dir, tmp_path):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = sweep.main(["--model-path", str(tiny_model_dir), "--launch-mode", "thread", "--dataset", "shared-prefix",
                     "--num-prompts", "6", "--num-groups", "2", "--system-len", "60", "--question-len", "6",
                     "--output-len", "4", "--request-rates", "20,inf", "--server-args", "--max-total-tokens 8192",
                     "--config", "radix=", "--config", "no-radix=--disable-radix-cache",
                     "--slo-ttft-ms", "10000", "--slo-tpot-ms", "2000", "--disable-tqdm",
                     "--output-json", str(out), "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["series"]) == {"radix", "no-radix"}
    for label, pts in data["series"].items():
        assert [p["request_rate"] for p in pts] == [20.0, None]   # inf is stored as null
        assert all(p["metrics"]["completed"] == 6 for p in pts)
    assert all(p["metrics"]["cache_hit_rate"] == 0 for p in data["series"]["no-radix"])
    assert data["distserve_goodput"]["radix"] is None   # inf -> null in strict JSON
    assert png.read_bytes()[:8] == PNG


def test_bad_sweep_arguments_are_named():
    with pytest.raises(ValueError, match="config"):
        sweep.parse_config("--disable-radix-cache")
    with pytest.raises(ValueError, match="request_rates"):
        sweep.parse_rates("1,0")
    assert sweep.parse_config("off=--disable-radix-cache --dtype float32") == ("off", "--disable-radix-cache --dtype float32")
    with pytest.raises(ValueError, match="request_rate"):
        serving.RunOptions(request_rate=0)
