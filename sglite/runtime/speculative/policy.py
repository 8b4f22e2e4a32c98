"""Draft policy: how many draft tokens a step should carry, from a measured step-cost curve and
per-request acceptance estimates.

Speculation pays when the tokens a verify step is expected to add outweigh what its extra rows
cost. Neither side is a constant: the cost of a forward of ``R`` rows depends on the kernels (on
this CPU the int8-activation GEMV costs about linearly in rows: 8 rows ~3-4x one row, see
docs/benchmarks.md), and the chance that a draft token is kept depends on where the draft came
from (a 4-token n-gram match in a copy task vs a 1-token match in open chat) and on how the
request's drafts fared so far.

* :class:`StepCost` — seconds of a step of ``R`` rows: the forward measured once at start-up on
  the loaded model (:func:`probe_forward`, decode rows of one request, the fastest of a few
  interleaved runs), plus the scheduler's per-step overhead and the extra of a step that verifies
  drafts (drafting, verification), both learned online from the time between steps
  (:meth:`StepCost.observe`).
* :class:`AcceptModel` — per draft source of a token (``ngram1`` .. ``ngram4``: n-gram match of
  that many tokens; ``text``: a trusted text-level prompt match, ``text_cont`` its later tokens
  that continue a word, ``text_word`` its tokens that
  start a new word (where a copied JSON value tends to end), ``text_weak``: a short one;
  ``model``: a draft model) the probability that a draft token is kept given the one before it
  was: a prior, moved by every verify step of every request (decayed counts), and per request by
  its own results.
* :func:`choose` — the draft tokens of a step: every candidate token gets the probability that it
  is kept (the product of the conditional probabilities down its chain; a second chain of a token
  tree only where the first chain's first token is not kept), tokens are taken in decreasing
  probability (a chain's tokens stay a prefix) and the count that maximizes the step's expected
  tokens per second is kept, with what the drafts add to the step's cost counted
  ``COST_MARGIN`` times (a margin for the estimates); zero when no count beats the plain step.
  Where rows are free (a GEMM step) any token with a positive estimate is taken.
* :func:`may_pay` — the same rule on an optimistic bound, before a request's candidates are
  built: every token of a candidate gets ``rate ** depth`` (its source's conditional keep
  probability, at least what :func:`choose` would see), so when even that draft does not pay,
  the candidate is dropped before the expensive part (re-encoding a text match, walking a
  grammar). Per request: in open chat most steps end here.

This is the expected-throughput draft-length rule of the speculative-decoding literature (e.g.
Leviathan et al. 2023 §3.3, optimal ``gamma`` for a cost ratio ``c``; SpecDec++ / "dynamic
draft length" work), with the cost curve measured instead of assumed linear.
"""
from __future__ import annotations

import bisect
import time
from typing import Callable, Optional, Sequence

import torch

PROBE_ROWS = (1, 2, 4, 8, 16, 32)  # row counts timed at start-up (others interpolated)
PROBE_REPS = 2  # interleaved passes; the fastest run of each row count is kept
PROBE_SMALL_REPS = 5  # passes for the row counts a step usually carries (<= PROBE_SMALL_ROWS): cheap,
PROBE_SMALL_ROWS = 8  # and where a noisy minimum (a shared machine) decides whether one draft pays
PROBE_CONTEXT = 128  # tokens the probe rows attend to
OVERHEAD_EMA = 0.1  # weight of the newest step in the per-step overhead average
PRIORS = {"ngram1": 0.3, "ngram2": 0.5, "ngram3": 0.6, "ngram4": 0.7, "text": 0.6, "text_word": 0.5, "text_cont": 0.8,
          "text_weak": 0.35, "model": 0.6}  # conditional keep probability of a draft token before any evidence
PRIOR_WEIGHT = 4.0  # pseudo-counts of the prior (and of the global estimate in a request's one)
DECAY = 0.995  # per verify step, the global counts fade (recent requests weigh more)
COST_MARGIN = 1.25  # what drafts add to a step's cost is counted this much higher (estimates err)


class StepCost:
    """Seconds of a scheduler step of ``rows`` rows.

    Args:
        forward: ``{rows: seconds}`` of the model's forward (at least one entry); other row counts
            are interpolated linearly, beyond the largest extrapolated from the last two.
        overhead: the first guess of the scheduler's per-step time outside the forward (seconds).
    """

    def __init__(self, forward: dict, overhead: float = 0.0):
        if not forward:
            raise ValueError("forward: at least one measured row count is needed")
        self.rows = sorted(forward)
        self.secs = [float(forward[r]) for r in self.rows]
        self.overhead = overhead
        self.verify_extra = 0.0  # what a step with drafts costs beyond that (drafting, verification)

    def forward(self, rows: int) -> float:
        """Forward seconds of ``rows`` rows: linear between the two measured row counts around it
        (beyond the ends: the line through the first / last two), never below half the smallest
        measurement; one measurement: proportional to ``rows``."""
        xs, ys = self.rows, self.secs
        if len(xs) == 1:
            return ys[0] * rows / xs[0]
        i = min(max(bisect.bisect_left(xs, rows), 1), len(xs) - 1)  # segment xs[i-1]..xs[i]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(ys[0] * 0.5, y0 + (y1 - y0) * (rows - x0) / (x1 - x0))

    def __call__(self, rows: int, drafted: bool = False) -> float:
        """Seconds of a step of ``rows`` rows (``drafted``: one that verifies drafts)."""
        return self.forward(rows) + self.overhead + (self.verify_extra if drafted else 0.0)

    def observe(self, rows: int, seconds: float, drafted: bool = False) -> None:
        """A step of ``rows`` rows took ``seconds`` from start to start: the part beyond the
        forward updates the overhead estimate of plain steps, or (``drafted``) the extra of steps
        that verify drafts; outliers (an idle wait between requests) are ignored."""
        extra = seconds - self.forward(rows)
        if not 0.0 <= extra <= 2.0 * self.forward(1) + self.overhead + self.verify_extra:
            return
        if drafted:
            self.verify_extra = max(0.0, self.verify_extra + OVERHEAD_EMA * (extra - self.overhead - self.verify_extra))
        else:
            self.overhead += OVERHEAD_EMA * (extra - self.overhead)


def probe_forward(runner, kv, rows: Sequence[int] = PROBE_ROWS, reps: int = PROBE_REPS) -> Optional[dict]:
    """Time the runner's forward for steps of ``rows`` decode rows of one request (attending to
    ``PROBE_CONTEXT`` tokens): ``{rows: seconds}``, the fastest of ``reps`` interleaved runs. Runs
    at start-up, before any request: it borrows a slot-table row (``KVManager.probe_row``) and
    writes K/V into free pool slots (both unused then). Row counts up to ``PROBE_SMALL_ROWS``
    get ``PROBE_SMALL_REPS`` passes (cheap; a second row's price decides whether open-chat
    drafts pay), and the times are made non-decreasing in rows (more rows never cost less: a
    lower time is noise). None when the pool or the slot table is too small for the probe, or no
    slot-table row is free. ``runner`` is a :class:`~sglite.runtime.runner_protocol.RunnerProtocol`
    (``measure_forward`` True), ``kv`` its scheduler's :class:`~sglite.runtime.kv_manager.KVManager`."""
    from ..forward_batch import ForwardBatch

    pool, table = runner.token_to_kv_pool, kv.req_to_token
    n_max = PROBE_CONTEXT + max(rows)
    if pool.capacity < n_max + 8 or table.shape[1] < n_max + 8:
        return None
    best: dict = {}
    with kv.probe_row(n_max) as row:  # free slots past the padding page, zeroed after
        if row is None:
            return None
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        for rep in range(max(reps, PROBE_SMALL_REPS) + 1):  # the first pass warms up
            for m in rows:
                if rep > reps and m > PROBE_SMALL_ROWS:
                    continue
                pos = list(range(PROBE_CONTEXT, PROBE_CONTEXT + m))
                fb = ForwardBatch(input_ids=t([1] * m), positions=t(pos), out_cache_loc=table[row, pos].to(torch.int64),
                                  req_to_token=table, ext_req_pool_indices=t([]), ext_prefix_lens=t([]),
                                  ext_extend_lens=t([]), dec_req_pool_indices=t([row] * m),
                                  dec_seq_lens=t([p + 1 for p in pos]), logits_indices=t(list(range(m))))
                t0 = time.perf_counter()
                runner.forward(fb)
                dt = time.perf_counter() - t0
                if rep:
                    best[m] = min(best.get(m, dt), dt)
    low = 0.0
    for m in sorted(best):
        best[m] = low = max(best[m], low)
    return best


class AcceptModel:
    """Conditional keep probability of a draft token per draft source, learned online.

    ``rate(source, own)``: the global estimate of ``source`` (prior + decayed counts of every
    request), blended with a request's own counts ``own`` (``{source: [kept, tried]}``) when given.
    """

    def __init__(self, priors: Optional[dict] = None):
        self.priors = dict(PRIORS if priors is None else priors)
        self.counts = {s: [0.0, 0.0] for s in self.priors}  # source -> [kept, tried]

    def rate(self, source: str, own: Optional[dict] = None) -> float:
        """Probability in (0, 1) that a draft token of ``source`` is kept given the one before it
        was: ``(kept + w * prior) / (tried + w)`` over the decayed counts of every request (w =
        ``PRIOR_WEIGHT``; an unknown source has prior 0.5), then the same blend of ``own``'s counts
        (``{source: [kept, tried]}``, one request's) with that global estimate as the prior."""
        p0 = self.priors.get(source, 0.5)
        kept, tried = self.counts.get(source, (0.0, 0.0))
        g = (kept + PRIOR_WEIGHT * p0) / (tried + PRIOR_WEIGHT)
        if own and source in own:
            k, n = own[source]
            return (k + PRIOR_WEIGHT * g) / (n + PRIOR_WEIGHT)
        return g

    def record(self, sources: Sequence[str], accepted: int, own: Optional[dict] = None) -> None:
        """A chain of draft tokens with these per-token ``sources`` kept its first ``accepted``:
        each of those counts as kept and tried, the rejected one (if any) as tried; ``own`` (a
        request's counts) is updated too."""
        for c in self.counts.values():
            c[0] *= DECAY
            c[1] *= DECAY
        for i, src in enumerate(sources[:accepted + 1]):
            self.add(src, int(i < accepted), 1, own)

    def add(self, source: str, kept: int, tried: int, own: Optional[dict] = None) -> None:
        """``tried`` draft tokens of ``source``, ``kept`` of them kept, counted without a decay
        step (outcomes learned beside a verify step's own :meth:`record`, e.g. closes that were
        not drafted); ``own`` (a request's counts) is updated too."""
        c = self.counts.setdefault(source, [0.0, 0.0])
        c[0] += kept
        c[1] += tried
        if own is not None:
            o = own.setdefault(source, [0, 0])
            o[0] += kept
            o[1] += tried


def choose(base_tokens: int, base_rows: int, chains: Sequence[Sequence[float]],
           cost: Callable[[int], float]) -> list[int]:
    """How many tokens of each chain to draft.

    Args:
        base_tokens: tokens the step yields without drafts (its sampling requests).
        base_rows: its rows without drafts.
        chains: per candidate chain, the keep probability of each of its tokens (decreasing down
            the chain: each the product of the conditional ones above it).
        cost: ``cost(rows, drafted)`` seconds of a step of ``rows`` rows, ``drafted`` when it
            verifies drafts (:class:`StepCost`).
    Returns:
        per chain the number of leading tokens to draft (all zero when drafting does not pay).
    """
    toks = sorted(((-p, d, c) for c, ps in enumerate(chains) for d, p in enumerate(ps) if p > 0.0))
    c0 = cost(base_rows)
    best_n, best = 0, base_tokens / c0
    gain = float(base_tokens)
    for n, (neg_p, _, _) in enumerate(toks, start=1):
        gain -= neg_p
        v = gain / (c0 + COST_MARGIN * (cost(base_rows + n, True) - c0))
        if v > best:
            best_n, best = n, v
    out = [0] * len(chains)
    for _, d, c in toks[:best_n]:
        out[c] = max(out[c], d + 1)
    return out


def may_pay(base_tokens: int, base_rows: int, candidates: Sequence[tuple[float, int]],
            cost: Callable[..., float]) -> bool:
    """Whether some draft of these candidates could pay (:func:`choose` on an upper bound).

    Args:
        base_tokens, base_rows, cost: as for :func:`choose` (the step without drafts).
        candidates: per candidate chain ``(rate, length)``: the highest conditional keep
            probability any of its tokens can get and its most tokens. Each token at depth ``d``
            is bounded by ``rate ** d`` (a later chain of a token tree has a smaller first
            probability still), so False means :func:`choose` would draft none of them.
    Returns:
        False when no count of bounded tokens beats the plain step; True otherwise.

    Cheap in the common "no" of open chat: first a bound on the gain of ``n`` tokens (at most
    ``n`` times the best rate, at most the sum of every bounded token) against what ``n`` rows
    cost, for the few ``n`` where those differ (``cost`` non-decreasing in rows, as the probe's
    curve is); only when that cannot rule drafting out, :func:`choose` on the bounded chains.
    """
    best = max((q for q, n in candidates if n > 0), default=0.0)
    if best <= 0.0:
        return False
    c0 = cost(base_rows)
    # the cheapest test first: one token of the best candidate pays
    if (base_tokens + best) / (c0 + COST_MARGIN * (cost(base_rows + 1, True) - c0)) > base_tokens / c0:
        return True
    # a quick no: ``n`` bounded tokens gain at most min(n * best, S) (S: every bounded token); when
    # that never beats what the n rows cost (cost rises with rows), nothing can pay
    s_all = sum(q * (1.0 - q ** n) / (1.0 - q) if q < 1.0 else float(n) for q, n in candidates if n > 0 and q > 0.0)
    total = sum(n for q, n in candidates if n > 0 and q > 0.0)
    need = base_tokens * COST_MARGIN / c0
    for n in range(1, total + 1):
        gain = min(n * best, s_all)
        if gain > need * (cost(base_rows + n, True) - c0):
            break  # this count might pay: decide on the bounded chains themselves
        if gain >= s_all:
            return False  # more rows only cost more
    else:
        return False
    chains = [[q ** d for d in range(1, n + 1)] for q, n in candidates if n > 0 and q > 0.0]
    return any(choose(base_tokens, base_rows, chains, cost))
