"""The agent frameworks people use, run unchanged against an sglite server (FakeEngine scripted as
a one-tool agent: :class:`sglite.server.agent_testing.ScriptedAgentEngine`): the OpenAI Agents SDK
(chat-completions and Responses models), pydantic-ai, smolagents and LangGraph, each with a
function tool and a typed output. What each sends on the wire is recorded by an httpx hook on
the framework's own client and checked here (docs/agents.md describes it)."""
from __future__ import annotations

import json
import warnings

import httpx
import pytest
from pydantic import BaseModel

from sglite.server.agent_testing import ScriptedAgentEngine
from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig

# slow tier: importing the five frameworks costs ~9 s, a twentieth of the fast tier's budget
pytestmark = pytest.mark.slow

MODEL = "fake-model"


class Weather(BaseModel):
    city: str
    summary: str


CALLS: list[str] = []


def get_weather(city: str) -> str:
    """Get the weather of a city."""
    CALLS.append(city)
    return f"{city}: sunny, 21 C"


@pytest.fixture()
def server():
    eng = ScriptedAgentEngine()
    CALLS.clear()
    with ServerThread(eng, ServerConfig(port=0)) as s:
        yield s


class Recorder:
    """``(path, JSON body)`` of every request a framework's httpx client sends."""

    def __init__(self):
        self.bodies: list[tuple[str, dict]] = []

    def _add(self, req: httpx.Request) -> None:
        self.bodies.append((req.url.path, json.loads(req.content or b"{}")))

    async def _async_add(self, req: httpx.Request) -> None:
        self._add(req)

    def client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"request": [self._add]}, timeout=30)

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"request": [self._async_add]}, timeout=30)


def _tool_then_answer(rec: Recorder, path: str) -> tuple[dict, dict]:
    assert CALLS == ["Paris"], "the framework ran the tool with the model's arguments"
    assert len(rec.bodies) >= 2 and all(p == path for p, _ in rec.bodies)
    return rec.bodies[0][1], rec.bodies[-1][1]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_sdk(server, api):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    rec = Recorder()
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", http_client=rec.async_client())
    model_cls = agents.OpenAIChatCompletionsModel if api == "chat" else agents.OpenAIResponsesModel
    agent = agents.Agent(name="weather", instructions="Use the tools.", tools=[agents.function_tool(get_weather)],
                         output_type=Weather, model=model_cls(model=MODEL, openai_client=client))
    out = agents.Runner.run_sync(agent, "Weather in Paris?").final_output
    assert isinstance(out, Weather)
    first, last = _tool_then_answer(rec, "/v1/chat/completions" if api == "chat" else "/v1/responses")
    if api == "chat":  # tools in "auto" together with response_format: one union grammar
        assert first["response_format"]["type"] == "json_schema" and first["tools"]
        assert [m["role"] for m in last["messages"]][-2:] == ["assistant", "tool"]
    else:  # the whole history resent as items; no previous_response_id
        assert first["text"]["format"]["type"] == "json_schema" and first["instructions"]
        assert "previous_response_id" not in last
        assert [i.get("type", "message") for i in last["input"]] == ["message", "function_call",
                                                                     "function_call_output"]


def test_pydantic_ai(server):
    pytest.importorskip("pydantic_ai")
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    rec = Recorder()
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", http_client=rec.async_client())
    agent = Agent(OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client)), output_type=Weather,
                  tools=[get_weather])
    out = agent.run_sync("Weather in Paris?").output
    assert isinstance(out, Weather)
    first, last = _tool_then_answer(rec, "/v1/chat/completions")
    # the typed output is a "final_result" tool; with tools it forces a call every turn
    assert first["tool_choice"] == "required"
    assert {t["function"]["name"] for t in first["tools"]} == {"get_weather", "final_result"}


def test_smolagents(server):
    smolagents = pytest.importorskip("smolagents")

    def get_weather(city: str) -> str:  # smolagents reads the Args section of the docstring
        """Get the weather of a city.

        Args:
            city: the city
        """
        CALLS.append(city)
        return f"{city}: sunny, 21 C"

    rec = Recorder()
    model = smolagents.OpenAIServerModel(model_id=MODEL, api_base=server.url + "/v1", api_key="x",
                                         client_kwargs={"http_client": rec.client()})
    agent = smolagents.ToolCallingAgent(tools=[smolagents.tool(get_weather)], model=model, max_steps=3)
    out = agent.run("Weather in Paris?")
    assert isinstance(out, str) and out
    first, last = _tool_then_answer(rec, "/v1/chat/completions")
    assert first["tool_choice"] == "required" and first["stop"] == ["Observation:", "Calling tools:"]
    # smolagents replays the call and its result as plain text (no tool_calls, no tool role)
    roles = [m["role"] for m in last["messages"]]
    assert "tool" not in roles and "Observation:" in json.dumps(last["messages"])


def test_langgraph(server):
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    rec = Recorder()
    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="x", http_client=rec.client(),
                     http_async_client=rec.async_client())
    with warnings.catch_warnings():  # create_react_agent moved to langchain.agents in LangGraph 1.0
        warnings.simplefilter("ignore")
        agent = create_react_agent(llm, [tool(get_weather)], response_format=Weather)
    out = agent.invoke({"messages": [("user", "Weather in Paris?")]})["structured_response"]
    assert isinstance(out, Weather)
    first, last = _tool_then_answer(rec, "/v1/chat/completions")
    assert "response_format" not in first and first["tools"]
    # the typed output is one more call: the history plus response_format, without tools
    assert last["response_format"]["type"] == "json_schema" and "tools" not in last


# ----------------------------------------------------------------------------- examples/agents_*.py
EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[2] / "examples"


def _example(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name,kw,pkg", [("agents_openai_agents", {"api": "responses"}, "agents"),
                                         ("agents_openai_agents", {"api": "chat"}, "agents"),
                                         ("agents_pydantic_ai", {}, "pydantic_ai"),
                                         ("agents_smolagents", {}, "smolagents"),
                                         ("agents_langgraph", {}, "langgraph")])
def test_agent_examples_run_against_the_server(server, name, kw, pkg):
    """Each example as written (default model name from /v1/models) on the scripted fake engine;
    every model call carries the example's output cap (no reply may run to the end of the context)."""
    pytest.importorskip(pkg)
    mod = _example(name)
    out = mod.main(server.url + "/v1", **kw)
    assert out and (isinstance(out, str) or out.city)
    caps = [c["sampling_params"] for c in server.engine.calls]
    caps = [sp.get("max_new_tokens") if isinstance(sp, dict) else sp.max_new_tokens for sp in caps]
    assert caps and all(c == mod.MAX_TOKENS for c in caps), caps
