"""Load on the default model: 64 concurrent streaming clients, a quarter of them hanging up
mid-stream. Everyone else gets a complete answer, and afterwards the KV pool is whole again
(free + evictable == capacity, from /get_server_info)."""
import asyncio
import json
import time

import httpx
import pytest

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig

CLIENTS, MAX_TOKENS = 64, 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(real_engine):
    with ServerThread(real_engine, ServerConfig(port=0, enable_metrics=True)) as srv:
        yield srv


async def _client(http: httpx.AsyncClient, i: int, hang_up: bool) -> dict:
    body = {"messages": [{"role": "user", "content": f"Client {i}: name a colour."}], "max_tokens": MAX_TOKENS,
            "temperature": 0.7, "seed": i, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    got = {"content": "", "finish": None, "usage": None, "done": False, "chunks": 0}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                got["done"] = True
                break
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            for ch in ev["choices"]:
                got["content"] += ch["delta"].get("content") or ""
                got["finish"] = ch["finish_reason"] or got["finish"]
                got["chunks"] += 1
            got["usage"] = ev.get("usage") or got["usage"]
            if hang_up and got["chunks"] >= 3:
                break  # leaving the block closes the connection mid-stream
    return got


async def _run_all(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        return await asyncio.gather(*(_client(http, i, i % 4 == 0) for i in range(CLIENTS)))


def test_64_streaming_clients_with_hang_ups(server):
    t0 = time.monotonic()
    results = asyncio.run(_run_all(server.url))
    elapsed = time.monotonic() - t0
    for i, res in enumerate(results):
        if i % 4 == 0:
            assert not res["done"]
            continue
        assert res["done"] and res["finish"] == "length", res
        assert res["usage"]["completion_tokens"] == MAX_TOKENS and res["content"]
    deadline = time.monotonic() + 30
    while True:
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        if info["running_requests"] == 0 and info["waiting_requests"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert info["running_requests"] == 0 and info["waiting_requests"] == 0
    assert info["available_tokens"] == info["free_tokens"] + info["evictable_tokens"] == info["max_total_tokens"]
    metrics = httpx.get(server.url + "/metrics").text
    aborted = float(next(ln.split()[-1] for ln in metrics.splitlines()
                         if ln.startswith("sglite_aborted_requests_total")))
    assert aborted >= CLIENTS // 4
    print(f"{CLIENTS} streaming clients in {elapsed:.1f} s, {aborted:.0f} aborted")
