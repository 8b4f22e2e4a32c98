"""``POST /v1/chat/completions``: a thin adapter over :mod:`sglite.server.request_pipeline`
(validate -> plan tools and output format -> render -> sampling params and constraint -> call).

The prompt is the engine's chat template over ``messages`` (with the tools shown when
``tool_choice`` is not ``none``); tools, ``response_format`` and reasoning make the turn's grammar
(:mod:`sglite.server.tool_constraint`: forced calls, constrained "auto" calls, the reasoning gate). Streamed chunks carry ``delta.role`` first, then
``delta.content`` pieces, then (for calls) ``delta.tool_calls`` chunks as OpenAI streams them (the
call's id and name first, then its arguments text as it is generated: see
:mod:`sglite.server.tool_stream`), then a chunk with ``finish_reason`` and ``matched_stop``.
``finish_reason`` is ``tool_calls`` when the model called a tool, ``length`` when ``max_tokens``
cut a call's arguments (the partial call is still returned as ``tool_calls``, never as content).
With ``--reasoning-parser`` (and ``separate_reasoning``, the default), the model's thinking is
``message.reasoning_content`` (streamed as ``delta.reasoning_content``) and tool calls are parsed
from the answer only.
"""
from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .openai_common import open_call, run_call
from .openai_format import chat_logprobs, finish_info, new_id, now, num_logprob_tokens, usage_of
from .openai_params import chat_messages
from .protocol import ChatCompletionRequest
from .request_pipeline import ChatInput, PreparedCall, parse_output, prepare, remember_output
from .sse import sse_event, sse_response
from .tool_stream import chunk_entries


def chat_input(req: ChatCompletionRequest) -> ChatInput:
    """A chat-completions request in the pipeline's terms (:mod:`sglite.server.request_pipeline`)."""
    if req.max_completion_tokens is not None:
        max_tokens, max_field = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_field = req.max_tokens, "max_tokens"
    inp = ChatInput("/v1/chat/completions", req, lambda: chat_messages(req), tools=req.tools,
                    tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
                    response_format=req.response_format, max_tokens=max_tokens, n=req.n,
                    logprobs=req.logprobs, top_logprobs=req.top_logprobs, rid=req.rid,
                    continue_final_message=req.continue_final_message,
                    chat_template_kwargs=req.chat_template_kwargs, separate_reasoning=req.separate_reasoning)
    inp.fields.max_tokens = max_field
    return inp


def _prepare(ctx, req: ChatCompletionRequest) -> PreparedCall:
    return prepare(ctx, chat_input(req))


def _token_bytes(ctx):
    """``token_id -> raw bytes`` of the engine's tokenizer, or None when it has no such method."""
    return getattr(getattr(ctx.client.engine, "tokenizer", None), "id_to_bytes", None)


def _chat_choice(ctx, i: int, out: dict, prep: PreparedCall, tb=None) -> dict:
    meta = out["meta_info"]
    fr, ms = finish_info(meta)
    parsed = parse_output(out["text"], fr, prep.plan)
    remember_output(ctx, prep, out["text"], out.get("output_ids"), parsed)
    msg: dict = {"role": "assistant", "content": parsed.content}
    if prep.plan.reasoning is not None:
        msg["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        msg["tool_calls"] = parsed.tool_calls
    return {"index": i, "message": msg,
            "logprobs": chat_logprobs(meta, 0, None, tb) if prep.logprobs >= 0 else None,
            "finish_reason": parsed.finish_reason, "matched_stop": ms}


async def _chat_events(ctx, req: ChatCompletionRequest, stream, prep: PreparedCall):
    """OpenAI chunks from the incremental engine stream; the tool filter sees each choice's text so far."""
    rid, created = new_id("chatcmpl"), now()
    n_out = stream.call.num_outputs
    k = prep.logprobs
    outs = [prep.streamer() for _ in range(n_out)]
    last: list[Optional[dict]] = [None] * n_out
    texts: list[list[str]] = [[] for _ in range(n_out)]
    ids: list[list[int]] = [[] for _ in range(n_out)]

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
        texts[i].append(out["text"])
        ids[i].extend(out.get("output_ids") or [])
        fr, ms = finish_info(meta)
        thought, delta, calls = outs[i].step(out["text"], fr)
        if thought:  # the reasoning goes out as delta.reasoning_content, before the answer
            yield chunk(i, {"reasoning_content": thought})
        lp = chat_logprobs(meta, 0, None, _token_bytes(ctx)) if k >= 0 and num_logprob_tokens(meta) else None
        if delta or lp:
            yield chunk(i, {"content": delta}, lp=lp)
        for entry in chunk_entries(calls):
            yield chunk(i, {"tool_calls": [entry]})
        if fr is not None:
            text = "".join(texts[i])
            remember_output(ctx, prep, text, ids[i], parse_output(text, fr, prep.plan))
            yield chunk(i, {}, outs[i].finish_reason(fr), ms)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": ctx.model_name, "choices": [],
                         "usage": usage_of([o for o in last if o is not None], req.n)})


def add_chat_route(router: APIRouter, ctx) -> None:
    """Register ``POST /v1/chat/completions`` on ``router``, bound to ``ctx`` (an OpenAIContext)."""
    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        prep = await ctx.client.prepare(_prepare, ctx, req, field="messages")
        if req.stream:
            stream = await open_call(ctx, prep.call, prep.rename)
            return sse_response(_chat_events(ctx, req, stream, prep))
        outs = await run_call(ctx, request, prep.call, prep.rename)
        choices = [_chat_choice(ctx, i, o, prep, _token_bytes(ctx)) for i, o in enumerate(outs)]
        return JSONResponse({"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(),
                             "model": ctx.model_name, "choices": choices, "usage": usage_of(outs, req.n)})
