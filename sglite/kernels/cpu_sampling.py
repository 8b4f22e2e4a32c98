"""The sampling op on CPU: :func:`.reference_sampling.sample`'s tokens without its full sort.

The reference sorts every ranked row's whole vocabulary (top-k / top-p) and draws noise for every
token: 5 ms a row of the default model's 49,152 tokens on this machine's cores (a sort of 3 ms and
the noise 0.9 ms), so a 16-row step with top_p spent 83 ms sampling and a 64-row one ~340 ms
against a ~45 ms forward (2026-12-07). Here a ranked row looks only at its ``K`` most likely tokens
(``torch.topk``, sorted): when the ``K``-th is already outside top-k / top-p, every later one is too
(the mass before a rank only grows), so the kept set is the reference's; otherwise ``K`` grows 8x
and the rows still open look again (up to the whole vocabulary). The winner is the candidates'
``argmax(p / E)`` with the reference's draws (:func:`.reference_sampling.exp_noise`; a row's whole
draws are still made, ~0.9 ms a row). Rows with neither top-k nor top-p keep the reference's dense
form (min-p over the whole vocabulary).

The same tokens as the reference wherever no two tokens of a row tie in probability at the top-p
or top-k boundary (the two sorts may order tied tokens differently): tests/kernels/test_cpu_sampling.py.
"""
from __future__ import annotations

from typing import Optional

import torch

from .reference_sampling import exp_noise, sampling_probs

FIRST_K = 64  # candidates a ranked row looks at first (a chat model's nucleus is mostly far smaller)
GROWTH = 8  # K's factor while a row's boundary lies past its K candidates


def _ranked_draw(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, thr: torch.Tensor,
                 seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Tokens [R] int64 of ranked rows: probs [R, V] float32; top_ks [R] int64 (V when off); top_ps
    [R] float32; thr [R] float32 (min-p's threshold); seeds / positions [R] int64."""
    R, V = probs.shape
    out = torch.empty(R, dtype=torch.int64)
    todo = torch.arange(R)
    k = FIRST_K
    while todo.numel():
        kk = min(V, k)
        p = probs if len(todo) == R else probs.index_select(0, todo)  # [r, V]
        vals, idx = p.topk(kk, dim=-1, sorted=True)  # [r, kk] descending
        ranks = torch.arange(kk)[None, :]
        keep = (ranks < top_ks.index_select(0, todo)[:, None]) \
            & ((vals.cumsum(dim=-1) - vals) < top_ps.index_select(0, todo)[:, None])  # [r, kk]
        done = ~keep[:, -1] if kk < V else torch.ones(len(todo), dtype=torch.bool)  # the boundary lies inside
        rows = done.nonzero().squeeze(1)
        if rows.numel():
            v, i, kp = vals.index_select(0, rows), idx.index_select(0, rows), keep.index_select(0, rows)
            kp &= v >= thr.index_select(0, todo.index_select(0, rows))[:, None]  # min-p
            top = p.index_select(0, rows).argmax(dim=-1, keepdim=True)  # [d, 1] the reference's top token
            kp |= i == top  # always kept
            r = todo.index_select(0, rows)
            e = exp_noise(seeds.index_select(0, r), positions.index_select(0, r), i, V)  # [d, kk]
            score = torch.where(kp, v / e, torch.full_like(v, -1.0))  # [d, kk]
            out[r] = i.gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)
        todo = todo[~done]
        k *= GROWTH
    return out


def sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
           top_ks: torch.Tensor, min_ps: torch.Tensor, seeds: torch.Tensor,
           positions: torch.Tensor, bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`.reference_sampling.sample` on CPU tensors: the same arguments (logits [B, V] float,
    per-row parameters [B]) and result ([B] int64 token ids), the same tokens."""
    V = logits.shape[1]
    out, sr, probs = sampling_probs(logits, temperatures, bitmask)
    if sr is None:
        return out
    pmax = probs.max(dim=-1).values  # [Bs]
    thr = min_ps.index_select(0, sr) * pmax  # [Bs] min-p
    tk, tp = top_ks.index_select(0, sr), top_ps.index_select(0, sr)
    k_on = (tk > 0) & (tk < V)
    tk = torch.where(k_on, tk, torch.full_like(tk, V))  # [Bs] V: top-k off
    ranked = k_on | (tp < 1.0)  # [Bs]
    rk = ranked.nonzero().squeeze(1)
    if rk.numel():
        rows = sr[rk]
        p = probs if len(rk) == len(sr) else probs.index_select(0, rk)  # [Br, V]
        out[rows] = _ranked_draw(p, tk.index_select(0, rk), tp.index_select(0, rk), thr.index_select(0, rk),
                                 seeds.index_select(0, rows), positions.index_select(0, rows))
    dense = (~ranked).nonzero().squeeze(1)
    if dense.numel():  # temperature / min-p only: the whole vocabulary may stay
        p = probs.index_select(0, dense)  # [d, V]
        keep = p >= thr.index_select(0, dense)[:, None]
        keep.scatter_(1, p.argmax(dim=-1, keepdim=True), True)
        r = sr[dense]
        ids = torch.arange(V).expand(len(r), V)  # [d, V]: every token
        e = exp_noise(seeds.index_select(0, r), positions.index_select(0, r), ids, V)  # [d, V]
        out[r] = (p.masked_fill(~keep, 0.0) / e).argmax(dim=-1)
    return out
