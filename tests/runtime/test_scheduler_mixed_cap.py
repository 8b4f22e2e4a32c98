"""``max_mixed_prefill_tokens``: beside decoding requests a step admits the first waiting prompt
and further ones only while its prefill tokens stay within the cap (issue 33, serving TTFT).

Fake runner and oracle of tests/runtime/test_scheduler_unit.py: outputs stay the plain greedy ones.
"""
import pytest

from sglite.errors import InvalidRequestError
from sglite.runtime.forward_batch import ForwardBatch
from tests.runtime.test_scheduler_unit import make, oracle, req, run


def one_step(sched, runner) -> list:
    """Run one step by hand; return ``(rid, n)`` of its prefill entries (sorted by rid)."""
    plan = sched.schedule()
    pre = sorted((e.req.rid, e.n) for e in plan.entries if e.req.prefilling)
    logits = runner.forward(ForwardBatch.from_plan(plan, sched.kv.req_to_token))
    sched.process(plan, logits, sched.sample(plan, logits))
    sched.check_invariants()
    return pre


def decoding(sched, runner, n: int = 2):
    """Start ``n`` long-running requests and step until all of them decode."""
    rs = [req(f"d{i}", [20 + i, 2, 3], 60) for i in range(n)]  # no prefix shared with the tests' prompts
    for r in rs:
        sched.add_request(r)
    while any(r.prefilling for r in sched.running) or sched.waiting:
        one_step(sched, runner)
    return rs


def test_arrivals_during_decoding_get_a_step_each():
    """Two 20-token prompts arriving together while others decode: each is prefilled whole in its
    own step (20 + 20 > cap 32), the first in the very next step, the second in the one after."""
    sched, runner = make(chunked_prefill_size=64, max_mixed_prefill_tokens=32)
    dec = decoding(sched, runner)
    a, b = req("a", list(range(7, 27)), 3), req("b", list(range(6, 26)), 3)  # no cached prefix
    sched.add_request(a)
    sched.add_request(b)
    assert one_step(sched, runner) == [("a", 20)]
    assert a.output_ids and not b.output_ids  # a's first token came out of its own prefill step
    assert one_step(sched, runner) == [("b", 20)]
    assert len(b.output_ids) == 1
    run(sched, [])
    for r in (a, b, *dec):
        assert r.output_ids == oracle(r.input_ids, r.params.max_new_tokens)


def test_short_prompts_still_share_a_step_within_the_cap():
    sched, runner = make(chunked_prefill_size=64, max_mixed_prefill_tokens=32)
    decoding(sched, runner, 5)  # as many decoding as will wait: not a burst
    rs = [req(f"s{i}", [3 + i, 4, 5, 6, 7, 8, 9, 10], 2) for i in range(5)]  # 8 tokens each
    for r in rs:
        sched.add_request(r)
    assert [n for _, n in one_step(sched, runner)] == [8, 8, 8, 8]  # 32 tokens: the fifth waits
    assert one_step(sched, runner) == [("s4", 8)]


def test_first_prompt_is_admitted_whatever_its_length_and_off_restores_the_budget():
    sched, runner = make(chunked_prefill_size=64, max_mixed_prefill_tokens=16)
    decoding(sched, runner)
    long, short = req("long", list(range(10, 26)) * 3, 2), req("short", [5, 6, 7], 2)  # 48 > cap
    sched.add_request(long)
    sched.add_request(short)
    assert one_step(sched, runner) == [("long", 48)]
    assert one_step(sched, runner) == [("short", 3)]
    # off (-1): the 64-token prefill budget alone packs both into one step
    sched, runner = make(chunked_prefill_size=64, max_mixed_prefill_tokens=-1)
    decoding(sched, runner)
    sched.add_request(req("long", list(range(10, 26)) * 3, 2))
    sched.add_request(req("short", [5, 6, 7], 2))
    assert one_step(sched, runner) == [("long", 48), ("short", 3)]


def test_cap_does_not_apply_without_decoding_requests():
    """A burst into an idle engine fills the prefill budget as before (offline throughput)."""
    sched, runner = make(chunked_prefill_size=64, max_mixed_prefill_tokens=16)
    rs = [req(f"r{i}", [1 + i] * 20, 2) for i in range(3)]
    for r in rs:
        sched.add_request(r)
    assert one_step(sched, runner) == [("r0", 20), ("r1", 20), ("r2", 20)]


def test_a_burst_beside_fewer_decoding_requests_fills_the_budget_until_the_queue_drains():
    """More requests wait than decode: the cap is lifted and the prefill budget alone packs each
    step until the queue is empty (a burst, e.g. 64 requests sent at once, is not spread over many
    capped steps, not even once half of it decodes); later arrivals that do not outnumber the
    decoding requests get the cap again."""
    sched, runner = make(chunked_prefill_size=64, max_mixed_prefill_tokens=16, decode_steps_per_chunk=0)
    dec = decoding(sched, runner)
    rs = [req(f"b{i}", [3 + i, *range(4, 19)], 8) for i in range(6)]  # 16 tokens each
    for r in rs:
        sched.add_request(r)
    assert one_step(sched, runner) == [(f"b{i}", 16) for i in range(4)]  # the whole 64-token budget
    assert one_step(sched, runner) == [("b4", 16), ("b5", 16)]  # 2 wait beside 6 decoding: still the burst
    late = [req(f"l{i}", [10 + i, *range(4, 19)], 2) for i in range(2)]  # 2 arrive beside 8 decoding
    for r in late:
        sched.add_request(r)
    assert one_step(sched, runner) == [("l0", 16)]  # the cap (16) is back: the second waits
    assert one_step(sched, runner) == [("l1", 16)]
    run(sched, [])
    for r in (*rs, *late, *dec):
        assert r.output_ids == oracle(r.input_ids, r.params.max_new_tokens)
    assert sched.flush_cache() and sched.kv.free_tokens() == sched.kv.kv_pool.capacity  # every slot freed


def test_no_decode_only_steps_while_a_burst_waits():
    """Budget-filling chunks beside a decoding request earn no decode-only steps while a burst
    waits: every step until the queue is empty carries prompt tokens."""
    sched, runner = make(chunked_prefill_size=16, decode_steps_per_chunk=2, max_mixed_prefill_tokens=-1)
    dec = decoding(sched, runner, 1)
    rs = [req(f"w{i}", [2 + i] * 20, 8) for i in range(6)]  # 20 tokens: chunks fill the budget
    for r in rs:
        sched.add_request(r)
    steps = 0
    while sched.waiting:
        assert one_step(sched, runner), f"a decode-only step at step {steps} with {len(sched.waiting)} waiting"
        steps += 1
    assert steps == 7  # 120 prompt tokens in 16-token steps: the last request admitted in the 7th
    run(sched, [])
    for r in (*rs, *dec):
        assert r.output_ids == oracle(r.input_ids, r.params.max_new_tokens)
    assert sched.flush_cache() and sched.kv.free_tokens() == sched.kv.kv_pool.capacity


@pytest.mark.parametrize("bad", [0, -2])
def test_bad_cap_is_refused_naming_the_field(bad):
    with pytest.raises(InvalidRequestError, match="max_mixed_prefill_tokens"):
        make(max_mixed_prefill_tokens=bad)
