"""Triton RMSNorm (Zhang & Sennrich 2019), one program per row: the batch-invariant ``rms_norm`` on
CUDA tensors (``sglite.kernels.rms_norm(..., batch_invariant=True)``).

Why: torch's CUDA reductions pick their launch configuration (threads per output, split of the
reduced dim across warps or blocks) from the number of outputs too, so a row's mean of squares may
be summed in another order when the batch changes. Here one program reduces one whole row in
``BLOCK`` = next_pow2(H) lanes with one ``tl.sum``, the same code for every row and batch size.
Arithmetic in float32: ``y = x * rsqrt(mean(x^2) + eps) * weight``, rounded once to x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import check_device, next_pow2


@triton.jit
def _rms_norm_kernel(X, W, Y, H, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    x = tl.load(X + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
    w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (x * rstd * w).to(Y.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim.

    Args:
        x: [..., H] (any leading shape; rows need unit stride along H).
        weight: [H].
        eps: added to the mean of squares.
    Returns:
        x's shape and dtype.
    Raises:
        ValueError: weight is not [H].
    """
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"rms_norm: weight must be [H = {H}], got {tuple(weight.shape)}")
    check_device(x, weight)
    x2 = x.reshape(-1, H)
    if x2.shape[0] and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, H, x2.stride(0), y.stride(0), float(eps),
                                         BLOCK=next_pow2(H), num_warps=4)
    return y.view(x.shape)
