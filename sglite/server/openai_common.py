"""What the OpenAI routes share: their context and how they run engine calls."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import Request

from .engine_client import EngineClient, EngineStream, GenCall, until_disconnect
from .errors import ApiError, from_value_error

logger = logging.getLogger("sglite.server")

# Fields of OpenAI's API this server knows but cannot honour: a 400 naming them beats a silent
# accept (a client relying on them would get something else than it asked for).
UNHONOURED = {
    "functions": "the legacy functions API is not supported; send tools",
    "function_call": "the legacy functions API is not supported; send tool_choice",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}


def check_fields(req, route: str) -> None:
    """400 for a field this server knows but cannot honour (:data:`UNHONOURED`, ``modalities``
    other than text); request fields it does not know are accepted, ignored and named in one
    warning log line (vLLM's behaviour)."""
    extra = dict(req.model_extra or {})
    for name, why in UNHONOURED.items():
        if extra.get(name) is not None:
            raise ApiError(f"{name}: {why}", param=name)
    mods = extra.pop("modalities", None)
    if mods is not None and list(mods) != ["text"]:
        raise ApiError(f"modalities: only [\"text\"] is supported, got {mods!r}", param="modalities")
    if extra:
        logger.warning("%s: ignoring request fields this server does not know: %s", route, ", ".join(sorted(extra)))


@dataclass
class OpenAIContext:
    """What the OpenAI routes share: the engine client, the model id, the names it answers to,
    the tool-call parser (a ``--tool-call-parser`` name) and the reasoning parser (None: none);
    whether "auto" tool calls are constrained, and the end-of-reasoning marker (None: no
    reasoning parser) after which grammars apply."""

    client: EngineClient
    model_name: str
    names: set
    tool_parser: Optional[str] = None       # the --tool-call-parser name in effect (None: hermes)
    reasoning_parser: Optional[str] = None  # the --reasoning-parser name (None: no reasoning split)
    constrain_auto_tools: bool = True
    reasoning_end: Optional[str] = None
    turn_tokens: Optional[Any] = None       # a TurnTokens: past turns re-sent as generated (None: off)

    def lora_names(self) -> list[str]:
        """Names of the LoRA adapters served (each answers as a ``model``; sglite.lora)."""
        lora = getattr(self.client.engine, "lora", None)
        return [] if lora is None else lora.names()


async def run_call(ctx: OpenAIContext, request: Request, call: GenCall, rename: dict) -> list[dict]:
    """Run the call (the engine prefills a prompt once for its ``n`` choices); cancelled if the
    client leaves. Returns the choices' outputs in choice order."""
    try:
        return await until_disconnect(request.receive, ctx.client.run(call))
    except ValueError as e:
        raise from_value_error(e, rename, top_level=True) from e


async def open_call(ctx: OpenAIContext, call: GenCall, rename: dict) -> EngineStream:
    """Open the call as an incremental stream (each event: new text, ids, logprobs); 400 on bad input."""
    try:
        return await ctx.client.open(call, incremental=True)
    except ValueError as e:
        raise from_value_error(e, rename, top_level=True) from e
