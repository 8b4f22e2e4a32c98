"""Per-request speculation state: the n-gram index, the adaptive draft length, acceptance counts.

:class:`SpecState` is changed only through its methods (the decoder and the proposers read its
fields): a step's draft is set up with :meth:`~SpecState.begin_draft` and
:meth:`~SpecState.set_draft`, and cleared after verification with :meth:`~SpecState.end_verify`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from .ngram import NgramIndex

EMA = 0.3  # weight of the newest step in the acceptance-rate average
LOW_ACCEPTANCE = 0.15  # below this average acceptance rate, drafting pauses ...
COOLDOWN_STEPS = 16  # ... for this many steps (then it is tried again)
START_LEN = 4  # first draft length cap; doubled after a fully accepted draft, cut after a rejection
BACKOFF_AFTER = 4  # consecutive fruitless looks before the lookups back off ...
BACKOFF_MAX = 8  # ... to one look every 2, 4, .. up to this many steps (reset by a kept draft token)


@dataclass
class SpecState:
    """One request's speculation bookkeeping (``req.spec``; created on its first draft).

    Attributes:
        index: n-gram index of the request's sequence (``NGRAM``), or None.
        verify_ct: verify steps run (SGLang's ``spec_verify_ct``).
        accepted: draft tokens accepted in all.
        drafted: draft tokens proposed in all.
        histogram: ``histogram[a]`` = verify steps that accepted ``a`` draft tokens.
        rate: moving average of the accepted fraction of each draft.
        cap: the next draft's length cap: doubled (up to the configured most) when a draft was
            kept whole, else one more than the tokens kept (drafts that fail early stay short,
            so a verify step costs little more than a decode step).
        cooldown: steps left without drafting (acceptance fell low).
        masks: the grammar bitmask rows of the draft being verified ([k+1, W] int32) or None.
        draft_kv: the draft model's KV state of this request (``STANDALONE``; ``EAGLE``: the
            draft layer's K/V, :mod:`.head_proposer`).
        feats: the target's hidden states of this request's positions (``EAGLE`` / ``MEDUSA``:
            :class:`.head_proposer.FeatureLog`), or None.
        text: the text-level lookup of the request's prompt (``NGRAM``; :mod:`.text_lookup`).
        sources: the draft source of each chain being verified (:class:`.policy.AcceptModel`).
        close_points: per chain being verified, the positions where a closing draft was left out
            (:meth:`.grammar_walk.GrammarWalk.walk` with ``close`` False), or None.
        own: this request's ``{source: [kept, tried]}`` draft tokens (:class:`.policy.AcceptModel`).
        misses: consecutive fruitless looks for drafts (no draft chosen, or every token rejected).
        wait: steps still skipped before the next look (the backoff, :meth:`may_look`).
        looked: whether the current step looked for drafts (a miss is then counted if none is
            chosen).
        gate: ``EAGLE`` / ``MEDUSA``: the head gate's bookkeeping of this request
            (:class:`.head_gate.GateState`, changed by :class:`.head_gate.HeadGate` only), or None.
    """

    index: Optional[NgramIndex] = None
    verify_ct: int = 0
    accepted: int = 0
    drafted: int = 0
    histogram: list = field(default_factory=list)
    rate: float = 1.0
    cooldown: int = 0
    cap: int = START_LEN
    masks: Any = None
    draft_kv: Any = None
    feats: Any = None
    text: Any = None
    sources: list = field(default_factory=list)
    close_points: Optional[list] = None
    own: dict = field(default_factory=dict)
    misses: int = 0
    wait: int = 0
    looked: bool = False
    gate: Any = None

    @staticmethod
    def of(req) -> "SpecState":
        """``req.spec``, created (empty) on first use."""
        if req.spec is None:
            req.spec = SpecState()
        return req.spec

    def ensure_index(self) -> NgramIndex:
        """The request's n-gram index (``NGRAM``), created empty on first use."""
        if self.index is None:
            self.index = NgramIndex()
        return self.index

    def text_lookup(self, make: Callable[[], Any]) -> Any:
        """The text-level lookup of the prompt (:class:`.text_lookup.TextLookup`): ``make()`` on
        first use, kept after."""
        if self.text is None:
            self.text = make()
        return self.text

    def mark_look(self, counted: bool) -> None:
        """This step looked for drafts (``counted``: a look that chooses none counts as a miss,
        the measured-cost policy), or did not (False)."""
        self.looked = counted

    def begin_draft(self, track_closes: bool) -> None:
        """A new step's draft: no masks yet; ``close_points`` an empty list to be filled by the
        grammar walk where closing drafts are left out (``track_closes``), else None."""
        self.masks = None
        self.close_points = [] if track_closes else None

    def set_draft(self, sources: Sequence[list], keep: Sequence[int], masks: Any = None) -> None:
        """The draft attached to the step: chains ``keep`` of the proposed ones, with their
        per-token ``sources`` (all proposed chains'; ``close_points`` is cut to ``keep`` too) and
        the grammar bitmask rows (``masks`` [rows, W] int32, None: unchanged)."""
        self.sources = [sources[i] for i in keep]
        if self.close_points is not None:
            self.close_points = [self.close_points[i] for i in keep]
        if masks is not None:
            self.masks = masks

    def drop_masks(self) -> None:
        """The draft's grammar masks were used (verification done)."""
        self.masks = None

    def end_verify(self) -> None:
        """The verify step is committed and learned from: no draft masks or close points remain."""
        self.masks = None
        self.close_points = None

    def record(self, k: int, a: int, k_max: int = 64) -> None:
        """A verify step of ``k`` draft tokens kept ``a`` of them (``k_max``: the configured most)."""
        self.cap = min(k_max, 2 * self.cap) if a == k else max(1, a + 1)
        self.verify_ct += 1
        self.accepted += a
        self.drafted += k
        if len(self.histogram) <= a:
            self.histogram.extend([0] * (a + 1 - len(self.histogram)))
        self.histogram[a] += 1
        self.rate = (1 - EMA) * self.rate + EMA * (a / k if k else 0.0)
        if a > 0:
            self.hit()
        else:
            self.missed()
        if self.rate < LOW_ACCEPTANCE:
            self.cooldown, self.rate = COOLDOWN_STEPS, 0.5

    def may_draft(self) -> bool:
        """False while cooling down after low acceptance (counts the step down)."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return False
        return True

    def may_look(self, force: bool = False) -> bool:
        """Whether this step looks for drafts: always right after a kept draft token and for the
        first ``BACKOFF_AFTER`` fruitless looks, then once every 2, 4, .. ``BACKOFF_MAX`` steps
        (a skipped step counts the wait down); ``force`` (a strong signal: a long n-gram match,
        forced grammar text) looks whatever the wait."""
        if force or self.wait <= 0:
            return True
        self.wait -= 1
        return False

    def missed(self) -> None:
        """A look found no draft worth verifying, or a verified draft kept no token: past
        ``BACKOFF_AFTER`` such looks in a row the next look waits 2, 4, .. ``BACKOFF_MAX`` steps."""
        self.misses += 1
        over = self.misses - BACKOFF_AFTER
        self.wait = min(BACKOFF_MAX, 1 << over) if over >= 1 else 0

    def hit(self) -> None:
        """A draft token was kept: look at every step again."""
        self.misses = self.wait = 0

    def meta(self) -> dict:
        """``meta_info`` fields: ``spec_verify_ct`` (verify steps), ``spec_accept_length`` (mean
        tokens produced per verify step, bonus token included: SGLang's accept length),
        ``spec_accept_histogram`` (``[a]`` = steps that accepted ``a`` draft tokens),
        ``spec_draft_tokens`` and ``spec_accepted_tokens``."""
        ct = self.verify_ct
        return {"spec_verify_ct": ct, "spec_accept_length": (self.accepted + ct) / ct if ct else 0.0,
                "spec_accept_histogram": list(self.histogram), "spec_draft_tokens": self.drafted,
                "spec_accepted_tokens": self.accepted}
