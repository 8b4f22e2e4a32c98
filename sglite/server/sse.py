"""Server-sent events: ``data: {json}\\n\\n`` frames ending with ``data: [DONE]``.

An error after the response has started cannot change the status any more, so it is sent as
one ``data: {"error": {...}}`` frame (SGLang and OpenAI do the same) followed by ``[DONE]``.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from .errors import ApiError, error_body, from_value_error

logger = logging.getLogger("sglite.server")
DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    """One SSE frame carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        try:
            async for ev in events:
                yield ev
        except asyncio.CancelledError:
            raise
        except ApiError as e:
            yield sse_event(error_body(e.message, e.status, e.param))
        except ValueError as e:
            err = from_value_error(e)
            yield sse_event(error_body(err.message, 400, err.param))
        except Exception as e:  # noqa: BLE001 - reported to the client, logged here
            logger.exception("error while streaming: %s", e)
            yield sse_event(error_body(f"internal server error: {type(e).__name__}", 500))
        yield DONE
    finally:
        # Close the producer now (its finally aborts unfinished engine requests), not at GC time.
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    """A StreamingResponse for SSE frames; appends ``[DONE]`` and turns errors into error frames."""
    return StreamingResponse(_guarded(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
