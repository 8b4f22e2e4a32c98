"""``/start_profile`` and ``/stop_profile`` over HTTP on a tiny real engine: admin-guarded, a
parseable Chrome trace and a summary with the phase rows, 400 when stopping what never started
(issue 33, profiling built in)."""
import json

import httpx
import pytest

from sglite.runtime.profiler import CATEGORIES, OTHER
from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig

ADMIN, USER = {"Authorization": "Bearer admin-key"}, {"Authorization": "Bearer user-key"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from sglite import Engine

    eng = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096)
    with ServerThread(eng, ServerConfig(port=0, api_key="user-key", admin_api_key="admin-key")) as srv:
        yield srv
    eng.shutdown()


def _generate(url: str, n: int = 3) -> None:
    r = httpx.post(url + "/generate", headers=USER, timeout=60, json={
        "text": ["The sea is", "Once upon a time"], "sampling_params": {"max_new_tokens": n, "temperature": 0}})
    assert r.status_code == 200, r.text


def test_profile_writes_trace_and_phase_summary(server, tmp_path):
    r = httpx.post(server.url + "/start_profile", headers=ADMIN, json={"output_dir": str(tmp_path)}, timeout=60)
    assert r.status_code == 200 and r.json()["output_dir"] == str(tmp_path)
    _generate(server.url, 4)
    r = httpx.post(server.url + "/stop_profile", headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["steps"] >= 4  # one prefill step and at least three decode steps
    trace = json.load(open(out["trace"]))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"sglite::step", "sglite::forward", "sglite::sample", "sglite::gemm", "sglite::attention"} <= names
    summary = open(out["summary"]).read()
    for row, _ in CATEGORIES:
        assert row in summary and row in out["phases"]
    assert OTHER in summary and "self CPU" in summary
    phases = out["phases"]
    assert phases["GEMM"]["us"] > 0 and phases["attention"]["us"] > 0 and phases["sampling"]["us"] > 0
    rows = sum(v["us"] for k, v in phases.items() if k != "step total")
    assert rows == pytest.approx(phases["step total"]["us"], rel=0.01)
    assert json.load(open(out["summary_json"]))["phases"] == phases
    from sglite import kernels
    assert not hasattr(kernels.linear, "__wrapped__")  # the probes come off with the last profile


def test_profile_routes_need_the_admin_key(server, tmp_path):
    assert httpx.post(server.url + "/start_profile", json={"output_dir": str(tmp_path)}).status_code == 401
    r = httpx.post(server.url + "/start_profile", headers=USER, json={"output_dir": str(tmp_path)})
    assert r.status_code == 401 and "admin" in r.json()["error"]["message"]
    assert httpx.post(server.url + "/stop_profile", headers=USER).status_code == 401
    assert not list(tmp_path.iterdir())


def test_stop_without_start_is_400(server):
    r = httpx.post(server.url + "/stop_profile", headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "profile"


def test_start_twice_is_400_and_num_steps_stops_by_itself(server, tmp_path):
    r = httpx.post(server.url + "/start_profile", headers=ADMIN, json={"output_dir": str(tmp_path), "num_steps": 2})
    assert r.status_code == 200
    again = httpx.post(server.url + "/start_profile", headers=ADMIN, json={})
    assert again.status_code == 400 and again.json()["error"]["param"] == "profile"
    _generate(server.url, 5)  # more than two steps: the profile stopped after two
    out = httpx.post(server.url + "/stop_profile", headers=ADMIN, timeout=120).json()
    assert out["steps"] == 2 and json.load(open(out["trace"]))["traceEvents"]
    assert httpx.post(server.url + "/stop_profile", headers=ADMIN).status_code == 400


def test_bad_options_name_the_field(server):
    r = httpx.post(server.url + "/start_profile", headers=ADMIN, json={"num_steps": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_steps"
    r = httpx.post(server.url + "/start_profile", headers=ADMIN, json={"activities": ["TPU"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "activities"


def test_unavailable_or_empty_activities_are_400_naming_the_field(server):
    """``GPU`` on a machine without CUDA was a 500 (torch's "No activities specified"); an empty
    list silently meant the default. Both are 400s naming ``activities``, and nothing is left running."""
    import torch

    r = httpx.post(server.url + "/start_profile", headers=ADMIN, json={"activities": []})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "activities"
    if not torch.cuda.is_available():
        r = httpx.post(server.url + "/start_profile", headers=ADMIN, json={"activities": ["GPU"]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "activities" and "GPU is not available" in err["message"]
        assert "available: CPU" in err["message"]
    r = httpx.post(server.url + "/stop_profile", headers=ADMIN)
    assert r.status_code == 400  # no profile was left running
