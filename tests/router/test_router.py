"""Data-parallel router: approximate radix tree, routing policies, and the HTTP proxy over two
FakeEngine workers on 127.0.0.1 (streaming pass-through, retries, health checks)."""
import json

import httpx
import pytest

from sglite.router.approx_tree import ApproxRadixTree
from sglite.router.app import RouterThread, request_text
from sglite.router.policy import Policy, RouterConfig
from sglite.errors import InvalidRequestError


def test_tree_matches_longest_prefix_and_splits_edges():
    t = ApproxRadixTree()
    t.insert("hello world")
    t.insert("hello there")
    assert t.match("hello world!") == 11 and t.match("hello th") == 8 and t.match("help") == 3
    assert t.match("xyz") == 0 and t.size == len("hello world") + len("there")


def test_tree_evicts_least_recently_used_leaves():
    t = ApproxRadixTree(max_chars=20)
    t.insert("aaaaaaaaaa")
    t.insert("bbbbbbbbbb")
    t.match("aaaaaaaaaa")  # a is now more recent than b
    t.insert("cccccccccc")
    assert t.size <= 20 and t.match("aaaaaaaaaa") == 10 and t.match("bbbbbbbbbb") == 0
    assert t.match("cccccccccc") == 10


def cfg(**kw):
    return RouterConfig(worker_urls=("http://a:1", "http://b:2"), **kw)


def test_cache_aware_keeps_a_prefix_on_one_worker_and_spreads_new_ones():
    p = Policy(cfg(), 2)
    sys_a, sys_b = "You are a pirate. " * 5, "You are a lawyer. " * 5
    first_a = p.select(sys_a + "q1", [0, 0], [True, True])
    first_b = p.select(sys_b + "q1", [0, 0], [True, True])
    assert first_a != first_b  # the second prefix goes to the emptier tree
    for q in range(2, 6):
        assert p.select(sys_a + f"q{q}", [0, 0], [True, True]) == first_a
        assert p.select(sys_b + f"q{q}", [0, 0], [True, True]) == first_b


def test_cache_aware_balances_when_load_is_imbalanced():
    text = "shared prefix " * 10

    def route(load_of_cached, load_of_other):
        p = Policy(cfg(balance_abs_threshold=4, balance_rel_threshold=1.5), 2)
        w = p.select(text, [0, 0], [True, True])  # w now holds the prefix
        loads = [load_of_cached if i == w else load_of_other for i in range(2)]
        return "cached" if p.select(text, loads, [True, True]) == w else "other"

    assert route(10, 0) == "other"  # 10 - 0 > 4 and 10 > 0 * 1.5: least loaded
    assert route(4, 0) == "cached"  # 4 - 0 is not > 4
    assert route(12, 7) == "other"  # 5 > 4 and 12 > 10.5
    assert route(12, 9) == "cached"  # 12 <= 9 * 1.5


def test_round_robin_random_and_unhealthy_workers():
    rr = Policy(cfg(policy="round_robin"), 2)
    assert [rr.select("x", [0, 0], [True, True]) for _ in range(4)] == [0, 1, 0, 1]
    assert {rr.select("x", [0, 0], [False, True]) for _ in range(3)} == {1}
    ca = Policy(cfg(), 2)
    assert {ca.select("x" * 50, [0, 0], [True, False]) for _ in range(3)} == {0}
    with pytest.raises(RuntimeError, match="no healthy worker"):
        ca.select("x", [0, 0], [False, False])


@pytest.mark.parametrize("kw,field", [(dict(policy="lru"), "policy"), (dict(cache_threshold=2), "cache_threshold"),
                                      (dict(balance_rel_threshold=0.5), "balance_rel_threshold"),
                                      (dict(worker_urls=("localhost:1",)), "worker_urls")])
def test_router_config_rejects_bad_values(kw, field):
    with pytest.raises(InvalidRequestError, match=field):
        RouterConfig(**kw)


def test_request_text_of_each_route():
    assert request_text("/generate", {"text": "hi"}) == "hi"
    assert request_text("/generate", {"text": ["a", "b"]}) == "a"
    assert request_text("/generate", {"input_ids": [1, 2]}) == "1 2"
    assert request_text("/v1/completions", {"prompt": "p"}) == "p"
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert request_text("/v1/chat/completions", {"messages": msgs}) == "<system>S<user>U"


@pytest.fixture()
def two_fake_workers():
    from sglite.server.runner import ServerThread
    from sglite.server.testing import FakeEngine

    engines = [FakeEngine(), FakeEngine()]
    servers = [ServerThread(e).start() for e in engines]
    yield engines, servers
    for s in servers:
        s.stop()


def gen(url, text, **kw):
    return httpx.post(url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}, **kw},
                      timeout=30)


def test_router_proxies_routes_by_prefix_and_streams(two_fake_workers):
    engines, servers = two_fake_workers
    conf = RouterConfig(worker_urls=tuple(s.url for s in servers), port=0)
    with RouterThread(conf) as r:
        direct = gen(servers[0].url, "Hello").json()
        routed = gen(r.url, "Hello").json()
        assert routed["text"] == direct["text"]
        before = [len(e.calls) for e in engines]
        prefix = "A long shared system prompt that many requests start with. "
        for i in range(6):
            assert gen(r.url, prefix + f"question {i}").status_code == 200
        grew = [len(e.calls) - b for e, b in zip(engines, before)]
        assert sorted(grew) == [0, 6]  # one worker got every request sharing the prefix
        # streaming: the same SSE frames as the worker's own
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "stream": True}
        with httpx.stream("POST", r.url + "/generate", json=body, timeout=30) as resp:
            frames = [ln for ln in resp.iter_lines() if ln]
        assert frames[-1] == "data: [DONE]"
        assert json.loads(frames[-2][len("data: "):])["text"] == direct["text"]
        oa = httpx.post(r.url + "/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 4})
        assert oa.status_code == 200 and oa.json()["object"] == "text_completion"
        assert httpx.post(r.url + "/generate", content=b"{not json").status_code == 400
        info = httpx.get(r.url + "/get_server_info").json()
        assert info["policy"] == "cache_aware" and len(info["workers"]) == 2
        assert sum(w["routed_requests"] for w in info["workers"]) == 8 + 1
        assert httpx.get(r.url + "/health").status_code == 200
        assert httpx.post(r.url + "/flush_cache").status_code == 200


def test_router_retries_on_a_dead_worker_and_health_checks_bring_it_back(two_fake_workers):
    engines, servers = two_fake_workers
    conf = RouterConfig(worker_urls=tuple(s.url for s in servers), port=0, policy="round_robin",
                        health_check_interval_secs=0.2)
    with RouterThread(conf) as r:
        servers[0].stop()
        for _ in range(4):
            assert gen(r.url, "Hello").status_code == 200  # retried on worker 1
        assert r.router.healthy == [False, True]
        servers[1].stop()
        resp = gen(r.url, "Hello")
        assert resp.status_code == 503 and "no worker" in resp.json()["error"]["message"]
        import time
        time.sleep(0.6)
        assert httpx.get(r.url + "/health").status_code == 503


@pytest.mark.slow
def test_cache_aware_hit_rate_on_two_tiny_workers_is_near_a_single_workers(tiny_model_dir):
    """Shared-prefix and multi-turn workloads: cache-aware routing keeps >= 90 % of one worker's
    prefix-cache hit rate; round robin (reported) loses more on multi-turn."""
    from sglite import Engine
    from sglite.bench.router import run_workload
    from sglite.server.runner import ServerThread

    engines = [Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=16384, log_level="warning")
               for _ in range(3)]
    servers = [ServerThread(e).start() for e in engines]
    try:
        conf = RouterConfig(worker_urls=(servers[1].url, servers[2].url), port=0)
        for wl in ("shared-prefix", "multi-turn"):
            single = run_workload(servers[0].url, wl, 16, 0, 4, 2)
            with RouterThread(conf) as r:
                routed = run_workload(r.url, wl, 16, 0, 4, 2)
                assert min(r.router.routed) > 0  # both workers served
            assert single["hit_rate"] > 0.3
            assert routed["hit_rate"] >= 0.9 * single["hit_rate"], (wl, routed, single)
    finally:
        for s in servers:
            s.stop()
        for e in engines:
            e.shutdown()


@pytest.mark.slow
def test_serve_dp_size_starts_workers_behind_the_router(tiny_model_dir, tmp_path):
    import subprocess
    import sys
    import time

    from sglite.runtime.parallel.ports import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sglite.launch_server", "--model-path", str(tiny_model_dir),
                             "--dp-size", "2", "--port", str(port), "--dtype", "float32",
                             "--max-total-tokens", "2048", "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, "sglite serve --dp-size exited"
            try:
                if httpx.get(url + "/get_server_info", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(1)
        info = httpx.get(url + "/get_server_info").json()
        assert len(info["workers"]) == 2 and all(w["healthy"] for w in info["workers"])
        out = gen(url, "The capital of France is")
        assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 8
    finally:
        proc.terminate()
        proc.wait(timeout=60)
