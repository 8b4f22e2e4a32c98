"""The router's prefill/decode pairing (``sglite router --pd-disaggregation --prefill URL PORT
--decode URL``).

For each generation request the router picks a decode server (its usual policy over the decode
servers) and a prefill server (round robin), draws a random bootstrap room, and posts at once
``/disagg/prefill`` to the prefill server and ``/disagg/receive`` (with the prefill server's host
and bootstrap port) to the decode server (:mod:`~sglite.distributed.disaggregation`); when both
answer, the original request goes to the decode server, whose radix cache now holds the prompt.
Chat requests (the prompt text needs the chat template) and batches skip the transfer: the decode
server prefills them itself. A failed transfer is logged and the decode server prefills too (same
output, no disaggregation for that request).
"""
from __future__ import annotations

import asyncio
import logging
import random
from typing import Optional
from urllib.parse import urlparse

import httpx

from .router_policy import RouterConfig

log = logging.getLogger("sglite.router")


def prefill_body(path: str, body: dict) -> Optional[dict]:
    """What the prefill server prefills for this request: ``{"text"}`` or ``{"input_ids"}``; None
    when the request is a batch or a chat (no transfer)."""
    if path == "/generate":
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, str):
            return {"text": text}
        if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
            return {"input_ids": ids}
    elif path == "/v1/completions" and isinstance(body.get("prompt"), str):
        return {"text": body["prompt"]}
    return None


class PrefillPairing:
    """Prefill servers of a P/D router and the transfer step run before each decode request.

    Attributes:
        transfers: requests whose KV came from a prefill server.
        transferred_tokens: prompt tokens whose KV was sent.
        failures: transfers that failed (those requests were prefilled by the decode server).
    """

    def __init__(self, config: RouterConfig, seed: Optional[int] = None):
        self.prefill = [(u.rstrip("/"), int(p)) for u, p in config.prefill_urls]
        self._rr = 0
        self._rng = random.Random(seed)
        self.client: Optional[httpx.AsyncClient] = None
        self.transfers = self.transferred_tokens = self.failures = 0

    async def transfer(self, decode_url: str, body: dict, text: str, path: str) -> None:
        pre = prefill_body(path, body)
        if pre is None:
            return
        url, bport = self.prefill[self._rr % len(self.prefill)]
        self._rr += 1
        room = self._rng.getrandbits(62)
        pre["bootstrap_room"] = room
        recv = {"bootstrap_host": urlparse(url).hostname, "bootstrap_port": bport, "bootstrap_room": room}
        try:
            rp, rd = await asyncio.gather(self.client.post(url + "/disagg/prefill", json=pre),
                                          self.client.post(decode_url + "/disagg/receive", json=recv))
            if rp.status_code != 200 or rd.status_code != 200:
                raise RuntimeError(f"prefill {rp.status_code} {rp.text[:200]}; decode {rd.status_code} {rd.text[:200]}")
            self.transfers += 1
            self.transferred_tokens += rd.json().get("received_tokens", 0)
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            self.failures += 1
            log.warning("KV transfer %s -> %s (room %d) failed, the decode server prefills: %s",
                        url, decode_url, room, exc)
