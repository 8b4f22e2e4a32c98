"""Slow tier: each examples/agents_*.py, unchanged, against a server on the default model
(SmolLM2-135M). The model is small: what is checked is what the server guarantees, a typed
output that validates (constrained "auto" calls and the response_format union), not the answer."""
import importlib.util
import pathlib

import pytest
from pydantic import BaseModel

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig

pytestmark = pytest.mark.slow
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def base_url(real_engine):
    with ServerThread(real_engine, ServerConfig(port=0)) as srv:
        yield srv.url + "/v1"


_TRAJECTORY = ("the 135M model's greedy path through a multi-request agent run depends on how its requests "
               "were batched and chunked (timing): on a loaded host it can loop past the framework's turn limit "
               "or run a structured answer to the length limit (seen 2026-12-06 in one full slow run, passing "
               "in the next; issue 34 follow-up)")


@pytest.mark.parametrize("name,kw,pkg", [pytest.param("agents_openai_agents", {"api": "responses"}, "agents",
                                                      marks=pytest.mark.xfail(strict=False, reason=_TRAJECTORY)),
                                         ("agents_openai_agents", {"api": "chat"}, "agents"),
                                         pytest.param("agents_pydantic_ai", {}, "pydantic_ai", marks=pytest.mark.xfail(
                                             strict=False, reason="since forced calls follow the family markup the 135M "
                                             "model can loop past pydantic-ai's 50-request limit (issue 34 follow-up)")),
                                         ("agents_smolagents", {}, "smolagents"),
                                         pytest.param("agents_langgraph", {}, "langgraph",
                                                      marks=pytest.mark.xfail(strict=False, reason=_TRAJECTORY))])
def test_example_on_default_model(base_url, name, kw, pkg):
    pytest.importorskip(pkg)
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(base_url, **kw)
    if name == "agents_smolagents":
        assert isinstance(out, str) and out
    else:
        assert isinstance(out, BaseModel) and type(out).__name__ == "Weather"
        assert isinstance(out.city, str) and isinstance(out.summary, str)
