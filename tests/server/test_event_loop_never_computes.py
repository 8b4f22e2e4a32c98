"""Request preparation (chat template, tokenizing, grammar and stop-regex compilation) runs on a
worker pool with a time budget: /health answers while it runs, and a request over the budget is a
400 naming the field and the budget (issue 26 §2)."""
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig
from sglite.server.testing import FakeEngine

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class SlowTemplateEngine(FakeEngine):
    def __init__(self, delay: float, budget: float):
        super().__init__()
        self.delay = delay
        self.config = SimpleNamespace(request_prep_timeout=budget, disaggregation_mode="null")
        self.template_threads = []

    def apply_chat_template(self, *a, **k):
        self.template_threads.append(threading.current_thread().name)
        time.sleep(self.delay)  # a huge prompt or a pathological template
        return super().apply_chat_template(*a, **k)


def test_health_answers_while_a_request_is_prepared():
    eng = SlowTemplateEngine(delay=1.5, budget=30)
    with ServerThread(eng, ServerConfig(port=0)) as srv:
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(srv.url + "/v1/chat/completions",
                                                                               json=CHAT, timeout=30)))
        t.start()
        while not eng.template_threads:
            time.sleep(0.01)
        t0 = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        waited = time.monotonic() - t0
        t.join()
        assert result["r"].status_code == 200
        assert waited < 1.0, f"/health waited {waited:.2f} s behind a request's preparation"
        assert all(name.startswith("sglite-http-prep") for name in eng.template_threads)


def test_preparation_over_budget_is_a_400_naming_field_and_budget():
    eng = SlowTemplateEngine(delay=2.0, budget=0.3)
    with ServerThread(eng, ServerConfig(port=0)) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "messages" and "request_prep_timeout=0.3" in err["message"]
        assert httpx.get(srv.url + "/health").status_code == 200
        assert not eng._held  # nothing was scheduled


def test_engine_builds_async_requests_off_the_event_loop(tiny_model_dir, monkeypatch):
    import asyncio

    from sglite import Engine
    from sglite.errors import InvalidRequestError

    with Engine(str(tiny_model_dir), dtype="float32", device="cpu", max_total_tokens=1024,
                request_prep_timeout=0.5) as e:
        threads = []
        real = e.requests.build

        def spy(*a, **k):
            threads.append(threading.current_thread().name)
            return real(*a, **k)
        monkeypatch.setattr(e.requests, "build", spy)
        out = asyncio.run(e.async_generate("hi", {"max_new_tokens": 2, "temperature": 0}))
        assert out["meta_info"]["completion_tokens"] == 2 and threads[0].startswith("sglite-prep")

        real_compile = e.requests.compile_grammar

        def slow_compile(sp):
            time.sleep(1.5)
            return real_compile(sp)
        monkeypatch.setattr(e.requests, "compile_grammar", slow_compile)
        with pytest.raises(InvalidRequestError, match=r"request_prep_timeout=0.5") as err:
            asyncio.run(e.async_generate("hi", {"max_new_tokens": 2, "regex": "[ab]+"}))
        assert err.value.field == "regex"
        time.sleep(1.5)  # the abandoned build finishes in the pool and is dropped: nothing runs
        assert e.get_server_info()["running_requests"] == 0 and e.get_server_info()["waiting_requests"] == 0


def test_generate_validates_its_sampling_params_on_the_preparation_pool(monkeypatch):
    """/generate's validation compiles every stop regex of every prompt (a breaker's 480 prompts x
    64 patterns stalled /health 8 s on the event loop): it runs on the preparation pool."""
    from sglite.server import native_api

    threads = []
    real = native_api.build_call

    def spy(*a, **k):
        threads.append(threading.current_thread().name)
        return real(*a, **k)
    monkeypatch.setattr(native_api, "build_call", spy)
    with ServerThread(FakeEngine(), ServerConfig(port=0)) as srv:
        r = httpx.post(srv.url + "/generate", json={"text": "hi", "sampling_params": {
            "max_new_tokens": 2, "stop_regex": ["a+b", "c(d|e)"]}}, timeout=30)
        assert r.status_code == 200, r.text
        bad = httpx.post(srv.url + "/generate", json={"text": "hi", "sampling_params": {"stop_regex": ["(x"]}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.stop_regex"
    assert len(threads) == 2 and all(n.startswith("sglite-http-prep") for n in threads)
