"""Triton batch-invariant matmul: ``linear_invariant(x, w, bias)`` = ``F.linear`` whose row i depends
only on ``x[i]``, ``w`` and ``bias``, whatever the row count M (the ``invariant`` implementation of
:func:`sglite.kernels.linear` on CUDA tensors).

Why: cuBLAS picks its kernel, tiling and split-K by (M, N, K), so a row's summation order, and its
bf16 bits, change with the batch size (Thinking Machines, "Defeating Nondeterminism in LLM
Inference", 2025, §"batch-invariant matmul"). Here one tile configuration serves every M: each
program owns a ``BLOCK_M x BLOCK_N`` output tile and walks K in ``BLOCK_K`` steps in order with one
float32 accumulator (``tl.dot``), never splitting K, so output (m, n) sees the same sequence of
operations wherever row m sits; rows past M are masked loads of zero, which touch no other row.
Cost: no split-K and no shape-tuned tiles, so small-M products leave most of the GPU idle.

On CPU tensors (only under ``TRITON_INTERPRET=1``) bf16/fp16 tiles are upcast to float32 before
``tl.dot`` (the interpreter's bf16 dot is wrong), as in :mod:`.triton_attention`.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_utils import check_device, is_interpreted

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32  # fixed for every shape: the point of the kernel


@triton.jit
def _linear_kernel(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)  # [BM]
    offs_n = pid_n * BN + tl.arange(0, BN)  # [BN]
    offs_k = tl.arange(0, BK)  # [BK]
    mm, nm = offs_m < M, offs_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        km = k0 + offs_k < K
        x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :],
                    mask=mm[:, None] & km[None, :], other=0.0)  # [BM, BK]
        w = tl.load(W + offs_n[None, :].to(tl.int64) * stride_wn + (k0 + offs_k)[:, None],
                    mask=nm[None, :] & km[:, None], other=0.0)  # [BK, BN]
        if UPCAST:  # the interpreter: an explicit k-ordered reduction (see linear_invariant)
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
    y = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def linear_invariant(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Batch-invariant ``F.linear(x, w, bias)``.

    Args:
        x: [M, K] (M >= 0), float32 / bfloat16 / float16.
        w: [N, K] of x's dtype (made contiguous along K if needed).
        bias: [N] or None.
    Returns:
        [M, N] in x's dtype; each output a float32 sum over K in BLOCK_K steps, rounded once.
    Raises:
        ValueError: mismatched shapes or dtypes.

    Under ``TRITON_INTERPRET=1`` the tile product is an explicit broadcast-multiply and sum over
    ``BLOCK_K`` instead of ``tl.dot``: the interpreter runs ``tl.dot`` as a numpy/BLAS matmul whose
    per-row summation order depends on the row's position in the tile (OpenBLAS micro-kernel edges),
    which would make the interpreted kernel row-variant for reasons that do not exist on a GPU.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear_invariant: x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, K] and [N, K]")
    if x.dtype != w.dtype:
        raise ValueError(f"linear_invariant: x is {x.dtype} but w is {w.dtype}")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"linear_invariant: bias must be [N = {w.shape[0]}], got {tuple(bias.shape)}")
    check_device(*(t for t in (x, w, bias) if t is not None))
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _linear_kernel[grid](x, w, bias if bias is not None else x, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                         HAS_BIAS=bias is not None, UPCAST=is_interpreted(x), BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                         num_warps=4, num_stages=2)
    return y
