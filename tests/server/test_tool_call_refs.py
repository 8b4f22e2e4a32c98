"""Tool ``parameters`` with ``$defs`` / ``definitions`` + ``$ref`` (pydantic nested models, as
instructor sends them) resolve against the parameters' own root for every ``tool_choice``."""
from __future__ import annotations

import json
from typing import Iterable, Optional

import jsonschema
import pydantic
import pytest

from sglite.bench.grammar_coverage import accepts, byte_backend
from sglite.server.protocol import ChatCompletionRequest
from sglite.server.tool_calls import plan_tools


class Address(pydantic.BaseModel):
    street: str
    city: str


class User(pydantic.BaseModel):
    name: str
    age: int
    address: Address


class Users(pydantic.BaseModel):  # instructor's Iterable[User] wrapper: {"tasks": [User, ...]}
    tasks: list[User]


class PartialUser(pydantic.BaseModel):  # instructor's Partial[User]: every field optional
    name: Optional[str] = None
    address: Optional[Address] = None


class Node(pydantic.BaseModel):  # recursive
    value: int
    children: list["Node"] = []


def _tool(name, model):
    return {"type": "function", "function": {"name": name, "description": model.__doc__ or name,
                                             "parameters": model.model_json_schema()}}


def _definitions_style(model):
    """The draft-7 spelling (``definitions``, ``#/definitions/...``) other generators emit."""
    text = json.dumps(model.model_json_schema()).replace('"$defs"', '"definitions"').replace("#/$defs/", "#/definitions/")
    return json.loads(text)


TOOLS = [_tool("User", User), _tool("Users", Users), _tool("PartialUser", PartialUser), _tool("Node", Node),
         {"type": "function", "function": {"name": "UserD", "parameters": _definitions_style(User)}}]
GOOD = {"User": {"name": "Ann", "age": 3, "address": {"street": "1 Main", "city": "Oslo"}},
        "Users": {"tasks": [{"name": "A", "age": 1, "address": {"street": "s", "city": "c"}}]},
        "PartialUser": {"name": "A", "address": {"street": "s", "city": "c"}},
        "Node": {"value": 1, "children": [{"value": 2, "children": [{"value": 3, "children": []}]}]},
        "UserD": {"name": "Ann", "age": 3, "address": {"street": "1 Main", "city": "Oslo"}}}
BAD = {"User": {"name": "Ann", "age": 3, "address": {"street": 1, "city": "Oslo"}},
       "Users": {"tasks": [{"name": "A", "age": 1, "address": {"city": "c"}}]},
       "PartialUser": {"name": "A", "address": {"street": "s"}},
       "Node": {"value": 1, "children": [{"value": "x"}]},
       "UserD": {"name": "Ann", "age": 3, "address": {"street": "1 Main", "town": "Oslo"}}}


def _plan(tool_choice, tools=TOOLS):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice=tool_choice)
    return plan_tools(req.tools, req.tool_choice)


def _text(name, args):
    return json.dumps({"name": name, "arguments": args}, separators=(",", ":"))


@pytest.fixture(scope="module")
def backend():
    return byte_backend(json_schema_strict=True)


@pytest.mark.parametrize("name", list(GOOD))
def test_named_tool_choice_compiles_and_constrains(backend, name):
    tool = next(t for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(GOOD[name], tool["function"]["parameters"])  # the oracle agrees with the fixtures
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(BAD[name], tool["function"]["parameters"])
    plan = _plan({"type": "function", "function": {"name": name}})
    g = backend.compile("json_schema", json.dumps(plan.schema))
    assert accepts(g, _text(name, GOOD[name]).encode())
    assert not accepts(g, _text(name, BAD[name]).encode())
    other = next(n for n in GOOD if n != name)
    assert not accepts(g, _text(other, GOOD[other]).encode())


def test_required_tool_choice_any_tool(backend):
    plan = _plan("required")
    g = backend.compile("json_schema", json.dumps(plan.schema))
    for name in GOOD:
        assert accepts(g, _text(name, GOOD[name]).encode()), name
        assert not accepts(g, _text(name, BAD[name]).encode()), name
    jsonschema.Draft202012Validator.check_schema(plan.schema)
    jsonschema.validate(json.loads(_text("Users", GOOD["Users"])), plan.schema)


def test_auto_keeps_the_tools_as_given():
    plan = _plan("auto")
    assert plan.mode == "auto" and plan.tools[0]["function"]["parameters"] == User.model_json_schema()


def test_refs_inside_data_keywords_are_not_rewritten():
    params = {"$defs": {"A": {"type": "string"}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"const": {"$ref": "#/$defs/A"}}}}
    plan = _plan("required", [{"type": "function", "function": {"name": "f", "parameters": params}}])
    args = plan.schema["$defs"]["tool0"]
    assert args["properties"]["a"] == {"$ref": "#/$defs/tool0/$defs/A"}
    assert args["properties"]["b"] == {"const": {"$ref": "#/$defs/A"}}


def test_parallel_tool_calls_false_keeps_the_first_call():
    from sglite.server.tool_calls import parse_tool_calls

    text = ('<tool_call>{"name": "User", "arguments": {"name": "a"}}</tool_call>'
            '<tool_call>{"name": "Node", "arguments": {"value": 1}}</tool_call>')
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, parallel_tool_calls=False)
    one = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    assert [c["function"]["name"] for c in parse_tool_calls(text, one)[1]] == ["User"]
    both = plan_tools(req.tools, req.tool_choice)
    assert [c["function"]["name"] for c in parse_tool_calls(text, both)[1]] == ["User", "Node"]
