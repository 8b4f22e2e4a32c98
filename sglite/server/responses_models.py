"""Request and response models of ``/v1/responses`` (pydantic v2; they also make the OpenAPI schema).

Only types are checked here; :mod:`sglite.server.responses_input` checks the input items, the
tools and the fields this server cannot honour, with 400s naming the field (``input[2].call_id``).
Unknown fields are kept in ``model_extra`` and named in one warning line, as on the other OpenAI
routes. Source: OpenAI's Responses API reference and the ``openai`` Python SDK's
``types/responses`` (field names, item and event shapes).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False)


# ----------------------------------------------------------------------------- request
class TextFormat(_Base):
    """``text.format``: ``text`` | ``json_object`` | ``json_schema`` (``name``, ``schema``, ``strict``)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[Union[dict[str, Any], bool]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(_Base):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None


class ResponsesRequest(_Base):
    """``POST /v1/responses``. ``input``: a string (one user message) or a list of items
    (messages, ``function_call``, ``function_call_output``); ``tools``: function tools
    (``{"type": "function", "name", "parameters", "strict"}``); ``max_output_tokens`` bounds the
    output (status ``incomplete`` when reached)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, allow_inf_nan=False)

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    text: Optional[TextConfig] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    rid: Optional[str] = None  # SGLang's request id; the response id is ``resp_<rid>`` when given
    # accepted, no effect on the output (hints about caching, accounting or identity)
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[str] = None
    stream_options: Optional[dict[str, Any]] = None
    # background (polled, cancellable), "message.output_text.logprobs", "auto" | "disabled", 0-20
    background: Optional[bool] = None
    include: Optional[list[str]] = None
    truncation: Optional[str] = None
    top_logprobs: Optional[int] = None
    # known, honoured only at their neutral value (anything else is a 400 naming the field)
    max_tool_calls: Optional[int] = None
    reasoning: Optional[dict[str, Any]] = None
    conversation: Optional[Union[str, dict[str, Any]]] = None
    prompt: Optional[dict[str, Any]] = None


# ----------------------------------------------------------------------------- response
class OutputText(_Base):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(_Base):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCall(_Base):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(_Base):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Base):
    """The model's thinking (with ``--reasoning-parser``), before the answer's items."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(_Base):
    cached_tokens: int


class OutputTokensDetails(_Base):
    reasoning_tokens: int = 0


class ResponseUsage(_Base):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Base):
    """Why a response is ``incomplete``: OpenAI's reasons, and ``aborted`` (``/abort_request``)."""

    reason: Literal["max_output_tokens", "content_filter", "aborted"]


class ResponseObject(_Base):
    """A response (``object: "response"``), as created, retrieved and streamed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed", "queued", "cancelled"]
    completed_at: Optional[int] = None
    error: Optional[dict[str, Any]] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    model: str
    output: list[Union[ReasoningItem, OutputMessage, FunctionCall]]
    parallel_tool_calls: bool
    previous_response_id: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: dict[str, Any]
    tool_choice: Union[str, dict[str, Any]]
    tools: list[dict[str, Any]]
    store: bool
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None
    background: bool = False
    truncation: str = "disabled"


class ResponseDeleted(_Base):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(_Base):
    """``GET /v1/responses/{id}/input_items``: the response's input items (each with an ``id``)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: Optional[str] = None
    last_id: Optional[str] = None
    has_more: bool = False


class StreamEvent(_Base):
    """One server-sent event of a streamed response: ``type`` (``response.created``,
    ``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
    ``response.output_text.delta`` / ``.done``, ``response.content_part.done``,
    ``response.function_call_arguments.delta`` / ``.done``, ``response.reasoning_text.delta`` /
    ``.done``, ``response.output_item.done``,
    ``response.completed`` or ``response.incomplete``), a ``sequence_number`` counting from 0, and
    the fields of that type (``response``, ``item``, ``output_index``, ``item_id``,
    ``content_index``, ``part``, ``delta``, ``text``, ``arguments``, ``logprobs``)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
