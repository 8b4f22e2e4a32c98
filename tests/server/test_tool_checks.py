"""Tools the server cannot show or constrain are a 400 naming the field and the limit, before any
work (found by a break-it pass, 2026-12-06: a 400-level ``parameters`` schema was a 500 from a
RecursionError, and empty or 5,000-character names were accepted); a named ``tool_choice`` returns
one call, as OpenAI's does."""
import json

import pytest

from sglite.server.errors import ApiError
from sglite.server.protocol import NamedToolChoice, Tool
from sglite.server.tool_calls import MAX_TOOL_NAME, plan_tools


def _tool(name="get_weather", params=None) -> Tool:
    return Tool.model_validate({"type": "function", "function": {
        "name": name, "parameters": params or {"type": "object", "properties": {"city": {"type": "string"}}}}})


def _deep(levels: int) -> dict:
    s = {"type": "string"}
    for _ in range(levels):
        s = {"type": "array", "items": s}
    return {"type": "object", "properties": {"a": s}}


@pytest.mark.parametrize("name", ["", " ", "get weather", "nul\x00", 'a"b', "a\\b", "x" * (MAX_TOOL_NAME + 1),
                                  "get_weather\n"])
def test_bad_names_are_refused_naming_the_field(name):
    with pytest.raises(ApiError) as e:
        plan_tools([_tool("ok"), _tool(name)], "auto")
    assert e.value.param == "tools[1].function.name" and str(MAX_TOOL_NAME) in str(e.value)


@pytest.mark.parametrize("name", ["get_weather", "search.web", "ns:tool-2", "x" * MAX_TOOL_NAME, "météo"])
def test_usual_names_pass(name):
    assert plan_tools([_tool(name)], "required").names == [name]


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_schema_nested_past_the_compiler_is_a_400_for_every_mode(choice):
    plan_tools([_tool(params=_deep(100))], choice)  # deep but within the limit
    with pytest.raises(ApiError) as e:
        plan_tools([_tool(params=_deep(400))], choice)
    assert e.value.param == "tools[0].function.parameters" and "nested too deeply (at most" in str(e.value)


def test_the_responses_api_names_its_own_fields():
    with pytest.raises(ApiError) as e:
        plan_tools([_tool(params=_deep(400))], "auto", field_of=lambda i, key: f"tools[{i}].{key}")
    assert e.value.param == "tools[0].parameters"


def test_a_named_choice_returns_one_call():
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    plan = plan_tools([_tool(), _tool("get_time")], named, parallel=True)
    assert plan.mode == "forced" and plan.names == ["get_weather"] and plan.parallel is False
    assert plan_tools([_tool(), _tool("get_time")], "required", parallel=True).parallel is True
    assert json.dumps(plan.schema)  # the call's schema is built
