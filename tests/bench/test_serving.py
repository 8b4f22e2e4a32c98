"""Smoke runs of `sglite bench serving` / `sweep` against a live server on the tiny random model."""
import json
import math

import pytest

from sglite.bench import serving, sweep
from sglite.server.launcher import LaunchedServer

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


def test_serving_smoke_16_requests_every_metric_finite(server, tmp_path, capsys):
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
    # SGLang's flat keys at the top level, equal to the nested statistics
    assert (data["completed"], data["total_output_tokens"]) == (16, m["total_output_tokens"])
    assert data["duration"] == m["duration_s"] > 0 and data["request_throughput"] == m["request_throughput"]
    for flat, (key, stat) in {"mean_ttft_ms": ("ttft_ms", "mean"), "median_ttft_ms": ("ttft_ms", "p50"),
                              "p99_ttft_ms": ("ttft_ms", "p99"), "median_tpot_ms": ("tpot_ms", "p50"),
                              "p99_itl_ms": ("itl_ms", "p99"), "mean_e2e_latency_ms": ("e2e_ms", "mean"),
                              "median_e2e_latency_ms": ("e2e_ms", "p50")}.items():
        assert data[flat] == m[key][stat], flat
    assert data["backend"] == "sglite" and data["dataset_name"] == "random" and data["request_rate"] == 50.0
    for k in ("input_throughput", "output_throughput", "total_input_tokens", "mean_tpot_ms", "p99_tpot_ms",
              "mean_itl_ms", "median_itl_ms", "p99_e2e_latency_ms", "concurrency"):
        assert isinstance(data[k], (int, float)) and math.isfinite(data[k]), k
    table = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in table
    assert f"{'Successful requests:':<40} 16" in table and f"{'Traffic request rate:':<40} 50.00" in table
    assert "Median TTFT (ms):" in table and "P99 E2E Latency (ms):" in table


def test_sharegpt_file_replayed_with_reply_lengths_and_titled_plot(server, tiny_model_dir, tmp_path, monkeypatch):
    from sglite.bench import plots
    from sglite.bench.workloads import load_sharegpt, sharegpt_workload

    convs = [{"conversations": [{"from": "human", "value": f"Question {i}: what is the capital of country {i}?"},
                                {"from": "gpt", "value": "The capital is a large city" + " indeed" * i}]}
             for i in range(6)]
    convs.append({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "x"}]})  # too short
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    titles = []
    real_plot = plots.plot_serving
    monkeypatch.setattr(plots, "plot_serving",
                        lambda runs, p, title="": titles.append(title) or real_plot(runs, p, title))
    out, png = tmp_path / "sg.json", tmp_path / "sg.png"
    rc = serving.main(["--base-url", server.url, "--dataset-name", "sharegpt", "--dataset-path", str(path),
                       "--num-prompts", "10", "--seed", "1", "--disable-tqdm", "--output-details",
                       "--output-json", str(out), "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    encode = serving.load_encoder(str(tiny_model_dir))
    expected = sharegpt_workload(load_sharegpt(path), 10, encode, seed=1)
    assert len(expected) == 6 and data["completed"] == 6 and data["failed"] == 0   # the 7th is too short
    assert data["dataset_name"] == "sharegpt" and data["config"]["dataset_path"] == str(path)
    # ignore_eos: each request generates exactly as many tokens as its gpt reply has
    assert sorted(r["output_tokens"] for r in data["requests"]) == sorted(s.turns[0].output_len for s in expected)
    assert data["total_output_tokens"] == sum(len(encode(c["conversations"][1]["value"])) for c in convs[:6])
    assert data["total_input_tokens"] >= sum(len(encode(c["conversations"][0]["value"])) for c in convs[:6])
    assert len(titles) == 1 and "sharegpt" in titles[0] and "request rate inf req/s" in titles[0]
    assert tiny_model_dir.name in titles[0] and png.read_bytes()[:8] == PNG


def test_agent_workload_runs_through_the_frontend(server):
    res = serving.run_dataset(serving.build_parser().parse_args(
        ["--dataset", "agent", "--num-prompts", "3", "--system-len", "40", "--disable-tqdm"]),
        server.url, math.inf, "agent")
    m = res.metrics
    assert m["programs"] == 3 and m["completed"] == 3 * 5 and m["failed"] == 0   # 2 steps × 2 gens + answer
    assert m["program_throughput"] > 0 and m["cache_hit_rate"] > 0.5   # shared system prompt is reused


@pytest.mark.slow  # a whole benchmark run (several engines)
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
