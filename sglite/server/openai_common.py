"""What the OpenAI routes share: their context and how they run engine calls."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from .engine_client import EngineClient, EngineStream, GenCall, until_disconnect
from .errors import from_value_error


@dataclass
class OpenAIContext:
    """What the OpenAI routes share: the engine client, the model id, the names it answers to."""

    client: EngineClient
    model_name: str
    names: set


async def run_call(ctx: OpenAIContext, request: Request, call: GenCall, rename: dict) -> list[dict]:
    """Run the call (the engine prefills a prompt once for its ``n`` choices); cancelled if the
    client leaves. Returns the choices' outputs in choice order."""
    try:
        return await until_disconnect(request.receive, ctx.client.run(call))
    except ValueError as e:
        raise from_value_error(e, rename) from e


async def open_call(ctx: OpenAIContext, call: GenCall, rename: dict) -> EngineStream:
    """Open the call as an incremental stream (each event: new text, ids, logprobs); 400 on bad input."""
    try:
        return await ctx.client.open(call, incremental=True)
    except ValueError as e:
        raise from_value_error(e, rename) from e
