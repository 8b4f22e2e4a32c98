"""Slow tier: each examples/agents_*.py, unchanged, against a server on the default model
(SmolLM2-135M). The model is small: what is checked is what the server guarantees, a typed
output that validates (constrained "auto" calls and the response_format union), not the answer.
Each example runs on a fresh server over an emptied cache. Its greedy trajectory still depends on
the session (after the whole slow tier the OpenAI Agents chat example looped past its 4 turns, the
pydantic-ai one filled the context and the LangGraph one ran its typed answer to the length limit,
while each file order tried alone passed; 2026-12-06): a run the model ends that way is an xfail
(after checking the server still serves), anything else (a 5xx, an answer that did not parse)
fails, and a finished run must give the typed output."""
import importlib.util
import pathlib

import httpx
import pytest
from pydantic import BaseModel

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig

pytestmark = pytest.mark.slow
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def base_url(real_engine):
    """A fresh server over an emptied radix cache for each example: the greedy path of a
    multi-request agent run depends on which prefixes were cached before it (they set the
    extend chunks, hence the float sums) and on the turns a server remembered, so each example
    starts from the same state whatever ran before it."""
    assert real_engine.flush_cache()
    with ServerThread(real_engine, ServerConfig(port=0)) as srv:
        yield srv.url + "/v1"


def _trajectory_end(e: BaseException) -> bool:
    """Whether ``e`` (or what it wraps) is how a framework ends a run the model did not finish:
    a turn / request / usage limit, the context window filled, or an answer cut by the length
    limit (the context's or the example's MAX_TOKENS cap: a Responses reply left incomplete for
    max_output_tokens, pydantic-ai's OutputTokenLimitExceeded). Anything else (a 5xx, an answer
    that did not parse) is a failure."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = f"{type(e).__name__}: {e}"
        if any(k in text for k in ("MaxTurnsExceeded", "UsageLimitExceeded", "ContextWindowExceeded",
                                   "LengthFinishReasonError", "context_length_exceeded", "GraphRecursionError",
                                   "maximum context length", "max_output_tokens", "OutputTokenLimitExceeded")):
            return True
        e = e.__cause__ or e.__context__
    return False


@pytest.mark.parametrize("name,kw,pkg", [("agents_openai_agents", {"api": "responses"}, "agents"),
                                         ("agents_openai_agents", {"api": "chat"}, "agents"),
                                         ("agents_pydantic_ai", {}, "pydantic_ai"),
                                         ("agents_smolagents", {}, "smolagents"),
                                         ("agents_langgraph", {}, "langgraph")])
def test_example_on_default_model(base_url, name, kw, pkg):
    pytest.importorskip(pkg)
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        out = mod.main(base_url, **kw)
    except Exception as e:  # noqa: BLE001 - sorted below: the model's path, or the server's fault
        if not _trajectory_end(e):
            raise
        # the 135M model looped (turn or request limit, context filled) or ran a typed answer to
        # the length limit: its greedy path, not a server guarantee; every answer it got parsed
        # (the framework raises its own error otherwise) and the server still serves
        assert httpx.get(base_url + "/models", timeout=30).status_code == 200
        pytest.xfail(f"the default model's trajectory ended the run: {type(e).__name__}: {str(e)[:200]}")
    if name == "agents_smolagents":
        assert isinstance(out, str) and out
    else:
        assert isinstance(out, BaseModel) and type(out).__name__ == "Weather"
        assert isinstance(out.city, str) and isinstance(out.summary, str)
