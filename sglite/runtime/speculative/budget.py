"""Draft budget: how many draft tokens a step may carry, and how the lookups are cut to fit.

Two policies behind one :class:`DraftBudget` Protocol; :func:`~.decoder.make_spec_decoder`
picks one per engine:

* :class:`MeasuredCost` — ``NGRAM`` on CPU, where the forward of 1..32 decode rows is timed at
  start-up (:func:`.policy.probe_forward`) and the per-step overhead is learned from the time
  between steps (:meth:`.policy.StepCost.observe`). Lookups are not capped; they are gated,
  cheapest first (the text lookup follows the request's backoff, :meth:`.SpecState.may_look`;
  :func:`.policy.may_pay` drops candidates that cannot pay before they are built), and the whole
  step's candidate tokens are cut by :func:`.policy.choose` to what maximizes expected tokens
  per second.
* :class:`RowBlock` — without a measured cost (GPU, ``STANDALONE``, a runner that cannot be
  probed). With a ``row_block`` (CPU bf16: the GEMV kernels read the weights once per block of
  that many rows) the drafts of a step only fill the rows left in its current block (weak
  candidates only the first ``FREE_ROWS``); a per-request cap (:attr:`.SpecState.cap`: doubled
  after a draft kept whole, cut after a rejection) and a pause after low acceptance
  (:meth:`.SpecState.may_draft`) bound each request.

A *proposal* below is ``(entry, chains, sources, masks)``: a decoding :class:`.StepEntry`, its
candidate chains of draft token ids, the per-token source names of each chain
(:class:`.policy.AcceptModel`) and the grammar masks of its chains (or None).
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol

from ..step_plan import StepEntry
from .grammar_walk import FORCED, whole_forced
from .policy import AcceptModel, StepCost, choose, may_pay

FREE_ROWS = 4  # rows of a CPU GEMV block that cost about nothing (measured: 1-4 rows alike, 8 rows 1.4x)
GEMM_ROWS = 32  # steps with more rows run their matmuls as GEMMs: extra draft rows cost little
UNLIMITED = 1 << 30  # rows left in a step without a row limit


class DraftBudget(Protocol):
    """What a step may draft. Per step the decoder calls :meth:`step_began`, then (with
    candidates) :meth:`open_step`, the lookups' limits while proposing, :meth:`choose` over the
    step's proposals, :meth:`fit` and :meth:`spend` per proposal as it is attached, and
    :meth:`step_drafted` at the end."""

    rows_left: int  # draft tokens the step can still take (UNLIMITED: no row limit)
    counts_looks: bool  # whether a look that drafts nothing counts as a miss (.SpecState.missed)

    def step_began(self, now: float) -> None:
        """A step starts drafting at ``now`` (``time.perf_counter`` seconds)."""

    def step_drafted(self, now: float, entries: list[StepEntry]) -> None:
        """The step that began at ``now`` carries ``entries`` (drafts attached)."""

    def may_draft(self, spec) -> bool:
        """Whether a request with this :class:`.SpecState` may draft this step (may count a
        cool-down step)."""

    def open_step(self, entries: list[StepEntry], decoding: int) -> bool:
        """Set up the step's limits (``entries``: all its entries; ``decoding``: how many decode).
        False: no draft fits this step."""

    def cap(self, spec, k: int, trusted: bool = False) -> int:
        """Most tokens of a lookup candidate of a request with ``k`` tokens of room
        (``trusted``: a trusted text match)."""

    def match_cap(self, n: int) -> int:
        """Most tokens of an n-gram continuation after a match of ``n`` tokens."""

    def weak_rows(self, k: int) -> int:
        """Most tokens the weak candidates of one request may take together."""

    def may_look(self, spec, strong: bool) -> bool:
        """Whether the (costly) text lookup runs for this request this step (``strong``: a strong
        signal, e.g. a long n-gram match); may count its backoff down."""

    def may_pay(self, spec, ngrams: list, texts: list, k: int) -> bool:
        """Whether some draft of these candidates could pay, before they are built: n-gram
        continuations ``(tokens, n)`` and text matches ``(chars, trusted, text, source)``."""

    def choose(self, proposals: list, entries: list[StepEntry]) -> list:
        """The step's proposals with each chain cut to the tokens worth verifying."""

    def fit(self, chains: list[list[int]], sources: list) -> list[list[int]]:
        """One proposal's chains cut to the rows left (empty chains stay)."""

    def spend(self, n: int) -> None:
        """``n`` draft tokens were attached to the step."""


def fit_chains(chains: list[list[int]], budget: int, sources: Optional[list] = None) -> list[list[int]]:
    """The chains cut to ``budget`` nodes in all: the first takes what it needs, each later one at
    most half of what is left (empty chains stay, to keep the mask rows aligned); a cut inside a
    chain's jump-forward text moves before the token that forces it (``sources``: per chain the
    per-token source names)."""
    out = []
    for i, c in enumerate(chains):
        n = min(len(c), budget if i == 0 or not any(out) else budget // 2)
        if sources is not None:
            n = whole_forced(sources[i][:len(c)], n, up=False)
        out.append(c[:n])
        budget -= n
    return out


class RowBlock:
    """The row-block policy (no measured cost): see the module docstring.

    Args:
        row_block: rows a forward carries at about the price of one (CPU GEMV kernels:
            ``MAX_ROWS``), or None: no such limit (GPU).
    """

    counts_looks = False

    def __init__(self, row_block: Optional[int] = None):
        self.row_block = row_block
        self.free_rows_cheap = FREE_ROWS
        self.rows_left = UNLIMITED

    def step_rows(self, entries: list[StepEntry]) -> int:
        """Draft tokens the step can carry at about the price of the rows it has already: the
        rows left to the end of the current block, none when the step's rows fill whole blocks;
        unlimited without a block, or when the step is a GEMM anyway (more than ``GEMM_ROWS``)."""
        rows = sum(e.n for e in entries)
        if self.row_block is None or rows > GEMM_ROWS:
            return UNLIMITED
        return -rows % self.row_block

    def step_began(self, now: float) -> None:
        pass

    def step_drafted(self, now: float, entries: list[StepEntry]) -> None:
        pass

    def may_draft(self, spec) -> bool:
        return spec.may_draft()

    def open_step(self, entries: list[StepEntry], decoding: int) -> bool:
        self.rows_left = self.step_rows(entries)
        return self.rows_left >= 1

    def cap(self, spec, k: int, trusted: bool = False) -> int:
        return k if trusted else min(k, spec.cap)

    def match_cap(self, n: int) -> int:
        return 2 * n  # a short match predicts little: at most twice its length

    def weak_rows(self, k: int) -> int:
        # weak candidates only take the rows that cost next to nothing (the block's first FREE_ROWS)
        if self.row_block is None:
            return k
        return max(0, min(k, self.rows_left - (self.row_block - self.free_rows_cheap)))

    def may_look(self, spec, strong: bool) -> bool:
        return True

    def may_pay(self, spec, ngrams: list, texts: list, k: int) -> bool:
        return True

    def choose(self, proposals: list, entries: list[StepEntry]) -> list:
        return proposals

    def fit(self, chains: list[list[int]], sources: list) -> list[list[int]]:
        return fit_chains(chains, self.rows_left, sources)

    def spend(self, n: int) -> None:
        self.rows_left -= n


class MeasuredCost:
    """The measured-cost policy (``NGRAM`` on CPU): see the module docstring.

    Args:
        cost: the step-cost curve (:class:`.policy.StepCost`, learned further between steps).
        accept: the keep probability per draft source (shared with the decoder, which records
            every verify step into it).
    """

    counts_looks = True

    def __init__(self, cost: StepCost, accept: AcceptModel):
        self.cost, self.accept = cost, accept
        self.rows_left = UNLIMITED
        self._last_step: Optional[tuple] = None  # (start time, rows, drafted) of a decode-only step
        self._gate: Optional[tuple] = None  # this step's (decoding, rows, cost) for policy.may_pay

    def step_began(self, now: float) -> None:
        if self._last_step is not None:
            self.cost.observe(self._last_step[1], now - self._last_step[0], self._last_step[2])

    def step_drafted(self, now: float, entries: list[StepEntry]) -> None:
        decode_only = entries and not any(e.req.prefilling for e in entries)
        self._last_step = (now, sum(e.n for e in entries), any(e.draft for e in entries)) if decode_only else None

    def may_draft(self, spec) -> bool:
        return True

    def open_step(self, entries: list[StepEntry], decoding: int) -> bool:
        self.rows_left = UNLIMITED
        rows = sum(e.n for e in entries)
        cost: Callable = self.cost
        if rows > GEMM_ROWS:
            cost = lambda rows, drafted=False: 1.0  # noqa: E731  (as choose: rows are free)
        elif decoding > 1:  # the verify extra is paid once per step: not this request's alone
            cost = lambda rows, drafted=False, c=self.cost: c(rows)  # noqa: E731
        self._gate = (decoding, rows, cost)
        return True

    def cap(self, spec, k: int, trusted: bool = False) -> int:
        return k

    def match_cap(self, n: int) -> int:
        return UNLIMITED

    def weak_rows(self, k: int) -> int:
        return k

    def may_look(self, spec, strong: bool) -> bool:
        return spec.may_look(strong)

    def may_pay(self, spec, ngrams: list, texts: list, k: int) -> bool:
        """:func:`.policy.may_pay` for a request's candidates before they are built: n-gram
        continuations with their own length, text matches with ``k`` tokens at the best rate of
        their sources (``text``, ``text_word``, ``text_cont`` for a trusted match)."""
        rate, own = self.accept.rate, spec.own
        bounds = [(rate(f"ngram{n}", own), len(cont)) for cont, n in ngrams]
        for _, trusted, _, src in texts:
            q = max(rate("text", own), rate("text_word", own), rate("text_cont", own)) if trusted else rate(src, own)
            bounds.append((q, k))
        gate = self._gate
        return may_pay(gate[0], gate[1], bounds, gate[2])

    def choose(self, proposals: list, entries: list[StepEntry]) -> list:
        """:func:`.policy.choose` over the whole step: the keep probability of every candidate
        token against the measured cost of the rows it adds. A request that looked and drafts
        nothing counts a miss (:meth:`.SpecState.missed`)."""
        lens = self._lengths(proposals, entries) if any(p[1] for p in proposals) else [[] for _ in proposals]
        proposals = [(e, [c[:n] for c, n in zip(chains, ns)], src, m)
                     for (e, chains, src, m), ns in zip(proposals, lens)]
        for e, chains, _, _ in proposals:  # a look that drafts nothing counts toward the backoff
            if e.req.spec.looked and not any(chains):
                e.req.spec.missed()
        return proposals

    def _lengths(self, proposals: list, entries: list[StepEntry]) -> list[list[int]]:
        """Per proposal, the tokens of each chain worth verifying this step."""
        probs, owner = [], []
        for j, (e, chains, sources, _) in enumerate(proposals):
            q = 1.0  # a later chain of a tree is only reached where the earlier first tokens fail
            for c, srcs in zip(chains, sources):
                ps, p = [], q
                for src in srcs[:len(c)]:
                    if src != FORCED:  # jump-forward text: kept whenever the token before it is
                        p *= self.accept.rate(src, e.req.spec.own)
                    ps.append(p)
                probs.append(ps)
                owner.append(j)
                q *= 1.0 - (ps[0] / q if ps and q > 0 else 0.0)
        base_rows = sum(e.n for e in entries)
        if base_rows > GEMM_ROWS:  # a GEMM step (prefill chunk): a few more rows cost next to nothing
            cost = lambda rows, drafted=False: 1.0  # noqa: E731
        else:
            cost = self.cost
        base_tokens = sum(1 for e in entries if not e.req.prefilling)
        flat = choose(base_tokens, base_rows, probs, cost)
        out: list[list[int]] = [[] for _ in proposals]
        for j, n in zip(owner, flat):
            out[j].append(n)
        for (_, chains, sources, _), lens in zip(proposals, out):
            for b, (c, srcs) in enumerate(zip(chains, sources)):
                lens[b] = whole_forced(srcs[:len(c)], lens[b], up=True)
        return out

    def fit(self, chains: list[list[int]], sources: list) -> list[list[int]]:
        return chains

    def spend(self, n: int) -> None:
        self.rows_left -= n
