"""C++ CPU kernel of the segmented LoRA op (``csrc/cpu_lora.cpp``; contract:
:func:`.reference.lora_add`).

``lora_add(y, x, a, b, seg_lens, seg_slots)`` adds ``(x_i · A_sᵀ) · b_s`` to every row ``i`` of
a segment of adapter slot ``s`` (Hu et al. 2021, "LoRA"; segments as S-LoRA's / Punica's SGMV),
in place, rows of slot -1 untouched. x [N, K], y [N, O] (unit stride along the last dim), a
[S, R, K], b [S, R, O] (B transposed) contiguous. x and y share one dtype (the activations), a and b
one (the adapter weights, ``--lora-dtype``), each float32 or bfloat16: bf16 weights are read as
float32. Sums in float32; the shrink result and the delta are rounded to the activation dtype as
the reference rounds them, so float32 agrees with the reference to ~1e-6 (the summation order
differs).

Errors: RuntimeError naming the argument for shapes, strides or dtypes outside the contract;
IndexError for a slot outside ``[-1, S)``. Threads: the shared pool (``csrc/thread_pool.h``) over
tiles of up to 16 rows of one segment (each A / b row is read once per tile, not once per row;
every value is computed as for one row alone, so tiling and threads do not change the result).

Build: :func:`.cpu_build.load_cpp` (``-O3 -march=native``), cached on disk; when the build fails
one warning is logged and :func:`lora_add` runs the torch reference.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import reference
from .cpu_build import load_cpp, read_source

_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def load():
    """The compiled ops namespace (built once per process, cached on disk), or None."""
    return load_cpp("sglite_cpu_lora", read_source("cpu_lora.cpp"), ("-O3", "-march=native"),
                    ops_namespace="sglite_cpu_lora")


def available() -> bool:
    """True when the extension compiled (or was already built) and loaded."""
    return load() is not None


def supported(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernel covers these inputs (CPU; x, y one float32/bf16 dtype, a, b one float32/bf16
    dtype; unit-stride rows)."""
    return (x.device.type == "cpu" and x.dtype in _DTYPES and y.dtype == x.dtype and a.dtype in _DTYPES
            and b.dtype == a.dtype and x.dim() == 2 and y.dim() == 2 and x.stride(-1) == 1 and y.stride(-1) == 1)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_lens: torch.Tensor,
             seg_slots: torch.Tensor, spans: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y`` with every adapted row's LoRA delta added in place (module docstring); falls back to
    :func:`.reference.lora_add` outside the kernel's inputs or when the build failed.

    ``spans`` (optional, [S, blocks, 3] int64, ``blocks`` dividing R): per slot and rank block of
    ``R / blocks`` rows, the rank rows in use and the output columns ``[lo, hi)`` the block writes
    (:class:`sglite.lora.pool.LoraPool`'s ``spans``); A rows and b columns outside them must be
    zero, and are skipped (the result is the same: they would add exact zeros). RuntimeError for
    entries outside the buffers."""
    ops = load()
    if ops is None or not supported(y, x, a, b):
        return reference.lora_add(y, x, a, b, seg_lens, seg_slots)
    return ops.lora_add(y, x, a.contiguous(), b.contiguous(), seg_lens, seg_slots, spans)
