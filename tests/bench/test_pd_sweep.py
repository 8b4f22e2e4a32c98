"""`sglite bench sweep` over deployments: one server, a prefill/decode pair behind the P/D router,
a running URL; KV transfer counters and output comparison across configurations."""
import json

import pytest

from sglite.bench import deploy, sweep


def test_parse_spec_kinds_and_errors():
    assert deploy.parse_spec("") == ("server", [])
    assert deploy.parse_spec("--dp-size 2 --num-threads 1") == ("server", ["--dp-size", "2", "--num-threads", "1"])
    assert deploy.parse_spec("--pd-disaggregation --dtype float32") == ("pd", ["--dtype", "float32"])
    assert deploy.parse_spec("@http://127.0.0.1:30000/") == ("url", ["http://127.0.0.1:30000"])
    with pytest.raises(ValueError, match="config: '@URL'"):
        deploy.parse_spec("@localhost:30000")
    with pytest.raises(ValueError, match="--disaggregation-mode"):
        deploy.parse_spec("--pd-disaggregation --disaggregation-mode=decode")
    with pytest.raises(ValueError, match="--dp-size"):
        deploy.parse_spec("--pd-disaggregation --dp-size 2")
    with pytest.raises(ValueError, match="launch_mode"):
        deploy.Deployment("", mode="docker")


def test_compare_outputs_and_pd_delta():
    series = {"a": [{"request_rate": 1.0, "outputs": ["x", "y", "z"]}],
              "b": [{"request_rate": 1.0, "outputs": ["x", "q", "z"]}],
              "c": [{"request_rate": 1.0, "outputs": ["x"]}]}
    sweep.compare_outputs(series)
    assert [series[k][0]["same_output"] for k in "abc"] == ["3/3", "2/3", "1/3"]
    assert sweep.pd_delta({}, {}) == {}
    assert sweep.pd_delta({"transfers": 2, "failures": 1, "transferred_tokens": 10},
                          {"transfers": 5, "failures": 1, "transferred_tokens": 40}) == \
        {"kv_transfers": 3, "kv_fallbacks": 0, "kv_transferred_tokens": 30}


@pytest.mark.slow
def test_sweep_colocated_vs_disaggregated_same_outputs(tiny_model_dir, tmp_path):
    """Colocated, P/D (prefill + decode server + router) and the colocated server again by URL:
    every request's KV comes over (no fallback), greedy texts equal the colocated ones."""
    from sglite import Engine
    from sglite.server.runner import ServerThread

    out = tmp_path / "pd.json"
    with Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=8192, log_level="warning") as eng:
        srv = ServerThread(eng).start()
        try:
            rc = sweep.main(["--model-path", str(tiny_model_dir), "--launch-mode", "thread", "--dataset", "random",
                             "--num-prompts", "4", "--input-len", "40", "--range-ratio", "0.5", "--output-len", "6",
                             "--request-rates", "inf", "--server-args", "--dtype float32 --max-total-tokens 8192",
                             "--config", "colocated=", "--config", "pd=--pd-disaggregation",
                             "--config", f"url=@{srv.url}", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "10000",
                             "--percentile", "p99", "--disable-tqdm", "--output-json", str(out)])
        finally:
            srv.stop()
    assert rc == 0
    data = json.loads(out.read_text())
    colo, pd, url = (data["series"][k][0] for k in ("colocated", "pd", "url"))
    assert [p["deployment"] for p in (colo, pd, url)] == ["server", "pd", "url"]
    assert pd["kv_transfers"] == 4 + 1 and pd["kv_fallbacks"] == 0  # 4 requests + the warmup request
    assert pd["kv_transferred_tokens"] > 0 and "kv_transfers" not in colo
    assert len(colo["outputs"]) == 4 and all(colo["outputs"])
    assert pd["same_output"] == "4/4" and url["same_output"] == "4/4"
    assert pd["outputs"] == colo["outputs"]
    assert all(r["success"] for r in pd["requests"])


@pytest.mark.slow
def test_deployment_warms_every_server_behind_a_router(tiny_model_dir):
    """A P/D deployment (thread mode): both halves are listed and each gets its warm-up request."""
    d = deploy.Deployment("--pd-disaggregation", ["--model-path", str(tiny_model_dir), "--dtype", "float32",
                                                  "--max-total-tokens", "4096"], mode="thread")
    with d:
        urls = d.worker_urls()
        assert sorted(urls) == sorted(s.url for s in d._servers)
        served = [s._engine.get_server_info()["prompt_tokens"] for s in d._servers]
        assert all(n > 0 for n in served)  # the warm-up requests ran on both
        assert d.warm_workers() == 2
    assert deploy.Deployment("@http://127.0.0.1:1").worker_urls() == []
