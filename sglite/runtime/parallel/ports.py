"""Choosing a free TCP port to hand to another process: the tensor-parallel rendezvous
(``dist_init_addr``), the P/D bootstrap store, a server subprocess, the router's workers.
No torch (the server launcher and the router import it)."""
from __future__ import annotations

import random
import socket

__all__ = ["free_port"]


def _ephemeral_low() -> int:
    """The lowest local port the kernel gives outgoing connections (Linux), else IANA's 49152."""
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``, for a port number that must be handed
    to another process (a bootstrap store, ``dist_init_addr``, a server subprocess).

    Chosen at random *below* the kernel's ephemeral range where there is room: a port from
    ``bind(0)`` comes from that range, which every outgoing connection (an HTTP client, a
    ``TCPStore`` client) also draws from, so it can be taken before the caller binds it. Still a
    race with other processes; a server in this process binds first (:func:`bind_listener`)."""
    lo = _ephemeral_low()
    if lo > 11000:
        rng = random.SystemRandom()
        for _ in range(64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, rng.randrange(10000, lo)))
                except OSError:
                    continue
                return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
