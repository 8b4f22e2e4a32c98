"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions`` (here) and
``/v1/chat/completions`` (:mod:`sglite.server.openai_chat`).

Each prompt and each of ``n`` choices is its own engine request (choice index ``p * n + j``);
with ``n > 1`` the prompt is prefilled once first so the choices share its KV. Streams send
OpenAI chunks whose text is the delta of the engine's cumulative text, one final chunk per
choice with ``finish_reason`` and SGLang's ``matched_stop``, then (``stream_options.include_usage``)
a usage chunk with no choices, then ``data: [DONE]``.
"""
from __future__ import annotations

import uuid
from typing import Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .engine_client import GenItem, merge_streams
from .errors import ApiError, from_value_error
from .openai_chat import add_chat_route
from .openai_common import OpenAIContext, open_items, run_items
from .openai_format import completion_logprobs, finish_info, new_id, now, num_logprob_tokens, usage_of
from .openai_params import check_model, completion_prompts, fan_out, sampling_params
from .protocol import CompletionRequest
from .sse import sse_event, sse_response

MAX_TOP_LOGPROBS = 20


def _logprobs_k(req: CompletionRequest) -> int:
    if req.logprobs is None:
        return -1
    if not (0 <= req.logprobs <= MAX_TOP_LOGPROBS):
        raise ApiError(f"logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}", param="logprobs")
    return req.logprobs


def _echo_texts(ctx: OpenAIContext, req: CompletionRequest, prompts: list[dict]) -> list[str]:
    if not req.echo:
        return ["" for _ in prompts]
    out = []
    for p in prompts:
        if "prompt" in p:
            out.append(p["prompt"])
        else:
            tok = getattr(ctx.client.engine, "tokenizer", None)
            out.append(tok.decode(p["input_ids"]) if tok is not None else "")
    return out


def _prepare(ctx: OpenAIContext, req: CompletionRequest) -> tuple[list[GenItem], list[str], int, dict]:
    check_model(req.model, ctx.names)
    if req.suffix:
        raise ApiError("suffix: not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError("best_of: only best_of == n is supported", param="best_of")
    k = _logprobs_k(req)
    prompts = completion_prompts(req)
    counts = []
    for p in prompts:
        if "input_ids" in p:
            try:
                ctx.client.check_ids(p["input_ids"], "prompt")
            except ValueError as e:
                raise from_value_error(e) from e
            counts.append(len(p["input_ids"]))
        else:
            counts.append(ctx.client.count_tokens(p["prompt"]))
    longest = max((c for c in counts if c is not None), default=None)
    ctx_len = ctx.client.context_length
    if longest is not None and ctx_len and longest >= ctx_len:
        raise ApiError(f"prompt: {longest} tokens exceed the context length ({ctx_len} tokens)", param="prompt")
    sp, rename = sampling_params(req, req.max_tokens, "max_tokens", ctx.client, prompt_tokens=longest)
    items = fan_out(prompts, sp, req.n, req.rid or uuid.uuid4().hex, k)
    return items, _echo_texts(ctx, req, prompts), k, rename


def _completion_choice(i: int, out: dict, echo: str, k: int) -> dict:
    meta = out.get("meta_info", {})
    fr, ms = finish_info(meta)
    return {"index": i, "text": echo + out.get("text", ""),
            "logprobs": completion_logprobs(meta, 0, None, len(echo)) if k >= 0 else None,
            "finish_reason": fr, "matched_stop": ms}


async def _completion_events(ctx, req: CompletionRequest, streams, echoes: list[str], k: int):
    rid, created, n = new_id("cmpl"), now(), req.n
    sent = [""] * len(streams)
    lp_sent = [0] * len(streams)
    last: list[Optional[dict]] = [None] * len(streams)

    def chunk(choices, **extra):
        return sse_event({"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                          "choices": choices, **extra})
    async for i, out in merge_streams(streams):
        meta, text = out.get("meta_info", {}), out.get("text", "")
        fr, ms = finish_info(meta)
        echo = echoes[i // n] if sent[i] == "" and last[i] is None else ""
        delta = text[len(sent[i]):]
        new_lp = k >= 0 and num_logprob_tokens(meta) > lp_sent[i]
        last[i] = out
        if not (delta or echo or new_lp or fr):
            continue
        lp = completion_logprobs(meta, lp_sent[i], None, len(echoes[i // n]) + len(sent[i])) if k >= 0 else None
        lp_sent[i] = num_logprob_tokens(meta)
        sent[i] = text
        yield chunk([{"index": i, "text": echo + delta, "logprobs": lp, "finish_reason": fr, "matched_stop": ms}])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], usage=usage_of([o for o in last if o is not None], n))


def build_openai_router(ctx: OpenAIContext) -> APIRouter:
    """``/v1/models`` and ``/v1/completions``, plus the chat route, bound to ``ctx``."""
    router = APIRouter()

    def card() -> dict:
        return {"id": ctx.model_name, "object": "model", "created": now(), "owned_by": "sglite",
                "root": ctx.model_name, "max_model_len": ctx.client.context_length}

    @router.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [card()]}

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id not in ctx.names:
            raise ApiError(f"model: {model_id!r} not found", status=404, param="model", code="model_not_found")
        return card()

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        items, echoes, k, rename = _prepare(ctx, req)
        if req.stream:
            streams = await open_items(ctx, items, req.n, rename)
            return sse_response(_completion_events(ctx, req, streams, echoes, k))
        outs = await run_items(ctx, request, items, req.n, rename)
        choices = [_completion_choice(i, o, echoes[i // req.n], k) for i, o in enumerate(outs)]
        return JSONResponse({"id": new_id("cmpl"), "object": "text_completion", "created": now(),
                             "model": ctx.model_name, "choices": choices, "usage": usage_of(outs, req.n)})

    add_chat_route(router, ctx)
    return router
