"""``POST /v1/chat/completions``: chat template, tools, response_format, streaming.

The prompt is the engine's chat template over ``messages`` (with the tools shown when
``tool_choice`` is not ``none``); forced tool calls add a JSON-schema constraint (see
:mod:`sglite.server.tool_calls`). Streamed chunks carry ``delta.role`` first, then
``delta.content`` pieces, then (for calls) ``delta.tool_calls`` chunks as OpenAI streams them (the
call's id and name first, then its arguments text as it is generated: see
:mod:`sglite.server.tool_stream`), then a chunk with ``finish_reason`` and ``matched_stop``.
``finish_reason`` is ``tool_calls`` when the model called a tool, ``length`` when ``max_tokens``
cut a call's arguments (the partial call is still returned as ``tool_calls``, never as content).
"""
from __future__ import annotations

import json
import uuid
from typing import Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..errors import context_length_message
from .errors import ApiError
from .openai_common import check_fields, open_call, run_call
from .openai_format import chat_logprobs, finish_info, new_id, now, num_logprob_tokens, usage_of
from .openai_params import chat_messages, check_model, make_call, sampling_params
from .protocol import ChatCompletionRequest
from .sse import sse_event, sse_response
from .tool_calls import ToolPlan, parse_tool_calls, plan_tools, render_prompt
from .tool_stream import ToolCallStreamer, chunk_entries, truncated_tool_calls

MAX_TOP_LOGPROBS = 20


def _logprobs_k(req: ChatCompletionRequest) -> int:
    if req.top_logprobs is not None:
        if not (0 <= req.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ApiError(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                           param="top_logprobs")
        if not req.logprobs:
            raise ApiError("top_logprobs: requires logprobs to be true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else -1


def _prompt(ctx, req: ChatCompletionRequest, plan: ToolPlan) -> str:
    msgs = chat_messages(req)
    if req.continue_final_message and msgs[-1]["role"] != "assistant":
        raise ApiError("continue_final_message: the last message must be the assistant's",
                       param="continue_final_message")
    try:
        return render_prompt(ctx.client.engine, msgs, plan, add_generation_prompt=not req.continue_final_message)
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the request's fault
        raise ApiError(f"messages: the chat template rejected them: {e}", param="messages") from e


def _prepare(ctx, req: ChatCompletionRequest):
    check_model(req.model, ctx.names, [ctx.model_name])
    check_fields(req, "/v1/chat/completions")
    k = _logprobs_k(req)
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    has_format = req.response_format is not None and req.response_format.type != "text"
    if plan.mode == "forced" and (req.regex is not None or req.ebnf is not None or has_format):
        raise ApiError("tool_choice: a forced tool call cannot be combined with regex, ebnf or response_format "
                       "(only one constraint may be set)", param="tool_choice")
    prompt = _prompt(ctx, req, plan)
    ptoks = ctx.client.count_tokens(prompt)
    ctx_len = ctx.client.context_length
    if ptoks is not None and ctx_len and ptoks >= ctx_len:
        raise ApiError(context_length_message(ptoks, ctx_len, prompt_field="messages"), param="messages", code="context_length_exceeded")
    if req.max_completion_tokens is not None:
        max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, field = req.max_tokens, "max_tokens"
    sp, rename = sampling_params(req, max_tokens, field, ctx.client, prompt_tokens=ptoks)
    if plan.mode == "forced":
        sp["json_schema"] = json.dumps(plan.schema)
        rename["json_schema"] = rename["grammar"] = "tools"
    call = make_call([{"prompt": prompt}], sp, req.n, req.rid or uuid.uuid4().hex, k)
    return call, plan, k, rename


def _token_bytes(ctx):
    """``token_id -> raw bytes`` of the engine's tokenizer, or None when it has no such method."""
    return getattr(getattr(ctx.client.engine, "tokenizer", None), "id_to_bytes", None)


def _chat_choice(i: int, out: dict, plan: ToolPlan, k: int, tb=None) -> dict:
    meta = out["meta_info"]
    fr, ms = finish_info(meta)
    content, calls = parse_tool_calls(out["text"], plan)
    if not calls and fr == "length" and plan.mode != "none":
        content, calls = truncated_tool_calls(out["text"], plan)
    elif calls:
        fr = "tool_calls" if fr in ("stop", "length") else fr
    msg: dict = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    return {"index": i, "message": msg, "logprobs": chat_logprobs(meta, 0, None, tb) if k >= 0 else None,
            "finish_reason": fr, "matched_stop": ms}


async def _chat_events(ctx, req: ChatCompletionRequest, stream, plan: ToolPlan, k: int):
    """OpenAI chunks from the incremental engine stream; the tool filter sees each choice's text so far."""
    rid, created = new_id("chatcmpl"), now()
    n_out = stream.call.num_outputs
    tools = [ToolCallStreamer(plan) for _ in range(n_out)]
    texts = [""] * n_out  # each choice's text so far, built from the deltas (the tool parser needs it)
    last: list[Optional[dict]] = [None] * n_out

    def chunk(i, delta, fr=None, ms=None, lp=None):
        choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": fr}
        if fr is not None:
            choice["matched_stop"] = ms
        return sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                          "model": ctx.model_name, "choices": [choice]})
    async for i, out in stream:
        meta = out["meta_info"]
        if last[i] is None:
            yield chunk(i, {"role": "assistant", "content": ""})
        last[i] = out
        texts[i] += out["text"]
        fr, ms = finish_info(meta)
        if fr is None:
            delta, calls = tools[i].feed(texts[i])
        else:
            delta, calls = tools[i].finish(texts[i], fr)
        lp = chat_logprobs(meta, 0, None, _token_bytes(ctx)) if k >= 0 and num_logprob_tokens(meta) else None
        if delta or lp:
            yield chunk(i, {"content": delta}, lp=lp)
        for entry in chunk_entries(calls):
            yield chunk(i, {"tool_calls": [entry]})
        if fr is not None:
            if tools[i].called and fr in ("stop", "length"):
                fr = "length" if fr == "length" and tools[i].incomplete else "tool_calls"
            yield chunk(i, {}, fr, ms)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": ctx.model_name, "choices": [],
                         "usage": usage_of([o for o in last if o is not None], req.n)})


def add_chat_route(router: APIRouter, ctx) -> None:
    """Register ``POST /v1/chat/completions`` on ``router``, bound to ``ctx`` (an OpenAIContext)."""
    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        call, plan, k, rename = await ctx.client.prepare(_prepare, ctx, req, field="messages")
        if req.stream:
            stream = await open_call(ctx, call, rename)
            return sse_response(_chat_events(ctx, req, stream, plan, k))
        outs = await run_call(ctx, request, call, rename)
        choices = [_chat_choice(i, o, plan, k, _token_bytes(ctx)) for i, o in enumerate(outs)]
        return JSONResponse({"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(),
                             "model": ctx.model_name, "choices": choices, "usage": usage_of(outs, req.n)})
