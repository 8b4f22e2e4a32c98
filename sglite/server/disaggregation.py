"""Prefill/decode disaggregation: a prefill server computes a prompt's KV, a decode server continues.

DistServe (Zhong et al. 2024) / Splitwise placement: prefill and decode run on different servers so
neither phase stalls the other. Here (``disaggregation_mode``):

* the **prefill** server (``prefill``) hosts a bootstrap ``TCPStore`` on
  ``disaggregation_bootstrap_port``; ``POST /disagg/prefill {"text" | "input_ids",
  "bootstrap_room"}`` prefills the prompt into its radix cache, reads the prompt's K/V out of its
  pool (:meth:`~sglite.runtime.engine.Engine.export_prefix`) and sends token ids and K/V to the
  decode server of that room;
* the **decode** server (``decode``) answers ``POST /disagg/receive {"bootstrap_host",
  "bootstrap_port", "bootstrap_room"}``: it joins the room, receives the ids and K/V, writes them
  into free slots of its own pool and inserts them into its radix cache
  (:meth:`~sglite.runtime.engine.Engine.import_prefix`);
* the router (``sglite router --pd-disaggregation``) sends both at once, then the original request
  to the decode server, whose radix cache now holds the prompt: it computes the last prompt token
  and decodes. Greedy output is the colocated server's.

The bootstrap handshake: the room id (random, from the router) names a store prefix; both sides
announce themselves there and wait for the other at most ``disaggregation_connect_timeout``
seconds (so a transfer whose peer never comes fails in seconds, on either side), then build a
2-rank gloo group on it (prefill rank 0, decode rank 1) through the prefill server's store; the
transfer is torch.distributed send/recv of raw tensors (nothing is unpickled). Payload: header
``[MAGIC, n, L, Hkv, D, dtype code, 0, 0]`` int64, a 32-byte peer proof (uint8), ids ``[n]`` int64,
then K and V as ``[L, n, Hkv, D]`` in the pool dtype. A prefill that fails sends ``n = -1`` instead,
so its decode peer stops waiting (:class:`TransferError`, HTTP 502). ``tp_size`` must be 1.

Trust (docs/security.md): a decode server connects only to loopback addresses or to the
``disaggregation_peers`` it was given (anything else: 403 naming the flag, nothing connects).
With a shared secret (``disaggregation_secret_file`` or ``SGLITE_DISAGGREGATION_SECRET``) the router
first obtains a one-time token from the prefill server (``POST /disagg/token``: HMAC-SHA256 over
room and expiry), the decode server checks it (constant time, once per room) before it connects,
and the prefill peer proves in the header that it holds the secret (HMAC over the room) before
any id or K/V is read. Everything received is checked before the radix cache sees it: the header's
layout and dtype against this pool, ``n`` against the context length and the pool, every id
against the vocabulary, every K/V value finite; else :class:`TransferError` (502) and nothing is
inserted. ``GET /disagg/stats`` counts each half's transfers, failures, refusals, unreachable peers
and rejected payloads. The routes exist only on a server started with ``disaggregation_mode``.
"""
from __future__ import annotations

import asyncio
import logging
import threading

from ..config import parse_peers
from .pd_transfer import (DTYPE_CODES, HEADER_MAGIC, LOOPBACK, MAC_BYTES, MIN_SECRET_BYTES, MODES, SECRET_ENV,
                          TRANSFER_THREADS, TRANSFER_TIMEOUT, Bootstrap, Room, TokenCheck, TransferError,
                          TransferRefused, check_peer, connect_store, is_loopback, issue_token, load_secret,
                          open_room, peer_proof, ping_store, recv_kv, send_failure, send_kv)

__all__ = ["DTYPE_CODES", "HEADER_MAGIC", "LOOPBACK", "MAC_BYTES", "MIN_SECRET_BYTES", "MODES", "SECRET_ENV",
           "TRANSFER_THREADS", "TRANSFER_TIMEOUT", "Bootstrap", "Room", "TokenCheck", "TransferError",
           "TransferRefused", "check_peer", "connect_store", "disaggregation_routes", "is_loopback", "issue_token",
           "load_secret", "open_room", "peer_proof", "ping_store", "recv_kv", "send_failure", "send_kv"]

log = logging.getLogger("sglite.disaggregation")


def disaggregation_routes(engine, config, server_host: str = LOOPBACK):
    """FastAPI routes of a prefill (``/disagg/token``, ``/disagg/prefill``) or decode
    (``/disagg/receive``) server, and ``/disagg/stats``; ``config``: the engine's
    :class:`~sglite.config.EngineConfig` (``disaggregation_*`` fields), ``server_host``: the
    server's ``--host`` (the bootstrap store's interface unless ``disaggregation_bootstrap_host``).

    Raises:
        InvalidRequestError: an unreadable or short secret (``disaggregation_secret_file``).
        OSError: the bootstrap address cannot be bound.
    """
    from concurrent.futures import ThreadPoolExecutor

    from fastapi import APIRouter
    from fastapi.responses import JSONResponse

    mode, timeout = config.disaggregation_mode, config.disaggregation_connect_timeout
    secret = load_secret(config.disaggregation_secret_file)
    peers = parse_peers(config.disaggregation_peers) if config.disaggregation_peers else None
    router = APIRouter()
    bhost = config.disaggregation_bootstrap_host or server_host
    boot = Bootstrap(config.disaggregation_bootstrap_port if mode == "prefill" else None, bhost, timeout)
    # own threads, not asyncio's small default pool: a receive blocks until its prefill is done,
    # and prefill sends block until their receivers come; sharing a few threads could deadlock
    pool_ = ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix=f"sglite-pd-{mode}")

    async def in_thread(fn):
        return await asyncio.get_running_loop().run_in_executor(pool_, fn)

    stats = {"sent": 0, "sent_tokens": 0, "failed": 0, "tokens_issued": 0} if mode == "prefill" else \
        {"received": 0, "received_tokens": 0, "failed": 0, "refused": 0, "connect_failed": 0, "invalid": 0}
    stats_lock = threading.Lock()

    def count(key, n=1):
        with stats_lock:
            stats[key] += n

    def error(code, kind, msg):
        (log.warning if code >= 500 else log.info)("%s", msg)
        return JSONResponse({"error": {"message": msg, "code": code, "type": kind}}, status_code=code)

    def bad(msg):
        return error(400, "BadRequestError", msg)

    def room_of(body):
        room = body.get("bootstrap_room")
        return room if isinstance(room, int) and not isinstance(room, bool) and 0 <= room < 1 << 63 else None

    def gloo_host(host):
        return LOOPBACK if is_loopback(host) else None

    if mode == "prefill":
        local = gloo_host(boot.host) if boot.host not in ("0.0.0.0", "", "::") else None

        @router.post("/disagg/token")
        async def token(body: dict):
            """A one-time transfer token for ``bootstrap_room`` (None without a secret)."""
            room = room_of(body)
            if room is None:
                return bad("bootstrap_room: a non-negative integer is required")
            if secret is None:
                return {"bootstrap_room": room, "token": None, "expires_at": None}
            tok, expires = issue_token(secret, room, config.disaggregation_token_ttl)
            count("tokens_issued")
            return {"bootstrap_room": room, "token": tok, "expires_at": expires}

        @router.post("/disagg/prefill")
        async def prefill(body: dict):
            room = room_of(body)
            if room is None:
                return bad("bootstrap_room: a non-negative integer is required")
            text, input_ids = body.get("text"), body.get("input_ids")
            if (text is None) == (input_ids is None) or (text is not None and not isinstance(text, str)):
                return bad("text: exactly one of text (a string) and input_ids is required")

            def work():
                pg = open_room(boot.connect(), room, 0, timeout, local)  # the decode server must come
                try:
                    try:
                        ids = engine.tokenizer.encode_prompt(text) if text is not None else input_ids
                        info = engine.cache_prefix(input_ids=ids)
                        got, k, v = engine.export_prefix(ids)
                    except Exception:
                        send_failure(pg, room, secret)  # the decode server of this room stops waiting
                        raise
                    send_kv(pg, room, got, k, v, secret)
                finally:
                    pg.close()
                count("sent")
                count("sent_tokens", len(got))
                return {"prompt_tokens": info["prompt_tokens"], "transferred_tokens": len(got)}
            try:
                return await in_thread(work)
            except ValueError as exc:  # InvalidRequestError: a bad prompt
                count("failed")
                return bad(str(exc))
            except Exception as exc:  # noqa: BLE001 - gloo: the decode side went away / timed out
                count("failed")
                return error(502, "KVTransferError",
                             f"bootstrap_room {room}: prefill or KV send failed: {type(exc).__name__}: {exc}")
    else:
        tokens = TokenCheck(secret, config.disaggregation_token_ttl) if secret is not None else None
        runner = getattr(engine, "runner", None)
        vocab = int(getattr(runner, "vocab_size", 0) or len(engine.tokenizer))
        max_tokens = min(int(getattr(runner, "context_length", 1 << 62)), int(getattr(runner, "max_total_tokens", 1 << 62)))
        if peers is not None and secret is None:
            log.warning("disaggregation_peers without a disaggregation secret: any client of this server's HTTP API "
                        "can start transfers from %s (see docs/security.md)", sorted(f"{h}:{p}" for h, p in peers))

        @router.post("/disagg/receive")
        async def receive(body: dict):
            room, host, port = room_of(body), body.get("bootstrap_host"), body.get("bootstrap_port")
            if room is None:
                return bad("bootstrap_room: a non-negative integer is required")
            if not isinstance(host, str) or not host or len(host) > 255 or not isinstance(port, int) \
                    or isinstance(port, bool) or not 0 < port < 65536:
                return bad("bootstrap_host/bootstrap_port: the prefill server's host and bootstrap port are required")
            try:
                check_peer(host, port, peers)
                if tokens is not None:
                    tokens.verify(room, body.get("transfer_token"))
            except TransferRefused as exc:
                count("refused")
                return error(403, "KVTransferRefused", f"bootstrap_room {room}: {exc}")
            dtype, shape = engine.kv_layout()

            def work():
                try:
                    store = connect_store(host, port, timeout)
                except TransferError:
                    count("connect_failed")
                    raise
                pg = open_room(store, room, 1, timeout, gloo_host(host))
                try:
                    ids, k, v = recv_kv(pg, room, dtype, shape, vocab, max_tokens, secret)
                except TransferError as exc:
                    if "failed this request's prefill" not in str(exc):
                        count("invalid")
                    raise
                finally:
                    pg.close()  # a receiver that stops closes its connections: the sender fails at once
                cached = engine.import_prefix(ids, k, v) if ids else 0
                count("received")
                count("received_tokens", len(ids))
                return {"cached_tokens": cached, "received_tokens": len(ids)}
            try:
                return await in_thread(work)
            except ValueError as exc:
                count("failed")
                return bad(str(exc))
            except Exception as exc:  # noqa: BLE001 - TransferError, gloo's timeout / closed connection
                count("failed")
                return error(502, "KVTransferError",
                             f"bootstrap_room {room}: receiving the KV failed: {type(exc).__name__}: {exc}")

    @router.get("/disagg/stats")
    async def disagg_stats():
        """This half's transfer counters: ``sent``/``sent_tokens``/``tokens_issued`` (prefill) or
        ``received``/``received_tokens``/``refused`` (403: peer or token)/``connect_failed``
        (peer unreachable in time)/``invalid`` (payload rejected) (decode), and ``failed``."""
        with stats_lock:
            return {"disaggregation_mode": mode, **stats}
    return router
