"""Triton matmul on group-quantized weights (:class:`.quant_linear.QuantLinearWeight`): the
``quant_triton`` implementation of ``kernels.linear`` on CUDA tensors.

``linear(x, w)``: x [M, K] (bf16 / fp16 / float32) -> [M, N] in x's dtype, ``= x @ W.T + bias``.
Each program owns a ``BM x BN`` output tile and walks K one 32-channel packing block at a time:
it loads the block's codes of its ``BN`` weight rows (16 bytes per row at 4 bits: low nibbles are
channels 0..15, high nibbles 16..31; 32 bytes at 8 bits), each half's group scale and offset per
row (the same group but at group size 16, GGUF Q6_K),
dequantizes the two 16-channel halves in float32 (``s * q + m``, the spec of
:meth:`QuantLinearWeight.dequantize_stored`), rounds them to x's dtype and accumulates two
``tl.dot`` products in float32. The codes are read once per M tile (decode: once). x's columns are
gathered into stored order first when the weight has an input permutation.

On CPU tensors (only under ``TRITON_INTERPRET=1``) tiles are float32 before ``tl.dot`` (the
interpreter's bf16 dot is wrong), as in :mod:`.triton_matmul`; on the GPU float32 x uses
``input_precision="ieee"`` (no TF32).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .quant_layout import gather_input
from .triton_utils import check_device, is_interpreted

if TYPE_CHECKING:
    from .quant_linear import QuantLinearWeight

BM, BN = 16, 64


@triton.jit
def _quant_kernel(X, Q, S, Mn, Bias, Y, M, N, K, G, GS, stride_xm, stride_ym,
                  BITS: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                  IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    r16 = tl.arange(0, 16)
    mm, nm = offs_m < M, offs_n < N
    rowb = K * BITS // 8
    qrow = Q + offs_n[:, None].to(tl.int64) * rowb  # [BN, 1]
    xrow = X + offs_m[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, K, 32):
        g, g2 = kb // GS, (kb + 16) // GS  # the groups of channels 0..15 and 16..31 (differ at GS 16)
        s = tl.load(S + offs_n.to(tl.int64) * G + g, mask=nm, other=0.0)  # [BN] float32
        s2 = tl.load(S + offs_n.to(tl.int64) * G + g2, mask=nm, other=0.0)
        if BITS == 4:
            b = tl.load(qrow + kb // 2 + r16[None, :], mask=nm[:, None], other=0).to(tl.int32)  # [BN, 16]
            lo, hi = (b & 15).to(tl.float32), (b >> 4).to(tl.float32)
        else:
            lo = tl.load(qrow + kb + r16[None, :], mask=nm[:, None], other=0).to(tl.float32)
            hi = tl.load(qrow + kb + 16 + r16[None, :], mask=nm[:, None], other=0).to(tl.float32)
        wlo, whi = lo * s[:, None], hi * s2[:, None]
        if HAS_MINS:
            mv = tl.load(Mn + offs_n.to(tl.int64) * G + g, mask=nm, other=0.0)
            mv2 = tl.load(Mn + offs_n.to(tl.int64) * G + g2, mask=nm, other=0.0)
            wlo, whi = wlo + mv[:, None], whi + mv2[:, None]
        xlo = tl.load(xrow + kb + r16[None, :], mask=mm[:, None], other=0.0)  # [BM, 16]
        xhi = tl.load(xrow + kb + 16 + r16[None, :], mask=mm[:, None], other=0.0)
        if UPCAST:
            xlo, xhi = xlo.to(tl.float32), xhi.to(tl.float32)
        else:
            wlo, whi = wlo.to(xlo.dtype), whi.to(xlo.dtype)
        if IEEE:
            acc = tl.dot(xlo, tl.trans(wlo), acc, input_precision="ieee")
            acc = tl.dot(xhi, tl.trans(whi), acc, input_precision="ieee")
        else:
            acc = tl.dot(xlo, tl.trans(wlo), acc)
            acc = tl.dot(xhi, tl.trans(whi), acc)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
    y = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def linear(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    """``x @ W.T + bias`` for x [M, K] on w's device (CUDA, or CPU under the interpreter) -> [M, N]
    in x's dtype. Raises ValueError / RuntimeError for mismatched devices (see ``check_device``)."""
    w = w.untiled()  # the kernel reads the row layout
    check_device(x, w.qweight)
    xs = gather_input(x, w)
    m, n = xs.shape[0], w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    interp = is_interpreted(x)
    mins = w.mins if w.mins is not None else w.scales
    bias = w.bias if w.bias is not None else w.scales
    grid = (triton.cdiv(m, BM), triton.cdiv(n, BN))
    _quant_kernel[grid](xs, w.qweight, w.scales, mins, bias, y, m, n, w.in_features, w.in_features // w.group_size,
                        w.group_size, xs.stride(0), y.stride(0), BITS=w.bits, HAS_MINS=w.mins is not None,
                        HAS_BIAS=w.bias is not None, UPCAST=interp, IEEE=(x.dtype == torch.float32 and not interp),
                        BLOCK_M=BM, BLOCK_N=BN)
    return y
