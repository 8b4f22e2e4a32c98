"""One request pipeline for the chat-style APIs (``/v1/chat/completions``, ``/v1/responses``).

Each API is a thin adapter: it turns its request into a :class:`ChatInput` and its engine outputs
back into its own response shape. Everything in between runs here, once, in this order:

1. **validate** (:func:`validate`): the model name, fields the server cannot honour, logprobs;
2. **plan tools and output format** (:func:`plan_output`): the :class:`OutputPlan` (tool mode,
   ``response_format``, reasoning) and the :class:`ToolCallParser` that will read the output;
3. **render the prompt** (:func:`render`): the chat template over the messages (tools shown),
   past assistant turns the server generated spliced in as their generated token ids
   (:mod:`sglite.server.turn_tokens`, remembered by :func:`remember_output`), the oldest
   messages dropped to fit when the request asks (``truncate``), and its length checked against
   the context;
4. **sampling params and constraint** (:func:`sampling`: :func:`user_constraint`, then
   :func:`build_constraint`): the engine's sampling params, with the turn's one grammar built
   from the plan (:mod:`sglite.server.tool_constraint`);
5. **call** (:func:`prepare` returns the :class:`PreparedCall`; the adapter runs it), then
   **parse** the output with the plan's parser (:func:`parse_output` / :meth:`PreparedCall.streamer`).

Seams: the tool-call format is the plan's (``--tool-call-parser``, ``OpenAIContext.tool_parser``:
:mod:`sglite.server.tool_parsers`), read by a :class:`ToolCallParser`; the reasoning split is the
``--reasoning-parser``'s (:mod:`sglite.server.reasoning`): the thinking is cut off first and tool
calls are parsed from the answer only; the constraint of a request is :func:`build_constraint`
of ``(tools plan, response_format, reasoning)``.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from ..errors import context_length_message
from .engine_client import GenCall
from .errors import ApiError
from .openai_common import check_fields
from .openai_params import Constraint, make_call, model_adapter, response_format_schema, sampling_params
from .reasoning import ReasoningFormat, ReasoningStreamer, get_reasoning_format, split_reasoning, thinking_on
from .tool_calls import ToolPlan, parse_tool_calls, plan_tools, render_prompt
from .tool_constraint import apply_constraint, opener_is_text
from .tool_stream import ToolCallStreamer, merge_tool_call_deltas

MAX_TOP_LOGPROBS = 20


class ToolCallParser(Protocol):
    """Reads one model family's tool-call format out of generated text (the parsers' seam).

    ``parse(text, plan)`` -> ``(content or None, [OpenAI tool-call dicts])`` of a whole output;
    ``streamer(plan)`` -> an object with ``feed(text_so_far) -> (content_delta, call_deltas)``,
    ``finish(text, finish_reason)``, and the flags ``called`` and ``incomplete`` (also how a whole
    output cut by the token limit or a stop string is read: :func:`parse_output`)
    (see :class:`sglite.server.tool_stream.ToolCallStreamer`). Malformed calls come back as
    content, never as an exception.
    """

    def parse(self, text: str, plan: ToolPlan) -> tuple[Optional[str], list[dict]]: ...

    def streamer(self, plan: ToolPlan) -> Any: ...


class FormatToolCallParser:
    """Calls in the plan's format (``ToolPlan.fmt``: Hermes ``<tool_call>`` blocks, llama3,
    mistral, pythonic, granite; see :mod:`sglite.server.tool_calls` and
    :mod:`sglite.server.tool_stream`), or a bare call object."""

    def parse(self, text: str, plan: ToolPlan) -> tuple[Optional[str], list[dict]]:
        return parse_tool_calls(text, plan)

    def streamer(self, plan: ToolPlan) -> ToolCallStreamer:
        return ToolCallStreamer(plan)


DEFAULT_TOOL_PARSER = FormatToolCallParser()


@dataclass
class FieldNames:
    """How the adapter's API names the pipeline's fields (in 400 messages and ``param``)."""

    messages: str = "messages"
    tools: str = "tools"
    tool_fn: str = "function."  # between ``tools[i].`` and a function's ``name`` / ``parameters``
    tool_choice: str = "tool_choice"
    response_format: str = "response_format"
    max_tokens: str = "max_tokens"
    logprobs: str = "logprobs"
    top_logprobs: str = "top_logprobs"


@dataclass
class ChatInput:
    """A chat-style request in the pipeline's terms (what each API adapts its request into).

    ``request`` is the API's pydantic request: it carries ``model``, the unknown fields
    (``model_extra``) and the sampling fields (``temperature``, ``top_p``, ``stop``, ...; missing
    ones count as unset). ``messages`` returns the template-ready message dicts; it is called by
    the render stage, so that the earlier stages' errors come first.
    """

    route: str
    request: Any
    messages: Callable[[], list[dict]]
    tools: Optional[list] = None                 # pydantic Tool objects
    tool_choice: Any = None                      # "none" | "auto" | "required" | NamedToolChoice | None
    parallel_tool_calls: bool = True
    response_format: Any = None                  # pydantic ResponseFormat or None
    max_tokens: Optional[int] = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    rid: Optional[str] = None
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict] = None  # extra chat-template variables (e.g. enable_thinking)
    separate_reasoning: bool = True              # split the thinking off (with a reasoning parser)
    truncate: bool = False                       # drop the oldest messages to fit the context
    fields: FieldNames = field(default_factory=FieldNames)


@dataclass
class OutputPlan:
    """What the output will be: the tool plan, the requested format, how it is parsed.

    ``reasoning`` is ``(format, thinking on)`` when the output starts with the model's thinking,
    split off before the answer is parsed (None: no reasoning parser, or ``separate_reasoning``
    off: the whole output is the answer).
    """

    tools: ToolPlan
    response_format: Any = None
    reasoning: Optional[tuple[ReasoningFormat, bool]] = None
    parser: ToolCallParser = DEFAULT_TOOL_PARSER


@dataclass
class PreparedCall:
    """Everything an adapter needs to run the engine call and read its outputs."""

    call: GenCall
    plan: OutputPlan
    logprobs: int          # top logprobs per token, -1: none
    rename: dict           # engine field -> request field, for the engine's errors
    prompt: str
    prompt_tokens: Optional[int]
    input_ids: Optional[list[int]] = None  # the prompt's ids when past turns were spliced in

    def streamer(self) -> "OutputStreamer":
        """A fresh per-choice incremental output reader (reasoning, content, tool calls)."""
        return OutputStreamer(self.plan)


@dataclass
class ParsedOutput:
    """One choice's output, read: text content (None if empty), tool calls, OpenAI finish
    reason, and the reasoning text (None without a reasoning split or when there was none)."""

    content: Optional[str]
    tool_calls: list[dict]
    finish_reason: Optional[str]
    reasoning: Optional[str] = None


class OutputStreamer:
    """Reads one choice's output as it streams: ``step(delta, finish_reason)`` ->
    ``(reasoning delta, content delta, tool-call deltas)`` (the thinking split off first, then the
    answer through the plan's tool-call streamer); the same split for every chunking."""

    def __init__(self, plan: OutputPlan):
        self.tools = plan.parser.streamer(plan.tools)
        self.thinker = ReasoningStreamer(*plan.reasoning) if plan.reasoning is not None else None
        self.answer = ""  # the answer so far (the tool streamer reads it whole)

    def step(self, delta: str, finish_reason: Optional[str]) -> tuple[str, str, list[dict]]:
        thought = ""
        if self.thinker is None:
            self.answer += delta
        else:
            thought, answer = self.thinker.feed(delta)
            if finish_reason is not None:
                more = self.thinker.finish()
                thought, answer = thought + more[0], answer + more[1]
            self.answer += answer
        if finish_reason is None:
            content, calls = self.tools.feed(self.answer)
        else:
            content, calls = self.tools.finish(self.answer, finish_reason)
        return thought, content, calls

    def finish_reason(self, finish_reason: Optional[str]) -> Optional[str]:
        """The OpenAI finish reason once the whole output was read: ``tool_calls`` after whole
        calls; ``length`` / ``stop`` as the engine said when the limit or a stop string cut the
        last call's arguments (they are then not JSON)."""
        if self.tools.called and finish_reason in ("stop", "length"):
            return finish_reason if self.tools.incomplete else "tool_calls"
        return finish_reason


# ----------------------------------------------------------------------------- stages
def validate(ctx, inp: ChatInput) -> tuple[int, Optional[str]]:
    """Stage 1: 404 for an unknown model; 400 for fields the server cannot honour and for bad
    logprobs options. Returns the number of top logprobs per token (-1: no logprobs) and the LoRA
    adapter the request's ``model`` names (None: the base model)."""
    adapter = model_adapter(ctx, getattr(inp.request, "model", None))  # 404 for an unknown model
    check_fields(inp.request, inp.route)
    f = inp.fields
    if inp.top_logprobs is not None:
        if not (0 <= inp.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ApiError(f"{f.top_logprobs}: must be in [0, {MAX_TOP_LOGPROBS}], got {inp.top_logprobs}",
                           param=f.top_logprobs)
        if not inp.logprobs:
            raise ApiError(f"{f.top_logprobs}: requires {f.logprobs} to be true", param=f.top_logprobs)
    return ((inp.top_logprobs or 0) if inp.logprobs else -1), adapter


def plan_output(ctx, inp: ChatInput) -> OutputPlan:
    """Stage 2: the tool mode (:func:`~sglite.server.tool_calls.plan_tools`), the output format,
    the tool-call format (``ctx.tool_parser``) and the reasoning split (``ctx.reasoning_parser``)."""
    f = inp.fields
    tools = plan_tools(inp.tools, inp.tool_choice, inp.parallel_tool_calls, parser=ctx.tool_parser,
                       field_of=lambda i, key: f"{f.tools}[{i}].{f.tool_fn}{key}")
    reasoning = None
    if ctx.reasoning_parser and inp.separate_reasoning:
        fmt = get_reasoning_format(ctx.reasoning_parser)
        reasoning = (fmt, thinking_on(fmt, inp.chat_template_kwargs))
    return OutputPlan(tools, inp.response_format, reasoning)


def render(ctx, inp: ChatInput, plan: OutputPlan) -> tuple[str, Optional[int], Optional[list[int]]]:
    """Stage 3: the prompt text (chat template over the messages, tools shown), its token count,
    and its token ids when past assistant turns were spliced in as generated
    (:mod:`sglite.server.turn_tokens`; None: the engine tokenizes the text).

    Raises:
        ApiError: 400 naming the messages field when the template rejects them or the prompt
            does not fit the context (``context_length_exceeded``).
    """
    field_ = inp.fields.messages
    msgs = inp.messages()
    if not msgs:
        raise ApiError(f"{field_}: must contain at least one message", param=field_)
    if inp.continue_final_message and msgs[-1]["role"] != "assistant":
        raise ApiError("continue_final_message: the last message must be the assistant's",
                       param="continue_final_message")
    prompt, ptoks, ids = _render_counted(ctx, inp, plan, msgs)
    ctx_len = ctx.client.context_length
    if inp.truncate and not _fits(ctx, inp, ptoks):
        prompt, ptoks, ids = _truncated(ctx, inp, plan, msgs)
    if ptoks is not None and ctx_len and ptoks >= ctx_len:
        raise ApiError(context_length_message(ptoks, ctx_len, prompt_field=field_), param=field_,
                       code="context_length_exceeded")
    return prompt, ptoks, ids


def _render_counted(ctx, inp: ChatInput, plan: OutputPlan, msgs: list[dict]):
    """``(prompt, token count, ids or None)`` of ``msgs``."""
    prompt, ids = _render_spliced(ctx, inp, plan, msgs)
    if prompt is None:
        prompt = _render_text(ctx, inp, plan, msgs)
    return prompt, len(ids) if ids is not None else ctx.client.count_tokens(prompt), ids


def _fits(ctx, inp: ChatInput, ptoks: Optional[int]) -> bool:
    ctx_len = ctx.client.context_length
    return ptoks is None or not ctx_len or ptoks + max(inp.max_tokens or 0, 1) <= ctx_len


def _truncated(ctx, inp: ChatInput, plan: OutputPlan, msgs: list[dict]):
    """``truncation: "auto"`` (OpenAI's Responses API): the render of ``msgs`` without its oldest
    messages, as few dropped as make the prompt (and ``max_output_tokens``) fit the context.
    Leading system messages (``instructions``) and the last message stay; a tool result whose
    call was dropped goes with it. When even that does not fit, the shortest render is returned
    (the caller's length check names the field)."""
    head = 0
    while head < len(msgs) - 1 and msgs[head]["role"] == "system":
        head += 1

    def keep(k: int) -> list[dict]:
        start = head + k
        while start < len(msgs) - 1 and msgs[start]["role"] == "tool":
            start += 1
        return msgs[:head] + msgs[start:]
    if len(msgs) - 1 - head < 1:
        return _render_counted(ctx, inp, plan, msgs)
    lo, hi = 1, len(msgs) - 1 - head  # messages dropped: the least that fits, by bisection
    best = _render_counted(ctx, inp, plan, keep(hi))
    if not _fits(ctx, inp, best[1]):
        return best
    while lo < hi:
        mid = (lo + hi) // 2
        got = _render_counted(ctx, inp, plan, keep(mid))
        if _fits(ctx, inp, got[1]):
            hi, best = mid, got
        else:
            lo = mid + 1
    return best


def _render_text(ctx, inp: ChatInput, plan: OutputPlan, msgs: list[dict]) -> str:
    field_ = inp.fields.messages
    try:
        return render_prompt(ctx.client.engine, msgs, plan.tools, add_generation_prompt=not inp.continue_final_message,
                             template_kwargs=inp.chat_template_kwargs, facts=getattr(ctx.client, "template_facts", None))
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the request's fault
        raise ApiError(f"{field_}: the chat template rejected them: {e}", param=field_) from e


def _render_spliced(ctx, inp: ChatInput, plan: OutputPlan, msgs: list[dict]) -> tuple[Optional[str], Optional[list]]:
    """The prompt with remembered assistant turns as generated (text, ids), or (None, None) when
    there are none or the template does not keep them in place."""
    memory = getattr(ctx, "turn_tokens", None)
    if memory is None or plan.reasoning is not None:
        return None, None
    subst, segs = memory.substitute(msgs, keep_last=inp.continue_final_message)
    if not segs:
        return None, None
    try:
        rendered = render_prompt(ctx.client.engine, subst, plan.tools,
                                 add_generation_prompt=not inp.continue_final_message,
                                 template_kwargs=inp.chat_template_kwargs,
                                 facts=getattr(ctx.client, "template_facts", None))
    except Exception:  # noqa: BLE001 - render the messages as they are (their errors are reported there)
        return None, None
    out = memory.splice(rendered, segs)
    return out if out is not None else (None, None)


def user_constraint(plan: OutputPlan, fields: Optional[FieldNames] = None) -> Optional[Constraint]:
    """Stage 4a: the constraint the request asks for itself: ``response_format``'s JSON schema
    (``regex`` / ``ebnf``, SGLang's extras, are taken by :func:`sampling_params` as they are).
    Returns None when there is none."""
    f = fields or FieldNames()
    schema = response_format_schema(plan.response_format, f.response_format)
    return Constraint("json_schema", schema, f.response_format) if schema is not None else None


def build_constraint(ctx, plan: OutputPlan, sp: dict, rename: dict, prompt: str) -> None:
    """Stage 4c: the turn's one grammar from ``(tools plan, the request's own constraint in sp,
    reasoning)``, set in ``sp`` in place (``rename`` names the request field a grammar error is
    blamed on). The rules are :func:`sglite.server.tool_constraint.apply_constraint`'s: a forced
    call is constrained to its schema (a ``response_format`` then applies to no text and is
    dropped); "auto" calls are constrained from the family's opener on (a structural tag), or-ed
    with the request's own constraint; with a reasoning parser the grammar starts after the
    end of reasoning."""
    apply_constraint(sp, rename, plan.tools, constrain_auto=ctx.constrain_auto_tools, fmt=plan.tools.fmt,
                     engine=ctx.client.engine, reasoning_end=ctx.reasoning_end, prompt=prompt)


def sampling(ctx, inp: ChatInput, plan: OutputPlan, prompt: str, prompt_tokens: Optional[int]) -> tuple[dict, dict]:
    """Stage 4: the engine sampling params, validated (4b) with the request's own constraint (4a),
    then the turn's grammar (4c); and the engine-field -> request-field renames for later errors."""
    sp, rename = sampling_params(inp.request, inp.max_tokens, inp.fields.max_tokens, ctx.client,
                                 prompt_tokens=prompt_tokens, constraint=user_constraint(plan, inp.fields), n=inp.n)
    fmt = plan.tools.fmt
    if plan.tools.mode != "none" and (fmt.name == "mistral" or not opener_is_text(ctx.client.engine, fmt.opener)):
        # a special-token opener (`<|python_tag|>`, `[TOOL_CALLS]`, mistral's `[ARGS]`, ...) stays
        # in the text for the parser (vLLM does the same for mistral)
        sp["skip_special_tokens"] = False
    build_constraint(ctx, plan, sp, rename, prompt)
    return sp, rename


def prepare(ctx, inp: ChatInput) -> PreparedCall:
    """Run stages 1-4 in order (on the preparation pool: templates and tokenizing are compute)."""
    k, adapter = validate(ctx, inp)
    plan = plan_output(ctx, inp)
    prompt, ptoks, ids = render(ctx, inp, plan)
    sp, rename = sampling(ctx, inp, plan, prompt, ptoks)
    call = make_call([{"prompt": prompt} if ids is None else {"input_ids": ids}], sp, inp.n,
                     inp.rid or uuid.uuid4().hex, k)
    call.lora_path = adapter  # the model may name an adapter
    return PreparedCall(call, plan, k, rename, prompt, ptoks, ids)


def remember_output(ctx, prep: PreparedCall, text: str, output_ids: Optional[list], parsed: "ParsedOutput") -> None:
    """After a choice finished: remember its generated ids for the next turn's prompt
    (:class:`sglite.server.turn_tokens.TurnTokens`; a no-op without a memory or with a reasoning split)."""
    memory = getattr(ctx, "turn_tokens", None)
    if memory is None or prep.plan.reasoning is not None:
        return
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls]
    memory.remember(parsed.content, calls, text, output_ids, prompt=prep.prompt)


# ----------------------------------------------------------------------------- outputs
def parse_output(text: str, finish_reason: Optional[str], plan: OutputPlan) -> ParsedOutput:
    """Stage 6 (whole output): the reasoning split off (with a reasoning parser), then content and
    tool calls of the answer by the plan's parser. ``finish_reason`` is ``tool_calls`` when the
    model called tools; when ``max_tokens`` (``length``) or a stop string (``stop``) cut the last
    call's arguments, every call is returned, the cut one with its partial arguments text, and the
    engine's reason stays: what the streamed answer gives (:meth:`OutputStreamer.finish_reason`)."""
    thought = None
    if plan.reasoning is not None:
        thought, text = split_reasoning(text, *plan.reasoning)
    if finish_reason in ("stop", "length") and plan.tools.mode != "none":
        cut = plan.parser.streamer(plan.tools)
        content, deltas = cut.finish(text, finish_reason)
        if deltas:
            return ParsedOutput(content.strip() or None, merge_tool_call_deltas(deltas),
                                finish_reason if cut.incomplete else "tool_calls", thought)
    content, calls = plan.parser.parse(text, plan.tools)
    if calls and finish_reason in ("stop", "length"):
        finish_reason = "tool_calls"
    return ParsedOutput(content, calls, finish_reason, thought)
