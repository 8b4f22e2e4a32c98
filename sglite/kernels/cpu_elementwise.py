"""Fused C++ CPU kernels for the elementwise chain around the GEMMs (``csrc/cpu_elementwise.cpp``).

``add_rms_norm(x, residual, weight, eps)`` → ``(s, out)``: the residual add and the RMSNorm that
follows it (Zhang & Sennrich 2019) in one pass over each row: ``s = x + residual`` (rounded to the
dtype, as torch's add) and ``out = rmsnorm(s) * weight`` with torch's ``F.rms_norm`` rounding
(``dtype(s * rsqrt(mean(s^2) + eps) * weight)`` in float32, rounded once); ``residual=None`` is the
plain RMSNorm (``s`` is then an empty tensor). x, residual: [M, H] float32 | bfloat16, unit stride
along H; weight [H] contiguous, of x's dtype, or float32 with a bf16 x: then the norm is the float32
one of x's exact float32 values, rounded once to bf16 (the bits of ``rms_norm(x.float(), weight)
.to(bf16)`` without the two copies; Gemma's float32 norms). The sum of squares is float32 with a fixed order
(16 lanes, element i to lane i % 16, then one fixed tree), so a row's bits depend only on that
row: batch-invariant. It differs from torch's reduction order, so ``out`` agrees with
``F.rms_norm`` to the dtype's rounding (float32: ~1e-7 relative), not bit for bit.

``rope_store_kv(qk, v, cos, sin, k_buffer, v_buffer, out_cache_loc, num_q_heads)`` → ``q``:
rotate-half RoPE (Su et al. 2021, "RoFormer", eq. 34, in HF's rotate-half layout) of the query and
key heads of the fused projection ``qk`` [N, Hq+Hkv, D] with ``cos``/``sin`` [N, D/2], returning
the rotated queries [N, Hq, D] (contiguous) and writing the rotated keys and ``v`` [N, Hkv, D]
into the pool slots ``out_cache_loc`` [N] int64 of ``k_buffer``/``v_buffer`` [S, Hkv, D] (any
strides, unit stride along D: the head-major pool works). Every product and sum is rounded to the
dtype exactly as ``x1 * c - x2 * s`` in torch, so the result is bit-identical to
:func:`.reference.rope_store_kv`. All tensors share one dtype, float32 or bfloat16.

``argmax_rows(x)`` → ``[B] int64``: each row's greedy pick over ``x`` [B, V] float32 (unit stride
along V): the first index of the row's maximum, a NaN counting as the maximum (the first NaN wins)
-- exactly ``x.argmax(dim=-1)`` / numpy's ``argmax``, whatever the thread count. The vocabulary is
split into one contiguous share per thread (the caller's torch thread count, on the decode pool of
``csrc/thread_pool.h``): at a 48-row decode step of a 49,152-token vocabulary (9.4 MB of logits
written by the LM head's two threads) numpy's one-thread argmax left the second core idle.

``dequant_rows(w, ids, dtype)`` → ``[len(ids), K]``: rows ``ids`` of a group-quantized
:class:`~.quant_linear.QuantLinearWeight` (4- or 8-bit codes, row or 16-row tiled layout, float32 /
float16 scales and mins, no input permutation) as ``float32(code) * scale (+ min)`` with each
product and sum rounded in float32, cast to ``dtype`` (float32 / bfloat16): the bits of
:meth:`~.quant_linear.QuantLinearWeight.rows_reference`'s torch ops in one call (the embedding
lookup of a quantized table, once per decode step: ~130 us of a dozen torch ops at 48 rows).

Errors: ValueError naming the argument for shapes, strides or dtypes outside the contract;
IndexError for a slot outside the pool. Threads: ``at::parallel_for`` over rows (tokens).

Build: :func:`.cpu_build.load_cpp` with ``-O3 -march=native -ffp-contract=off`` (the code computes
what it says: no compiler-fused multiply-adds), cached on disk. When the build fails, one warning is
logged and both functions run the torch reference (:func:`.reference.add_rms_norm`,
:func:`.reference.rope_store_kv`); inputs outside the kernel's dtypes or devices go there too.
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
    """The compiled ops namespace (built once per process, cached on disk), or None after one
    logged warning."""
    return load_cpp("sglite_cpu_elementwise", read_source("cpu_elementwise.cpp"),
                    ("-O3", "-march=native", "-ffp-contract=off"), ops_namespace="sglite_cpu_elementwise")


def available() -> bool:
    """True when the extension compiled (or was already built) and loaded."""
    return load() is not None


def norm_supported(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor) -> bool:
    """Whether :func:`add_rms_norm`'s kernel covers these inputs (CPU, 2-D, one float32/bf16 dtype,
    or bf16 x with a float32 weight; unit stride along H)."""
    return (x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() == 2 and x.stride(-1) == 1
            and (weight.dtype == x.dtype or (x.dtype == torch.bfloat16 and weight.dtype == torch.float32))
            and weight.dim() == 1
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape
                                      and residual.stride(-1) == 1)))


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rmsnorm(s) * weight)`` with ``s = x + residual`` (module docstring); x [M, H]. Without
    ``residual`` s is ``x`` itself. Falls back to :func:`.reference.add_rms_norm`."""
    ops = load()
    if ops is None or not norm_supported(x, residual, weight):
        return reference.add_rms_norm(x, residual, weight, eps)
    s, out = ops.add_rms_norm(x, residual, weight.contiguous(), float(eps))
    return (x if residual is None else s), out


def rope_supported(qk: torch.Tensor, k_buffer, v_buffer) -> bool:
    """Whether :func:`rope_store_kv`'s kernel covers these inputs (CPU tensors of one float32/bf16
    dtype, plain tensor pools)."""
    return (isinstance(k_buffer, torch.Tensor) and type(k_buffer) is torch.Tensor
            and type(v_buffer) is torch.Tensor and qk.device.type == "cpu" and qk.dtype in _DTYPES
            and k_buffer.dtype == qk.dtype and v_buffer.dtype == qk.dtype and k_buffer.device.type == "cpu")


def rope_store_kv(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_buffer: torch.Tensor, v_buffer: torch.Tensor, out_cache_loc: torch.Tensor,
                  num_q_heads: int) -> torch.Tensor:
    """Rotated queries [N, Hq, D]; rotated keys and v stored at ``out_cache_loc`` (module
    docstring). Falls back to :func:`.reference.rope_store_kv`."""
    ops = load()
    if (ops is None or not rope_supported(qk, k_buffer, v_buffer) or v.dtype != qk.dtype
            or cos.dtype != qk.dtype or sin.dtype != qk.dtype):
        return reference.rope_store_kv(qk, v, cos, sin, k_buffer, v_buffer, out_cache_loc, num_q_heads)
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    return ops.rope_store_kv(qk, v, cos, sin, k_buffer, v_buffer,
                             out_cache_loc.to(torch.int64).contiguous(), int(num_q_heads))


def argmax_supported(x: torch.Tensor) -> bool:
    """Whether :func:`argmax_rows`' kernel covers ``x``: a CPU float32 [B, V] tensor (V >= 1)
    with unit stride along V."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] >= 1
            and x.stride(1) == 1 and not x.requires_grad)


def argmax_rows(x: torch.Tensor, threads: Optional[int] = None) -> torch.Tensor:
    """[B] int64: the first index of each row's maximum (NaN as the maximum), as
    :func:`.reference.argmax_rows` bit for bit, split over ``threads`` (default: torch's intra-op
    count) threads. Falls back to the reference outside :func:`argmax_supported` or without a build."""
    ops = load()
    if ops is None or not argmax_supported(x):
        return reference.argmax_rows(x)
    return ops.argmax_rows(x, int(threads or torch.get_num_threads()))


def dequant_rows(w, ids: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Rows ``ids`` [M] of the quantized weight ``w`` dequantized to ``dtype`` [M, K] (module
    docstring), or None when the kernel does not cover ``w`` (an input permutation, a non-CPU
    weight, another dtype or code width) or did not build: the caller then runs the reference.
    Raises IndexError for an id outside ``[0, N)``."""
    ops = load()
    if (ops is None or w.perm is not None or w.bits not in (4, 8) or dtype not in _DTYPES
            or w.qweight.device.type != "cpu" or not w.qweight.is_contiguous()
            or w.scales.dtype not in (torch.float32, torch.float16)
            or (w.mins is not None and w.mins.dtype != w.scales.dtype)):
        return None
    ids = ids.reshape(-1)
    if ids.dtype != torch.int64 or not ids.is_contiguous():
        ids = ids.to(torch.int64).contiguous()
    return ops.dequant_rows(w.qweight, w.scales.contiguous(), None if w.mins is None else w.mins.contiguous(), ids,
                            int(w.bits), int(w.group_size), int(w.in_features), bool(w.tiled), dtype)
