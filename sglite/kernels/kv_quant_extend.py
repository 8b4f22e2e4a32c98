"""Extend (prefill) attention over a quantized KV pool through the float pool's extend kernel.

Same contract and semantics as :func:`.kv_quant.extend_attention` (the torch reference): q [N, Hq,
D] -> [N, Hq, D] in q's dtype, the step's new tokens already stored (:func:`.kv_quant.store_kv`),
decode-equivalent: the query at position ``p`` sees the keys below ``(p + 1) // G * G`` as the pool
stores them (quantized) and the rest of its own key group in full precision, so chunking, cached
prefixes and prompt logprobs see what token-by-token decoding sees.

How: the reference scores every query against every key of its request in float32 with masks (a
2,300-token prompt took 6.9 s to prefill with int8 KV against 0.7 s with the bf16 pool). Here each
request's queries are cut at key-group boundaries into sub-requests that the float pool's extend
attention (``attend``: :mod:`.cpu_attention`'s kernel on CPU, the AMX tiles for bf16) runs as
ordinary requests over a scratch K/V buffer in q's dtype:

* per request, the positions below its quantized boundary ``S = (p + e) // G * G`` dequantized
  from the pool (:func:`dequant_groups`), and the positions of the groups this step
  touched, ``[p // G * G, p + e)``, in full precision (:func:`_full_rows`: the step's own rows as
  its store received them, which :func:`.kv_quant.store_kv` leaves in the layer step's stash, after
  the earlier rows of the group the step entered, from the residual window or, when the step sealed
  that group, the stash);
* the query at position ``x`` sees the keys below ``c = (x + 1) // G * G`` dequantized and the rest
  in full precision (a group's last position sees its whole group quantized, as the decode step that
  seals the group does), so the queries sharing a cut ``c`` (positions ``[c - 1, c + G - 1)``) form
  a sub-request whose table row reads the dequantized keys below ``c`` and the full-precision ones
  from ``c`` on: exactly the keys the reference shows them.

fp8 pools (every key as stored, no residual) take one sub-request per request over the dequantized
keys. The scratch buffer is in q's dtype: float32 models see the reference's values (up to the
order of float32 sums), bf16 models the dequantized keys rounded once to bf16, as a bf16 pool
rounds every key.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import kv_quant
from .device import serial_torch


def dequant_groups(layer: kv_quant.QuantKVLayer, gids: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of whole key groups ``gids`` ([n] int64 pool group ids: slots ``gid * G ..
    gid * G + G - 1``, as a request's positions lie in its pages) as stored, [n * G, Hkv, D] in
    ``dtype`` each: :func:`.kv_quant.dequant_slots` of those slots (float32, then rounded once); in
    C++ (:func:`.kv_quant_cpu.dequant_groups`, each group's key scales read once) where it builds."""
    from . import kv_quant_cpu

    out = kv_quant_cpu.dequant_groups(layer, gids, dtype)
    if out is not None:
        return out
    slots = (gids[:, None] * layer.group + torch.arange(layer.group, device=gids.device)).reshape(-1)
    k, v = kv_quant.dequant_slots(layer, slots)
    return k.to(dtype), v.to(dtype)


def _dequant_fp8(layer: kv_quant.QuantKVLayer, slots: torch.Tensor, dtype: torch.dtype):
    """:func:`.kv_quant.dequant_slots` of an fp8 layer in ``dtype`` (C++ where it builds)."""
    from . import kv_quant_cpu

    out = kv_quant_cpu.dequant_fp8(layer, slots, dtype)
    if out is not None:
        return out
    k, v = kv_quant.dequant_slots(layer, slots)
    return k.to(dtype), v.to(dtype)


def _full_rows(layer: kv_quant.QuantKVLayer, slots: torch.Tensor, row: int, p: int, start: int,
               e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-precision K/V [T - g0, Hkv, D] of one request's positions ``[g0, T)`` (``g0 = p // G *
    G``, ``T = p + e``): the step's own rows ``start .. start + e`` as the store received them (in the
    residual windows' dtype, as the store keeps them), after
    the rows ``[g0, p)`` of the group the step entered (the store's stash when the step sealed that
    group, else the residual window, which the step did not overwrite below ``p``). Falls back to
    :func:`.kv_quant._own_group_kv` when the store left no rows (a store that is not ``store_kv``)."""
    G, T = layer.group, p + e
    g0 = p // G * G
    new = layer.step.stash.get((id(layer), "new"))
    if new is None:
        return kv_quant._own_group_kv(layer, slots[g0:], row, torch.arange(g0, T, device=slots.device),
                                      torch.tensor(T // G * G, device=slots.device))
    rd = layer.res_k.dtype  # a wider k (float32 into a bf16 pool) rounded, as the reference sees it
    nk, nv = new[0][start:start + e].to(rd), new[1][start:start + e].to(rd)
    if p == g0:
        return nk, nv
    if T >= g0 + G:  # the group [g0, g0 + G) was completed by this step: its earlier rows are in the stash
        groups, bk, bv = layer.step.stash[id(layer)]
        i = int(torch.searchsorted(groups, slots[g0:g0 + 1] // G))
        pk, pv = bk[i, :p - g0], bv[i, :p - g0]
    else:
        pk, pv = layer.res_k[row, :p - g0], layer.res_v[row, :p - g0]
    return torch.cat((pk.to(nk.dtype), nk)), torch.cat((pv.to(nv.dtype), nv))


def _scratch(q: torch.Tensor, layer: kv_quant.QuantKVLayer, req_to_token: torch.Tensor,
             req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor):
    """The scratch K/V buffers, and the sub-requests' table and (prefix, extend) lengths of
    :func:`extend_attention`."""
    dt, dev = q.dtype, q.device
    G = layer.group if layer.res_k is not None else 0
    # per sub-request: its table row reads scratch slot qb + j for positions j < cut, fb + j from there
    ks, vs, cut, qb, fb, sub_p, sub_e = [], [], [], [], [], [], []
    off = start = 0
    for row, p, e in zip(req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist()):
        T = p + e
        slots = req_to_token[row, :T].long()
        if not G:  # fp8: every key as stored
            k, v = _dequant_fp8(layer, slots, dt)
            ks.append(k), vs.append(v)
            cut.append(T), qb.append(off), fb.append(off), sub_p.append(p), sub_e.append(e)
            off, start = off + T, start + e
            continue
        S, g0 = T // G * G, p // G * G
        qbase = off
        if S:
            k, v = dequant_groups(layer, slots[:S:G] // G, dt)
            ks.append(k), vs.append(v)
            off += S
        fk, fv = _full_rows(layer, slots, row, p, start, e)
        ks.append(fk.to(dt)), vs.append(fv.to(dt))
        fbase, off = off, off + T - g0
        # the query at x sees the keys below (x + 1) // G * G quantized (a group's last position its
        # whole group) and the rest in full precision: one sub-request per such cut c, queries [c - 1, c + G - 1)
        c = (p + 1) // G * G
        while c - 1 < T:
            a, b = max(p, c - 1), min(T, c + G - 1)
            cut.append(c), qb.append(qbase), fb.append(fbase - g0), sub_p.append(a), sub_e.append(b - a)
            c += G
        start += e
    kb, vb = torch.cat(ks), torch.cat(vs)  # [off, Hkv, D] in q's dtype
    lmax = max(a + n for a, n in zip(sub_p, sub_e))
    j = torch.arange(lmax, device=dev)[None, :]
    col = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)[:, None]  # noqa: E731
    rt = torch.where(j < col(cut), col(qb) + j, col(fb) + j).clamp_(max=off - 1).to(torch.int32)  # past a row: unread
    return kb, vb, rt, sub_p, sub_e


def extend_attention(q: torch.Tensor, layer: kv_quant.QuantKVLayer, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                     sm_scale: float, attend: Callable) -> torch.Tensor:
    """See the module docstring. ``attend``: a float pool's ``extend_attention(q, k_buffer, v_buffer,
    req_to_token, req_pool_indices, prefix_lens, extend_lens, sm_scale)``. The
    torch glue (the scratch and the table) runs on the calling thread alone
    (:func:`.device.serial_torch`): interleaved with the C++ kernels' pool, torch's OpenMP team made a
    2,300-token int8 prefill 2-5x slower on a shared 2-core machine.

    Raises:
        ValueError / IndexError: from ``attend`` (lengths outside the table, slots
        outside the pool), as the kernels they are."""
    with serial_torch():
        kb, vb, rt, sub_p, sub_e = _scratch(q, layer, req_to_token, req_pool_indices, prefix_lens, extend_lens)
    ints = dict(dtype=torch.int64, device=q.device)
    return attend(q, kb, vb, rt, torch.arange(len(sub_p), **ints), torch.tensor(sub_p, **ints),
                  torch.tensor(sub_e, **ints), sm_scale)
