"""``sglite serve`` flags and ``python -m sglite.launch_server`` end to end (tiny model)."""
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from sglite.config import EngineConfig
from sglite.launch_server import build_parser, engine_kwargs, server_config
from sglite.runtime.parallel.ports import free_port


def test_flags_map_to_engine_config_and_server_config():
    args = build_parser().parse_args([
        "--model-path", "/m", "--port", "31000", "--host", "0.0.0.0", "--disable-radix-cache",
        "--chunked-prefill-size", "256", "--max-running-requests", "8", "--max-total-tokens", "4096",
        "--schedule-policy", "lpm", "--dtype", "bfloat16", "--api-key", "k", "--mem-fraction-static", "0.3",
        "--page-size", "4"])
    kw = engine_kwargs(args)
    assert kw == {"model_path": "/m", "disable_radix_cache": True, "chunked_prefill_size": 256,
                  "max_running_requests": 8, "max_total_tokens": 4096, "schedule_policy": "lpm",
                  "dtype": "bfloat16", "mem_fraction_static": 0.3, "page_size": 4}
    EngineConfig.from_kwargs(**kw)  # every flag is a real option
    cfg = server_config(args)
    assert (cfg.host, cfg.port, cfg.api_key) == ("0.0.0.0", 31000, "k")
    assert engine_kwargs(build_parser().parse_args([])) == {}


@pytest.mark.slow  # starts a server process
def test_launch_server_module_serves(tiny_model_dir, tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "sglite.launch_server", "--model-path", str(tiny_model_dir),
                                 "--port", str(port), "--max-total-tokens", "2048", "--dtype", "float32",
                                 "--log-requests", "--enable-metrics", "--decode-log-interval", "2",
                                 "--num-threads", "1"],
                                stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
        url = f"http://127.0.0.1:{port}"
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(url + "/get_server_info").json()["max_total_tokens"] == 2048
        # a small workload: a batch of 3 decoding together, then a bad request (400)
        r = httpx.post(url + "/generate", timeout=60, json={
            "text": ["One two", "Three four five", "Six"], "rid": "batch-a",
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200 and [o["meta_info"]["completion_tokens"] for o in r.json()] == [6, 6, 6]
        bad = httpx.post(url + "/generate", timeout=60, json={"text": "x", "sampling_params": {"top_p": 2}})
        assert bad.status_code == 400
        assert httpx.get(url + "/metrics").status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    assert "KV cache of 2048 tokens" in text and "bytes per token" in text
    for phase in ("checkpoint load", "tokenizer", "weights", "KV pool"):  # start-up phases, timed
        assert re.search(rf"Start-up: [^\n]*{phase}[^\n]* took \d+\.\d\d s", text), phase
    assert re.search(r"Start-up: server ready in \d+\.\d\d s", text)
    # SGLang's batch lines from the scheduler
    assert re.search(r"Prefill batch\. #new-seq: 3, #new-token: \d+, #cached-token: \d+, token usage: [\d.]+, "
                     r"#running-req: \d+, #queue-req: 0", text), text[-3000:]
    assert re.search(r"Decode batch\. #running-req: 3, #token: \d+, token usage: [\d.]+, "
                     r"gen throughput \(token/s\): [\d.]+", text), text[-3000:]
    # --log-requests: one Receive for the batch call, one Finish per output
    assert re.search(r"Receive: rid=batch-a, prompts=3, prompt='One two'", text)
    for i in range(3):
        assert re.search(rf"Finish: rid=batch-a-{i}, prompt_tokens=\d+, cached_tokens=\d+, completion_tokens=6, "
                         r"finish_reason=length, e2e_latency=[\d.]+ s, text='", text), i
    # the 4xx reason, one line
    assert re.search(r"HTTP 400 POST /generate param=sampling_params\.top_p: ", text)


def test_start_up_banner_is_info_not_warning(monkeypatch, caplog):
    """The KV-cache / serving line is the normal start-up report: INFO (shown at the default level),
    not a WARNING. uvicorn's server is stubbed so main() returns once it would start serving."""
    import logging

    import uvicorn

    from sglite.launch_server import main
    from sglite.server.testing import FakeEngine

    class NoServer:
        started, should_exit = False, True

        def __init__(self, config):
            pass

        def run(self):
            pass

    monkeypatch.setattr(uvicorn, "Server", NoServer)
    lg = logging.getLogger("sglite")   # main() configures sglite's logging: undone afterwards
    monkeypatch.setattr(lg, "handlers", list(lg.handlers))
    monkeypatch.setattr(lg, "level", lg.level)
    with caplog.at_level(logging.INFO, logger="sglite"):
        main(["--port", "0"], engine=FakeEngine(max_total_tokens=4096))
    banner = [r for r in caplog.records if "KV cache of 4096 tokens" in r.getMessage()]
    assert len(banner) == 1 and banner[0].levelno == logging.INFO, [(r.levelname, r.getMessage()) for r in banner]
