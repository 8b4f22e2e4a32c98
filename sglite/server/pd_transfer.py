"""The wire of prefill/decode KV transfers (:mod:`sglite.server.disaggregation` serves the routes):
the shared secret, one-time transfer tokens, the decode server's peer check, the bootstrap store
(bound to one interface) and its bounded client, the room handshake and the checked payload.
Nothing received is unpickled: a fixed int64 header, a 32-byte peer proof and raw tensors."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import stat
import struct
import threading
import time
from datetime import timedelta
from typing import Optional

import torch

from ..errors import InvalidRequestError

log = logging.getLogger("sglite.disaggregation")

MODES = ("null", "prefill", "decode")
TRANSFER_TIMEOUT = timedelta(seconds=600)  # a decode server may wait for a whole queued prefill
TRANSFER_THREADS = 64  # transfers in flight per server (each blocks a thread until its peer comes)
HEADER_MAGIC = 0x53474C5044_02  # "SGLPD", wire version 2
MAC_BYTES = 32
DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
SECRET_ENV = "SGLITE_DISAGGREGATION_SECRET"
MIN_SECRET_BYTES = 16
LOOPBACK = "127.0.0.1"


class TransferError(RuntimeError):
    """A KV transfer that did not happen (HTTP 502): the prefill server failed the request's
    prefill (it sends a failure header), the peer could not be reached within
    ``disaggregation_connect_timeout``, it sent a payload that does not fit this server (layout,
    dtype, token count, an id outside the vocabulary, a non-finite value), or the connection
    broke / timed out (gloo's error)."""


class TransferRefused(RuntimeError):
    """A transfer this server will not attempt (HTTP 403): the bootstrap address is not an allowed
    peer, or the transfer token is missing, forged, expired or already used."""


# ---------------------------------------------------------------- secret, tokens, peers
def load_secret(path: Optional[str]) -> Optional[bytes]:
    """The deployment's shared secret: the stripped content of ``path`` when given, else the
    environment variable ``SGLITE_DISAGGREGATION_SECRET``; None when neither is set.

    Raises:
        InvalidRequestError: the file cannot be read, or the secret is shorter than 16 bytes
            (field ``disaggregation_secret_file``).
    """
    field = "disaggregation_secret_file"
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise InvalidRequestError(f"{field}: cannot read {path!r}: {exc.strerror}", field=field) from None
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning("%s: %s is readable by other users (chmod 600 it)", field, path)
    else:
        env = os.environ.get(SECRET_ENV)
        if not env:
            return None
        secret = env.strip().encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise InvalidRequestError(f"{field}: the secret ({'file ' + repr(path) if path else SECRET_ENV}) has "
                                  f"{len(secret)} bytes, at least {MIN_SECRET_BYTES} are required", field=field)
    return secret


def _token_mac(secret: bytes, room: int, expires: int) -> str:
    return hmac.new(secret, b"sglite-pd-token\0%d\0%d" % (room, expires), hashlib.sha256).hexdigest()


def issue_token(secret: bytes, room: int, ttl: float, now: Optional[float] = None) -> tuple[str, int]:
    """A transfer token for ``room``: ``"<expires>.<hex HMAC-SHA256(secret, room, expires)>"``,
    valid ``ttl`` seconds. Returns (token, expires as Unix seconds)."""
    expires = int((time.time() if now is None else now) + ttl) + 1
    return f"{expires}.{_token_mac(secret, int(room), expires)}", expires


def peer_proof(secret: Optional[bytes], room: int) -> torch.Tensor:
    """The 32 bytes a prefill server sends after its header to show it holds ``secret``
    (HMAC-SHA256 over the room); zeros without a secret."""
    if secret is None:
        return torch.zeros(MAC_BYTES, dtype=torch.uint8)
    mac = hmac.new(secret, b"sglite-pd-peer\0%d" % int(room), hashlib.sha256).digest()
    return torch.frombuffer(bytearray(mac), dtype=torch.uint8)


class TokenCheck:
    """Decode side: verifies transfer tokens (constant time) and remembers the rooms already
    used until their tokens expire, so each token opens one transfer."""

    def __init__(self, secret: bytes, ttl: float):
        self.secret, self.ttl = secret, ttl
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    def verify(self, room: int, token, now: Optional[float] = None) -> None:
        """Raises TransferRefused unless ``token`` is a valid, unexpired, unused token of ``room``."""
        now = time.time() if now is None else now
        if not isinstance(token, str) or not token:
            raise TransferRefused("transfer_token: required (this decode server has a disaggregation secret; "
                                  "the router obtains it from the prefill server's /disagg/token)")
        exp_s, _, mac = token.partition(".")
        if not exp_s.isdigit() or len(exp_s) > 12:
            raise TransferRefused("transfer_token: malformed")
        expires = int(exp_s)
        if not hmac.compare_digest(mac.encode(), _token_mac(self.secret, room, expires).encode()):
            raise TransferRefused("transfer_token: invalid for this bootstrap_room (is the "
                                  "disaggregation secret the same on both servers?)")
        if expires < now:
            raise TransferRefused(f"transfer_token: expired {now - expires:.0f} s ago "
                                  f"(disaggregation_token_ttl={self.ttl:g} s)")
        if expires > now + 2 * self.ttl + 1:  # issued for far longer than this server allows
            raise TransferRefused(f"transfer_token: expires in {expires - now:.0f} s, more than "
                                  f"disaggregation_token_ttl={self.ttl:g} s (clocks apart?)")
        with self._lock:
            for r in [r for r, e in self._used.items() if e < now]:
                del self._used[r]
            if room in self._used:
                raise TransferRefused(f"transfer_token: bootstrap_room {room} was already used")
            self._used[room] = expires


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (no name is resolved)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_peer(host: str, port: int, peers: Optional[frozenset]) -> None:
    """Raises TransferRefused unless ``host:port`` is in ``peers`` (from
    :func:`~sglite.config.parse_peers`), or, when ``peers`` is None, ``host`` is a loopback address."""
    if peers is None:
        if not is_loopback(host):
            raise TransferRefused(f"bootstrap_host: {host}:{port} is not a loopback address and this decode server "
                                  "has no --disaggregation-peers; list the prefill servers' bootstrap addresses "
                                  "there (host:port, comma-separated) to receive KV from another machine")
    elif (host.strip("[]").lower(), port) not in peers:
        raise TransferRefused(f"bootstrap_host/bootstrap_port: {host}:{port} is not in this decode server's "
                              "--disaggregation-peers")


# ---------------------------------------------------------------- the transfer
class Room:
    """One transfer's 2-rank gloo group (this side's ``rank``: prefill 0, decode 1). :meth:`close`
    drops the group, which closes its connections: a peer blocked sending to a receiver that gave
    up fails at once ("connection closed by peer") instead of at ``TRANSFER_TIMEOUT``."""

    def __init__(self, pg, room: int, rank: int):
        self._pg, self.room, self.rank = pg, room, rank

    def send(self, t: torch.Tensor) -> None:
        """Send ``t`` to the other side (blocks until it is received)."""
        self._pg.send([t], 1 - self.rank, 0).wait()

    def recv(self, t: torch.Tensor) -> torch.Tensor:
        """Fill ``t`` (preallocated) from the other side."""
        self._pg.recv([t], 1 - self.rank, 0).wait()
        return t

    def close(self) -> None:
        """Drop the group (idempotent)."""
        self._pg = None


def open_room(store, room: int, rank: int, connect_timeout: float, host: Optional[str] = None) -> Room:
    """Meet the other server in room ``room`` on ``store`` (each side announces itself and waits at
    most ``connect_timeout`` seconds for the other), then the 2-rank gloo group of the transfer
    (ops time out after ``TRANSFER_TIMEOUT``). ``host``: the address gloo listens on (loopback for
    a loopback peer). Raises TransferError when the peer does not come in time."""
    import torch.distributed as dist

    from ..runtime.parallel.control import gloo_group

    hello = dist.PrefixStore(f"sglite/pd-hello/{int(room)}", store)
    hello.set(str(rank), b"1")
    try:
        hello.wait([str(1 - rank)], timedelta(seconds=connect_timeout))
    except Exception as exc:  # noqa: BLE001 - DistStoreError: the wait timed out
        side = "decode" if rank == 0 else "prefill"
        raise TransferError(f"the {side} server did not join bootstrap_room {room} within "
                            f"{connect_timeout:g} s (disaggregation_connect_timeout)") from exc
    return Room(gloo_group(dist.PrefixStore(f"sglite/pd/{int(room)}", store), rank, 2, TRANSFER_TIMEOUT, host),
                int(room), rank)


def _header(n: int, L: int = 0, H: int = 0, D: int = 0, dtype=None) -> torch.Tensor:
    return torch.tensor([HEADER_MAGIC, n, L, H, D, DTYPE_CODES.get(dtype, 0), 0, 0], dtype=torch.int64)


def send_kv(pg: Room, room: int, ids: list[int], k: torch.Tensor, v: torch.Tensor,
            secret: Optional[bytes] = None) -> None:
    """Prefill side of room ``room`` (``pg`` from :func:`open_room`, rank 0): header, peer proof,
    ids, K, V to rank 1 (blocks until received)."""
    L, n, H, D = k.shape
    for t in (_header(n, L, H, D, k.dtype), peer_proof(secret, room), torch.tensor(ids, dtype=torch.int64),
              k.contiguous(), v.contiguous()):
        if t.numel():
            pg.send(t)


def send_failure(pg: Room, room: int, secret: Optional[bytes] = None) -> None:
    """Prefill side of room ``room`` when its prefill failed: a header with ``n = -1``, so the
    waiting decode server stops at once (:class:`TransferError`) instead of at the timeout."""
    for t in (_header(-1), peer_proof(secret, room)):
        pg.send(t)


def recv_kv(pg: Room, room: int, dtype: torch.dtype, shape: tuple[int, int, int], vocab_size: int,
            max_tokens: int, secret: Optional[bytes] = None):
    """Decode side of room ``room`` (``pg`` from :func:`open_room`, rank 1): (ids, K, V), each
    checked before it is returned. ``shape`` = this pool's (L, Hkv, D); ``max_tokens``: the most
    tokens one prefix may have here (context length, pool size).

    Raises:
        TransferError: a failure header; not an sglite v2 peer; a wrong peer proof (with
            ``secret``); another layout or dtype; ``n`` above ``max_tokens``; an id outside
            ``[0, vocab_size)``; a non-finite K/V value.
    """
    hdr = torch.zeros(8, dtype=torch.int64)
    pg.recv(hdr)
    magic, n, L, H, D, code = hdr.tolist()[:6]
    if magic != HEADER_MAGIC:
        raise TransferError(f"bootstrap_room {room}: the peer's header is not sglite's P/D wire format v2")
    proof = torch.zeros(MAC_BYTES, dtype=torch.uint8)
    pg.recv(proof)
    if secret is not None and not hmac.compare_digest(bytes(proof.tolist()), bytes(peer_proof(secret, room).tolist())):
        raise TransferError(f"bootstrap_room {room}: the peer did not prove it holds the disaggregation secret")
    if n < 0:
        raise TransferError(f"bootstrap_room {room}: the prefill server failed this request's prefill")
    if (L, H, D) != tuple(shape) or code != DTYPE_CODES.get(dtype, -1):
        theirs = next((str(d).replace("torch.", "") for d, c in DTYPE_CODES.items() if c == code), f"code {code}")
        raise TransferError(f"bootstrap_room {room}: the prefill server's KV is (layers, heads, dim)={L, H, D} "
                            f"{theirs}, this server's {tuple(shape)} {str(dtype).replace('torch.', '')}: "
                            "not the same model and dtype")
    if n > max_tokens:
        raise TransferError(f"bootstrap_room {room}: {n} tokens announced, this server holds at most {max_tokens}")
    if n == 0:
        return [], None, None
    ids = torch.zeros(n, dtype=torch.int64)
    pg.recv(ids)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise TransferError(f"bootstrap_room {room}: token id {lo if lo < 0 else hi} outside the vocabulary "
                            f"[0, {vocab_size})")
    k, v = torch.empty(L, n, H, D, dtype=dtype), torch.empty(L, n, H, D, dtype=dtype)
    for name, t in (("K", k), ("V", v)):
        pg.recv(t)
        if not bool(torch.isfinite(t).all()):
            raise TransferError(f"bootstrap_room {room}: the received {name} has non-finite values")
    return ids.tolist(), k, v


_STORE_VALIDATE, _STORE_PING, _STORE_MAGIC = 0, 13, 0x3C85F7CE  # torch's TCPStore wire protocol


def ping_store(host: str, port: int, timeout: float) -> None:
    """Check within ``timeout`` seconds that ``host:port`` answers as a torch ``TCPStore`` (its
    validate + ping queries; the answer must echo a random nonce). torch's own client retries a
    closed port for several timeouts and waits forever on a port that accepts but never answers;
    this check bounds both. Raises OSError (ConnectionError, socket.timeout) otherwise."""
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, port), timeout=timeout) as c:
        nonce = int.from_bytes(os.urandom(4), "little")
        c.sendall(struct.pack("=BI", _STORE_VALIDATE, _STORE_MAGIC) + struct.pack("=BI", _STORE_PING, nonce))
        got = b""
        while len(got) < 4:
            c.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = c.recv(4 - len(got))
            if not chunk:
                raise ConnectionError("the peer closed the connection: not a bootstrap store")
            got += chunk
    if struct.unpack("=I", got)[0] != nonce:
        raise ConnectionError("the peer's answer is not a bootstrap store's")


def connect_store(host: str, port: int, timeout: float):
    """A new ``TCPStore`` client of ``host:port``, reached within ``timeout`` seconds
    (:func:`ping_store` first). Raises TransferError."""
    import torch.distributed as dist

    try:
        ping_store(host, port, timeout)
        store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - OSError, DistNetworkError
        raise TransferError(f"cannot reach the bootstrap store {host}:{port} within {timeout:g} s "
                            f"(disaggregation_connect_timeout): {type(exc).__name__}: {str(exc)[:200]}") from None
    store.set_timeout(TRANSFER_TIMEOUT)
    return store


class Bootstrap:
    """The prefill server's bootstrap store (``TCPStore`` master on ``host:port``, listening on
    that interface only) and one client connection per transfer, on either side.

    A ``TCPStore`` client serializes its blocking waits (one operation at a time per connection),
    so two transfers rendezvousing through one shared connection can each wait for a key the
    other's peer cannot set yet: a deadlock under concurrent transfers. Hence a fresh connection
    per transfer (:meth:`connect`), the prefill server's own transfers included."""

    def __init__(self, port: Optional[int] = None, host: str = LOOPBACK, connect_timeout: float = 10.0):
        from ..runtime.parallel.control import bound_tcp_store

        self.host, self.connect_timeout = host, connect_timeout
        self.server = bound_tcp_store(host, port) if port else None
        self.port = self.server.port if self.server is not None else port

    def connect(self, host: Optional[str] = None, port: Optional[int] = None):
        """A new client of the store at ``host:port`` (default: this server's own store), reached
        within ``connect_timeout`` seconds (else TransferError)."""
        if host is None:
            host = LOOPBACK if self.host in ("0.0.0.0", "", "::") else self.host
        return connect_store(host, port or self.port, self.connect_timeout)
