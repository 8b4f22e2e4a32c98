"""The router's ``/v1/responses`` routes: worker affinity for stored responses.

A stored response lives on the worker that created it (:mod:`sglite.server.responses_store`), so
the router remembers ``response id -> worker``: it gives every forwarded ``POST /v1/responses`` a
``rid`` (the client's, or a new one), and the worker names the response ``resp_<rid>``. A request
with ``previous_response_id`` goes to that response's worker (the policy picks when the id is
unknown or its worker is down: that worker then answers the 400 ``previous_response_not_found``);
``GET`` / ``DELETE /v1/responses/{id}``, ``/input_items`` and ``POST .../cancel`` go there too (every healthy worker
is asked in turn when the id is unknown, the first answer other than 404 wins). The map is bounded
(:data:`MAX_REMEMBERED` ids, least recently used dropped first), like the workers' stores.
"""
from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from typing import Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..server.errors import error_body
from ..server.responses_models import ResponsesRequest

MAX_REMEMBERED = 100_000


class ResponseAffinity:
    """``response id -> worker index``, at most ``max_size`` ids (least recently used dropped)."""

    def __init__(self, max_size: int = MAX_REMEMBERED):
        self.max_size = max_size
        self._ids: OrderedDict[str, int] = OrderedDict()

    def remember(self, response_id: str, worker: int) -> None:
        self._ids[response_id] = worker
        self._ids.move_to_end(response_id)
        while len(self._ids) > self.max_size:
            self._ids.popitem(last=False)

    def worker(self, response_id: Optional[str]) -> Optional[int]:
        """The worker that created ``response_id``, or None when unknown."""
        i = self._ids.get(response_id) if response_id else None
        if i is not None:
            self._ids.move_to_end(response_id)
        return i

    def forget(self, response_id: str) -> None:
        self._ids.pop(response_id, None)


def responses_text(body: dict) -> str:
    """The text a Responses request's prompt starts with (instructions, then the input's text),
    for the cache-aware policy's prefix matching."""
    parts = [f"<system>{body['instructions']}"] if isinstance(body.get("instructions"), str) else []
    inp = body.get("input")
    if isinstance(inp, str):
        parts.append(f"<user>{inp}")
    for item in inp if isinstance(inp, list) else []:
        if isinstance(item, dict):
            c = item.get("content", item.get("output", item.get("arguments")))
            parts.append(f"<{item.get('role') or item.get('type')}>{c if isinstance(c, str) else json.dumps(c)}")
    return "".join(parts)


def add_responses_routes(app: FastAPI, router, fwd, read_body) -> ResponseAffinity:
    """Register ``/v1/responses`` and its ``{id}`` routes on the router's ``app``; returns the map."""
    affinity = ResponseAffinity()

    @app.post("/v1/responses")
    async def create_response(request: Request):
        body = await read_body(request, ResponsesRequest)
        if body.get("rid") is None:
            body["rid"] = uuid.uuid4().hex
        response_id = f"resp_{body['rid']}"
        return await router.proxy("/v1/responses", body, fwd(request), receive=request.receive,
                                  pin=affinity.worker(body.get("previous_response_id")),
                                  picked=lambda i: affinity.remember(response_id, i))

    async def to_owner(request: Request, method: str, response_id: str, suffix: str = "") -> Response:
        owner = affinity.worker(response_id)
        order = [owner] if owner is not None and router.healthy[owner] else \
            [i for i, h in enumerate(router.healthy) if h]
        answer = None
        for i in order:
            url = f"{router.urls[i]}/v1/responses/{response_id}{suffix}"
            try:
                r = await router.client.request(method, url, params=request.query_params, headers=fwd(request))
            except httpx.HTTPError:
                continue  # the health checks mark it down; the next worker may hold the response
            answer = Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
            if r.status_code != 404:
                if method == "DELETE" and r.status_code == 200:
                    affinity.forget(response_id)
                else:
                    affinity.remember(response_id, i)
                return answer
        if answer is not None:
            return answer
        return JSONResponse(error_body("no healthy worker", 503), status_code=503)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request):
        return await to_owner(request, "GET", response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        return await to_owner(request, "DELETE", response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request):
        return await to_owner(request, "GET", response_id, "/input_items")

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request):
        return await to_owner(request, "POST", response_id, "/cancel")

    return affinity
