"""Triton kernel of the segmented LoRA op (contract: :func:`sglite.kernels.reference.lora_add`;
Hu et al. 2021, "LoRA"; the per-row adapter gather of S-LoRA / Punica's SGMV).

One program per (row, block of ``BLOCK_O`` outputs): it reads the row's adapter slot (rows of
slot -1 return at once), shrinks ``t = x_i · A_sᵀ`` over K in ``BLOCK_K`` tiles (A / B in their own
dtype, ``--lora-dtype``, read as float32; float32 sums, rounded to x's dtype as a matmul's output), then adds ``t · b_s`` (``b_s = B_sᵀ`` [R, O]) for its outputs (float32, the
delta rounded to the dtype before the add). The shrink is recomputed per output block: cheap for
LoRA ranks (R ≤ 64 per part) next to the expand.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import check_device, next_pow2


@triton.jit
def _lora_add_kernel(X, A, B, Y, SLOT, K, O, R, stride_x, stride_y,
                     BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ob = tl.program_id(1)
    s = tl.load(SLOT + row).to(tl.int64)
    if s >= 0:
        rr = tl.arange(0, BLOCK_R)
        t = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(X + row * stride_x + kk, mask=kk < K, other=0.0).to(tl.float32)
            ak = tl.load(A + s * R * K + rr[:, None] * K + kk[None, :],
                         mask=(rr[:, None] < R) & (kk[None, :] < K), other=0.0).to(tl.float32)
            t += tl.sum(ak * xk[None, :], axis=1)
        t = t.to(X.dtype.element_ty).to(tl.float32)
        oo = ob * BLOCK_O + tl.arange(0, BLOCK_O)
        bo = tl.load(B + s * R * O + rr[None, :] * O + oo[:, None],
                     mask=(oo[:, None] < O) & (rr[None, :] < R), other=0.0).to(tl.float32)
        d = tl.sum(bo * t[None, :], axis=1).to(X.dtype.element_ty).to(tl.float32)
        y = tl.load(Y + row * stride_y + oo, mask=oo < O, other=0.0).to(tl.float32)
        tl.store(Y + row * stride_y + oo, (y + d).to(Y.dtype.element_ty), mask=oo < O)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_lens: torch.Tensor,
             seg_slots: torch.Tensor, *, block_k: int = 64, block_o: int = 64) -> torch.Tensor:
    """``y`` [N, O] with the LoRA delta of every adapted row added in place (see
    :func:`sglite.kernels.reference.lora_add`; x [N, K], a [S, R, K], b [S, R, O]; x and y one dtype,
    a and b one dtype, read as float32: bf16 adapter weights under float32 activations work).

    Raises:
        ValueError: shapes that disagree, or ``seg_lens`` not summing to N.
    """
    N, K = x.shape
    S, R, K2 = a.shape
    if K2 != K or tuple(b.shape) != (S, R, y.shape[1]) or y.shape[0] != N:
        raise ValueError(f"lora_add: x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)} disagree (x [N, K], y [N, O], a [S, R, K], b [S, R, O])")
    check_device(y, x, a, b)
    lens = seg_lens.to(device=x.device, dtype=torch.int64)
    if int(lens.sum()) != N:
        raise ValueError(f"lora_add: seg_lens sum to {int(lens.sum())}, x has {N} rows")
    if N == 0:
        return y
    row_slot = torch.repeat_interleave(seg_slots.to(device=x.device, dtype=torch.int32), lens)  # [N]
    if x.stride(-1) != 1:
        x = x.contiguous()
    a, b = a.contiguous(), b.contiguous()
    O = y.shape[1]
    grid = (N, triton.cdiv(O, block_o))
    _lora_add_kernel[grid](x, a, b, y, row_slot, K, O, R, x.stride(0), y.stride(0),
                           BLOCK_K=block_k, BLOCK_R=next_pow2(R), BLOCK_O=block_o)
    return y
