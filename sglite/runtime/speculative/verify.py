"""Verification of draft tokens: exact speculative sampling.

One verify step gives the target model's logits at every position of ``[pending, d_1 .. d_k]``
(row ``i`` predicts the token after ``d_i``; row 0 the token after the pending one). The target
distribution ``p_i`` of each row is the request's *sampling* distribution: penalties and
``logit_bias`` (over the output so far *including* ``d_1 .. d_i``), the min-new-tokens EOS block,
the grammar mask at the state after ``d_1 .. d_i``, temperature, top-k / top-p / min-p -- the
same transforms, in the same order, as :class:`~sglite.runtime.sampler.Sampler` and
``kernels.sample`` apply, so the output is distributed exactly as without speculation.

Acceptance (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
§2.3; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling", Alg. 2): draft
token ``d_i`` drawn from ``q_i`` is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the
first rejection the token is drawn from ``normalize(max(p_i - q_i, 0))`` and the rest of the draft
is dropped; when every draft token is kept a bonus token is drawn from ``p_k``. Drafts here are
deterministic (n-gram lookup, greedy draft model): ``q_i`` is a point mass, so ``d_i`` is kept with
probability ``p_i(d_i)`` and the residual is ``p_i`` without ``d_i``. Greedy requests (temperature
0) keep the longest prefix of the draft that equals the target's argmax (prefix matching).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Optional, Sequence

import torch

from sglite import kernels
from sglite.kernels.reference import bitmask_to_additive


@dataclass
class RowView:
    """What the sampler's penalties read of a request, as it will be after ``d_1 .. d_i``."""

    params: Any
    output_ids: list


_MASK64 = (1 << 64) - 1


def verify_seed(seed: int, n_output: int) -> int:
    """Seed of the random draws of a verify step of a seeded request (``seed``: the request's
    sample seed; ``n_output``: tokens generated before the step). A splitmix64 finalizer (Steele
    et al. 2014, "Fast splittable pseudorandom number generators") of both, with a tag of its own:
    torch's CPU generator keeps only the low 32 bits of a seed, and a linear formula can meet
    the plain sampler's ``(seed, position)`` seeds (``kernels.reference._row_noise``) at some
    output length, which would reuse one draw stream for two decisions of one request. Returns
    an int in [0, 2**62)."""
    x = (seed * 0x9E3779B97F4A7C15 + n_output + 0x5E1EC7) & _MASK64  # golden-ratio stride, tag
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 2


def target_probs(x: torch.Tensor, params) -> torch.Tensor:
    """The sampling distribution of logits rows ``x`` ([n, V] float32, penalties and grammar mask
    applied already) under ``params`` (temperature > 0): softmax(x / T) restricted to the tokens
    min-p, top-k and top-p keep (the argmax always kept), renormalized. Mirrors the order of
    ``kernels.reference.sample``. Returns [n, V] float32 rows summing to 1."""
    V = x.shape[-1]
    probs = torch.softmax(x / params.temperature, dim=-1)  # [n, V]
    top = probs.argmax(dim=-1, keepdim=True)  # [n, 1]
    keep = probs >= params.min_p * probs.gather(1, top)  # [n, V]
    k_on = 0 < params.top_k < V
    if k_on or params.top_p < 1.0:
        sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)  # [n, V]
        ranks = torch.arange(V)[None, :]
        keep_sorted = ranks < (params.top_k if k_on else V)
        keep_sorted = keep_sorted & ((sorted_p.cumsum(dim=-1) - sorted_p) < params.top_p)
        keep &= torch.zeros_like(keep).scatter_(1, sorted_idx, keep_sorted)
    keep.scatter_(1, top, True)
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def row_logits(sampler, logits: torch.Tensor, req, contexts: Sequence[Sequence[int]],
               bitmask: Optional[torch.Tensor]) -> torch.Tensor:
    """The verify rows of one request with the sampler's logit transforms applied: penalties,
    ``logit_bias`` and the min-new-tokens block per row (row ``i`` sees the output plus
    ``contexts[i]``, the draft tokens before it: ``d_1 .. d_i`` for a chain), then the grammar
    rows of ``bitmask`` ([rows, W] int32 or None). ``logits``: [rows, V] float32 (not mutated).
    Returns [rows, V] float32: ``logits`` itself when nothing applies (no penalty, bias or
    min-new-tokens block, no mask; callers do not write to it)."""
    if bitmask is None and not any(sampler.changes_logits(RowView(req.params, req.output_ids + list(c)))
                                   for c in (min(contexts, key=len), max(contexts, key=len))):
        # the rule is monotone in the context: the shortest row is the last one the min-new-tokens
        # block can reach, the longest the first a penalty can (one needs some output); testing
        # the two copies the output twice per step, not once per row
        return logits
    x = logits.clone()
    sampler._penalize(x, [RowView(req.params, req.output_ids + list(c)) for c in contexts])
    if bitmask is not None:
        x = x + bitmask_to_additive(bitmask, x.shape[1])
    return x


def verify_chain(x: torch.Tensor, draft: Sequence[int], params, generator: Optional[torch.Generator] = None,
                 draft_probs: Optional[torch.Tensor] = None, forced: Collection[int] = ()) -> tuple[list[int], int]:
    """Accept a prefix of ``draft`` against the transformed verify rows ``x`` ([k+1, V] float32,
    from :func:`row_logits`) and add one token from the target (correction or bonus).

    Args:
        draft: the k draft tokens ``d_1 .. d_k``.
        params: the request's sampling params (temperature 0: greedy prefix matching).
        generator: torch generator of the random draws (sampling only).
        draft_probs: [k, V] the draft distributions ``q_i`` when drafts were sampled; None for
            deterministic drafts (point masses).
        forced: indices of draft tokens the grammar forces after the token before them
            (jump-forward text): kept whenever reached, never checked against ``x`` (the plain
            run appends them without sampling).
    Returns:
        (tokens, accepted): ``accepted`` draft tokens kept, ``tokens`` = those plus one more
        (``accepted + 1`` tokens in all).
    """
    k = len(draft)
    if params.temperature <= 1e-6:
        target = kernels.greedy(x).tolist()  # [k+1]
        a = 0
        while a < k and (a in forced or draft[a] == target[a]):
            a += 1
        return list(draft[:a]) + [target[a]], a
    p = target_probs(x, params)  # [k+1, V]
    u = torch.rand(k, generator=generator).tolist() if k else []
    for i, d in enumerate(draft):
        if i in forced:
            continue
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if q_d > 0 and u[i] < float(p[i, d]) / q_d:  # kept with probability min(1, p/q)
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - draft_probs[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: rejection had probability 0 (rounding)
            residual = p[i]
        tok = int(torch.multinomial(residual, 1, generator=generator))
        return list(draft[:i]) + [tok], i
    tok = int(torch.multinomial(p[k], 1, generator=generator))
    return list(draft) + [tok], k


def greedy_walk(x: torch.Tensor, child: Callable[[int, int], Optional[int]], grammar, words: int,
                forced: Optional[Callable[[int], Optional[int]]] = None) -> tuple[list[int], list[int]]:
    """Greedy verification of a grammar request without the draft's masks. From row 0, each
    row's target token is the argmax of ``x`` ([rows, V] float32, penalties applied, no grammar
    mask) when the matcher (at the state after the draft tokens above the row) allows it, else the
    argmax of the row masked by the matcher's bitmask (``words`` int32 words; a vocabulary walk
    only where the cheap answer is refused). Masking only removes tokens, so an allowed argmax is
    the masked argmax: the result equals prefix matching against fully masked rows.

    Args:
        child: ``child(row, token)`` the row of the draft node under ``row`` spelling ``token``,
            or None (the draft ends there or disagrees).
        grammar: the request's matcher; left where it was, also when this raises.
        forced: ``forced(row)`` the token the grammar forces after ``row`` (a jump-forward draft
            node under it: taken without looking at ``x``), or None.
    Returns:
        (tokens, rows): the target token of every row walked (accepted drafts, then the
        correction or bonus) and those rows.
    """
    tokens: list[int] = []
    rows: list[int] = []
    walked, row = 0, 0
    top = kernels.greedy(x).tolist()  # one pass over all rows
    try:
        while True:
            f = forced(row) if forced is not None else None
            t = f if f is not None else top[row]
            if grammar.is_terminated():
                ok = False  # nothing follows; the request ends at the previous token
            elif grammar.accept_token(t):
                ok = True
            else:
                m = torch.full((1, words), -1, dtype=torch.int32)
                grammar.fill_next_token_bitmask(m, 0)
                t = int((x[row:row + 1] + bitmask_to_additive(m, x.shape[1]))[0].argmax())
                ok = grammar.accept_token(t)
            walked += ok
            tokens.append(t)
            rows.append(row)
            nxt = child(row, t)
            if nxt is None:
                return tokens, rows
            row = nxt
    finally:
        if walked:
            grammar.rollback(walked)
