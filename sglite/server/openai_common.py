"""What the OpenAI routes share: their context and how they run engine requests."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request

from .engine_client import EngineClient, GenItem, until_disconnect
from .errors import from_value_error


@dataclass
class OpenAIContext:
    """What the OpenAI routes share: the engine client, the model id, server options."""

    client: EngineClient
    model_name: str
    names: set
    warm_prefix_for_n: bool = True


async def run_items(ctx: OpenAIContext, request: Request, items: list[GenItem], n: int,
                    rename: dict) -> list[dict]:
    """Warm the prefixes (``n > 1``), then run every item; cancelled if the client leaves."""
    async def go():
        await warm(ctx, items, n)
        return await ctx.client.generate_many(items)
    try:
        return await until_disconnect(request.receive, go())
    except ValueError as e:
        raise from_value_error(e, rename) from e


async def open_items(ctx: OpenAIContext, items: list[GenItem], n: int, rename: dict):
    """Warm the prefixes (``n > 1``), then open a stream per item (400 on bad input)."""
    try:
        await warm(ctx, items, n)
        return await ctx.client.open_streams(items)
    except ValueError as e:
        raise from_value_error(e, rename) from e


async def warm(ctx: OpenAIContext, items: list[GenItem], n: int) -> None:
    if n > 1 and ctx.warm_prefix_for_n:
        await asyncio.gather(*(ctx.client.warm_prefix(items[p]) for p in range(0, len(items), n)))
