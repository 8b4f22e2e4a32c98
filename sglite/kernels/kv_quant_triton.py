"""Triton decode attention over an int8 / int4 KIVI-quantized KV pool (CUDA; tested under
``TRITON_INTERPRET=1``, and compiled for sm_90 by :mod:`.triton_compile_check`).

Same contract as :func:`.kv_quant.decode_attention` (the torch reference): q [B, Hq, D] float32 /
bfloat16 / float16, a :class:`.kv_quant.QuantKVLayer` of kind int8 / int4 (codes [S, Hkv, Dq]
uint8, key scales [S/G, Hkv, 2, D] float16, value scales [S, Hkv, 2] float16, residual windows
[R, G, Hkv, D]), req_to_token [R, Lmax] int32, rows / seq_lens [B] int64 → [B, Hq, D] in q's dtype.

One program per (request, KV head) walks the request's slots in blocks of ``BLOCK_N`` tokens with
FlashAttention-2's online softmax (Dao 2023, §3.1), all query heads of the GQA group at once;
positions below the row's quantized boundary dequantize codes in registers (keys: per-channel
scale and minimum of the slot's group ``slot // G``; values: the token's scale and minimum), the
rest read the residual window (row ``position % G``). Float32 arithmetic. Rows of a short extend
whose own group the step sealed (:func:`.kv_quant.needs_stash`) are redone by the reference.
Head dims that are not powers of two go to the reference as well.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import kv_quant
from .triton_utils import next_pow2


@triton.jit
def _qdecode_kernel(Q, KD, VD, KS, VS, RK, RV, RT, Rows, Lens, Sealed, Out, sm_scale,
                    sq_b, sq_h, skd_s, skd_h, svd_s, svd_h, sks_g, sks_h, svs_s, svs_h,
                    srk_r, srk_t, srk_h, srt_r, so_b, so_h,
                    QG: tl.constexpr, BLOCK_QG: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
                    BITS: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(Rows + b)
    L = tl.load(Lens + b)
    Ls = tl.minimum(tl.load(Sealed + b), L)
    offs_g = tl.arange(0, BLOCK_QG)
    gmask = offs_g < QG
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * sq_b + (h * QG + offs_g)[:, None] * sq_h + offs_d[None, :], mask=gmask[:, None],
                other=0.0).to(tl.float32) * sm_scale  # [QG, D]
    if BITS == 8:
        code_off = offs_d
    else:
        code_off = offs_d % (D // 2)
    m_i = tl.full([BLOCK_QG], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_QG], tl.float32)
    acc = tl.zeros([BLOCK_QG, D], tl.float32)
    for start in range(0, L, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        tmask = t < L
        sealed = t < Ls
        qmask = (tmask & sealed)[:, None]
        rmask = (tmask & (t >= Ls))[:, None]
        slot = tl.load(RT + row * srt_r + t, mask=tmask, other=0).to(tl.int64)
        gid = slot // GROUP
        kb = tl.load(KD + slot[:, None] * skd_s + h * skd_h + code_off[None, :], mask=qmask, other=0).to(tl.int32)
        vb = tl.load(VD + slot[:, None] * svd_s + h * svd_h + code_off[None, :], mask=qmask, other=0).to(tl.int32)
        if BITS == 4:
            hi = (offs_d >= D // 2)[None, :]
            kb = tl.where(hi, kb >> 4, kb & 15)
            vb = tl.where(hi, vb >> 4, vb & 15)
        ksc = tl.load(KS + gid[:, None] * sks_g + h * sks_h + offs_d[None, :], mask=qmask, other=0.0).to(tl.float32)
        kmn = tl.load(KS + gid[:, None] * sks_g + h * sks_h + D + offs_d[None, :], mask=qmask, other=0.0).to(tl.float32)
        vsc = tl.load(VS + slot * svs_s + h * svs_h, mask=tmask & sealed, other=0.0).to(tl.float32)
        vmn = tl.load(VS + slot * svs_s + h * svs_h + 1, mask=tmask & sealed, other=0.0).to(tl.float32)
        roff = row * srk_r + (t % GROUP)[:, None] * srk_t + h * srk_h + offs_d[None, :]
        kr = tl.load(RK + roff, mask=rmask, other=0.0).to(tl.float32)
        vr = tl.load(RV + roff, mask=rmask, other=0.0).to(tl.float32)
        k = tl.where(sealed[:, None], kb.to(tl.float32) * ksc + kmn, kr)  # [N, D]
        v = tl.where(sealed[:, None], vb.to(tl.float32) * vsc[:, None] + vmn[:, None], vr)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [QG, N]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + b * so_b + (h * QG + offs_g)[:, None] * so_h + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=gmask[:, None])


def supported(q: torch.Tensor, layer: kv_quant.QuantKVLayer) -> bool:
    """Whether the kernel covers these inputs (int8 / int4 layer, power-of-two head dim, unit
    strides along D, contiguous scales and residuals)."""
    D = layer.head_dim
    return (layer.kind in kv_quant.INT_KINDS and D >= 16 and D & (D - 1) == 0 and q.stride(-1) == 1
            and layer.k_data.stride(-1) == 1 and layer.v_data.stride(-1) == 1 and layer.k_scale.is_contiguous()
            and layer.v_scale.stride(-1) == 1 and layer.res_k.is_contiguous() and layer.res_v.is_contiguous())


def decode_attention(q: torch.Tensor, layer: kv_quant.QuantKVLayer, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                     *, block_n: int = 32) -> torch.Tensor:
    """See the module docstring; falls back to the reference for uncovered inputs."""
    if not supported(q, layer):
        return kv_quant.decode_attention(q, layer, req_to_token, req_pool_indices, seq_lens, sm_scale)
    B, Hq, D = q.shape
    Hkv = layer.k_data.shape[1]
    rows = req_pool_indices.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    sealed = layer.sealed_lens(rows).contiguous()
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    if B:
        rt = req_to_token if req_to_token.stride(-1) == 1 else req_to_token.contiguous()
        kd, vd, ks, vs, rk = layer.k_data, layer.v_data, layer.k_scale, layer.v_scale, layer.res_k
        _qdecode_kernel[(B, Hkv)](
            q, kd, vd, ks, vs, rk, layer.res_v, rt, rows, lens, sealed, out, float(sm_scale),
            q.stride(0), q.stride(1), kd.stride(0), kd.stride(1), vd.stride(0), vd.stride(1),
            ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), rk.stride(0), rk.stride(1), rk.stride(2),
            rt.stride(0), out.stride(0), out.stride(1),
            QG=Hq // Hkv, BLOCK_QG=next_pow2(Hq // Hkv), D=D, GROUP=layer.group, BITS=layer.bits, BLOCK_N=block_n)
    stash = kv_quant.needs_stash(layer, rows, lens)
    if bool(stash.any()):
        i = stash.nonzero().squeeze(1)
        out[i] = kv_quant.decode_attention(q[i], layer, req_to_token, rows[i], lens[i], sm_scale)
    return out
