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
is dropped; when every draft token is kept a bonus token is drawn from ``p_k``. Greedy requests
(temperature 0) keep the longest prefix of the draft that equals the target's argmax (prefix
matching).

Exact seeds. The drafts here are deterministic (n-gram lookup, greedy draft model): ``q_i`` is a
point mass, ``d_i`` must be kept with probability ``p_i(d_i)`` and the residual is ``p_i`` without
``d_i``. Drawing the target's own token ``t_i`` from ``p_i`` and keeping ``d_i`` iff ``d_i == t_i``
does exactly that (the correction is ``t_i``, distributed as ``p_i`` given ``t_i != d_i``), and
when ``t_i`` is drawn by ``kernels.sample`` with the plain sampler's ``(seed, output position)``
noise, the verified tokens *are* the plain run's tokens: a seeded request gives the same output
with or without speculation, whatever was drafted, however long the steps were (this is
"prefix matching against sampled targets", the greedy rule with the plain sampler's draw as the
target; the acceptance probability ``p_i(d_i)`` is the most any exact verifier reaches for a point
mass). Sampled drafts (``draft_probs``: ``q_i`` a distribution) need rejection sampling; its
uniform and its residual draw come from generators keyed by ``(seed, output position, stream)``
(:func:`position_generator`, streams :data:`ACCEPT` and :data:`RESAMPLE`), so no draw depends on
where a step began; the bonus token is the plain sampler's draw.
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
    """Seed of random draws of a request (``seed``: the request's sample seed; ``n_output``: an
    output position, or a position and sub-stream packed by :func:`position_seed`; the block
    verifier of an unseeded request: tokens generated before the step). A splitmix64 finalizer (Steele
    et al. 2014, "Fast splittable pseudorandom number generators") of both, with a tag of its own:
    torch's CPU generator keeps only the low 32 bits of a seed, and a linear formula can meet
    the plain sampler's ``(seed, position)`` keys (``kernels.reference_sampling.exp_noise``) at some
    output length, which would reuse one draw stream for two decisions of one request. Returns
    an int in [0, 2**62)."""
    x = (seed * 0x9E3779B97F4A7C15 + n_output + 0x5E1EC7) & _MASK64  # golden-ratio stride, tag
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 2


ACCEPT, RESAMPLE = 1, 2  # sub-streams of a position's draws: acceptance uniform, residual draw


@dataclass(frozen=True)
class Draws:
    """Where a verify step's random draws come from: the request's sample ``seed`` and ``start``,
    the output position (tokens generated before the step) that verify row 0 predicts; row ``i``
    of a chain (depth ``i`` of a tree) predicts position ``start + i``."""

    seed: int
    start: int

    def generator(self, offset: int, stream: int) -> torch.Generator:
        """A torch CPU generator for the draws of sub-stream ``stream`` at output position
        ``start + offset`` (:func:`position_seed`)."""
        return torch.Generator().manual_seed(position_seed(self.seed, self.start + offset, stream))

    def targets(self, x: torch.Tensor, params, depths: Sequence[int]) -> list[int]:
        """The plain sampler's token for each row of ``x`` ([n, V] float32, logit transforms and
        grammar mask applied) at output position ``start + depths[row]``: ``kernels.sample`` with
        the request's sampling params and seed, the very draw a plain decode step makes there."""
        n, dev = x.shape[0], x.device
        full = lambda v, dt: torch.full((n,), v, dtype=dt, device=dev)  # noqa: E731
        positions = torch.tensor([self.start + d for d in depths], dtype=torch.int64, device=dev)
        return kernels.sample(x, full(params.temperature, torch.float32), full(params.top_p, torch.float32),
                              full(params.top_k, torch.int64), full(params.min_p, torch.float32),
                              full(self.seed, torch.int64), positions).tolist()


def position_seed(seed: int, position: int, stream: int) -> int:
    """Seed of the draws of sub-stream ``stream`` (:data:`ACCEPT`, :data:`RESAMPLE`) at output
    ``position`` of a request with sample ``seed``: a splitmix64 finalizer of the three (see
    :func:`verify_seed`), so it never meets the plain sampler's ``(seed, position)`` seeds by a
    linear coincidence. Returns an int in [0, 2**62)."""
    return verify_seed(seed, position * 8 + stream)


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


def verify_chain(x: torch.Tensor, draft: Sequence[int], params, draws: Optional[Draws] = None,
                 draft_probs: Optional[torch.Tensor] = None, forced: Collection[int] = ()) -> tuple[list[int], int]:
    """Accept a prefix of ``draft`` against the transformed verify rows ``x`` ([k+1, V] float32,
    from :func:`row_logits`) and add one token from the target (correction or bonus).

    Args:
        draft: the k draft tokens ``d_1 .. d_k``.
        params: the request's sampling params (temperature 0: greedy prefix matching).
        draws: the request's seed and the output position of row 0 (sampling only; required then).
        draft_probs: [k, V] the draft distributions ``q_i`` when drafts were sampled; None for
            deterministic drafts (point masses: the plain sampler's token of each row is the
            target, see the module docstring).
        forced: indices of draft tokens the grammar forces after the token before them
            (jump-forward text): kept whenever reached, never checked against ``x`` (the plain
            run appends them without sampling).
    Returns:
        (tokens, accepted): ``accepted`` draft tokens kept, ``tokens`` = those plus one more
        (``accepted + 1`` tokens in all).
    Raises:
        ValueError: a sampled request without ``draws``.
    """
    k = len(draft)
    if params.temperature <= 1e-6 or draft_probs is None:
        if params.temperature <= 1e-6:
            target = kernels.greedy(x).tolist()  # [k+1]
        elif draws is None:
            raise ValueError("draws: sampled verification needs the request's seed and output position")
        else:
            target = draws.targets(x, params, range(k + 1))  # [k+1] the plain run's own draws
        a = 0
        while a < k and (a in forced or draft[a] == target[a]):
            a += 1
        return list(draft[:a]) + [target[a]], a
    if draws is None:
        raise ValueError("draws: sampled verification needs the request's seed and output position")
    p = target_probs(x, params)  # [k+1, V]
    for i, d in enumerate(draft):
        if i in forced:
            continue
        q_d = float(draft_probs[i, d])
        u = float(torch.rand(1, generator=draws.generator(i, ACCEPT)))
        if q_d > 0 and u < float(p[i, d]) / q_d:  # kept with probability min(1, p/q)
            continue
        residual = (p[i] - draft_probs[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: rejection had probability 0 (rounding)
            residual = p[i]
        tok = int(torch.multinomial(residual, 1, generator=draws.generator(i, RESAMPLE)))
        return list(draft[:i]) + [tok], i
    return list(draft) + draws.targets(x[k:], params, [k]), k


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
