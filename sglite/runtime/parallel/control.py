"""The scheduler's control channel to its model workers: one gloo process group over torch.distributed.

Rank 0 is the scheduler, rank ``1 + r`` the model worker of tensor-parallel rank ``r``. The group is
built directly on a ``TCPStore`` (``dist.ProcessGroupGloo``), not as the process's default group, so
an engine process can hold several (one per engine) and the workers' default group stays free for
their tensor-parallel collectives. Messages are the typed records of
:mod:`sglite.runtime.parallel.commands` (a JSON header and raw tensor bytes, length first): nothing
received is unpickled.

Rendezvous stores (:func:`open_store`): a single machine uses a ``FileStore`` in a private temporary
folder (mode 0700; no port at all) and gloo connections on the loopback interface
(:func:`gloo_group`); several machines use a ``TCPStore`` that listens on the host of
``dist_init_addr`` only (:func:`bound_tcp_store`; torch's own would listen on every interface).
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from sglite.runtime.parallel.commands import Message, decode, encode

DEFAULT_TIMEOUT = timedelta(minutes=10)


LOOPBACK = "127.0.0.1"
FILE_STORE = "file:"  # an ``addr`` of this form names a FileStore (single machine), not host:port


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def bound_tcp_store(host: str, port: int, world_size: Optional[int] = None,
                    timeout: timedelta = DEFAULT_TIMEOUT):
    """A ``TCPStore`` server that listens on ``host:port`` only (``port`` 0: a free one, read it
    from the store's ``port``). torch's ``TCPStore(host, ...)`` listens on every interface whatever
    ``host`` says; here the socket is bound first and handed over (``master_listen_fd``; the store
    owns and closes it). Raises OSError when the address cannot be bound."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(1024)
        bound = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()
    try:
        return dist.TCPStore(host, bound, world_size, True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=fd)
    except Exception:
        os.close(fd)
        raise


def private_store_dir() -> str:
    """A new temporary folder only this user can enter (mode 0700) for a single machine's
    ``FileStore``; remove it with :func:`remove_store_dir`."""
    return tempfile.mkdtemp(prefix="sglite-tp-")  # mkdtemp creates it 0700


def remove_store_dir(addr: Optional[str]) -> None:
    """Remove the folder of a ``file:`` store address made by :func:`private_store_dir`."""
    if addr and addr.startswith(FILE_STORE):
        shutil.rmtree(os.path.dirname(addr[len(FILE_STORE):]), ignore_errors=True)


def open_store(addr: str, world_size: int, is_master: bool, timeout: timedelta = DEFAULT_TIMEOUT):
    """The rendezvous store at ``addr``: ``file:<path>`` (a ``FileStore``, one machine) or
    ``host:port`` (a ``TCPStore``; the master listens on ``host`` only, see :func:`bound_tcp_store`)."""
    if addr.startswith(FILE_STORE):
        store = dist.FileStore(addr[len(FILE_STORE):], -1)
        store.set_timeout(timeout)
        return store
    host, port = parse_addr(addr)
    if is_master:
        return bound_tcp_store(host, port, world_size, timeout)
    return dist.TCPStore(host, port, world_size, False, timeout=timeout)


def gloo_group(store, rank: int, size: int, timeout: timedelta = DEFAULT_TIMEOUT, host: Optional[str] = None):
    """A ``ProcessGroupGloo`` of ``size`` ranks on ``store``. ``host``: the address its connections
    listen on (``"127.0.0.1"`` keeps a single machine's group off the network); None = gloo's
    default (the interface of this machine's host name)."""
    if host is None:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


class ControlChannel:
    """Collectives between the scheduler (rank 0) and ``size - 1`` workers.

    Methods take ``alive``: a callable that raises when a worker is known to be gone, called before
    each blocking wait. A worker that dies while the scheduler waits closes its gloo connection,
    which fails the wait ("Connection closed by peer"); a hung worker blocks until ``timeout``.
    (Gloo's ``is_completed`` does not report finished receives, so waits are not polled.)
    """

    def __init__(self, store, rank: int, size: int, timeout: timedelta = DEFAULT_TIMEOUT,
                 host: Optional[str] = None):
        self.rank, self.size = rank, size
        self.pg = gloo_group(dist.PrefixStore("sglite/ctrl", store), rank, size, timeout, host)

    @staticmethod
    def wait(work, alive: Optional[Callable[[], None]] = None) -> None:
        """Block until ``work`` completes (after ``alive()``, when given)."""
        if alive is not None:
            alive()
        work.wait()

    def broadcast_msg(self, msg: Optional[Message] = None, alive=None) -> Message:
        """Rank 0's ``msg`` (a :mod:`~sglite.runtime.parallel.commands` record) on every rank (others
        pass None): its byte length (int64 [1]), then its bytes (uint8). Raises ValueError on a
        worker when the bytes are not a valid message."""
        if self.rank == 0:
            data = encode(msg)
            n = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            n = torch.zeros(1, dtype=torch.int64)
        self.wait(self.pg.broadcast(n, 0), alive)
        if self.rank != 0:
            data = torch.empty(int(n.item()), dtype=torch.uint8)
        self.wait(self.pg.broadcast(data, 0), alive)
        return msg if self.rank == 0 else decode(data)

    def all_reduce_int(self, value: int, op, alive=None) -> int:
        """``op`` (``dist.ReduceOp.MIN``/``MAX``/``SUM``) of one int over every rank."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.wait(self.pg.allreduce([t], opts), alive)
        return int(t.item())

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Send tensor ``t`` (any shape/dtype; made contiguous) to rank ``dst``; blocks until sent."""
        self.pg.send([t.contiguous()], dst, 0).wait()

    def recv(self, t: torch.Tensor, src: int, alive=None) -> torch.Tensor:
        """Fill ``t`` (preallocated, right shape and dtype) from rank ``src``."""
        self.wait(self.pg.recv([t], src, 0), alive)
        return t

    def send_msg(self, msg: Message, dst: int) -> None:
        """Send ``msg`` (a :mod:`~sglite.runtime.parallel.commands` record) to rank ``dst``: its byte
        length (int64 [1]) then its bytes (uint8)."""
        data = encode(msg)
        self.send(torch.tensor([data.numel()], dtype=torch.int64), dst)
        self.send(data, dst)

    def recv_msg(self, src: int, alive=None) -> Message:
        """The message :meth:`send_msg` sent from rank ``src``; ``alive`` (optional) is called first
        and raises when the peer has died. Raises ValueError when the bytes are not a valid message."""
        n = self.recv(torch.zeros(1, dtype=torch.int64), src, alive)
        return decode(self.recv(torch.empty(int(n.item()), dtype=torch.uint8), src, alive))
