"""The 10,000-case fuzz run of issue 26 (slow tier): cases generated from the OpenAPI schema the
server publishes (schemathesis, valid and invalid by the schema), sent to the server's native and
OpenAI routes in process (ASGI) and through ``sglite router`` over HTTP to a live server; no answer
may be a 5xx (a busy 503 aside, which a fuzz run never reaches), every 4xx has an error body, no
case may hang (each is bounded by an HTTP timeout), and the engine holds no KV afterwards.

Per target, the test prints the cases sent and a status histogram (recorded in docs/security.md)."""
import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from sglite.router.app import RouterThread
from sglite.router.policy import RouterConfig
from sglite.server.app import create_app
from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig
from sglite.server.testing import FakeEngine

pytestmark = pytest.mark.slow

SERVER_CASES, ROUTER_CASES = 6_000, 4_000
ENGINE = FakeEngine(context_length=96, max_total_tokens=4096)
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", create_app(ENGINE))
OPERATIONS = [r.ok() for r in SCHEMA.get_all_operations()]
ROUTED = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/abort_request", "/health")


def cases(paths=None):
    ops = [op for op in OPERATIONS if paths is None or op.path in paths]
    return st.one_of(*[op.as_strategy(generation_mode=mode) for op in ops
                       for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])


def check(response, case, seen):
    seen[(case.path, response.status_code)] += 1
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        assert "error" in response.json(), response.text[:300]


def report(name, seen):
    total = sum(seen.values())
    by_status = collections.Counter()
    for (_, status), n in seen.items():
        by_status[status] += n
    print(f"\n{name}: {total} cases, statuses {dict(sorted(by_status.items()))}, "
          f"routes {len({p for p, _ in seen})}")
    return total


def test_server_routes_10k_share():
    seen = collections.Counter()

    @settings(max_examples=SERVER_CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def run(case):
        check(case.call(timeout=30), case, seen)

    run()
    assert report("server (ASGI)", seen) >= SERVER_CASES * 0.95
    info = ENGINE.get_server_info()
    assert info["available_tokens"] == info["max_total_tokens"]


def test_router_routes_10k_share():
    seen = collections.Counter()
    engine = FakeEngine(context_length=96, max_total_tokens=4096)
    with ServerThread(engine, ServerConfig(port=0)) as worker, \
            RouterThread(RouterConfig(worker_urls=(worker.url,), port=0, health_check_interval_secs=60)) as r:

        @settings(max_examples=ROUTER_CASES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases(ROUTED))
        def run(case):
            check(case.call(base_url=r.url, timeout=30), case, seen)

        run()
        assert r.router.healthy == [True]
    assert report("router (HTTP) -> server", seen) >= ROUTER_CASES * 0.95
    info = engine.get_server_info()
    assert info["available_tokens"] == info["max_total_tokens"]
