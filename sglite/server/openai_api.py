"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions`` (here) and
``/v1/chat/completions`` (:mod:`sglite.server.openai_chat`).

One request is one engine call; the engine fans out the prompts and the ``n`` choices (choice
index ``p * n + j``) and prefills a prompt once for its choices. Streams are opened incremental:
each engine event carries the new text and logprob entries, sent as they are in OpenAI chunks,
one final chunk per choice with ``finish_reason`` and SGLang's ``matched_stop``, then
(``stream_options.include_usage``) a usage chunk with no choices, then ``data: [DONE]``.
"""
from __future__ import annotations

import uuid
from typing import Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .engine_client import GenCall
from .errors import ApiError, from_value_error
from .openai_chat import add_chat_route
from .openai_common import OpenAIContext, check_fields, open_call, run_call
from .openai_format import completion_logprobs, finish_info, new_id, now, num_logprob_tokens, usage_of
from ..errors import context_length_message
from .openai_params import completion_prompts, make_call, model_adapter, sampling_params
from .protocol import CompletionRequest
from .sse import sse_event, sse_response

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; an explicit null means it too

MAX_TOP_LOGPROBS = 20


def _logprobs_k(req: CompletionRequest) -> int:
    if req.logprobs is None:
        return -1
    if not (0 <= req.logprobs <= MAX_TOP_LOGPROBS):
        raise ApiError(f"logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}", param="logprobs")
    return req.logprobs


def _echo_texts(ctx: OpenAIContext, req: CompletionRequest, prompts: list[dict]) -> list[Optional[str]]:
    """Each prompt's text to echo, or None per prompt without ``echo``."""
    if not req.echo:
        return [None for _ in prompts]
    out = []
    for p in prompts:
        if "prompt" in p:
            out.append(p["prompt"])
        else:
            out.append(ctx.client.engine.tokenizer.decode(p["input_ids"]))
    return out


def _prepare(ctx: OpenAIContext, req: CompletionRequest) -> tuple[GenCall, list[Optional[str]], int, dict]:
    adapter = model_adapter(ctx, req.model)
    check_fields(req, "/v1/completions")
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
        raise ApiError(context_length_message(longest, ctx_len), param="prompt", code="context_length_exceeded")
    max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS  # null: the default
    sp, rename = sampling_params(req, max_tokens, "max_tokens", ctx.client, prompt_tokens=longest,
                                 allow_zero=req.echo)
    # echo + logprobs: the prompt tokens' logprobs too (how evaluation harnesses score text)
    call = make_call(prompts, sp, req.n, req.rid or uuid.uuid4().hex, k, prompt_logprobs=req.echo)
    call.lora_path = adapter
    return call, _echo_texts(ctx, req, prompts), k, {**rename, "text": "prompt"}  # the engine says text


def _completion_choice(i: int, out: dict, echo: Optional[str], k: int) -> dict:
    meta = out["meta_info"]
    fr, ms = finish_info(meta)
    return {"index": i, "text": (echo or "") + out["text"],
            "logprobs": completion_logprobs(meta, 0, None, 0, prompt=echo is not None) if k >= 0 else None,
            "finish_reason": fr, "matched_stop": ms}


async def _completion_events(ctx, req: CompletionRequest, stream, echoes: list[Optional[str]], k: int):
    """OpenAI chunks from the incremental engine stream (no re-diffing of cumulative text)."""
    rid, created, n = new_id("cmpl"), now(), req.n
    chars = [0] * stream.call.num_outputs  # characters of each choice sent so far (echo included)
    started = [False] * len(chars)
    last: list[Optional[dict]] = [None] * len(chars)

    def chunk(choices, **extra):
        return sse_event({"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                          "choices": choices, **extra})
    async for i, out in stream:
        meta, delta = out["meta_info"], out["text"]
        fr, ms = finish_info(meta)
        first = not started[i]
        echo = (echoes[i // n] or "") if first else ""
        with_prompt = first and echoes[i // n] is not None
        new_lp = k >= 0 and (num_logprob_tokens(meta, drop_stop_token=False) > 0
                             or (with_prompt and bool(meta.get("input_token_logprobs"))))
        last[i] = out
        if not (delta or echo or new_lp or fr):
            continue
        started[i] = True
        lp = completion_logprobs(meta, 0, None, chars[i], prompt=with_prompt) if k >= 0 else None
        chars[i] += len(echo) + len(delta)
        yield chunk([{"index": i, "text": echo + delta, "logprobs": lp, "finish_reason": fr, "matched_stop": ms}])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], usage=usage_of([o for o in last if o is not None], n))


def build_openai_router(ctx: OpenAIContext) -> APIRouter:
    """``/v1/models`` and ``/v1/completions``, plus the chat route, bound to ``ctx``."""
    router = APIRouter()

    def card() -> dict:
        return {"id": ctx.model_name, "object": "model", "created": now(), "owned_by": "sglite",
                "root": ctx.model_name, "max_model_len": ctx.client.context_length}

    def adapter_card(name: str) -> dict:  # a LoRA adapter over the base model (SGLang lists them too)
        return {**card(), "id": name, "root": name, "parent": ctx.model_name}

    @router.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [card()] + [adapter_card(n) for n in ctx.lora_names()]}

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_adapter(ctx, model_id) is not None:
            return adapter_card(model_id)
        return card()

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        call, echoes, k, rename = await ctx.client.prepare(_prepare, ctx, req, field="prompt")
        if req.stream:
            stream = await open_call(ctx, call, rename)
            return sse_response(_completion_events(ctx, req, stream, echoes, k))
        outs = await run_call(ctx, request, call, rename)
        choices = [_completion_choice(i, o, echoes[i // req.n], k) for i, o in enumerate(outs)]
        return JSONResponse({"id": new_id("cmpl"), "object": "text_completion", "created": now(),
                             "model": ctx.model_name, "choices": choices, "usage": usage_of(outs, req.n)})

    add_chat_route(router, ctx)
    return router
