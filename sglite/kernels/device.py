"""What the machine offers the kernels: the probes every other kernels module asks (a leaf of
``sglite.kernels``: it imports nothing of sglite, so the dispatcher, the ``linear`` registry and
every implementation can ask it without importing one another).

:func:`triton_available`: whether ``import triton`` succeeds (asked once per process; CUDA ops
consult it on every call). :func:`cpu_flags`: the CPU's feature flags, which decide the C++
builds (AVX-512-BF16 GEMV, VNNI int8 GEMV) and are hashed into every build tag.
:func:`serial_torch`: torch's own ops on the calling thread only (the glue between the C++ kernels).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Iterator

import torch


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether triton imports here (asked once per process; any import error counts as absent)."""
    try:
        importlib.import_module("triton")
        return True
    except Exception:
        return False


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on Arm),
    e.g. ``"avx512_bf16"``; empty when the file is unreadable (non-Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@contextlib.contextmanager
def serial_torch() -> Iterator[None]:
    """Run the torch ops inside on the calling thread only (``torch.set_num_threads(1)``, the old
    count restored on exit; ~0.3 us a pair). For the small torch glue between sglite's C++ kernels
    (row gathers, dtype casts, concatenations, RoPE table lookups): a torch op above its grain size
    splits across torch's OpenMP team, and when another process holds a core the team's second
    thread waits for a scheduler slice, so a 0.05 ms copy took 10-15 ms on the shared 2-core
    machine (2026-12-06). sglite's own kernels read the thread count per call
    (``csrc/thread_pool.h``): call none of them inside, or they run on one thread too."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
