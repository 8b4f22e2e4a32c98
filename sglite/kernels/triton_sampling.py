"""Triton kernels for grammar masks and sampling: ``apply_token_bitmask`` and fused ``sample``.

Same signatures and semantics as :mod:`sglite.kernels.reference`. The bitmask is the packed
``int32 [B, ceil(V/32)]`` layout of XGrammar / llguidance (bit ``t % 32`` of word ``t // 32`` set
= token ``t`` allowed).

Sampling algorithm (one program per row, or per tile of rows under the interpreter):
  1. one pass over the vocabulary: masked max / argmax (greedy rows; first index on ties, like
     ``torch.argmax``), fused with the draw for rows without truncation;
  2. rows with top-k / top-p: the cut-off logit is found by a 16-ary search over the
     order-preserving integer image of float32 (8 passes of 15 cut points each, exact: it
     separates any two distinct floats). The
     kept set {x >= t} keeps the k largest logits (top-k) and the shortest prefix of the sorted
     distribution whose mass reaches top_p (top-p, Holtzman et al. 2020), whichever is smaller;
     min-p (Nguyen et al. 2024) keeps p >= min_p * p_max;
  3. the draw is the Gumbel-max trick (Gumbel 1954; Maddison et al. 2014 §2): argmax of
     ``x / T + G`` over kept tokens, G = -log(-log U), U from counter-based Philox-4x32-10
     (Salmon et al., SC'11) keyed by the request seed, with counter (token id, position). A row's
     token depends only on its own logits, seed and position (batch-invariant), never on the
     launch layout. The reference uses torch's generator, so the two draw different (equally
     distributed) tokens for one seed; greedy rows agree exactly.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_utils import check_device, next_pow2, prev_pow2


# --------------------------------------------------------------------------------------------
# apply_token_bitmask
# --------------------------------------------------------------------------------------------

@triton.jit
def _bitmask_kernel(Logits, Mask, Indices, V, stride_l, stride_m,
                    HAS_INDICES: tl.constexpr, BLOCK_V: tl.constexpr):
    m = tl.program_id(0)
    vb = tl.program_id(1)
    if HAS_INDICES:
        row = tl.load(Indices + m).to(tl.int64)
    else:
        row = m.to(tl.int64)
    offs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = offs < V
    words = tl.load(Mask + m.to(tl.int64) * stride_m + offs // 32, mask=vmask, other=-1)
    banned = ((words >> (offs % 32)) & 1) == 0
    tl.store(Logits + row * stride_l + offs, tl.full([BLOCK_V], float("-inf"), tl.float32)
             .to(Logits.dtype.element_ty), mask=vmask & banned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        indices: Optional[torch.Tensor] = None) -> None:
    """Set disallowed logits to -inf in place.

    Args:
        logits: [B, V] float (mutated); bitmask: [M, ceil(V/32)] int32; indices: optional [M]
        int64 logits rows the bitmask rows apply to (M == B when None).
    Raises:
        ValueError: bitmask too narrow for V, not int32, or row counts that do not match.
    """
    check_device(logits, bitmask, *(() if indices is None else (indices,)))
    B, V = logits.shape
    _check_bitmask(bitmask, V)
    M = bitmask.shape[0]
    if indices is None and M != B:
        raise ValueError(f"apply_token_bitmask: bitmask rows {M} != logits rows {B} (pass indices)")
    if indices is not None and indices.shape[0] != M:
        raise ValueError(f"apply_token_bitmask: indices length {indices.shape[0]} != bitmask rows {M}")
    if M == 0:
        return
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("apply_token_bitmask: logits and bitmask must be contiguous in the last dim")
    block_v = min(4096 if logits.is_cuda else 65536, next_pow2(V))
    grid = (M, triton.cdiv(V, block_v))
    _bitmask_kernel[grid](logits, bitmask, indices if indices is not None else bitmask, V,
                          logits.stride(0), bitmask.stride(0), HAS_INDICES=indices is not None,
                          BLOCK_V=block_v, num_warps=4)


def _check_bitmask(bitmask: torch.Tensor, V: int) -> None:
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask dtype must be torch.int32, got {bitmask.dtype}")
    if bitmask.dim() != 2 or bitmask.shape[1] < (V + 31) // 32:
        raise ValueError(f"bitmask must be [rows, >= ceil(V/32) = {(V + 31) // 32}] int32, "
                         f"got {tuple(bitmask.shape)}")


# --------------------------------------------------------------------------------------------
# sample
# --------------------------------------------------------------------------------------------

@triton.jit
def _order_key(x):
    """Order-preserving int32 image of float32 ``x`` (a < b  <=>  key(a) < key(b))."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _load_tile(Logits, Mask, rows, rmask, offs, V, stride_l, stride_m, HAS_MASK: tl.constexpr):
    """Logits tile [R, BV] as float32 and its allowed-token mask (bitmask, bounds)."""
    m = rmask[:, None] & (offs < V)[None, :]
    x = tl.load(Logits + rows[:, None] * stride_l + offs[None, :], mask=m, other=float("-inf"))
    x = x.to(tl.float32)
    allowed = m
    if HAS_MASK:
        w = tl.load(Mask + rows[:, None] * stride_m + (offs // 32)[None, :], mask=m, other=0)
        allowed = allowed & (((w >> (offs % 32)[None, :]) & 1) != 0)
    return x, allowed


@triton.jit
def _gumbel(seed, pos, offs):
    """Gumbel(0, 1) noise [R, BV] from Philox keyed by ``seed [R]``, counter (token, position)."""
    u = tl.rand(seed[:, None], (pos[:, None] << 32) + offs[None, :].to(tl.int64))
    return -tl.log(-tl.log(u))


@triton.jit
def _sample_kernel(Logits, Mask, Temp, TopP, TopK, MinP, Seed, Pos, Out, B, V, stride_l, stride_m,
                   HAS_MASK: tl.constexpr, ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
                   BLOCK_S: tl.constexpr, RADIX: tl.constexpr, N_PASSES: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    rows = rows.to(tl.int64)
    temp = tl.load(Temp + rows, mask=rmask, other=0.0).to(tl.float32)
    greedy = temp <= 1e-6
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    top_p = tl.load(TopP + rows, mask=rmask, other=1.0).to(tl.float32)
    top_k = tl.load(TopK + rows, mask=rmask, other=0).to(tl.int64)
    min_p = tl.load(MinP + rows, mask=rmask, other=0.0).to(tl.float32)
    seed = tl.load(Seed + rows, mask=rmask, other=0).to(tl.int64)
    pos = tl.load(Pos + rows, mask=rmask, other=0).to(tl.int64)
    sampling = rmask & (temp > 1e-6)
    k_on = sampling & (top_k > 0) & (top_k < V)
    p_on = sampling & (top_p < 1.0)
    mp_on = sampling & (min_p > 0.0)
    trunc = k_on | p_on | mp_on
    any_plain = tl.max((sampling & (trunc == 0)).to(tl.int32), 0)
    any_trunc = tl.max(trunc.to(tl.int32), 0)
    any_bisect = tl.max((k_on | p_on).to(tl.int32), 0)
    any_top_p = tl.max(p_on.to(tl.int32), 0)

    # pass 1: masked max / argmax (greedy), fused with the untruncated draw
    best_x = tl.full([ROWS], float("-inf"), tl.float32)
    best_i = tl.zeros([ROWS], tl.int32)
    race_s = tl.full([ROWS], float("-inf"), tl.float32)
    race_i = tl.zeros([ROWS], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x, allowed = _load_tile(Logits, Mask, rows, rmask, offs, V, stride_l, stride_m, HAS_MASK)
        xm = tl.where(allowed, x, float("-inf"))
        cmax = tl.max(xm, 1)
        carg = tl.argmax(xm, 1, tie_break_left=True).to(tl.int32)
        upd = cmax > best_x
        best_i = tl.where(upd, v0 + carg, best_i)
        best_x = tl.where(upd, cmax, best_x)
        if any_plain:
            s = tl.where(allowed, x * inv_t[:, None] + _gumbel(seed, pos, offs), float("-inf"))
            smax = tl.max(s, 1)
            sarg = tl.argmax(s, 1, tie_break_left=True).to(tl.int32)
            supd = smax > race_s
            race_i = tl.where(supd, v0 + sarg, race_i)
            race_s = tl.where(supd, smax, race_s)

    if any_trunc:
        xmax = tl.where(best_x > float("-inf"), best_x, 0.0)  # 0 for padding / fully masked rows
        # normaliser of the temperature softmax (top-p compares masses against top_p * Z)
        z = tl.zeros([ROWS], tl.float32)
        if any_top_p:
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                x, allowed = _load_tile(Logits, Mask, rows, rmask, offs, V, stride_l, stride_m, HAS_MASK)
                e = tl.exp((x - xmax[:, None]) * inv_t[:, None])
                z += tl.sum(tl.where(allowed, e, 0.0), 1)
        # RADIX-ary search for the largest key t with count(key >= t) >= k or mass(key >= t) >=
        # top_p * Z: each pass tests RADIX - 1 cut points of [lo, hi) at once (invariant: the
        # condition holds at lo, fails at hi), so 2^32 keys take log_RADIX(2^32) passes
        lo = tl.full([ROWS], -2147483648, tl.int64)
        if any_bisect:
            hi = _order_key(xmax).to(tl.int64) + 1
            k_eff = tl.where(k_on, top_k, V + 1)
            p_eff = tl.where(p_on, top_p * z, float("inf"))
            js = tl.arange(0, RADIX).to(tl.int64)  # [RX]
            for _ in range(N_PASSES):
                width = hi - lo  # [R]
                cuts = lo[:, None] + (width[:, None] * js[None, :]) // RADIX  # [R, RX]
                cnt = tl.zeros([ROWS, RADIX], tl.int64)
                mass = tl.zeros([ROWS, RADIX], tl.float32)
                for v0 in range(0, V, BLOCK_S):
                    offs = v0 + tl.arange(0, BLOCK_S)
                    x, allowed = _load_tile(Logits, Mask, rows, rmask, offs, V, stride_l, stride_m,
                                            HAS_MASK)
                    key = tl.where(allowed, _order_key(x), -2147483648).to(tl.int64)  # [R, BS]
                    e = tl.where(allowed, tl.exp((x - xmax[:, None]) * inv_t[:, None]), 0.0)
                    sel = key[:, :, None] >= cuts[:, None, :]  # [R, BS, RX]
                    sel = sel & allowed[:, :, None]
                    cnt += tl.sum(sel.to(tl.int64), 1)
                    mass += tl.sum(tl.where(sel, e[:, :, None], 0.0), 1)
                ok = (cnt >= k_eff[:, None]) | (mass >= p_eff[:, None]) | (js[None, :] == 0)
                j = tl.max(tl.where(ok, js[None, :], 0), 1)  # [R] last cut where it holds
                new_lo = lo + (width * j) // RADIX
                hi = lo + (width * (j + 1)) // RADIX
                lo = new_lo
        thr = tl.where(k_on | p_on, lo, -2147483648)
        mp = tl.where(mp_on, min_p, 0.0)
        # final pass: draw among kept tokens of the truncated rows
        t_s = tl.full([ROWS], float("-inf"), tl.float32)
        t_i = tl.zeros([ROWS], tl.int32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            x, allowed = _load_tile(Logits, Mask, rows, rmask, offs, V, stride_l, stride_m, HAS_MASK)
            sc = (x - xmax[:, None]) * inv_t[:, None]
            keep = allowed & (_order_key(x).to(tl.int64) >= thr[:, None]) & (tl.exp(sc) >= mp[:, None])
            s = tl.where(keep, sc + _gumbel(seed, pos, offs), float("-inf"))
            smax = tl.max(s, 1)
            sarg = tl.argmax(s, 1, tie_break_left=True).to(tl.int32)
            supd = smax > t_s
            t_i = tl.where(supd, v0 + sarg, t_i)
            t_s = tl.where(supd, smax, t_s)
        race_i = tl.where(trunc, t_i, race_i)

    tok = tl.where(greedy, best_i, race_i)
    tl.store(Out + rows, tok.to(tl.int64), mask=rmask)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
           top_ks: torch.Tensor, min_ps: torch.Tensor, seeds: torch.Tensor,
           positions: torch.Tensor, bitmask: Optional[torch.Tensor] = None, *,
           out: Optional[torch.Tensor] = None, rows_per_program: Optional[int] = None,
           block_v: Optional[int] = None) -> torch.Tensor:
    """Fused (masked) sampling: one token per row. See :func:`reference.sample` for semantics.

    Args:
        logits: [B, V] float (not mutated); temperatures, top_ps, min_ps: [B] float32;
        top_ks: [B] int64; seeds, positions: [B] int64; bitmask: optional [B, ceil(V/32)] int32.
        out: optional [B] int64 output (written, returned).
        rows_per_program, block_v: tile sizes (defaults: 1 row x 2048 on GPU; a wide row tile
            under the interpreter, whose cost is per operation, not per element).
    Returns:
        [B] int64 token ids.
    Raises:
        ValueError: parameter vectors whose length is not B, or a malformed bitmask.
    """
    params = (temperatures, top_ps, top_ks, min_ps, seeds, positions)
    check_device(logits, *params, *(() if bitmask is None else (bitmask,)))
    B, V = logits.shape
    for name, t in zip(("temperatures", "top_ps", "top_ks", "min_ps", "seeds", "positions"), params):
        if t.shape != (B,):
            raise ValueError(f"sample: {name} must have shape [{B}], got {tuple(t.shape)}")
    if bitmask is not None:
        _check_bitmask(bitmask, V)
        if bitmask.shape[0] != B:
            raise ValueError(f"sample: bitmask rows {bitmask.shape[0]} != logits rows {B}")
        if bitmask.stride(1) != 1:
            raise ValueError("sample: bitmask must be contiguous in the last dim")
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    params = tuple(p.contiguous() for p in params)
    if logits.is_cuda:
        bv = int(block_v or min(2048, next_pow2(V)))
        rows = int(rows_per_program or 1)
        bs = min(bv, 512)  # search passes hold [rows, bs, 16] tiles
    else:
        bv = int(block_v or min(4096, next_pow2(V)))
        rows = int(rows_per_program or min(next_pow2(B), prev_pow2(max(1, 32768 // bv))))
        bs = min(bv, max(16, prev_pow2((1 << 19) // (16 * rows))))
    grid = (triton.cdiv(B, rows),)
    _sample_kernel[grid](logits, bitmask if bitmask is not None else logits, *params, out, B, V,
                         logits.stride(0), bitmask.stride(0) if bitmask is not None else 0,
                         HAS_MASK=bitmask is not None, ROWS=rows, BLOCK_V=bv, BLOCK_S=bs,
                         RADIX=16, N_PASSES=8,
                         num_warps=8)
    return out
