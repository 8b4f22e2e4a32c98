"""The router against scripted workers (small FastAPI apps in threads): streams are relayed chunk by
chunk (the first frame arrives before the worker has finished), a worker answering 503 is retried
elsewhere and marked down, health checks bring a restarted worker back, and the cache threshold
decides between the longest-prefix worker and the emptiest tree."""
import asyncio
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from sglite.router.app import RouterThread
from sglite.router.policy import Policy, RouterConfig
from tests.router.workers import Worker

GAP = 0.4  # seconds between a slow worker's frames


def worker_app(name: str, status: int = 200) -> FastAPI:
    app = FastAPI()
    app.state.calls = 0

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.post("/generate")
    async def generate(body: dict):
        app.state.calls += 1
        if status != 200:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=status)
        if not body.get("stream"):
            return {"text": name}

        async def frames():
            for i in range(3):
                yield f'data: {{"text": "{name}{i}", "t": {time.monotonic()}}}\n\n'
                await asyncio.sleep(GAP)
            yield "data: [DONE]\n\n"
        return StreamingResponse(frames(), media_type="text/event-stream")
    return app


def post(url, stream=False):
    return httpx.post(url + "/generate", json={"text": "hi", "stream": stream}, timeout=30)


def test_stream_is_relayed_chunk_by_chunk():
    with Worker(worker_app("w")) as w, RouterThread(RouterConfig(worker_urls=(w.url,), port=0)) as r:
        arrivals, texts = [], []
        with httpx.stream("POST", r.url + "/generate", json={"text": "hi", "stream": True}, timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    texts.append(line)
        assert [t.split('"text": "')[1][:2] for t in texts] == ["w0", "w1", "w2"]
        # the first frame came while the worker was still producing the others
        assert arrivals[1] - arrivals[0] > GAP / 2 and arrivals[2] - arrivals[0] > GAP


def test_a_worker_answering_503_is_retried_elsewhere_and_marked_down():
    bad_app, good_app = worker_app("bad", status=503), worker_app("good")
    with Worker(bad_app) as bad, Worker(good_app) as good:
        conf = RouterConfig(worker_urls=(bad.url, good.url), port=0, policy="round_robin",
                            health_check_interval_secs=60)
        with RouterThread(conf) as r:
            assert [post(r.url).json()["text"] for _ in range(3)] == ["good"] * 3
            assert bad_app.state.calls == 1 and r.router.healthy == [False, True]
        conf = RouterConfig(worker_urls=(bad.url,), port=0, max_retries=0, health_check_interval_secs=60)
        with RouterThread(conf) as r:  # nobody else: 503 naming the cause
            resp = post(r.url)
            assert resp.status_code == 503 and "answered 503" in resp.json()["error"]["message"]


def test_health_checks_bring_a_restarted_worker_back():
    a_app = worker_app("a")
    with Worker(worker_app("b")) as b:
        a = Worker(a_app).__enter__()
        conf = RouterConfig(worker_urls=(a.url, b.url), port=0, policy="round_robin", health_check_interval_secs=0.2)
        with RouterThread(conf) as r:
            r.router.policy.trees[0].insert("remembered prefix")
            a.__exit__()
            assert {post(r.url).json()["text"] for _ in range(4)} == {"b"}
            assert r.router.healthy == [False, True]
            with Worker(worker_app("a again"), port=a.port):
                deadline = time.monotonic() + 10
                while not r.router.healthy[0]:
                    assert time.monotonic() < deadline, "the restarted worker was not brought back"
                    time.sleep(0.05)
                assert r.router.policy.trees[0].size == 0  # its cache is new: the tree is forgotten
                assert {post(r.url).json()["text"] for _ in range(4)} == {"a again", "b"}


@pytest.mark.parametrize("threshold,winner", [(0.5, "emptiest"), (0.1, "prefix")])
def test_cache_threshold_decides_between_prefix_and_emptiest_tree(threshold, winner):
    p = Policy(RouterConfig(worker_urls=("http://a:1", "http://b:1"), cache_threshold=threshold), 2)
    p.trees[0].insert("common " * 4 + "x" * 200)  # worker 0: the prefix and a big tree
    text = "common " * 4 + "y" * 72  # 28 of 100 characters match worker 0's tree
    assert p.trees[0].match(text) == 28
    got = p.select(text, [0, 0], [True, True])
    assert got == (1 if winner == "emptiest" else 0)
