"""Request models of the HTTP API (pydantic v2): SGLang's native ``/generate`` and OpenAI's
``/v1/completions`` and ``/v1/chat/completions``.

Only the *types* are checked here (they also make the OpenAPI schema). Value ranges of sampling
fields are checked once, by :meth:`sglite.sampling_params.SamplingParams.from_dict`, and
OpenAI-only rules (``max_tokens > 0``, non-empty ``messages``, known ``model``) in
:mod:`sglite.server.openai_params`. Unknown fields are ignored; on the OpenAI routes they are kept
(``model_extra``) so that the server names them in one warning line, as vLLM does.
Sources: openai-openapi spec; SGLang ``srt/entrypoints/openai/protocol.py`` and
``srt/managers/io_struct.py`` (field names and defaults).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False)


# ----------------------------------------------------------------------------- native
class GenerateRequest(_Base):
    """``POST /generate``: exactly one of ``text`` / ``input_ids``; a list makes a batch."""

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    rid: Optional[Union[str, list[str]]] = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = True
    stream: bool = False
    separate_reasoning: bool = False
    lora_path: Optional[Union[str, list[Optional[str]]]] = None  # LoRA adapter name(s) (SGLang's field)


class LoadLoraAdapterRequest(_Base):
    """``POST /load_lora_adapter`` (SGLang's route; an operator route): serve the PEFT adapter in
    folder ``lora_path`` as ``lora_name``."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(_Base):
    """``POST /unload_lora_adapter`` (an operator route): stop serving ``lora_name``."""

    lora_name: str


class SeparateReasoningRequest(_Base):
    """``POST /separate_reasoning`` (SGLang): split a finished text's reasoning from its answer."""

    text: str
    reasoning_parser: Optional[str] = None


class AbortRequest(_Base):
    """``POST /abort_request``: one request id, or every request in flight."""

    rid: Optional[str] = None
    abort_all: bool = False


class ProfileRequest(_Base):
    """``POST /start_profile`` (SGLang's ``ProfileReqInput``; the body is optional): where the trace
    goes (default ``$SGLITE_TORCH_PROFILER_DIR``, else ``/tmp/sglite_profiles``), an optional step
    count after which it stops by itself, ``activities`` (``CPU``, ``GPU``), shapes and stacks."""

    output_dir: Optional[str] = None
    num_steps: Optional[int] = None
    activities: Optional[list[str]] = None
    record_shapes: bool = False
    with_stack: bool = False


# ----------------------------------------------------------------------------- OpenAI pieces
class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaSpec(_Base):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[Union[dict[str, Any], bool]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Base):
    """``text`` | ``json_object`` | ``json_schema`` (with ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaSpec] = None
    schema_: Optional[Union[dict[str, Any], bool]] = Field(default=None, alias="schema")


class FunctionDef(_Base):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Base):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Base):
    name: str


class NamedToolChoice(_Base):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolCallFunction(_Base):
    name: str
    arguments: Optional[Union[str, dict[str, Any]]] = None


class ToolCall(_Base):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(_Base):
    type: str
    text: Optional[str] = None


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class _SamplingFields(_Base):
    """Fields shared by completions and chat (OpenAI's plus SGLang's extras). Unknown fields are
    kept in ``model_extra`` (logged and ignored by the routes)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, allow_inf_nan=False)

    model: Optional[str] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    min_tokens: Optional[int] = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    user: Optional[str] = None
    rid: Optional[str] = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: text, token ids, or a batch of either."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    json_schema: Optional[Union[str, dict[str, Any]]] = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. The prompt is the engine's chat template over ``messages``."""

    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    separate_reasoning: bool = True
