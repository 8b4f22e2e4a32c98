"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes; also under ``/v1/`` as SGLang serves them).

* ``/tokenize`` ``{model?, prompt | messages, add_special_tokens, add_generation_prompt,
  chat_template_kwargs, return_token_strs}`` -> ``{count, max_model_len, tokens, token_strs?}``:
  ``prompt`` is encoded as is; ``messages`` are rendered with the chat template first (as
  ``/v1/chat/completions`` renders them, without tools).
* ``/detokenize`` ``{model?, tokens}`` -> ``{prompt}``.

Tokenizing and rendering run on the preparation pool (never on the event loop). Limits, each a
400 naming the field: exactly one of ``prompt`` / ``messages``; ``prompt`` at most
:data:`MAX_PROMPT_CHARS` characters; ``tokens`` non-empty, at most :data:`MAX_TOKENS` ids, each in
the vocabulary. Source: vLLM ``entrypoints/openai/protocol.py`` (TokenizeRequest,
DetokenizeRequest and their responses).
"""
from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, StrictInt

from ..runtime.tokenizer import check_text
from .errors import ApiError
from .openai_params import check_model, chat_messages
from .protocol import ChatMessage
from .tool_calls import check_template_kwargs

MAX_PROMPT_CHARS = 4_000_000
MAX_TOKENS = 1_000_000


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    """``count`` tokens, the model's context length ``max_model_len``, the ids, their strings when asked."""

    count: int
    max_model_len: Optional[int]
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: the token ids to turn back into text."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: list[StrictInt]  # a boolean is not a token id


class DetokenizeResponse(BaseModel):
    """The text of the ids (special tokens kept)."""

    prompt: str


def _encode(tokenizer, text: str, add_special: bool) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special))
    except TypeError:  # a tokenizer without the keyword (test fakes)
        return list(tokenizer.encode(text))


def tokenize(client, req: TokenizeRequest) -> dict:
    """The ``/tokenize`` answer (runs on the preparation pool).

    Raises:
        ApiError: 400 naming ``prompt`` / ``messages`` (both or neither, too long, template error).
    """
    if (req.prompt is None) == (req.messages is None):
        raise ApiError("prompt: give exactly one of prompt and messages", param="prompt")
    engine = client.engine
    if req.messages is not None:
        msgs = chat_messages(req)
        check_template_kwargs(req.chat_template_kwargs)
        kw = {"chat_template_kwargs": req.chat_template_kwargs} if req.chat_template_kwargs else {}
        try:
            text = engine.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt, **kw)
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise ApiError(f"messages: the chat template rejected them: {e}", param="messages") from e
        add_special = False  # the template already wrote the special tokens it wants
    else:
        text, add_special = req.prompt, req.add_special_tokens
        if len(text) > MAX_PROMPT_CHARS:
            raise ApiError(f"prompt: at most {MAX_PROMPT_CHARS} characters, got {len(text)}", param="prompt")
    check_text(text, "prompt")  # a lone surrogate: a 400 in our words
    try:
        ids = _encode(engine.tokenizer, text, add_special)
    except Exception as e:  # noqa: BLE001 - the library's own wording stays in the log
        raise ApiError("prompt: the tokenizer cannot encode this text", param="prompt") from e
    out = {"count": len(ids), "max_model_len": client.context_length, "tokens": ids}
    if req.return_token_strs:
        conv = getattr(engine.tokenizer, "convert_ids_to_tokens", None)
        out["token_strs"] = list(conv(ids)) if conv else [engine.tokenizer.decode([i]) for i in ids]
    return out


def detokenize(client, req: DetokenizeRequest) -> dict:
    """The ``/detokenize`` answer (runs on the preparation pool).

    Raises:
        ApiError: 400 naming ``tokens`` (empty, too many, an id outside the vocabulary).
    """
    if len(req.tokens) > MAX_TOKENS:
        raise ApiError(f"tokens: at most {MAX_TOKENS} ids, got {len(req.tokens)}", param="tokens")
    try:
        client.check_ids(req.tokens, "tokens")
    except ValueError as e:
        raise ApiError(str(e), param="tokens") from e
    return {"prompt": client.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def build_tokenize_router(ctx, responses: Optional[dict] = None) -> APIRouter:
    """``/tokenize``, ``/detokenize`` and their ``/v1/`` names, bound to ``ctx`` (an OpenAIContext);
    ``responses``: the error responses to publish in the OpenAPI schema."""
    router = APIRouter()
    for prefix in ("", "/v1"):
        @router.post(prefix + "/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True,
                     responses=responses, summary="Tokenize a prompt or chat messages")
        async def tokenize_route(req: TokenizeRequest):
            check_model(req.model, ctx.names, [ctx.model_name])
            field = "messages" if req.messages is not None else "prompt"
            return await ctx.client.prepare(tokenize, ctx.client, req, field=field)

        @router.post(prefix + "/detokenize", response_model=DetokenizeResponse, responses=responses,
                     summary="Turn token ids back into text")
        async def detokenize_route(req: DetokenizeRequest):
            check_model(req.model, ctx.names, [ctx.model_name])
            return await ctx.client.prepare(detokenize, ctx.client, req, field="tokens")
    return router
