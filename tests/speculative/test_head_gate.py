"""The head gate (issue 29): EAGLE / MEDUSA run their head only when the request's measured
acceptance pays for the head's measured pass plus the verify step; a request the gate turned off
drafts again only on its re-probe steps.

Oracles: the rule on simulated step times (a clock the test advances), and end to end on a tiny
fp32 model with a fake head whose drafts are always wrong / always right (the plain run's own
continuation): where the head ran, and greedy output token for token what the engine without
speculation gives."""
import json

import pytest
import torch

from sglite import Engine
from sglite.runtime.speculative import head_gate
from sglite.runtime.speculative.head_gate import HeadGate
from sglite.runtime.speculative.heads import EagleHead, save_heads
from sglite.runtime.speculative.state import SpecState

KW = dict(dtype="float32", device="cpu", max_total_tokens=2048)


def _simulate(accepted: int, steps: int, plain=3.5e-3, head=5e-3, extra=2e-3) -> list[bool]:
    """``steps`` decode steps of one request on a simulated clock: a plain step takes ``plain``
    seconds, a drafted one ``head + plain + extra`` and keeps ``accepted`` draft tokens. Returns
    per step whether the head ran."""
    gate, spec, t, ran = HeadGate(), SpecState(), 0.0, []
    for _ in range(steps):
        gate.step_began(t)
        drafted = gate.wants(spec)
        if drafted:
            gate.head_ran(head)
        gate.step_ended(t, 1, int(drafted))
        if drafted:
            gate.record(spec, accepted)
        t += plain + (head + extra if drafted else 0.0)
        ran.append(drafted)
    return ran


def _gaps(ran: list[bool]) -> list[int]:
    at = [i for i, r in enumerate(ran) if r]
    return [b - a - 1 for a, b in zip(at, at[1:])]


def test_gate_turns_a_never_accepted_head_off_but_for_probes():
    ran = _simulate(accepted=0, steps=600)
    gaps = _gaps(ran)
    # the first steps time a drafted, a plain and a drafted step; a few more drafts until the
    # request's own evidence outweighs the optimistic prior; then only probes, their waits doubling
    # from PROBE_EVERY to PROBE_MAX plain steps
    assert sum(ran[:3]) == 2 and not ran[1]
    probes = [g for g in gaps if g >= head_gate.PROBE_EVERY]
    first = gaps.index(probes[0])
    assert first <= 6 and all(g >= head_gate.PROBE_EVERY for g in gaps[first:]), gaps
    assert probes[:4] == [16, 32, 64, 128] and set(probes[4:]) == {head_gate.PROBE_MAX}, probes
    assert sum(ran) <= first + 2 + 600 // head_gate.PROBE_EVERY


def test_gate_keeps_a_head_on_when_its_drafts_pay():
    ran = _simulate(accepted=3, steps=300)
    assert ran[0] and not ran[1] and all(ran[2:])  # one timed plain step, then every step drafts
    # one kept token per step of 3.5 ms does not pay a 5 ms head + 2 ms verify extra
    ran = _simulate(accepted=1, steps=300)
    assert sum(ran[100:]) <= 2


def test_a_request_whose_text_becomes_predictable_drafts_again():
    gate, spec, t = HeadGate(), SpecState(), 0.0
    ran = []
    for i in range(400):
        gate.step_began(t)
        drafted = gate.wants(spec)
        if drafted:
            gate.head_ran(5e-3)
        gate.step_ended(t, 1, int(drafted))
        if drafted:
            gate.record(spec, 0 if i < 200 else 4)  # from step 200 on, every draft is kept
        t += 3.5e-3 + (7e-3 if drafted else 0.0)
        ran.append(drafted)
    assert sum(ran[100:200]) <= 1  # off (a probe at most) ...
    back = ran.index(True, 200)
    assert back <= 200 + head_gate.PROBE_MAX and all(ran[back + 1:])  # ... on again after a probe


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, tiny_model_dir):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    torch.manual_seed(0)
    head = EagleHead(dict(hidden_size=cfg["hidden_size"], intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=cfg["vocab_size"], rms_norm_eps=1e-6, rope_theta=10000.0))
    root = tmp_path_factory.mktemp("gate_heads") / "eagle"
    save_heads(head, root)
    return root


class _FakeHead:
    """A head whose drafts are the plain run's continuation (``right``) or each of its tokens + 1;
    records the output length at each call."""

    costs_forward = True

    def __init__(self, want: list[int], vocab: int, right: bool):
        self.want, self.vocab, self.right, self.calls = want, vocab, right, []

    def propose(self, entries, rooms, budget):
        out = []
        for e, room in zip(entries, rooms):
            n = len(e.req.output_ids)
            self.calls.append(n)
            c = list(self.want[n:n + min(room, 4)])
            c = c if self.right else [(t + 1) % self.vocab for t in c]
            out.append([(c, ["eagle"] * len(c))] if c else [])
        return out


class _SimClockGate(HeadGate):
    """The real gate's rule on a simulated clock, so the engine test checks the wiring (greedy
    identical, drafts kept when they pay, probes when they do not) whatever the machine's load:
    a step costs 10 ms a decoding request, a head pass 1 ms and a drafted step 2 ms more a
    drafting request. (On the wall clock a loaded CI worker once timed the drafted steps slow
    enough to switch the gate off with every draft right: 98 request-steps skipped.)"""

    def __init__(self):
        super().__init__()
        self.t = 0.0

    def head_ran(self, seconds):
        super().head_ran(0.001)

    def step_began(self, now):
        super().step_began(self.t)

    def step_ended(self, start, decoding, drafting):
        super().step_ended(self.t, decoding, drafting)
        self.t += 0.010 * decoding + 0.003 * drafting


@pytest.mark.parametrize("right", [False, True])
def test_engine_gate_with_a_fake_head(right, tiny_model_dir, eagle_dir):
    base = Engine(str(tiny_model_dir), **KW)
    spec = Engine(str(tiny_model_dir), speculative_algorithm="EAGLE", speculative_draft_model_path=str(eagle_dir),
                  **KW)
    try:
        sp = {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}
        ids = base.tokenizer.encode("the quick brown fox jumps over the lazy dog")
        want = base.generate(input_ids=ids, sampling_params=sp)["output_ids"]
        dec = spec.scheduler.spec
        assert dec.gate is not None
        dec.gate = _SimClockGate()  # the real rule (the session's engines get an open gate: tests/conftest.py)
        fake = dec.proposer = _FakeHead(want, spec.tokenizer.vocab_size, right)
        got = spec.generate(input_ids=ids, sampling_params=sp)["output_ids"]
        assert got == want
        calls = fake.calls
        if right:  # on at every step but the one timed plain step: each draft kept whole
            assert dec.gate.skipped <= 1 and len(calls) <= 120 // 5 + 3, (calls, dec.gate.skipped)
        else:  # off but for the first few steps and the probes (every PROBE_EVERY plain steps or more)
            gaps = [b - a - 1 for a, b in zip(calls, calls[1:])]
            late = [g for g in gaps if g >= head_gate.PROBE_EVERY]
            assert late and len(calls) <= 8 + 120 // head_gate.PROBE_EVERY // 2, calls
            assert all(g >= head_gate.PROBE_EVERY for g in gaps[gaps.index(late[0]):]), calls
    finally:
        base.shutdown()
        spec.shutdown()
