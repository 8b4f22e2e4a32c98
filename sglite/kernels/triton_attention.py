"""Triton paged-attention kernels: KV store, flash-decoding decode attention, extend (prefill) attention.

Same signatures and semantics as :mod:`sglite.kernels.reference` (the spec); see there for the
token-level paged KV layout (``req_to_token[row, pos]`` = pool slot).

Algorithms:
  * decode: flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023): the KV
    length of each request is cut into ``num_splits`` chunks; each program computes a partial
    softmax (running max, running sum, unnormalised output, FlashAttention-2's online softmax,
    Dao 2023 §3.1) for one (request, KV head, chunk) and all query heads of that KV head's GQA
    group at once, then a second kernel merges the chunks through their log-sum-exp.
  * extend: FlashAttention-2 forward over the gathered slots, causal with an offset of
    ``prefix_len`` (a new token sees the whole cached prefix and the new tokens up to itself),
    every request of the batch in one launch (grid over request × head × query block).

All softmax arithmetic is float32. On CPU tensors (only possible under ``TRITON_INTERPRET=1``)
bf16/fp16 tiles are upcast to float32 before ``tl.dot``: the interpreter's bf16 dot is wrong.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_utils import check_device, is_interpreted, next_pow2, prev_pow2


# --------------------------------------------------------------------------------------------
# store_kv
# --------------------------------------------------------------------------------------------

@triton.jit
def _store_kv_kernel(KBuf, VBuf, Loc, K, V, N,
                     stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                     stride_kn, stride_kh, stride_vn, stride_vh,
                     D: tl.constexpr, HD: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_HD: tl.constexpr):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] token index
    tmask = offs_t < N
    offs_e = tl.arange(0, BLOCK_HD)  # [BHD] flattened (head, dim)
    emask = offs_e < HD
    h = offs_e // D
    d = offs_e % D
    slot = tl.load(Loc + offs_t, mask=tmask, other=0).to(tl.int64)  # [BT]
    m = tmask[:, None] & emask[None, :]
    row = offs_t.to(tl.int64)[:, None]
    k = tl.load(K + row * stride_kn + h[None, :] * stride_kh + d[None, :], mask=m)
    v = tl.load(V + row * stride_vn + h[None, :] * stride_vh + d[None, :], mask=m)
    tl.store(KBuf + slot[:, None] * stride_kbs + h[None, :] * stride_kbh + d[None, :],
             k.to(KBuf.dtype.element_ty), mask=m)
    tl.store(VBuf + slot[:, None] * stride_vbs + h[None, :] * stride_vbh + d[None, :],
             v.to(VBuf.dtype.element_ty), mask=m)


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, out_cache_loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter ``k, v [N, Hkv, D]`` into pool slots ``out_cache_loc [N]`` of ``k_buffer, v_buffer
    [S, Hkv, D]`` (in place, cast to the pool dtype). See :func:`reference.store_kv`.

    Raises:
        ValueError: mismatched shapes, or a last dim that is not contiguous.
    """
    check_device(k_buffer, v_buffer, out_cache_loc, k, v)
    N = out_cache_loc.shape[0]
    if k.shape != v.shape or k.shape[0] != N or k.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"store_kv: k/v shape {tuple(k.shape)} must be [N={N}, "
                         f"{k_buffer.shape[1]}, {k_buffer.shape[2]}]")
    if N == 0:
        return
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"store_kv: {name} must be contiguous in its last dim")
    Hkv, D = k_buffer.shape[1], k_buffer.shape[2]
    block_hd = next_pow2(Hkv * D)
    budget = 4096 if k_buffer.is_cuda else 65536  # elements per program
    block_t = prev_pow2(max(1, min(64 if k_buffer.is_cuda else 256, budget // block_hd)))
    loc = out_cache_loc.contiguous()
    grid = (triton.cdiv(N, block_t),)
    _store_kv_kernel[grid](k_buffer, v_buffer, loc, k, v, N,
                           k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           D=D, HD=Hkv * D, BLOCK_T=block_t, BLOCK_HD=block_hd, num_warps=4)


# --------------------------------------------------------------------------------------------
# decode attention (flash-decoding)
# --------------------------------------------------------------------------------------------

@triton.jit
def _block_scores(q, KBuf, ReqToToken, row, stride_r2t, offs_n, nmask, kvh, stride_kbs, stride_kbh, offs_d, dmask,
                  sm_scale, softcap, UPCAST: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr):
    """One key block of a request row: its KV slots [BN], the K/V load mask [BN, BD] and the scaled
    (and, with ``SOFTCAP``, soft-capped) scores of ``q`` [BQ, BD] against its keys, [BQ, BN] float32
    (masking is the caller's)."""
    slots = tl.load(ReqToToken + row * stride_r2t + offs_n, mask=nmask, other=0).to(tl.int64)
    kvmask = nmask[:, None] & dmask[None, :]
    k = tl.load(KBuf + slots[:, None] * stride_kbs + kvh * stride_kbh + offs_d[None, :],
                mask=kvmask, other=0.0)  # [BN, BD]
    if UPCAST:
        k = k.to(tl.float32)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * sm_scale
    if SOFTCAP:  # cap * tanh(s / cap), tanh(x) = 2 sigmoid(2x) - 1
        qk = softcap * (2.0 * tl.sigmoid(qk * (2.0 / softcap)) - 1.0)
    return slots, kvmask, qk


@triton.jit
def _block_values(p, VBuf, slots, kvmask, kvh, stride_vbs, stride_vbh, offs_d,
                  UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``p`` [BQ, BN] (softmax numerators, float32) times the block's values: [BQ, BD] float32."""
    v = tl.load(VBuf + slots[:, None] * stride_vbs + kvh * stride_vbh + offs_d[None, :],
                mask=kvmask, other=0.0)  # [BN, BD]
    if UPCAST:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
    elif IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return pv


@triton.jit
def _decode_partial_kernel(Q, KBuf, VBuf, ReqToToken, ReqIdx, SeqLens, MidO, MidLse, sm_scale, window, softcap,
                           stride_qb, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                           stride_r2t, stride_mob, stride_moh, stride_mos, stride_lb, stride_lh,
                           GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           UPCAST: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr,
                           SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(ReqIdx + b).to(tl.int64)
    first = 0
    if WINDOW:  # sliding window: only the last `window` positions (earlier slots are never read)
        first = tl.maximum(seq_len - window, 0)
    # chunk length: a multiple of BLOCK_N, at least BLOCK_N (short sequences use fewer chunks)
    split_len = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    gmask = offs_g < GROUP
    dmask = offs_d < D
    heads = kvh * GROUP + offs_g  # [BG] query heads of this KV head
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)  # [BG, BD]
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(KBuf.dtype.element_ty)  # tl.dot needs matching operand types

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN] positions
        nmask = offs_n < end
        slots, kvmask, qk = _block_scores(q, KBuf, ReqToToken, row, stride_r2t, offs_n, nmask, kvh, stride_kbs,
                                          stride_kbh, offs_d, dmask, sm_scale, softcap, UPCAST, IEEE, SOFTCAP)
        qk = tl.where(nmask[None, :], qk, float("-inf"))  # [BG, BN]
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BG], finite: each chunk's first position is valid
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])  # [BG, BN]
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = _block_values(p, VBuf, slots, kvmask, kvh, stride_vbs, stride_vbh, offs_d, UPCAST, IEEE)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    mo = MidO + b.to(tl.int64) * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :]
    tl.store(mo, o, mask=gmask[:, None] & dmask[None, :])
    tl.store(MidLse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=gmask)


@triton.jit
def _decode_reduce_kernel(MidO, MidLse, Out, stride_mob, stride_moh, stride_mos, stride_lb, stride_lh,
                          stride_ob, stride_oh, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                          D: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < NUM_SPLITS
    dmask = offs_d < D
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: chunk 0 always holds >= 1 token
    w = tl.exp(lse - m)  # [BS], 0 for empty chunks
    o = tl.load(MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)  # [BS, BD]
    o = tl.where(w[:, None] > 0, o, 0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=dmask)


INVARIANT_SPLITS = 8  # KV chunks per request in batch-invariant mode (independent of the batch)


def _default_num_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(4 * sms, max(1, batch * kv_heads))
    return int(min(32, max(2, next_pow2(want))))


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, sm_scale: float, window: int = 0, softcap: float = 0.0, *,
                     out: Optional[torch.Tensor] = None, num_splits: Optional[int] = None,
                     block_n: Optional[int] = None, workspace: Optional[tuple] = None,
                     batch_invariant: bool = False) -> torch.Tensor:
    """Flash-decoding attention of one new token per request over its paged KV (GQA).

    Batch invariance: a row's chunks are ``cdiv(cdiv(seq_len, num_splits), block_n) * block_n``
    positions long, a function of its own length and of ``num_splits``; by default ``num_splits``
    grows as the batch shrinks (to fill the GPU), which changes how a row's softmax is split and
    merged. ``batch_invariant=True`` fixes it at :data:`INVARIANT_SPLITS` (and ``block_n`` at its
    default), so each row's result depends only on that row.

    Args:
        q: [B, Hq, D]; k_buffer, v_buffer: [S, Hkv, D]; req_to_token: [R, Lmax] int32;
        req_pool_indices: [B] int64; seq_lens: [B] int64 (each >= 1); sm_scale: float.
        window: > 0: only each request's last ``window`` positions are read (split among the
            chunks); 0: all. softcap: > 0: ``cap * tanh(score / cap)`` before the softmax.
        out: optional [B, Hq, D] output tensor (written, returned).
        num_splits: KV chunks per request (default: enough programs to fill the GPU; 4 on CPU).
        block_n: KV positions per inner step (default 64 on GPU, 32 under the interpreter).
        workspace: optional ``(mid_o [B, Hq, num_splits, D] f32, mid_lse [B, Hq, num_splits] f32)``.
        batch_invariant: use :data:`INVARIANT_SPLITS` KV chunks whatever the batch (see above).
    Returns:
        [B, Hq, D] in q's dtype.
    Raises:
        ValueError: Hq not a multiple of Hkv, or mismatched shapes.
    """
    check_device(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens)
    B, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    if Hq % Hkv != 0:
        raise ValueError(f"decode_attention: query heads {Hq} must be a multiple of KV heads {Hkv}")
    if k_buffer.shape[2] != D or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"decode_attention: pools {tuple(k_buffer.shape)}/{tuple(v_buffer.shape)} "
                         f"do not match q head dim {D}")
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    if q.stride(-1) != 1 or k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1 or req_to_token.stride(-1) != 1:
        raise ValueError("decode_attention: q, pools and req_to_token must be contiguous in the last dim")
    interp = is_interpreted(q)
    group = Hq // Hkv
    if batch_invariant:
        num_splits = num_splits or INVARIANT_SPLITS
    splits = int(num_splits or _default_num_splits(B, Hkv, q.device))
    bn = int(block_n or (32 if interp else 64))
    bg = max(16, next_pow2(group))
    bd = next_pow2(D)
    if workspace is None:
        mid_o = torch.empty(B, Hq, splits, D, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device)
    else:
        mid_o, mid_lse = workspace
    ieee = k_buffer.dtype == torch.float32 and not interp
    _decode_partial_kernel[(B, Hkv, splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, float(sm_scale),
        int(window), float(softcap),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
        v_buffer.stride(1), req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, BLOCK_G=bg, D=D, BLOCK_D=bd, BLOCK_N=bn, NUM_SPLITS=splits,
        UPCAST=interp, IEEE=ieee, WINDOW=window > 0, SOFTCAP=softcap > 0, num_warps=4, num_stages=2)
    _decode_reduce_kernel[(B, Hq)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), out.stride(0), out.stride(1),
        NUM_SPLITS=splits, BLOCK_S=next_pow2(splits), D=D, BLOCK_D=bd, num_warps=4)
    return out


# --------------------------------------------------------------------------------------------
# extend attention (prefill over a cached prefix)
# --------------------------------------------------------------------------------------------

@triton.jit
def _extend_kernel(Q, KBuf, VBuf, Out, ReqToToken, ReqIdx, PrefixLens, ExtendLens, QStart, sm_scale, window, softcap,
                   stride_qn, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                   stride_r2t, stride_on, stride_oh,
                   GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                   IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    kvh = h // GROUP
    ext = tl.load(ExtendLens + b).to(tl.int32)
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    row = tl.load(ReqIdx + b).to(tl.int64)
    q0 = tl.load(QStart + b).to(tl.int64)
    m_start = mb * BLOCK_M

    offs_m = m_start + tl.arange(0, BLOCK_M)  # [BM] index among the new tokens
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < ext
    dmask = offs_d < D
    qrow = q0 + offs_m.to(tl.int64)
    q = tl.load(Q + qrow[:, None] * stride_qn + h * stride_qh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)  # [BM, BD]
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(KBuf.dtype.element_ty)  # tl.dot needs matching operand types
    qpos = prefix + offs_m  # [BM] absolute positions
    # keys needed by this block: the prefix and new tokens up to the block's last valid query;
    # an empty range when the block lies past this request's new tokens
    kv_end = tl.where(m_start < ext, prefix + tl.minimum(m_start + BLOCK_M, ext), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_start = 0
    if WINDOW:  # the block's first query sees keys from prefix + m_start - window + 1 on
        kv_start = tl.maximum(prefix + m_start - window + 1, 0) // BLOCK_N * BLOCK_N
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < kv_end
        slots, kvmask, qk = _block_scores(q, KBuf, ReqToToken, row, stride_r2t, offs_n, nmask, kvh, stride_kbs,
                                          stride_kbh, offs_d, dmask, sm_scale, softcap, UPCAST, IEEE, SOFTCAP)
        visible = nmask[None, :] & (offs_n[None, :] <= qpos[:, None])  # [BM, BN] causal w/ offset
        if WINDOW:
            visible = visible & (offs_n[None, :] > qpos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
        # without a window key 0 is visible to every query row, so m_new is finite from the first
        # block on; with one a row may see nothing in a block: m_new stays -inf, read as 0 (alpha
        # and p are then exp(-inf) = 0, not NaN)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = _block_values(p, VBuf, slots, kvmask, kvh, stride_vbs, stride_vbh, offs_d, UPCAST, IEEE)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + qrow[:, None] * stride_on + h * stride_oh + offs_d[None, :],
             o.to(Out.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     prefix_lens: torch.Tensor, extend_lens: torch.Tensor, sm_scale: float,
                     window: int = 0, softcap: float = 0.0, *,
                     out: Optional[torch.Tensor] = None, block_m: Optional[int] = None,
                     block_n: Optional[int] = None) -> torch.Tensor:
    """Prefill attention for new tokens over their cached prefix plus themselves (causal).

    Args:
        q: [N, Hq, D] new tokens' queries, requests concatenated; k_buffer, v_buffer: [S, Hkv, D]
        (new tokens' K/V already stored); req_to_token: [R, Lmax] int32; req_pool_indices,
        prefix_lens, extend_lens: [B] int64; sm_scale: float.
        window: > 0: a new token at position p sees keys ``p - window < s <= p`` (blocks of keys
            wholly before a query block's window are skipped, never read); 0: all.
        softcap: > 0: ``cap * tanh(score / cap)`` before the softmax.
        out: optional [N, Hq, D] output (written, returned).
        block_m, block_n: query / key tile sizes (defaults 64/64 on GPU, 32/32 interpreted).
    Returns:
        [N, Hq, D] in q's dtype.
    Raises:
        ValueError: Hq not a multiple of Hkv, or N != extend_lens.sum().
    """
    check_device(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens)
    N, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    if Hq % Hkv != 0:
        raise ValueError(f"extend_attention: query heads {Hq} must be a multiple of KV heads {Hkv}")
    if k_buffer.shape[2] != D or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"extend_attention: pools {tuple(k_buffer.shape)} do not match head dim {D}")
    if out is None:
        out = torch.empty_like(q)
    B = extend_lens.shape[0]
    if B == 0 or N == 0:
        return out
    if q.stride(-1) != 1 or k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1 or req_to_token.stride(-1) != 1:
        raise ValueError("extend_attention: q, pools and req_to_token must be contiguous in the last dim")
    max_ext = int(extend_lens.max())  # one host sync: sizes the grid
    interp = is_interpreted(q)
    bm = int(block_m or (32 if interp else 64))
    bn = int(block_n or (32 if interp else 64))
    q_start = torch.cumsum(extend_lens, 0) - extend_lens  # [B] first q row of each request
    ieee = k_buffer.dtype == torch.float32 and not interp
    grid = (B, Hq, triton.cdiv(max_ext, bm))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, prefix_lens, extend_lens, q_start,
        float(sm_scale), int(window), float(softcap), q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0), out.stride(0), out.stride(1),
        GROUP=Hq // Hkv, D=D, BLOCK_D=next_pow2(D), BLOCK_M=bm, BLOCK_N=bn, UPCAST=interp, IEEE=ieee,
        WINDOW=window > 0, SOFTCAP=softcap > 0, num_warps=4, num_stages=2)
    return out
