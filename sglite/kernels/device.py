"""What the machine offers the kernels: the probes every other kernels module asks (a leaf of
``sglite.kernels``: it imports nothing of sglite, so the dispatcher, the ``linear`` registry and
every implementation can ask it without importing one another).

:func:`triton_available`: whether ``import triton`` succeeds (asked once per process; CUDA ops
consult it on every call). :func:`cpu_flags`: the CPU's feature flags, which decide the C++
builds (AVX-512-BF16 GEMV, VNNI int8 GEMV) and are hashed into every build tag.
"""
from __future__ import annotations

import functools
import importlib


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

