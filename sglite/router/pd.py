"""The router's prefill/decode pairing (``sglite router --pd-disaggregation --prefill URL PORT
--decode URL``).

For each generation request the router picks a decode server (its usual policy over the decode
servers) and a prefill server (round robin), draws a random bootstrap room, and posts at once
``/disagg/prefill`` to the prefill server and ``/disagg/receive`` (with the prefill server's host
and bootstrap port, and the one-time transfer token it first obtained from the prefill server's
``/disagg/token``) to the decode server (:mod:`~sglite.server.disaggregation`); when both
answer, the original request goes to the decode server, whose radix cache now holds the prompt.
The client's ``Authorization`` header goes with all three (servers started with ``--api-key``).
Chat requests (the prompt text needs the chat template) and batches skip the transfer: the decode
server prefills them itself. A failed transfer is logged and counted (``failures``, reported by
the router's ``/get_server_info`` under ``pd``; a warning names the cause, and a transfer that
a server refused with 401/403 also counts in ``unauthorized``) and the decode server prefills
too (same output, no disaggregation for that request). A client that disconnects during the transfer is not
forwarded (``aborted``).
"""
from __future__ import annotations

import asyncio
import logging
import random
from typing import Optional
from urllib.parse import urlparse

import httpx

from .policy import RouterConfig

log = logging.getLogger("sglite.router")

FAILURE_GRACE_SECS = 10.0  # how long a failed prefill waits for the decode server's answer


class ClientGone(Exception):
    """The client disconnected while its KV was being transferred: nothing is sent to the decode
    server (the KV it received stays in its radix cache, unlocked, evictable)."""


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
        unauthorized: of ``failures``, those a prefill or decode server answered 401 / 403 (a key
            or a disaggregation secret / peer list that does not match).
        aborted: requests whose client disconnected during the transfer (not forwarded).
    """

    def __init__(self, config: RouterConfig, seed: Optional[int] = None):
        self.prefill = [(u.rstrip("/"), int(p)) for u, p in config.prefill_urls]
        self._rr = 0
        self._rng = random.Random(seed)
        self.client: Optional[httpx.AsyncClient] = None
        self.transfers = self.transferred_tokens = self.failures = self.aborted = self.unauthorized = 0

    def stats(self) -> dict:
        """The counters (see the class), for the router's ``/get_server_info``."""
        return {"prefill_urls": [u for u, _ in self.prefill], "transfers": self.transfers,
                "transferred_tokens": self.transferred_tokens, "failures": self.failures,
                "unauthorized": self.unauthorized, "aborted": self.aborted}

    async def transfer(self, decode_url: str, body: dict, text: str, path: str, request=None) -> None:
        """Move the prompt's KV of ``body`` to ``decode_url`` (nothing for chats and batches).

        A failed transfer is counted in ``failures`` and logged; the request then goes on (the
        decode server prefills it). When one side fails first, the other's answer is awaited at
        most ``FAILURE_GRACE_SECS`` (a live prefill server tells its decode peer with a failure
        header; a decode server that gives up closes its gloo connection). Raises
        :class:`ClientGone` when ``request`` (the client's Starlette request) disconnected during
        the transfer (counted in ``aborted``).
        """
        pre = prefill_body(path, body)
        if pre is None:
            return
        url, bport = self.prefill[self._rr % len(self.prefill)]
        self._rr += 1
        room = self._rng.getrandbits(62)
        pre["bootstrap_room"] = room
        recv = {"bootstrap_host": urlparse(url).hostname, "bootstrap_port": bport, "bootstrap_room": room}
        auth = request.headers.get("authorization") if request is not None else None
        headers = {"authorization": auth} if auth else {}
        tp = td = None
        try:
            rt = await self.client.post(url + "/disagg/token", json={"bootstrap_room": room}, headers=headers)
            if rt.status_code != 200:
                raise _Refused(rt.status_code, f"prefill /disagg/token {rt.status_code} {rt.text[:200]}")
            issued = rt.json()
            recv["transfer_token"] = issued.get("token") if isinstance(issued, dict) else None
            tp = asyncio.ensure_future(self.client.post(url + "/disagg/prefill", json=pre, headers=headers))
            td = asyncio.ensure_future(self.client.post(decode_url + "/disagg/receive", json=recv, headers=headers))
            done, _ = await asyncio.wait((tp, td), return_when=asyncio.FIRST_COMPLETED)
            first = next(iter(done))
            if first.exception() is not None or first.result().status_code != 200:
                other = td if first is tp else tp  # told by the failure (or not): bounded wait
                await asyncio.wait((other,), timeout=FAILURE_GRACE_SECS)
            else:
                await asyncio.wait((tp, td))
            if not (tp.done() and td.done()):
                side = "prefill" if first is tp else "decode"
                code = first.result().status_code if first.exception() is None else 0
                raise _Refused(code if code in AUTH_CODES else 0,
                               f"the {side} server failed ({_describe(first)}) and the other had not "
                               f"answered after {FAILURE_GRACE_SECS:g} s")
            rp, rd = tp.result(), td.result()
            if rp.status_code != 200 or rd.status_code != 200:
                msg = f"prefill {rp.status_code} {rp.text[:200]}; decode {rd.status_code} {rd.text[:200]}"
                raise _Refused(next((c for c in (rp.status_code, rd.status_code) if c in AUTH_CODES), 0), msg)
            self.transfers += 1
            self.transferred_tokens += rd.json().get("received_tokens", 0)
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            self.failures += 1
            hint = ""
            if isinstance(exc, _Refused) and exc.status in AUTH_CODES:
                self.unauthorized += 1
                hint = (" (refused: the servers' --api-key must accept the client's Authorization, and both "
                        "P/D servers need the same disaggregation secret and --disaggregation-peers)")
            log.warning("KV transfer %s -> %s (room %d) failed, the decode server prefills: %s%s",
                        url, decode_url, room, exc, hint)
        finally:
            for t in (tp, td):
                if t is not None and not t.done():
                    t.cancel()
        if request is not None and await request.is_disconnected():
            self.aborted += 1
            raise ClientGone(f"the client disconnected during the KV transfer of room {room}")


AUTH_CODES = {401, 403}


class _Refused(RuntimeError):
    """A P/D server answered a transfer step with an error status (``status``; 0: not an auth error)."""

    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


def _describe(task) -> str:
    if not task.done():
        return "pending"
    if task.exception() is not None:
        return f"{type(task.exception()).__name__}: {task.exception()}"
    r = task.result()
    return f"{r.status_code} {r.text[:200]}"
