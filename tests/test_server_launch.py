"""``sglite serve`` flags and ``python -m sglite.launch_server`` end to end (tiny model)."""
import os
import subprocess
import sys
import time

import httpx

from sglite.config import EngineConfig
from sglite.server.launch import build_parser, engine_kwargs, server_config
from sglite.server.runner import free_port


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


def test_launch_server_module_serves(tiny_model_dir, tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "sglite.launch_server", "--model-path", str(tiny_model_dir),
                                 "--port", str(port), "--max-total-tokens", "2048", "--dtype", "float32"],
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
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"http://127.0.0.1:{port}/get_server_info").json()["max_total_tokens"] == 2048
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    assert "KV cache of 2048 tokens" in text and "bytes per token" in text
