"""Torch reference of every public kernel op: the spec the Triton versions are tested against.

Conventions (SGLang's token-level paged KV layout):
    S  = number of KV slots in the pool (slot 0 is padding)
    Hq = query heads, Hkv = KV heads (Hq % Hkv == 0, GQA), D = head dim
    req_to_token[r, p] = KV slot of token p of request row r
These run on any device; they are the CPU path of the engine, so they are written for speed too
(batched gathers and SDPA, no per-token Python).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .reference_moe import moe_experts, moe_topk  # noqa: F401  (mixture-of-experts references)
from .reference_sampling import (apply_token_bitmask, argmax_rows, bitmask_to_additive,  # noqa: F401
                                 bitmask_to_bool, exp_noise, greedy, sample)  # (token masks, greedy, sampling)


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, out_cache_loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter new keys/values into the token-level pool, in place.

    Args:
        k_buffer, v_buffer: [S, Hkv, D] pool of one layer (mutated).
        out_cache_loc: [N] int64 slots to write.
        k, v: [N, Hkv, D] new keys / values (cast to the pool dtype).
    """
    k_buffer[out_cache_loc] = k.to(k_buffer.dtype)  # [N, Hkv, D]
    v_buffer[out_cache_loc] = v.to(v_buffer.dtype)  # [N, Hkv, D]


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm (Zhang & Sennrich 2019): ``s = x + residual`` (``x`` when residual
    is None) and ``F.rms_norm(s, weight, eps)``.

    Args:
        x, residual: [..., H] of one dtype; weight: [H].
    Returns:
        (s, normed), both x's shape and dtype.
    """
    s = x if residual is None else x + residual  # [..., H]
    return s, F.rms_norm(s, (s.shape[-1],), weight, eps)


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Su et al. 2021, "RoFormer", in HF's layout) in x's dtype, HF's order of
    operations: x [N, H, D]; cos/sin [N, D/2] in x's dtype. Returns [N, H, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [N, H, D/2]
    c, s = cos[:, None, :], sin[:, None, :]  # [N, 1, D/2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)  # [N, H, D]


def rope_store_kv(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_buffer: torch.Tensor, v_buffer: torch.Tensor, out_cache_loc: torch.Tensor,
                  num_q_heads: int) -> torch.Tensor:
    """RoPE on the fused q/k heads, then the keys and values stored into the pool.

    Args:
        qk: [N, Hq+Hkv, D] query heads then key heads; v: [N, Hkv, D].
        cos, sin: [N, D/2] in qk's dtype.
        k_buffer, v_buffer: [S, Hkv, D] pool of one layer (mutated; cast as :func:`store_kv`).
        out_cache_loc: [N] int64 slots; num_q_heads: Hq.
    Returns:
        [N, Hq, D] rotated queries.
    """
    rotated = rope_rotate_half(qk, cos, sin)  # [N, Hq+Hkv, D]
    store_kv(k_buffer, v_buffer, out_cache_loc, rotated[:, num_q_heads:], v)
    return rotated[:, :num_q_heads]


def gather_heads(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` of a pool buffer, head-major: buf [S, Hkv, D], slots [T] int64 → [Hkv, T, D].

    Head-major pools (``TokenToKVPool``'s storage) gather each head from a contiguous plane;
    a contiguous ``[S, Hkv, D]`` buffer gathers whole rows and transposes the view.
    """
    hm = buf.transpose(0, 1)  # [Hkv, S, D]
    if hm.is_contiguous():
        return hm.index_select(1, slots)  # [Hkv, T, D]
    return buf.index_select(0, slots).transpose(0, 1)  # [Hkv, T, D] (a view)


def _gather_rows(req_to_token, req_pool_indices, seq_lens, max_len):
    rows = req_to_token[req_pool_indices, :max_len].long()  # [B, L] slots (garbage past seq_len)
    pos = torch.arange(max_len, device=rows.device)  # [L]
    valid = pos[None, :] < seq_lens[:, None]  # [B, L] bool
    rows = torch.where(valid, rows, torch.zeros_like(rows))  # [B, L]
    return rows.reshape(-1), valid  # [B*L] int64, [B, L] bool


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, sm_scale: float, window: int = 0,
                     softcap: float = 0.0) -> torch.Tensor:
    """One query token per request over its paged KV (GQA), softmax in float32.

    The two matmuls run in the pool's dtype with float32 accumulation (for bf16 the scores are
    rounded to bf16 before the float32 softmax and the probabilities to bf16 before the PV product,
    as HF's eager attention does); upcasting the gathered K/V to float32 first cost 2.8x the
    time at batch 64 x 260 tokens on CPU (14.6 vs 5.2 ms per layer).

    Gathers each KV head separately (``index_select`` of a strided head view yields a
    contiguous ``[B, L, D]`` block, so the batched matmuls need no further copies).

    Args:
        q: [B, Hq, D] query of each request's newest token.
        k_buffer, v_buffer: [S, Hkv, D] one layer's pool; the newest token's K/V already stored.
        req_to_token: [R, Lmax] int32 slot table.
        req_pool_indices: [B] int64 row of each request in ``req_to_token``.
        seq_lens: [B] int64 tokens to attend to (including the newest), each >= 1.
        sm_scale: softmax scale, usually 1/sqrt(D).
        window: sliding-window attention (Beltagy et al. 2020, "Longformer"; Gemma 2/3 local
            layers) when > 0: a request sees only its last ``window`` tokens (positions
            ``> seq_len - 1 - window``, HF's ``sliding_window_overlay``); 0 = every token.
        softcap: attention logit soft-capping (Gemma 2, Team Gemma 2024, sec. 2) when > 0:
            ``scores = softcap * tanh(scores * sm_scale / softcap)`` before the softmax.
    Returns:
        [B, Hq, D] attention output in q's dtype.
    """
    B, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    G = Hq // Hkv
    L = int(seq_lens.max())
    dt = k_buffer.dtype
    if B == 1:  # batch-1 decode: one gather of all heads, no mask (2.3x faster than the loop below)
        rows = req_to_token[req_pool_indices[0], max(0, L - window) if window > 0 else 0:L].long()  # [L'] slots
        k = gather_heads(k_buffer, rows).transpose(1, 2)  # [Hkv, D, L']
        v = gather_heads(v_buffer, rows)  # [Hkv, L', D]
        scores = _softcap(torch.bmm(q.to(dt).view(Hkv, G, D), k).float().mul_(sm_scale), softcap)  # [Hkv, G, L']
        out = torch.bmm(torch.softmax(scores, dim=-1).to(dt), v)  # [Hkv, G, D]
        return out.reshape(1, Hq, D).to(q.dtype)  # [1, Hq, D]
    flat, valid = _gather_rows(req_to_token, req_pool_indices, seq_lens, L)  # [B*L], [B, L]
    if window > 0:  # only the last `window` positions of each row
        valid = valid & (torch.arange(L, device=valid.device)[None, :] >= seq_lens[:, None] - window)
    masked = (~valid)[:, None, :]  # [B, 1, L]
    qd = q.to(dt).view(B, Hkv, G, D)  # [B, Hkv, G, D]
    outs = []
    for h in range(Hkv):
        kh = k_buffer[:, h].index_select(0, flat).view(B, L, D)  # [B, L, D]
        vh = v_buffer[:, h].index_select(0, flat).view(B, L, D)  # [B, L, D]
        scores = _softcap(torch.bmm(qd[:, h], kh.transpose(1, 2)).float().mul_(sm_scale), softcap)  # [B, G, L]
        scores.masked_fill_(masked, float("-inf"))
        outs.append(torch.bmm(torch.softmax(scores, dim=-1).to(dt), vh))  # [B, G, D]
    return torch.stack(outs, dim=1).reshape(B, Hq, D).to(q.dtype)  # [B, Hq, D]


def _softcap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(scores / cap)`` (Gemma 2's logit soft-capping) when ``cap > 0``, else scores."""
    return scores if cap <= 0 else torch.tanh(scores / cap) * cap


def decode_attention_rowwise(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                             req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                             seq_lens: torch.Tensor, sm_scale: float, window: int = 0,
                             softcap: float = 0.0) -> torch.Tensor:
    """:func:`decode_attention` one row at a time (its batch-1 path), so row i's result depends only
    on row i: the batched path pads every row to the longest one, and the padded softmax and bmm
    shapes change the summation order. Same arguments and result; B x slower in Python overhead.
    """
    if q.shape[0] <= 1:
        return decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale,
                                window, softcap)
    return torch.cat([decode_attention(q[i:i + 1], k_buffer, v_buffer, req_to_token, req_pool_indices[i:i + 1],
                                       seq_lens[i:i + 1], sm_scale, window, softcap) for i in range(q.shape[0])])


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     prefix_lens: torch.Tensor, extend_lens: torch.Tensor, sm_scale: float,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Prefill new tokens of requests whose prefix is already in the pool.

    New token i of request b (absolute position prefix_lens[b] + i) attends to all prefix
    tokens and causally to new tokens 0..i. The new tokens' K/V must already be stored
    (``store_kv``) at ``req_to_token[row, prefix_len : prefix_len + extend_len]``.

    Args:
        q: [N, Hq, D] queries of all new tokens, requests concatenated in batch order
            (N = extend_lens.sum()).
        k_buffer, v_buffer: [S, Hkv, D] one layer's pool.
        req_to_token: [R, Lmax] int32 slot table.
        req_pool_indices: [B] int64.
        prefix_lens: [B] int64 cached tokens per request (may be 0).
        extend_lens: [B] int64 new tokens per request (>= 1).
        sm_scale: softmax scale.
        window, softcap: sliding window and logit soft-capping, as in :func:`decode_attention`
            (query at position t sees keys at positions ``t - window < s <= t``).
    Returns:
        [N, Hq, D] in q's dtype.
    """
    N, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    out = torch.empty_like(q)  # [N, Hq, D]
    plist = prefix_lens.tolist()
    elist = extend_lens.tolist()
    rlist = req_pool_indices.tolist()
    start = 0
    for row, p, e in zip(rlist, plist, elist):
        total = p + e
        first = max(0, p - window + 1) if window > 0 else 0  # keys before it are outside every window
        slots = req_to_token[row, first:total].long()  # [T]
        k = gather_heads(k_buffer, slots)  # [Hkv, T, D]
        v = gather_heads(v_buffer, slots)  # [Hkv, T, D]
        qi = q[start:start + e].transpose(0, 1)  # [Hq, e, D]
        # causal mask with offset: query i sees keys 0 .. p + i
        qpos = torch.arange(e, device=q.device)[:, None] + p  # [e, 1]
        kpos = torch.arange(first, total, device=q.device)[None, :]  # [1, T]
        mask = kpos <= qpos  # [e, T] bool
        if window > 0:
            mask = mask & (kpos > qpos - window)
        if softcap > 0:  # SDPA has no soft-capping: scores by hand (HF eager's order of operations)
            kk = k.repeat_interleave(Hq // Hkv, dim=0)  # [Hq, T, D]
            vv = v.repeat_interleave(Hq // Hkv, dim=0)  # [Hq, T, D]
            scores = _softcap(torch.matmul(qi.to(k.dtype), kk.transpose(1, 2)).float() * sm_scale, softcap)
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # [Hq, e, T] float32
            out[start:start + e] = torch.matmul(probs.to(k.dtype), vv).transpose(0, 1).to(q.dtype)
            start += e
            continue
        o = F.scaled_dot_product_attention(qi.to(k.dtype), k, v, attn_mask=mask, scale=sm_scale,
                                           enable_gqa=(Hq != Hkv))  # [Hq, e, D]
        out[start:start + e] = o.transpose(0, 1).to(q.dtype)
        start += e
    return out


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_lens: torch.Tensor,
             seg_slots: torch.Tensor) -> torch.Tensor:
    """Segmented LoRA (Hu et al. 2021, "LoRA", eq. 3; batched as in S-LoRA / Punica's SGMV): add
    each row's adapter delta ``(x_i · A_sᵀ) · b_s`` (``b_s = B_sᵀ``) to ``y`` in place; returns ``y``.

    Rows come in consecutive segments (``seg_lens`` [G] int64, summing to N), each of one adapter
    slot (``seg_slots`` [G] int64 in ``[-1, S)``; -1: no adapter, the rows are left untouched).
    x: [N, K]; a: [S, R, K] (shrink); b: [S, R, O] (expand, stored transposed so the expand reads
    rows of O contiguous values; the LoRA scaling folded in);
    y: [N, O] (mutated), of x's dtype; a and b share one dtype (the adapter weights'
    ``--lora-dtype``), which may differ from x's: then both matmuls run in float32. The shrink
    result is rounded to x's dtype before the expand, as two chained matmuls would.
    """
    same = a.dtype == x.dtype
    start = 0
    for n, s in zip(seg_lens.tolist(), seg_slots.tolist()):
        if s >= 0 and n:
            xs = x[start:start + n]
            if same:
                t = xs @ a[s].t()  # [n, R]
                y[start:start + n] += t @ b[s]  # [n, O]
            else:  # float32 sums over the adapter's weights, rounded as the matmuls above round
                t = (xs.float() @ a[s].float().t()).to(x.dtype)
                y[start:start + n] += (t.float() @ b[s].float()).to(y.dtype)
        start += n
    return y
