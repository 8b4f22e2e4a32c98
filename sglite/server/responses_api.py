"""``/v1/responses``: OpenAI's Responses API as a thin adapter over the request pipeline.

* ``POST /v1/responses``: the request becomes a :class:`~sglite.server.request_pipeline.ChatInput`
  (:mod:`sglite.server.responses_input`), runs through the same stages as chat completions, and
  the output becomes output items (:mod:`sglite.server.responses_output`); ``stream: true`` sends
  the documented event sequence. With ``store`` (the default) the result is kept in the bounded
  :class:`~sglite.server.responses_store.ResponseStore`.
* ``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``
  (``limit`` 1-100, default 20; ``order`` ``desc`` (default) or ``asc``; ``after`` / ``before``:
  an item id to page from): 404 for an id that is not stored (never stored, deleted, evicted or
  expired).
* ``POST /v1/responses/{id}/cancel`` and ``background: true``: the response is stored as
  ``queued`` and runs as a task; polled with ``GET``, cancelled here
  (:mod:`sglite.server.responses_background`).
* ``include: ["message.output_text.logprobs"]`` / ``top_logprobs``: the message text's logprob
  entries on its ``output_text`` part (and on each streamed ``output_text.delta``).
* Stopped early: by ``max_output_tokens`` the response is ``incomplete`` with
  ``incomplete_details.reason`` ``"max_output_tokens"``; by ``/abort_request`` (or a shutdown)
  ``incomplete`` with reason ``"aborted"`` (streamed, the last event is ``response.incomplete``),
  or ``cancelled`` for a background response; the message item is ``incomplete`` either way.
* ``previous_response_id``: the stored conversation comes before the new input (an incomplete or
  cancelled response continues from the output it stored: none when cancelled before its
  output); an id that is not stored is a 400 naming the field (``code:
  "previous_response_not_found"``). While a response is stored, its prompt + output stay pinned in
  the radix cache (``--responses-pin-tokens``), so the follow-up prefills only its new input.

The response id is ``resp_<rid>`` when the request carries SGLang's ``rid`` (the router sets
one, so it knows which worker holds a response), else ``resp_<random>``.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Literal, Optional

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from .errors import ApiError
from .openai_common import OpenAIContext, open_call, run_call
from .openai_format import chat_logprobs, finish_info, now, num_logprob_tokens
from .request_pipeline import PreparedCall, parse_output, prepare, remember_output
from .responses_input import chat_input, normalize_input
from .responses_models import InputItemList, ResponseDeleted, ResponseObject, ResponsesRequest, StreamEvent
from .responses_output import EventWriter, Turn, output_items, response_object, usage
from .responses_background import BackgroundResponses
from .responses_pins import ResponsePins
from .responses_store import ResponseStore, StoredResponse
from .sse import sse_response

_ERR = {"description": "OpenAI-shaped error ({\"error\": {message, type, param, code}})"}


def _prepare(ctx: OpenAIContext, turn: Turn) -> PreparedCall:
    return prepare(ctx, chat_input(turn.req, turn.history, turn.input_items, turn.req.rid))


def _new_turn(store: ResponseStore, req: ResponsesRequest) -> Turn:
    history: list[dict] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise ApiError(f"previous_response_id: no stored response {req.previous_response_id!r} (never stored, "
                           "stored with store: false, deleted, or evicted from the bounded store)",
                           param="previous_response_id", code="previous_response_not_found")
        history = prev.conversation
    rid = f"resp_{req.rid}" if req.rid else f"resp_{uuid.uuid4().hex}"
    return Turn(rid, now(), req, normalize_input(req.input), history)


def _keep(store: ResponseStore, turn: Turn, response: dict, pins: Optional[ResponsePins] = None,
          prep: Optional[PreparedCall] = None, output_ids: Optional[list] = None, text: str = "") -> None:
    if turn.req.store:
        store.put(turn.id, StoredResponse(response, turn.input_items,
                                          turn.history + turn.input_items + response["output"]))
        if pins is not None and store.max_size > 0 and prep is not None:
            pins.pin(turn.id, prep.input_ids if prep.input_ids is not None else prep.prompt, output_ids, text,
                     turn.req.previous_response_id)


def _logprobs(ctx: OpenAIContext, prep: PreparedCall, meta: dict) -> list[dict]:
    """The logprob entries of an engine output (event): chat's shape, as OpenAI's ``output_text.logprobs``."""
    tb = getattr(getattr(ctx.client.engine, "tokenizer", None), "id_to_bytes", None)
    return chat_logprobs(meta, 0, None, tb)["content"]


#: ``incomplete_details.reason`` of an output the engine stopped early (OpenAI's own reasons are
#: ``max_output_tokens`` and ``content_filter``; ``aborted``: ``/abort_request`` or a shutdown)
REASONS = {"length": "max_output_tokens", "abort": "aborted"}


def _status(fr: Optional[str], background: bool = False) -> tuple[str, Optional[str]]:
    """``(status, incomplete reason)`` of an output that ended with ``fr``: ``incomplete`` when the
    token limit or an abort ended it; an aborted ``background`` response is ``cancelled``."""
    if fr == "abort" and background:
        return "cancelled", None
    return ("incomplete", REASONS[fr]) if fr in REASONS else ("completed", None)


async def _events(ctx: OpenAIContext, store: ResponseStore, turn: Turn, stream, prep: PreparedCall,
                  pins: Optional[ResponsePins] = None):
    w, text, ids = EventWriter(), [], []
    for ev in w.start(response_object(turn, ctx.model_name, [], "in_progress", None)):
        yield ev
    reader, meta, fr = prep.streamer(), None, None
    async for _, out in stream:
        meta = out["meta_info"]
        text.append(out["text"])
        ids.extend(out.get("output_ids") or [])
        fr, _ = finish_info(meta)
        thought, content, deltas = reader.step(out["text"], fr)
        lps = _logprobs(ctx, prep, meta) if prep.logprobs >= 0 and num_logprob_tokens(meta) else None
        for ev in w.reasoning(thought) + w.text(content, lps):
            yield ev
        for d in deltas:
            for ev in w.call(d):
                yield ev
    status, reason = _status(fr)
    for ev in w.end(status):
        yield ev
    response = response_object(turn, ctx.model_name, w.items, status, usage(meta), reason)
    full = "".join(text)
    remember_output(ctx, prep, full, ids, parse_output(full, fr, prep.plan))
    _keep(store, turn, response, pins, prep, ids, full)
    yield w.finish(response)


def _complete(ctx: OpenAIContext, store: ResponseStore, turn: Turn, prep: PreparedCall,
              pins: Optional[ResponsePins], out: dict) -> dict:
    """The response of a finished (non-streamed) output, stored when asked."""
    meta = out["meta_info"]
    fr, _ = finish_info(meta)
    status, reason = _status(fr, bool(turn.req.background))
    parsed = parse_output(out["text"], fr, prep.plan)
    remember_output(ctx, prep, out["text"], out.get("output_ids"), parsed)
    items = output_items(parsed, status != "completed", _logprobs(ctx, prep, meta) if prep.logprobs >= 0 else None)
    response = response_object(turn, ctx.model_name, items, status, usage(meta), reason)
    _keep(store, turn, response, pins, prep, out.get("output_ids"), out["text"])
    return response


def _start_background(ctx: OpenAIContext, store: ResponseStore, turn: Turn, prep: PreparedCall,
                      pins: Optional[ResponsePins], background: BackgroundResponses) -> dict:
    """Store the response as ``queued`` and run it as a task; the queued response (see
    :mod:`sglite.server.responses_background`)."""
    if turn.req.stream:
        raise ApiError("background: cannot be combined with stream: true here; poll GET /v1/responses/{id}",
                       param="background")
    if not turn.req.store or store.max_size == 0:
        raise ApiError("background: requires store: true (the response is polled from the store)",
                       param="background")
    response = response_object(turn, ctx.model_name, [], "queued", None)
    entry = StoredResponse(response, turn.input_items, turn.history + turn.input_items)
    store.put(turn.id, entry)

    async def run() -> None:
        entry.response["status"] = "in_progress"
        try:
            (out,) = await ctx.client.run(prep.call)
        except asyncio.CancelledError:
            entry.response.update(status="cancelled")
            raise
        except Exception as e:  # noqa: BLE001 - reported in the polled response
            background.finish(turn.id)
            entry.response.update(status="failed", error={"code": "server_error", "message": str(e)})
            return
        background.finish(turn.id)
        if store.get(turn.id) is entry:  # still stored (not evicted, expired or deleted meanwhile)
            _complete(ctx, store, turn, prep, pins, out)
    background.start(turn.id, run)
    return response


def add_responses_routes(router: APIRouter, ctx: OpenAIContext, store: ResponseStore,
                         pins: Optional[ResponsePins] = None, background: Optional[BackgroundResponses] = None) -> None:
    """Register the ``/v1/responses`` routes on ``router``, bound to ``ctx`` and ``store``; ``pins``
    keeps stored conversations' prefixes in the radix cache (:mod:`sglite.server.responses_pins`);
    ``background`` runs ``background: true`` responses (:mod:`sglite.server.responses_background`;
    the store's ``on_drop`` should call its ``dropped``)."""
    background = background if background is not None else BackgroundResponses()

    @router.post("/v1/responses", responses={
        200: {"model": ResponseObject, "description": "the response; with stream: server-sent events",
              "content": {"text/event-stream": {"schema": StreamEvent.model_json_schema()}}},
        400: _ERR, 404: _ERR})
    async def create_response(req: ResponsesRequest, request: Request):
        turn = _new_turn(store, req)
        prep = await ctx.client.prepare(_prepare, ctx, turn, field="input")
        if req.background:
            return JSONResponse(_start_background(ctx, store, turn, prep, pins, background))
        if req.stream:
            stream = await open_call(ctx, prep.call, prep.rename)
            return sse_response(_events(ctx, store, turn, stream, prep, pins))
        (out,) = await run_call(ctx, request, prep.call, prep.rename)
        return JSONResponse(_complete(ctx, store, turn, prep, pins, out))

    @router.post("/v1/responses/{response_id}/cancel", responses={200: {"model": ResponseObject}, 400: _ERR,
                                                                  404: _ERR})
    async def cancel_response(response_id: str):
        hit = _stored(response_id)
        if not hit.response.get("background"):
            raise ApiError(f"response_id: {response_id!r} was not created with background: true (only background "
                           "responses can be cancelled)", param="response_id")
        if background.cancel(response_id):
            hit.response.update(status="cancelled", completed_at=None)
        return JSONResponse(hit.response)

    def _stored(response_id: str) -> StoredResponse:
        hit = store.get(response_id)
        if hit is None:
            raise ApiError(f"response_id: no stored response {response_id!r}", status=404, param="response_id",
                           code="response_not_found")
        return hit

    @router.get("/v1/responses/{response_id}", responses={200: {"model": ResponseObject}, 404: _ERR})
    async def retrieve_response(response_id: str):
        return JSONResponse(_stored(response_id).response)

    @router.delete("/v1/responses/{response_id}", responses={200: {"model": ResponseDeleted}, 404: _ERR})
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            _stored(response_id)  # raises the 404
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @router.get("/v1/responses/{response_id}/input_items", responses={200: {"model": InputItemList}, 404: _ERR})
    async def list_input_items(response_id: str, limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc", after: Optional[str] = None,
                               before: Optional[str] = None):
        items = list(_stored(response_id).input_items)
        if order == "desc":
            items.reverse()
        ids = [it["id"] for it in items]
        for name, cursor in (("after", after), ("before", before)):
            if cursor is not None and cursor not in ids:
                raise ApiError(f"{name}: no input item {cursor!r} in response {response_id!r}", param=name)
        if after is not None:
            items = items[ids.index(after) + 1:]
        if before is not None:
            items = items[:[it["id"] for it in items].index(before)] if before in [it["id"] for it in items] else []
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
