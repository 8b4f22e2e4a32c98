"""Response models of the HTTP API (pydantic v2), published in ``/openapi.json``.

The routes build their bodies as dicts (and stream them as SSE ``data:`` lines); these models
*describe* those bodies for schema-driven clients and fuzzers, and the tests validate real
responses against the published schema. Unknown keys are allowed (SGLang's extras, the engine's
counters), so adding a key never breaks a client. Sources: openai-openapi spec (chat completion,
completion, model, error objects); SGLang ``srt/entrypoints/http_server.py`` (native bodies).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# ----------------------------------------------------------------------------- errors
class ErrorDetail(_Open):
    """OpenAI's error object: ``param`` names the request field at fault; ``code`` is the HTTP
    status or a string code (``context_length_exceeded``, ``model_not_found``, ``queue_full``)."""

    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[int, str]] = None


class ErrorResponse(_Open):
    """Every error body: OpenAI's nested ``error`` and, for SGLang clients, the same keys flat."""

    object: Literal["error"] = "error"
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[int, str]] = None
    error: ErrorDetail


# ----------------------------------------------------------------------------- native
class FinishReasonInfo(_Open):
    """SGLang's finish reason: ``type`` (``stop``, ``length``, ``abort``), ``matched`` (the stop
    string or token id) or ``length``."""

    type: str


class GenerateMetaInfo(_Open):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: Optional[int] = None
    finish_reason: Optional[FinishReasonInfo] = None  # null while streaming
    e2e_latency: Optional[float] = None
    ttft: Optional[float] = None
    output_token_logprobs: Optional[list[list[Any]]] = None  # [logprob, token id, text?] per token
    input_token_logprobs: Optional[list[list[Any]]] = None


class GenerateOutput(_Open):
    """One ``/generate`` output (a batch answers a list of them; streamed: one per ``data:`` line,
    the text so far, ending with ``data: [DONE]``)."""

    text: str
    output_ids: Optional[list[int]] = None
    meta_info: GenerateMetaInfo
    reasoning_text: Optional[str] = None  # with separate_reasoning: the reasoning, apart from text


class SeparateReasoningResponse(_Open):
    """``/separate_reasoning``: the answer ``text`` and the ``reasoning_text`` (null: none)."""

    text: str
    reasoning_text: Optional[str] = None


class StatusResponse(_Open):
    status: str


class ModelInfoResponse(_Open):
    model_path: str
    context_length: Optional[int] = None
    vocab_size: Optional[int] = None


class ServerInfoResponse(_Open):
    max_total_tokens: int
    version: Optional[str] = None


class FlushCacheResponse(_Open):
    success: bool
    message: str


class LoraAdapterResponse(_Open):
    success: bool
    loaded_adapters: dict[str, str]


class AbortResponse(_Open):
    success: bool
    aborted: int


# ----------------------------------------------------------------------------- OpenAI
class ModelCard(_Open):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Open):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(_Open):
    cached_tokens: int


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionLogprobs(_Open):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: Optional[list[Optional[dict[str, float]]]] = None
    text_offset: list[int]


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class Completion(_Open):
    """``/v1/completions`` (streamed: one per ``data:`` line with the new text, then ``[DONE]``)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class FunctionCallOut(_Open):
    name: str
    arguments: str


class ToolCallOut(_Open):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class TopLogprob(_Open):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Open):
    content: Optional[list[TokenLogprob]] = None


class AssistantMessage(_Open):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None
    reasoning_content: Optional[str] = None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(_Open):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Open):
    """One streamed tool-call entry: the call's first carries ``id``, ``type`` and ``function.name``
    (``arguments`` ``""``); later ones carry ``function.arguments`` pieces only."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunction] = None


class ChatDelta(_Open):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatChunkChoice(_Open):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None


class ChatCompletionChunk(_Open):
    """One streamed ``/v1/chat/completions`` event: ``delta.role`` first, then
    ``delta.reasoning_content`` / ``delta.content`` pieces, then ``delta.tool_calls`` entries, then
    a chunk with ``finish_reason``; the usage chunk (``choices: []``) when asked; ``[DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
