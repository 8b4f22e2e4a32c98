"""``/v1/responses`` request -> the request pipeline's :class:`~sglite.server.request_pipeline.ChatInput`.

* ``input`` (a string: one user message; or items: messages, ``function_call``,
  ``function_call_output``) becomes chat messages: ``instructions`` first as a system message,
  ``developer`` as ``system``, each ``function_call`` joins the assistant message before it (or
  starts one) as a tool call, each ``function_call_output`` is a ``tool`` message. ``reasoning``
  items are dropped (the thinking of earlier turns is not shown again, as reasoning templates do).
* With ``previous_response_id``, the stored conversation (that response's input and output
  items) comes before the new input, so a chained request renders exactly as one that resends
  the whole history.
* Function ``tools`` / ``tool_choice`` / ``text.format`` map onto chat's tools / tool_choice /
  response_format. ``truncation: "auto"`` drops the oldest messages until the prompt fits;
  ``include: ["message.output_text.logprobs"]`` / ``top_logprobs`` give the output text's logprobs.
  Fields this server cannot honour (built-in tools, other ``include`` values, ...) are a 400
  naming the field, never ignored.

Source: OpenAI's Responses API reference (input item and tool shapes).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from .errors import ApiError
from .protocol import FunctionDef, JsonSchemaSpec, NamedFunction, NamedToolChoice, ResponseFormat, Tool
from .request_pipeline import ChatInput, FieldNames
from .responses_models import ResponsesRequest

ROUTE = "/v1/responses"
FIELDS = FieldNames(messages="input", tools="tools", tool_fn="", tool_choice="tool_choice",
                    response_format="text.format", max_tokens="max_output_tokens", logprobs="include",
                    top_logprobs="top_logprobs")
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "assistant", "system", "developer")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def new_item_id(prefix: str) -> str:
    """A fresh Responses item id: ``"<prefix>_<32 hex digits>"`` (``msg``, ``fc``, ``rs``, ``resp``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def check_unsupported(req: ResponsesRequest) -> None:
    """400 naming the first field set to something this server cannot honour."""
    def bad(field: str, why: str):
        raise ApiError(f"{field}: {why}", param=field)
    for i, inc in enumerate(req.include or []):
        if inc != LOGPROBS_INCLUDE:
            bad(f"include[{i}]", f"only {LOGPROBS_INCLUDE!r} is available, got {inc!r}")
    if req.truncation not in (None, "disabled", "auto"):
        bad("truncation", f"must be 'auto' or 'disabled', got {req.truncation!r}")
    if req.max_tool_calls is not None:
        bad("max_tool_calls", "not supported; use parallel_tool_calls: false for at most one call")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        bad("reasoning", "reasoning options are not supported")
    if req.conversation is not None:
        bad("conversation", "conversations are not supported; chain responses with previous_response_id")
    if req.prompt is not None:
        bad("prompt", "prompt templates are not supported")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        bad("text.verbosity", f"only 'medium' is supported, got {req.text.verbosity!r}")


def _text_of(content: Any, field: str) -> str:
    """The text of a message's ``content`` (a string or text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(f"{field}: must be a string or a list of content parts", param=field)
    out = []
    for j, part in enumerate(content):
        f = f"{field}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(f"{f}.type: only text parts ({', '.join(_TEXT_PARTS)}) are supported, got {kind!r}",
                           param=f"{f}.type")
        if not isinstance(part.get("text"), str):
            raise ApiError(f"{f}.text: required (a string)", param=f"{f}.text")
        out.append(part["text"])
    return "".join(out)


def _need(item: dict, key: str, field: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise ApiError(f"{field}.{key}: required (a string)", param=f"{field}.{key}")
    return v


def normalize_input(inp) -> list[dict]:
    """``input`` as a list of item dicts, each checked and given an ``id`` (for ``input_items``).

    Raises:
        ApiError: 400 naming ``input[i]...``.
    """
    if isinstance(inp, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": inp}],
                 "id": new_item_id("msg"), "status": "completed"}]
    out = []
    for i, raw in enumerate(inp):
        field = f"input[{i}]"
        kind = raw.get("type", "message")
        item = dict(raw)
        if kind == "message":
            if item.get("role") not in _ROLES:
                raise ApiError(f"{field}.role: must be one of {list(_ROLES)}, got {item.get('role')!r}",
                               param=f"{field}.role")
            _text_of(item.get("content"), f"{field}.content")
            item.setdefault("type", "message")
            item.setdefault("id", new_item_id("msg"))
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                _need(item, key, field)
            item.setdefault("id", new_item_id("fc"))
        elif kind == "function_call_output":
            _need(item, "call_id", field)
            if not isinstance(item.get("output"), (str, list)):
                raise ApiError(f"{field}.output: required (a string or content parts)", param=f"{field}.output")
            item.setdefault("id", new_item_id("fco"))
        elif kind != "reasoning":
            raise ApiError(f"{field}.type: {kind!r} items are not supported (messages, function_call, "
                           "function_call_output)", param=f"{field}.type")
        out.append(item)
    return out


def items_to_messages(items: list[dict], instructions: Optional[str]) -> list[dict]:
    """Chat-template messages of a conversation's items (see the module docstring)."""
    msgs: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            msgs.append({"role": role, "content": _text_of(item["content"], f"input[{i}].content")})
        elif kind == "function_call":
            try:
                args = json.loads(item["arguments"]) if item["arguments"].strip() else {}
            except json.JSONDecodeError:
                raise ApiError(f"input[{i}].arguments: not valid JSON", param=f"input[{i}].arguments") from None
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": args}}
            if msgs and msgs[-1]["role"] == "assistant":  # the same turn: its text, then its calls
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item["output"]
            text = out if isinstance(out, str) else _text_of(out, f"input[{i}].output")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    return msgs


def chat_tools(tools: Optional[list[dict]]) -> Optional[list[Tool]]:
    """Responses function tools (flat ``{"type": "function", "name", ...}``) as chat ``Tool``s.

    Raises:
        ApiError: 400 naming ``tools[i].type`` for built-in tools (web search, file search, ...).
    """
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise ApiError(f"tools[{i}].type: only function tools are supported, got {t.get('type')!r}",
                           param=f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise ApiError(f"tools[{i}].name: required (a string)", param=f"tools[{i}].name")
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(f"tools[{i}].parameters: must be a JSON schema object", param=f"tools[{i}].parameters")
        out.append(Tool(function=FunctionDef(name=t["name"], description=t.get("description"),
                                             parameters=params, strict=t.get("strict"))))
    return out


def chat_tool_choice(choice):
    """Responses ``tool_choice`` as chat's: ``{"type": "function", "name"}`` -> a named choice."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ApiError(f"tool_choice: only 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}} "
                       f"are supported, got {choice!r}", param="tool_choice")
    return NamedToolChoice(function=NamedFunction(name=choice["name"]))


def chat_response_format(req: ResponsesRequest) -> Optional[ResponseFormat]:
    """``text.format`` of a Responses request as chat completions' ``response_format`` (None for
    ``text`` or no format)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaSpec(
        name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))


def chat_input(req: ResponsesRequest, history: list[dict], items: list[dict], rid: Optional[str]) -> ChatInput:
    """The pipeline input of a Responses request: ``history`` (a stored conversation's items, or
    none) then ``items`` (this request's normalized input)."""
    check_unsupported(req)
    if not items:
        raise ApiError("input: must not be empty", param="input")
    tools, choice = chat_tools(req.tools), chat_tool_choice(req.tool_choice)
    names = [t.function.name for t in tools or []]
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ApiError(f"tool_choice.name: {choice.function.name!r} is not one of the tools {names}",
                       param="tool_choice.name")
    return ChatInput(ROUTE, req, lambda: items_to_messages(history + items, req.instructions),
                     tools=tools, tool_choice=choice,
                     parallel_tool_calls=req.parallel_tool_calls, response_format=chat_response_format(req),
                     max_tokens=req.max_output_tokens, rid=rid, fields=FIELDS, truncate=req.truncation == "auto",
                     logprobs=wants_logprobs(req), top_logprobs=req.top_logprobs)


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether the output text carries logprobs: ``include`` names them, or ``top_logprobs`` is set."""
    return LOGPROBS_INCLUDE in (req.include or []) or req.top_logprobs is not None
