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
  touched, ``[p // G * G, p + e)``, in full precision (the residual window, or the step's stash for
  groups it sealed: :func:`.kv_quant._own_group_kv`);
* the queries of group ``g`` (positions ``[a, b)``) form a sub-request whose table row reads the
  dequantized keys below ``g * G`` and the full-precision ones from ``g * G`` on, with prefix ``a``
  and ``b - a`` new tokens: exactly the keys the reference shows them;
* a query at the last position of a complete group sees its whole group quantized: those rows (at
  most one a group) are redone by the quantized pool's decode attention (``decode``) at length
  ``b``, which reads every position below it from the pool.

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


def _scratch(q: torch.Tensor, layer: kv_quant.QuantKVLayer, req_to_token: torch.Tensor,
             req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor):
    """The scratch K/V buffers, the sub-requests' table and (prefix, extend) lengths, and the rows
    to redo (query index, request row, length) of :func:`extend_attention`."""
    dt, dev = q.dtype, q.device
    G = layer.group if layer.res_k is not None else 0
    # per sub-request: its table row reads scratch slot qb + j for positions j < cut, fb + j from there
    ks, vs, cut, qb, fb, sub_p, sub_e, fix_q, fix_row, fix_len = [], [], [], [], [], [], [], [], [], []
    off = start = 0
    for row, p, e in zip(req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist()):
        T = p + e
        slots = req_to_token[row, :T].long()
        if not G:  # fp8: every key as stored
            k, v = kv_quant.dequant_slots(layer, slots)
            ks.append(k.to(dt)), vs.append(v.to(dt))
            cut.append(T), qb.append(off), fb.append(off), sub_p.append(p), sub_e.append(e)
            off, start = off + T, start + e
            continue
        S, g0 = T // G * G, p // G * G
        qbase = off
        if S:
            k, v = dequant_groups(layer, slots[:S:G] // G, dt)
            ks.append(k), vs.append(v)
            off += S
        fk, fv = kv_quant._own_group_kv(layer, slots[g0:], row, torch.arange(g0, T, device=dev),
                                        torch.tensor(S, device=dev))
        ks.append(fk.to(dt)), vs.append(fv.to(dt))
        fbase, off = off, off + T - g0
        for g in range(p // G, (T - 1) // G + 1):
            a, b = max(p, g * G), min(T, (g + 1) * G)
            cut.append(g * G), qb.append(qbase), fb.append(fbase - g0), sub_p.append(a), sub_e.append(b - a)
            if b == (g + 1) * G:  # the group's last position sees the whole group quantized
                fix_q.append(start + b - 1 - p), fix_row.append(row), fix_len.append(b)
        start += e
    kb, vb = torch.cat(ks), torch.cat(vs)  # [off, Hkv, D] in q's dtype
    lmax = max(a + n for a, n in zip(sub_p, sub_e))
    j = torch.arange(lmax, device=dev)[None, :]
    col = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)[:, None]  # noqa: E731
    rt = torch.where(j < col(cut), col(qb) + j, col(fb) + j).clamp_(max=off - 1).to(torch.int32)  # past a row: unread
    return kb, vb, rt, sub_p, sub_e, (fix_q, fix_row, fix_len)


def extend_attention(q: torch.Tensor, layer: kv_quant.QuantKVLayer, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                     sm_scale: float, attend: Callable, decode: Callable) -> torch.Tensor:
    """See the module docstring. ``attend``: a float pool's ``extend_attention(q, k_buffer, v_buffer,
    req_to_token, req_pool_indices, prefix_lens, extend_lens, sm_scale)``; ``decode``: the quantized
    pool's ``decode_attention(q, layer, req_to_token, req_pool_indices, seq_lens, sm_scale)``. The
    torch glue (the scratch, the table, the fixed rows) runs on the calling thread alone
    (:func:`.device.serial_torch`): interleaved with the C++ kernels' pool, torch's OpenMP team made a
    2,300-token int8 prefill 2-5x slower on a shared 2-core machine.

    Raises:
        ValueError / IndexError: from ``attend`` or ``decode`` (lengths outside the table, slots
        outside the pool), as the kernels they are."""
    with serial_torch():
        kb, vb, rt, sub_p, sub_e, (fix_q, fix_row, fix_len) = _scratch(q, layer, req_to_token, req_pool_indices,
                                                                       prefix_lens, extend_lens)
    dev = q.device
    ints = dict(dtype=torch.int64, device=dev)
    out = attend(q, kb, vb, rt, torch.arange(len(sub_p), **ints), torch.tensor(sub_p, **ints),
                 torch.tensor(sub_e, **ints), sm_scale)
    if fix_q:
        with serial_torch():
            idx = torch.tensor(fix_q, **ints)
            out[idx] = decode(q[idx], layer, req_to_token, torch.tensor(fix_row, **ints),
                              torch.tensor(fix_len, **ints), sm_scale).to(out.dtype)
    return out
