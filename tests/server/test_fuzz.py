"""Fuzz the app's OpenAPI schema (schemathesis + hypothesis): no input may cause a 5xx.

Bounded: a few hundred generated requests (valid and invalid by the schema) over every route,
against the FakeEngine with a short context so each case stays cheap.
"""
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from sglite.server.app import create_app
from sglite.server.testing import FakeEngine

ENGINE = FakeEngine(context_length=96, max_total_tokens=4096)
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", create_app(ENGINE))
OPERATIONS = [r.ok() for r in SCHEMA.get_all_operations()]
CASES = st.one_of(*[op.as_strategy(generation_mode=mode) for op in OPERATIONS
                    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])


def test_schema_covers_the_api():
    paths = {op.path for op in OPERATIONS}
    for p in ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/abort_request"):
        assert p in paths


def _no_server_error(case):
    response = case.call()
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        assert "error" in response.json()


@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(case=CASES)
def test_fuzz_no_server_errors(case):
    """Fast tier: 60 derandomized cases over every route (positive and negative)."""
    _no_server_error(case)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(case=CASES)
def test_fuzz_no_server_errors_300(case):
    _no_server_error(case)


def test_idle_after_fuzzing():
    info = ENGINE.get_server_info()
    assert info["available_tokens"] == info["max_total_tokens"]
