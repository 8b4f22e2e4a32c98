"""The scheduler's control channel to its model workers: one gloo process group over torch.distributed.

Rank 0 is the scheduler, rank ``1 + r`` the model worker of tensor-parallel rank ``r``. The group is
built directly on a ``TCPStore`` (``dist.ProcessGroupGloo``), not as the process's default group, so
an engine process can hold several (one per engine) and the workers' default group stays free for
their tensor-parallel collectives. Messages are the typed records of
:mod:`sglite.runtime.parallel.commands` (a JSON header and raw tensor bytes, length first): nothing
received is unpickled.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from sglite.runtime.parallel.commands import Message, decode, encode

DEFAULT_TIMEOUT = timedelta(minutes=10)


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class ControlChannel:
    """Collectives between the scheduler (rank 0) and ``size - 1`` workers.

    Methods take ``alive``: a callable that raises when a worker is known to be gone, called before
    each blocking wait. A worker that dies while the scheduler waits closes its gloo connection,
    which fails the wait ("Connection closed by peer"); a hung worker blocks until ``timeout``.
    (Gloo's ``is_completed`` does not report finished receives, so waits are not polled.)
    """

    def __init__(self, store, rank: int, size: int, timeout: timedelta = DEFAULT_TIMEOUT):
        self.rank, self.size = rank, size
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("sglite/ctrl", store), rank, size, timeout)

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
