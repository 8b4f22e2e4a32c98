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
build a 2-rank gloo group on it (prefill rank 0, decode rank 1) through the prefill server's store;
the transfer is torch.distributed send/recv. Payload: header ``[n, L, Hkv, D]`` int64, ids ``[n]``
int64, then K and V as ``[L, n, Hkv, D]`` in the pool dtype. Both servers must run the same model
and dtype (checked from the header); ``tp_size`` must be 1. A prefill that fails sends the header
``[-1, 0, 0, 0]`` instead, so its decode peer stops waiting (:class:`TransferError`, HTTP 502);
``GET /disagg/stats`` counts each half's transfers and failures.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from datetime import timedelta

import torch

log = logging.getLogger("sglite.disaggregation")

MODES = ("null", "prefill", "decode")
TRANSFER_TIMEOUT = timedelta(seconds=600)  # a decode server may wait for a whole queued prefill
TRANSFER_THREADS = 64  # transfers in flight per server (each blocks a thread until its peer comes)


def _room_group(store, room: int, rank: int):
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore(f"sglite/pd/{int(room)}", store), rank, 2, TRANSFER_TIMEOUT)


class TransferError(RuntimeError):
    """A KV transfer that did not happen: the prefill server failed the request's prefill (it
    sends a failure header), or the peer's connection broke / timed out (gloo's error)."""


def send_kv(store, room: int, ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Prefill side of room ``room``: header, ids, K, V to rank 1 (blocks until received)."""
    pg = _room_group(store, room, 0)
    L, n, H, D = k.shape
    for t in (torch.tensor([n, L, H, D], dtype=torch.int64), torch.tensor(ids, dtype=torch.int64),
              k.contiguous(), v.contiguous()):
        if t.numel():
            pg.send([t], 1, 0).wait()


def send_failure(store, room: int) -> None:
    """Prefill side of room ``room`` when its prefill failed: a header with ``n = -1``, so the
    waiting decode server stops at once (:class:`TransferError`) instead of at the timeout."""
    _room_group(store, room, 0).send([torch.tensor([-1, 0, 0, 0], dtype=torch.int64)], 1, 0).wait()


def recv_kv(store, room: int, dtype: torch.dtype, shape: tuple[int, int, int]):
    """Decode side of room ``room``: (ids, K, V). ``shape`` = this pool's (L, Hkv, D); a
    different model raises ValueError; a failure header raises TransferError."""
    pg = _room_group(store, room, 1)
    hdr = torch.zeros(4, dtype=torch.int64)
    pg.recv([hdr], 0, 0).wait()
    n, L, H, D = hdr.tolist()
    if n < 0:
        raise TransferError(f"bootstrap_room {room}: the prefill server failed this request's prefill")
    if (L, H, D) != tuple(shape):
        raise ValueError(f"bootstrap_room {room}: the prefill server's KV is (layers, heads, dim)={L, H, D}, "
                         f"this server's {tuple(shape)}: not the same model")
    if n == 0:
        return [], None, None
    ids = torch.zeros(n, dtype=torch.int64)
    k, v = torch.empty(L, n, H, D, dtype=dtype), torch.empty(L, n, H, D, dtype=dtype)
    for t in (ids, k, v):
        pg.recv([t], 0, 0).wait()
    return ids.tolist(), k, v


class Bootstrap:
    """The prefill server's bootstrap store (``TCPStore`` master on ``port``, all interfaces) and
    one client connection per transfer, on either side.

    A ``TCPStore`` client serializes its blocking waits (one operation at a time per connection),
    so two transfers rendezvousing through one shared connection can each wait for a key the
    other's peer cannot set yet: a deadlock under concurrent transfers. Hence a fresh connection
    per transfer (:meth:`connect`), the prefill server's own transfers included."""

    def __init__(self, port: int | None = None):
        import torch.distributed as dist

        self._dist = dist
        self.port = port
        self.server = dist.TCPStore("0.0.0.0", port, None, True, wait_for_workers=False) if port else None

    def connect(self, host: str | None = None, port: int | None = None):
        """A new client of the store at ``host:port`` (default: this server's own store)."""
        return self._dist.TCPStore(host or "127.0.0.1", port or self.port, None, False, timeout=TRANSFER_TIMEOUT)


def disaggregation_routes(engine, mode: str, bootstrap_port: int):
    """FastAPI routes of a prefill (``/disagg/prefill``) or decode (``/disagg/receive``) server."""
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse

    from concurrent.futures import ThreadPoolExecutor

    router = APIRouter()
    boot = Bootstrap(bootstrap_port if mode == "prefill" else None)
    # own threads, not asyncio's small default pool: a receive blocks until its prefill is done,
    # and prefill sends block until their receivers come; sharing a few threads could deadlock
    pool_ = ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix=f"sglite-pd-{mode}")

    async def in_thread(fn):
        return await asyncio.get_running_loop().run_in_executor(pool_, fn)

    stats = {"sent": 0, "sent_tokens": 0, "failed": 0} if mode == "prefill" else \
        {"received": 0, "received_tokens": 0, "failed": 0}
    stats_lock = threading.Lock()

    def count(key, n=1):
        with stats_lock:
            stats[key] += n

    def bad(msg):
        return JSONResponse({"error": {"message": msg, "code": 400, "type": "BadRequestError"}}, status_code=400)

    def failed(msg):
        log.warning("%s", msg)
        return JSONResponse({"error": {"message": msg, "code": 502, "type": "KVTransferError"}}, status_code=502)

    def room_of(body):
        room = body.get("bootstrap_room")
        return room if isinstance(room, int) and not isinstance(room, bool) and room >= 0 else None

    if mode == "prefill":
        @router.post("/disagg/prefill")
        async def prefill(body: dict):
            room = room_of(body)
            if room is None:
                return bad("bootstrap_room: a non-negative integer is required")
            text, input_ids = body.get("text"), body.get("input_ids")
            if (text is None) == (input_ids is None) or (text is not None and not isinstance(text, str)):
                return bad("text: exactly one of text (a string) and input_ids is required")
            ids = engine.tokenizer.encode(text) if text is not None else input_ids

            def work():
                try:
                    info = engine.cache_prefix(input_ids=ids)
                    got, k, v = engine.export_prefix(ids)
                except Exception:
                    send_failure(boot.connect(), room)  # the decode server of this room stops waiting
                    raise
                send_kv(boot.connect(), room, got, k, v)
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
                return failed(f"bootstrap_room {room}: prefill or KV send failed: {type(exc).__name__}: {exc}")
    else:
        @router.post("/disagg/receive")
        async def receive(body: dict):
            room, host, port = room_of(body), body.get("bootstrap_host"), body.get("bootstrap_port")
            if room is None:
                return bad("bootstrap_room: a non-negative integer is required")
            if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
                return bad("bootstrap_host/bootstrap_port: the prefill server's host and bootstrap port are required")
            dtype, shape = engine.kv_layout()

            def work():
                ids, k, v = recv_kv(boot.connect(host, port), room, dtype, shape)
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
                return failed(f"bootstrap_room {room}: receiving the KV failed: {type(exc).__name__}: {exc}")

    @router.get("/disagg/stats")
    async def disagg_stats():
        """This half's transfer counters: ``sent``/``sent_tokens`` (prefill) or
        ``received``/``received_tokens`` (decode), and ``failed``."""
        return {"disaggregation_mode": mode, **stats}
    return router
