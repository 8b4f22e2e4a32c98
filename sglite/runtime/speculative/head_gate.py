"""Head gate: whether a request runs its draft head (``EAGLE`` / ``MEDUSA``) this step at all.

A head's candidates are not free: its forward (EAGLE: the draft layer over a tree of depths;
MEDUSA: the residual blocks and the LM head) runs before the draft policy could weigh them, and on
this CPU it costs more than a plain decode step (docs/speculative.md). So the decision whether to
draft has to be taken before the head runs, with the head's cost counted:

    draft iff  (E - 1) * p  >  h + x

* ``E`` — tokens a drafted step of this request is expected to yield (its verify steps' accepted
  tokens plus the bonus one): the request's own decayed counts (``OWN_DECAY`` per verify step, so
  its recent text weighs more), blended with the decayed mean of every request (``PRIOR_WEIGHT``
  pseudo-steps), which starts at ``ACCEPT_PRIOR`` (optimistic: new requests draft first);
* ``p`` — seconds of a plain decode step per decoding request (start to start, learned online);
* ``h`` — seconds of the head's own pass per drafting request (timed around the proposer);
* ``x`` — what a drafted step costs beyond a plain one (verify rows, tree mask, acceptance), per
  drafting request, never below ``MIN_COST`` of ``p`` (a verify step is never free).

At batch 1 this is ``E * T_plain > T_head + T_verify``: Leviathan et al. 2023 §3.3's expected
speedup ``(1 - a^(g+1)) / ((1 - a)(g c + 1))`` greater than 1, with the measured expected tokens
standing for the numerator and the draft's cost ``c`` (there: a draft model's pass; here the
head's) counted with the verify step's own extra, all three times measured rather than assumed.
A request the rule turns off drafts again after ``PROBE_EVERY`` plain steps (a re-probe), so one
whose text becomes predictable (a quote, code, a list) starts drafting again. A probe that did not
pay by itself (its kept tokens against ``h + x``) doubles the wait, up to ``PROBE_MAX`` (in open
chat a probe costs a head pass over the positions it missed plus a verify step, for less than one
kept token); one that paid is followed by another at the next step, until the request's own
estimate says drafting pays. A new request starts with the wait of the engine's last probe (after
a run of open chat most requests never probe; a predictable one waits at most ``PROBE_MAX`` plain
steps, or none while the acceptance of every request makes ``E`` pay). The engine's first steps
time a drafted, a plain and a drafted step, in turn. Greedy output is unaffected either way: the
gate only decides whether drafts are proposed; verification stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ACCEPT_PRIOR = 1.0  # accepted draft tokens per verify step before any evidence
PRIOR_WEIGHT = 2.0  # pseudo-steps of the global estimate in a request's own one (and of the prior in it)
OWN_DECAY = 0.8  # per verify step a request's own counts fade
GLOBAL_DECAY = 0.98  # per verify step the counts of every request fade
TIME_EMA = 0.1  # weight of the newest step in the time averages
OUTLIER = 4.0  # a step longer than this many times the current estimate is not counted (an idle wait)
MIN_COST = 0.1  # a drafted step costs at least this fraction of a plain step's per-request time more
PROBE_EVERY = 16  # a request the gate turned off drafts again after this many plain steps ...
PROBE_MAX = 128  # ... doubled after each probe that did not pay, up to this many


@dataclass
class GateState:
    """One request's gate bookkeeping (``req.spec.gate``): decayed accepted draft tokens and
    verify steps, plain steps since it last drafted, the plain steps before its next probe, and
    whether its current draft is a probe."""

    acc: float = 0.0
    steps: float = 0.0
    plain_run: int = 0
    wait: int = PROBE_EVERY
    probing: bool = False


def _ema(old: Optional[float], new: float) -> float:
    if old is None:
        return new
    if new > OUTLIER * old:
        return old
    return old + TIME_EMA * (new - old)


class HeadGate:
    """The rule of the module docstring, with its measurements.

    Per step the decoder calls :meth:`step_began` (start time), :meth:`wants` per candidate
    request, :meth:`head_ran` around the proposer, :meth:`step_ended` after the drafts are
    attached; :meth:`record` per verify step.
    """

    def __init__(self) -> None:
        self.plain: Optional[float] = None  # p: seconds of a plain step per decoding request
        self.head: Optional[float] = None  # h: head seconds per drafting request
        self.extra: Optional[float] = None  # x: a drafted step's extra seconds per drafting request
        self.g_acc, self.g_steps = 0.0, 0.0  # every request's decayed counts
        self._step: Optional[tuple] = None  # (start, decoding, drafting, head seconds) of the last step
        self._head_s = 0.0
        self.wait = PROBE_EVERY  # the probe wait after the engine's last probe (a new request's first)
        self.skipped = 0  # request-steps the gate kept from drafting

    def expected_tokens(self, st: GateState) -> float:
        """``E``: tokens a drafted step of this request is expected to yield (bonus included)."""
        g = (self.g_acc + PRIOR_WEIGHT * ACCEPT_PRIOR) / (self.g_steps + PRIOR_WEIGHT)
        return 1.0 + (st.acc + PRIOR_WEIGHT * g) / (st.steps + PRIOR_WEIGHT)

    def pays(self, st: GateState) -> bool:
        """Whether a drafted step of this request is expected to beat a plain one (the rule)."""
        if self.head is None or (self.plain is not None and self.extra is None):
            return True  # time a drafted step (before any, and once a plain step was timed) ...
        if self.plain is None:
            return False  # ... and a plain one
        return (self.expected_tokens(st) - 1.0) * self.plain > self.cost()

    def cost(self) -> float:
        """``h + x``: seconds a drafted step adds per drafting request (0 before any timing)."""
        if self.plain is None or self.head is None or self.extra is None:
            return 0.0
        return self.head + max(self.extra, MIN_COST * self.plain)

    def wants(self, spec) -> bool:
        """Whether the request with this :class:`.SpecState` runs the head this step: when the
        rule says it pays, else after its probe wait of plain steps (counted here)."""
        if spec.gate is None:
            spec.gate = GateState(wait=self.wait)
        st = spec.gate
        pays = self.pays(st)
        if pays or st.plain_run >= st.wait:
            st.probing, st.plain_run = not pays, 0
            return True
        st.plain_run += 1
        self.skipped += 1
        return False

    def head_ran(self, seconds: float) -> None:
        """The step's head pass(es) took ``seconds``."""
        self._head_s += seconds

    def step_began(self, now: float) -> None:
        """A step starts at ``now`` (``time.perf_counter``): the last decode-only step's time
        (start to start) updates ``p``, or ``h`` and ``x``."""
        if self._step is not None:
            t0, n, d, head = self._step
            secs = now - t0
            if d == 0:
                self.plain = _ema(self.plain, secs / n)
            else:
                self.head = _ema(self.head, head / d)
                if self.plain is not None:
                    self.extra = _ema(self.extra, max(0.0, secs - head - self.plain * n) / d)
        self._step, self._head_s = None, 0.0

    def step_ended(self, start: float, decoding: int, drafting: int) -> None:
        """The step that began at ``start`` decodes ``decoding`` requests (0: not decode-only),
        ``drafting`` of them with drafts attached."""
        self._step = (start, decoding, drafting, self._head_s) if decoding else None

    def record(self, spec, accepted: int) -> None:
        """A verify step of this request kept ``accepted`` draft tokens."""
        st = spec.gate if spec.gate is not None else GateState()
        spec.gate = st
        st.acc, st.steps = OWN_DECAY * st.acc + accepted, OWN_DECAY * st.steps + 1.0
        self.g_acc, self.g_steps = GLOBAL_DECAY * self.g_acc + accepted, GLOBAL_DECAY * self.g_steps + 1.0
        if st.probing:  # a probe that paid by itself: probe again next step; else wait twice as long
            if self.plain is not None and accepted * self.plain > self.cost():
                st.wait, self.wait = 0, PROBE_EVERY
            else:
                st.wait = self.wait = min(PROBE_MAX, max(PROBE_EVERY, 2 * st.wait))
            st.probing = False
