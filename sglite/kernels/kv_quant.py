"""Quantized KV pool layers and their torch reference ops (store, decode / extend attention).

Formats (``kind``):

* ``int8`` / ``int4`` after KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit
  Quantization for KV Cache", §3.2-3.3 and §4): asymmetric round-to-nearest with a float16 scale
  and minimum. **Keys per channel**: the ``group`` consecutive tokens of a request at positions
  ``[j*group, (j+1)*group)`` share one (scale, min) per (KV head, channel). **Values per token**:
  one (scale, min) per (token, KV head) over the head's channels. The newest tokens of a request
  whose key group is not complete yet stay in a full-precision **residual window** (KIVI's
  residual, ``[R, group, Hkv, D]`` in the model dtype, indexed by request row and ``position %
  group``); when a group's last token is stored the whole group is quantized at once from the
  residual plus the step's new tokens and written into the pool. Codes are ``uint8``: int8 one
  per byte, int4 two per byte, *split halves* (byte ``j`` holds channel ``j`` in its low nibble
  and channel ``j + D/2`` in its high nibble, so a SIMD unpack needs no shuffles).
* ``fp8_e4m3``: ``float8_e4m3fn`` per element with a static per-(layer, KV head) float32 scale
  (``x / scale`` is stored; 1.0 unless set), no residual.

Paging contract (``sglite.runtime.kv_quant`` guarantees it): the pool's page size is a multiple of
``group`` and a request's position ``p`` sits at slot offset ``p % page_size`` of its pages, so
the ``group`` slots of a key group are contiguous and ``slot // group`` numbers the group: its
scales live at ``k_scale[slot // group]``. The radix tree shares whole pages only, hence only
complete (quantized) groups; the residual of a request is its own.

Per step (``QuantStep``, filled once by the pool before the forward): ``tok_rows`` / ``positions``
([N] int64) of the step's new tokens in ``input_ids`` order and ``row_len`` ([R] int64: tokens each
request row holds after this step's store). A row's tokens at positions ``< row_len // group *
group`` are read from the quantized pool, the rest from its residual window. The store also keeps
the step's sealed groups in full precision and the step's own rows as it received them (``stash``,
replaced at the next store of any layer) so that extend attention is decode-equivalent (see
:func:`extend_attention` and :mod:`.kv_quant_extend`).

Shapes: S slots, Hkv KV heads, D head dim (even for int4), R request rows, G = ``group``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

KINDS = ("int8", "int4", "fp8_e4m3")
INT_KINDS = KINDS[:2]  # KIVI: key groups, value rows, a full-precision residual window
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class QuantStep:
    """The current step's token → (row, position) map (see the module docstring)."""

    tok_rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # [N]
    positions: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # [N]
    row_len: Optional[torch.Tensor] = None  # [R] int64
    stash: dict = field(default_factory=dict)  # id(layer) -> (groups, K, V) the store sealed this step;
    # (id(layer), "new") -> (K, V) [N, Hkv, D]: the step's rows as the store received them


@dataclass
class QuantKVLayer:
    """One layer of a quantized pool. The model passes it as both ``k_buffer`` and ``v_buffer`` of
    the ``sglite.kernels`` KV ops, which dispatch on its type.

    Attributes:
        kind: ``int8`` | ``int4`` | ``fp8_e4m3``.
        group: tokens per key group (int kinds); 1 for fp8.
        k_data, v_data: [S, Hkv, Dq] codes: uint8 (Dq = D for int8, D/2 for int4) or float8_e4m3fn.
        k_scale: int kinds [S // G, Hkv, 2, D] float16 (scale, min) per key group and channel;
            fp8 [Hkv] float32.
        v_scale: int kinds [S, Hkv, 2] float16 (scale, min) per token; fp8 [Hkv] float32.
        res_k, res_v: int kinds [R, G, Hkv, D] residual window in the model dtype; None for fp8.
        step: the pool's :class:`QuantStep` (shared by every layer).
        head_dim: D.
    """

    kind: str
    group: int
    k_data: torch.Tensor
    v_data: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    res_k: Optional[torch.Tensor]
    res_v: Optional[torch.Tensor]
    step: QuantStep
    head_dim: int

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4, "fp8_e4m3": 8}[self.kind]

    @property
    def shape(self) -> torch.Size:
        """``[S, Hkv, D]``, the logical shape of the buffer it stands for."""
        return torch.Size((self.k_data.shape[0], self.k_data.shape[1], self.head_dim))

    @property
    def device(self) -> torch.device:
        return self.k_data.device

    @property
    def is_cuda(self) -> bool:
        return self.k_data.is_cuda

    def sealed_lens(self, rows: torch.Tensor) -> torch.Tensor:
        """[B] int64: per request row, positions below it are read from the quantized pool."""
        if self.res_k is None:
            return torch.full_like(rows, 1 << 62)
        G = self.group
        return self.step.row_len.index_select(0, rows) // G * G


# ---------------------------------------------------------------------------- quantization
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[..., D] codes 0..15 (uint8) → [..., D/2] uint8, split halves (low nibble: channel j, high:
    channel j + D/2). Raises ValueError for odd D."""
    D = q.shape[-1]
    if D % 2:
        raise ValueError(f"int4 packing needs an even head dim, got {D}")
    return q[..., :D // 2] | (q[..., D // 2:] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: [..., D/2] uint8 → [..., D] uint8 codes."""
    return torch.cat((p & 0xF, p >> 4), dim=-1)


def quantize(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest of ``x`` with one (scale, min) per slice along ``dim``.

    The float16-rounded scale and min are the ones applied, so dequantization is exact to them.
    Returns (codes uint8 in [0, 2^bits - 1] of x's shape, scale float16, min float16) with ``dim``
    kept as size 1.
    """
    xf = x.float()
    qmax = (1 << bits) - 1
    mn = xf.amin(dim=dim, keepdim=True).to(torch.float16)
    mx = xf.amax(dim=dim, keepdim=True)
    sc = ((mx - mn.float()) / qmax).to(torch.float16)
    scf = sc.float()
    inv = torch.where(scf > 0, 1.0 / scf, torch.zeros_like(scf))
    q = torch.round((xf - mn.float()) * inv).clamp_(0, qmax).to(torch.uint8)
    return q, sc, mn


def dequant_codes(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """``q * scale + min`` in float32 (broadcasting)."""
    return q.float() * scale.float() + mn.float()


def quantize_keys(block: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel key quantization of full groups. block: [NB, G, Hkv, D] → (codes [NB, G, Hkv, Dq]
    uint8, scales [NB, Hkv, 2, D] float16)."""
    q, sc, mn = quantize(block, 1, bits)  # [NB, G, Hkv, D], [NB, 1, Hkv, D] x2
    scales = torch.stack((sc[:, 0], mn[:, 0]), dim=2)  # [NB, Hkv, 2, D]
    return (pack_int4(q) if bits == 4 else q), scales


def quantize_values(rows: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token value quantization. rows: [..., Hkv, D] → (codes [..., Hkv, Dq] uint8,
    scales [..., Hkv, 2] float16)."""
    q, sc, mn = quantize(rows, -1, bits)  # [..., Hkv, D], [..., Hkv, 1] x2
    return (pack_int4(q) if bits == 4 else q), torch.cat((sc, mn), dim=-1)


def _codes(layer: QuantKVLayer, data: torch.Tensor) -> torch.Tensor:
    return unpack_int4(data) if layer.kind == "int4" else data


def dequant_slots(layer: QuantKVLayer, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``slots`` ([...] int64) as stored in the pool, float32 [..., Hkv, D]."""
    if layer.kind == "fp8_e4m3":
        k = layer.k_data[slots].float() * layer.k_scale[:, None]
        v = layer.v_data[slots].float() * layer.v_scale[:, None]
        return k, v
    ks = layer.k_scale[slots // layer.group]  # [..., Hkv, 2, D]
    k = dequant_codes(_codes(layer, layer.k_data[slots]), ks[..., 0, :], ks[..., 1, :])
    vs = layer.v_scale[slots]  # [..., Hkv, 2]
    v = dequant_codes(_codes(layer, layer.v_data[slots]), vs[..., 0:1], vs[..., 1:2])
    return k, v


def gather_kv(layer: QuantKVLayer, slots: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
              sealed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V that attention sees at positions ``pos`` of request rows ``rows`` (slots ``slots``,
    all [...] int64, broadcastable; ``sealed`` the rows' quantized boundary): dequantized pool
    rows below ``sealed``, residual rows from there. Returns float32 [..., Hkv, D] twice."""
    k, v = dequant_slots(layer, slots)
    if layer.res_k is None:
        return k, v
    ridx = pos % layer.group
    rk = layer.res_k[rows, ridx].float()
    rv = layer.res_v[rows, ridx].float()
    use_pool = (pos < sealed)[..., None, None]
    return torch.where(use_pool, k, rk), torch.where(use_pool, v, rv)


# ---------------------------------------------------------------------------- reference ops
def store_kv(layer: QuantKVLayer, out_cache_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             seal: Optional[Callable] = None, store: Optional[Callable] = None) -> None:
    """Write the step's new K/V (``k, v`` [N, Hkv, D], slots ``out_cache_loc`` [N] int64, tokens in
    the order of ``layer.step``): into the residual window, and every key group the step completes
    quantized into the pool (codes and scales). fp8: every token quantized at once. ``seal``: a
    compiled quantizer ``seal(layer, groups, bk, bv) -> bool`` with this module's arithmetic
    (:func:`.kv_quant_cpu.seal_groups`; False: not covered, the torch code runs). ``store``: a
    compiled store ``store(layer, out_cache_loc, k, v)`` doing all of it (:func:`.kv_quant_cpu.store`:
    the stash ``(groups, K, V)`` of the int kinds, ``()`` for fp8, None when not covered)."""
    st, G = layer.step, layer.group
    if st is not None:  # only this layer's attention (next) reads the stash: other layers' entries go, else
        st.stash.clear()  # a forward held every layer's step rows (and the qkv outputs they view) until the next step
        st.stash[(id(layer), "new")] = (k, v)  # the step's rows as received (kv_quant_extend reads them)
    out = store(layer, out_cache_loc, k, v) if store is not None else None
    if out is not None:
        if out and out[0].numel():
            st.stash[id(layer)] = out
        return
    if layer.kind == "fp8_e4m3":
        for data, x, scale in ((layer.k_data, k, layer.k_scale), (layer.v_data, v, layer.v_scale)):
            data[out_cache_loc] = (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(data.dtype)
        return
    rows, pos = st.tok_rows, st.positions  # [N]
    done = pos < st.row_len.index_select(0, rows) // G * G  # [N] token's group complete after the step
    rest = (~done).nonzero().squeeze(1)
    idx = done.nonzero().squeeze(1)
    if idx.numel():
        _seal_groups(layer, out_cache_loc, k, v, idx, seal)
    if rest.numel():  # after sealing: the groups read their earlier tokens from the residual
        layer.res_k[rows[rest], pos[rest] % G] = k[rest].to(layer.res_k.dtype)
        layer.res_v[rows[rest], pos[rest] % G] = v[rest].to(layer.res_v.dtype)


def _seal_groups(layer: QuantKVLayer, out_cache_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 idx: torch.Tensor, seal: Optional[Callable] = None) -> None:
    """Quantize the groups that tokens ``idx`` of the step complete into the pool."""
    st, G = layer.step, layer.group
    rows, pos = st.tok_rows, st.positions
    gid = out_cache_loc[idx] // G  # [n] pool group of each token
    groups, inv = torch.unique(gid, return_inverse=True)  # [NB], [n]
    first = torch.full_like(groups, idx.numel()).scatter_reduce_(0, inv, torch.arange(idx.numel()), "amin")
    brow = rows[idx[first]]  # [NB] row of each group
    # earlier tokens of a group come from the residual, this step's from k/v
    bk = layer.res_k[brow].float()  # [NB, G, Hkv, D]
    bv = layer.res_v[brow].float()
    bk[inv, pos[idx] % G] = k[idx].float()
    bv[inv, pos[idx] % G] = v[idx].float()
    # the fp32 reference keeps the model dtype's rounding of the residual path
    bk = bk.to(layer.res_k.dtype)
    bv = bv.to(layer.res_v.dtype)
    st.stash[id(layer)] = (groups, bk, bv)  # full precision of the sealed groups, for extend attention
    if seal is not None and seal(layer, groups, bk, bv):
        return
    kq, ks = quantize_keys(bk, layer.bits)  # [NB, G, Hkv, Dq], [NB, Hkv, 2, D]
    vq, vs = quantize_values(bv, layer.bits)  # [NB, G, Hkv, Dq], [NB, G, Hkv, 2]
    slots = (groups[:, None] * G + torch.arange(G, device=groups.device)).reshape(-1)  # [NB*G]
    layer.k_data[slots] = kq.reshape(-1, *kq.shape[2:])
    layer.v_data[slots] = vq.reshape(-1, *vq.shape[2:])
    layer.v_scale[slots] = vs.reshape(-1, *vs.shape[2:])
    layer.k_scale[groups] = ks


def needs_stash(layer: QuantKVLayer, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """[B] bool: decode rows whose own key group this step sealed although the row's query is not
    the group's last token (a multi-token short extend crossing a group boundary); they read that
    group's earlier tokens in full precision from the step's stash."""
    if layer.res_k is None:
        return torch.zeros_like(seq_lens, dtype=torch.bool)
    G = layer.group
    return seq_lens // G * G < torch.minimum(layer.sealed_lens(req_pool_indices), seq_lens)


def decode_attention(q: torch.Tensor, layer: QuantKVLayer, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Decode attention over a quantized pool, as :func:`sglite.kernels.reference.decode_attention`
    (q [B, Hq, D] → [B, Hq, D] in q's dtype) with K/V from :func:`gather_kv`; float32 math, one
    request at a time (so row i depends only on row i: batch-invariant), except fp8 batches, which
    run padded in one batch (:func:`_decode_fp8_batched`). A row of length ``L``
    sees keys below ``L // G * G`` quantized and the rest of its group in full precision (the
    residual, or the stash for :func:`needs_stash` rows), as in token-by-token decoding."""
    B, Hq, D = q.shape
    if layer.kind == "fp8_e4m3" and B > 1:
        return _decode_fp8_batched(q, layer, req_to_token, req_pool_indices, seq_lens, sm_scale)
    out = torch.empty_like(q)
    sealed = layer.sealed_lens(req_pool_indices)
    stash = needs_stash(layer, req_pool_indices, seq_lens).tolist()
    for i in range(B):
        L, row = int(seq_lens[i]), req_pool_indices[i]
        pos = torch.arange(L, device=q.device)
        slots = req_to_token[row, :L].long()
        k, v = gather_kv(layer, slots, row, pos, sealed[i])  # [L, Hkv, D]
        if stash[i]:
            b = L // layer.group * layer.group
            k[b:], v[b:] = _own_group_kv(layer, slots[b:], row, pos[b:], sealed[i])
        o = F.scaled_dot_product_attention(q[i].float()[:, None], k.transpose(0, 1), v.transpose(0, 1),
                                           scale=sm_scale, enable_gqa=Hq != k.shape[1])  # [Hq, 1, D]
        out[i] = o[:, 0].to(q.dtype)
    return out


def _decode_fp8_batched(q: torch.Tensor, layer: QuantKVLayer, req_to_token: torch.Tensor,
                        req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """fp8 decode, all rows at once padded to the longest (one gather per KV head; the per-head
    scale folded into q and the output). Row results depend on the padding (not batch-invariant
    bitwise, as the bf16 reference's batched path)."""
    B, Hq, D = q.shape
    Hkv = layer.k_data.shape[1]
    G = Hq // Hkv
    L = int(seq_lens.max())
    rows = req_to_token[req_pool_indices, :L].long()  # [B, L]
    valid = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    flat = torch.where(valid, rows, torch.zeros_like(rows)).reshape(-1)
    qd = q.float().view(B, Hkv, G, D)
    outs = []
    for h in range(Hkv):
        kh = layer.k_data[:, h].index_select(0, flat).view(B, L, D).float()  # [B, L, D]
        vh = layer.v_data[:, h].index_select(0, flat).view(B, L, D).float()
        s = torch.bmm(qd[:, h], kh.transpose(1, 2)) * (sm_scale * float(layer.k_scale[h]))  # [B, G, L]
        s.masked_fill_(~valid[:, None, :], float("-inf"))
        outs.append(torch.bmm(torch.softmax(s, dim=-1), vh) * float(layer.v_scale[h]))  # [B, G, D]
    return torch.stack(outs, dim=1).reshape(B, Hq, D).to(q.dtype)


def _own_group_kv(layer: QuantKVLayer, slots: torch.Tensor, row: int, pos: torch.Tensor,
                  sealed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-precision K/V (float32 [T, Hkv, D]) of positions ``pos`` of one row that this step
    touched: groups the step sealed come from the step's stash, the rest from the residual."""
    rk = layer.res_k[row, pos % layer.group].float()
    rv = layer.res_v[row, pos % layer.group].float()
    groups, bk, bv = layer.step.stash.get(id(layer), (None, None, None))
    if groups is None or not groups.numel():
        return rk, rv
    gid = slots // layer.group
    i = torch.searchsorted(groups, gid).clamp_(max=groups.numel() - 1)
    hit = (groups[i] == gid) & (pos < sealed)
    fk = bk[i, pos % layer.group].float()
    fv = bv[i, pos % layer.group].float()
    return torch.where(hit[:, None, None], fk, rk), torch.where(hit[:, None, None], fv, rv)


def extend_attention(q: torch.Tensor, layer: QuantKVLayer, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                     sm_scale: float) -> torch.Tensor:
    """Extend (prefill) attention over a quantized pool, as
    :func:`sglite.kernels.reference.extend_attention` (q [N, Hq, D] → [N, Hq, D] in q's dtype), the
    step's new tokens already stored. Float32 math.

    Decode-equivalent: the query at position ``p`` sees keys below ``(p + 1) // G * G`` as stored
    in the pool (quantized) and the rest of its own group in full precision (from the residual, or
    from the step's stash when the step sealed that group), exactly what it would see were it
    decoded token by token; so prompt logprobs, chunking and cached prefixes do not change what a
    token attends to. fp8: every key as stored.
    """
    N, Hq, D = q.shape
    out = torch.empty_like(q)
    sealed = layer.sealed_lens(req_pool_indices)
    G = layer.group
    start = 0
    for i, (row, p, e) in enumerate(zip(req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist())):
        T = p + e
        pos = torch.arange(T, device=q.device)
        slots = req_to_token[row, :T].long()
        k, v = gather_kv(layer, slots, torch.tensor(row), pos, sealed[i])  # [T, Hkv, D] as stored
        qpos = torch.arange(e, device=q.device)[:, None] + p  # [e, 1]
        causal = pos[None, :] <= qpos  # [e, T]
        qi = q[start:start + e].float().transpose(0, 1)  # [Hq, e, D]
        Hkv = k.shape[1]
        kk, vv = k.transpose(0, 1).repeat_interleave(Hq // Hkv, 0), v.transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        scores = torch.matmul(qi, kk.transpose(1, 2)) * sm_scale  # [Hq, e, T]
        if layer.res_k is not None:
            g0 = p // G * G  # first position of the groups this step touched
            own = (pos[None, :] >= (qpos + 1) // G * G) & causal  # [e, T] keys seen in full precision
            fk, fv = _own_group_kv(layer, slots[g0:], row, pos[g0:], sealed[i])  # [T - g0, Hkv, D]
            fk = fk.transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
            fv = fv.transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
            sf = torch.matmul(qi, fk.transpose(1, 2)) * sm_scale  # [Hq, e, T - g0]
            scores[:, :, g0:] = torch.where(own[:, g0:], sf, scores[:, :, g0:])
            probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            o = torch.matmul(probs.masked_fill(own, 0.0), vv)
            o += torch.matmul(probs[:, :, g0:].masked_fill(~own[:, g0:], 0.0), fv)
        else:
            probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            o = torch.matmul(probs, vv)  # [Hq, e, D]
        out[start:start + e] = o.transpose(0, 1).to(q.dtype)
        start += e
    return out
