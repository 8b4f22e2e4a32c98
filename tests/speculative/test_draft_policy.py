"""Speculative decoding (issue 17): how many tokens to draft. The measured step-cost curve and
the expected-throughput rule (:func:`policy.choose`), the per-source acceptance model, the CPU row
budget (drafts kept inside the GEMV block), and near-zero cost when a step drafts nothing (the
backoff after misses, :func:`policy.may_pay` as a cheap upper bound of ``choose``).

Oracles: the rule worked by hand on small cases (linear and flat costs), the interpolation of the
measured cost curve, the backoff schedule worked by hand (misses -> waits 2, 4, 8, 8; a kept token
resets it; a strong signal looks anyway); ``may_pay`` never says no where ``choose`` would draft
(random chains under the bound); a copy prompt still drafts after a run of failures, at the
decoder (a request deep in backoff, weak sources poisoned) and end to end (greedy output identical
to the engine without speculation).
"""
import random
from types import SimpleNamespace

import pytest

from sglite.runtime.speculative import state as spec_state
from sglite.runtime.speculative.decoder import SpecDecoder
from sglite.runtime.speculative.policy import AcceptModel, StepCost, choose, may_pay
from sglite.runtime.speculative.state import BACKOFF_AFTER, BACKOFF_MAX, SpecState
from sglite.runtime.step_plan import StepEntry

# a CPU-like cost curve (ms): a second row ~10% of a step, 8 rows ~2.7x; a verify step +0.5 ms
CPU = StepCost({1: 7.5, 2: 8.3, 4: 11.7, 8: 20.3, 16: 38.9, 32: 73.2}, overhead=1.5)
CPU.verify_extra = 0.5


LINEAR = StepCost({1: 1.0, 2: 1.5, 8: 4.5, 32: 16.5})  # each row after the first half a step


FLAT = StepCost({1: 1.0, 32: 1.0})  # rows free (a GEMM step, a GPU)


# ---------------------------------------------------------------------- policy (unit)
def test_choose_drafts_only_what_pays_for_its_rows():
    # one request, rows at half a step each (counted 1.25x: COST_MARGIN): a token pays only when
    # kept with p > 0.625 (about)
    assert choose(1, 1, [[0.3, 0.09]], LINEAR) == [0]
    # (1 + 0.9 + 0.81) / (1 + 2 * 0.625) = 1.204 beats 3.44 / (1 + 3 * 0.625) = 1.196: two tokens
    assert choose(1, 1, [[0.9, 0.81, 0.73, 0.66, 0.59, 0.53, 0.48]], LINEAR) == [2]
    assert choose(1, 1, [[0.99 ** i for i in range(1, 8)]], LINEAR) == [7]  # a copy: all of it
    # the same probabilities on free rows: the whole chain
    assert choose(1, 1, [[0.9, 0.81, 0.73, 0.66, 0.59, 0.53, 0.48]], FLAT) == [7]
    # a tree: the second chain's tokens compete with the first chain's, by probability
    assert choose(1, 1, [[0.95, 0.9], [0.04, 0.03]], LINEAR) == [2, 0]
    assert choose(1, 1, [[0.95, 0.9], [0.04, 0.03]], FLAT) == [2, 2]
    # batch 8: a row costs 1/8 of what the step's tokens are worth each, so weak drafts stop ...
    assert choose(8, 8, [[0.3]] * 8, LINEAR) == [0] * 8
    # ... unless the rows are free (a step with a prefill chunk runs GEMMs): any estimate > 0
    assert choose(8, 40, [[0.3]] * 8, FLAT) == [1] * 8


def test_choose_keeps_chain_prefixes():
    got = choose(1, 1, [[1.0, 1.0, 1.0, 0.2], [0.9, 0.9]], StepCost({1: 1.0, 32: 1.0 + 31 * 0.3}))
    assert got == [3, 2]  # equal probabilities taken in chain order; the 0.2 tail left out


def test_step_cost_interpolates_and_learns_the_overhead():
    c = StepCost({1: 0.010, 8: 0.031, 32: 0.115}, overhead=0.002)
    assert c(1) == pytest.approx(0.012) and c.forward(8) == pytest.approx(0.031)
    assert c.forward(4) == pytest.approx(0.010 + 0.021 * 3 / 7)
    assert c.forward(40) > c.forward(32)  # extrapolated from the last two
    for _ in range(200):
        c.observe(1, 0.015)  # 5 ms beyond the forward, every step
    assert c.overhead == pytest.approx(0.005, abs=1e-4)
    c.observe(1, 5.0)  # an idle wait between requests: ignored
    assert c.overhead == pytest.approx(0.005, abs=1e-4)
    for _ in range(200):
        c.observe(4, c.forward(4) + 0.006, drafted=True)  # drafting and verification: 1 ms more
    assert c.verify_extra == pytest.approx(0.001, abs=1e-4) and c.overhead == pytest.approx(0.005, abs=1e-4)
    assert c(4, drafted=True) == pytest.approx(c(4) + 0.001, abs=1e-4)
    # the extra is charged to drafting: a draft kept with p = 0.3 no longer pays at batch 1
    assert choose(1, 1, [[0.3]], StepCost({1: 1.0, 2: 1.2})) == [1]
    slow = StepCost({1: 1.0, 2: 1.2})
    slow.verify_extra = 0.1
    assert choose(1, 1, [[0.3]], slow) == [0]
    with pytest.raises(ValueError, match="forward"):
        StepCost({})


def test_accept_model_learns_per_source_and_per_request():
    m = AcceptModel()
    p0 = m.rate("ngram1")
    own = {}
    for _ in range(20):
        m.record(["ngram1"] * 4, 0, own)  # every first token rejected
    assert m.rate("ngram1") < p0 / 2 and m.rate("ngram1", own) < m.rate("ngram1")
    for _ in range(20):
        m.record(["text"] * 8, 8)  # copies kept whole
    m.record(["text", "text_word"], 1)  # a copied value ended where a new word began
    assert m.rate("text") > 0.9
    assert m.rate("text", own) == m.rate("text")  # no evidence of its own: the global estimate
    assert m.counts["text_word"][0] == 0 and m.counts["text_word"][1] == pytest.approx(1.0)


# ---------------------------------------------------------------------- row budget (unit)
def test_row_budget_keeps_drafts_in_the_gemv_block():
    from sglite.runtime.speculative.budget import RowBlock, fit_chains
    from sglite.runtime.speculative.decoder import SpecDecoder
    from sglite.runtime.step_plan import StepEntry

    class Cfg:
        speculative_algorithm, speculative_num_draft_tokens, speculative_disable_by_batch_size = "NGRAM", 8, 8
        page_size = 1

    budget = SpecDecoder(Cfg, None, None, None, row_block=8).budget
    assert isinstance(budget, RowBlock)  # no measured cost: the row-block policy
    mk = lambda n: StepEntry(req=None, n=n, start=0)  # noqa: E731
    assert budget.step_rows([mk(1)]) == 7  # one decode row: 7 draft rows fit the block
    assert budget.step_rows([mk(4)]) == 4  # jump-forward pending tokens take their rows first
    assert budget.step_rows([mk(1)] * 8) == 0  # a full block: drafting would start a new one
    assert not budget.open_step([mk(1)] * 8, 8)  # ... so the step drafts nothing
    assert budget.step_rows([mk(40)]) > 8  # a GEMM step: rows are cheap
    assert SpecDecoder(Cfg, None, None, None).budget.step_rows([mk(1)] * 8) > 8  # no block (GPU)
    assert fit_chains([[1, 2, 3, 4, 5], [6, 7, 8], [9]], 6) == [[1, 2, 3, 4, 5], [], []]
    assert fit_chains([[1, 2], [6, 7, 8], [9]], 6) == [[1, 2], [6, 7], [9]]  # later: half of what is left
    assert budget.open_step([mk(1)], 1) and budget.fit([[1, 2, 3, 4, 5, 6, 7, 8]], [["text"] * 8]) == [[1, 2, 3, 4, 5, 6, 7]]
    budget.spend(7)
    assert budget.rows_left == 0


# ---------------------------------------------------------------------- backoff (unit)
def test_backoff_waits_2_4_8_after_a_run_of_misses_and_resets_on_a_kept_token():
    st = SpecState()
    for _ in range(BACKOFF_AFTER):
        assert st.may_look()
        st.missed()
    assert st.wait == 0 and st.may_look()  # the first BACKOFF_AFTER misses: still every step
    waits = []
    for _ in range(4):
        st.missed()
        waits.append(st.wait)
        skipped = 0
        while not st.may_look():
            skipped += 1
        assert skipped == waits[-1]
    assert waits == [2, 4, 8, BACKOFF_MAX]
    st.missed()
    assert not st.may_look() and st.may_look(force=True)  # a strong signal looks whatever the wait
    st.record(4, 1)  # a verify step kept a token: look every step again
    assert st.misses == 0 and st.wait == 0 and st.may_look()
    for _ in range(BACKOFF_AFTER + 1):
        st.record(3, 0)  # rejected drafts count as misses too
    assert st.wait == 2


# ---------------------------------------------------------------------- may_pay (unit)
def test_may_pay_is_an_upper_bound_of_choose():
    assert not may_pay(1, 1, [], CPU) and not may_pay(1, 1, [(0.0, 8), (0.5, 0)], CPU)
    assert may_pay(1, 1, [(0.9, 8)], CPU)  # a copy
    assert not may_pay(1, 1, [(0.05, 8), (0.04, 1)], CPU)  # open chat: nothing pays its row
    rng = random.Random(0)
    flat, linear = StepCost({1: 1.0, 32: 1.0}), StepCost({1: 1.0, 2: 1.5, 8: 4.5, 32: 16.5})
    heavy = StepCost({1: 7.5, 2: 8.3, 8: 20.3}, overhead=1.5)
    heavy.verify_extra = 6.0  # a fixed extra per verify step: one token never pays, a long chain may
    assert not may_pay(1, 1, [(0.5, 1)], heavy) and may_pay(1, 1, [(0.97, 8)], heavy)
    for _ in range(600):
        cost = rng.choice([CPU, flat, linear, heavy])
        base = rng.choice([1, 1, 2, 4, 8])
        cands = [(rng.uniform(0.0, rng.choice([0.3, 0.6, 1.0])), rng.randint(1, 8)) for _ in range(rng.randint(1, 3))]
        # actual chains under the bound: conditional rates <= q, a later chain scaled down
        chains, scale = [], 1.0
        for q, n in cands:
            ps, p = [], scale
            for _ in range(n):
                p *= rng.uniform(0.0, q)
                ps.append(p)
            chains.append(ps)
            scale *= rng.uniform(0.0, 1.0)
        if any(choose(base, base, chains, cost)):
            assert may_pay(base, base, cands, cost), (base, cands, chains)


# ---------------------------------------------------------------------- a copy after failures
class _Req:
    def __init__(self, prompt, out):
        self.input_ids, self.output_ids = list(prompt), list(out)
        self.prefilling, self.finished, self.return_logprob, self.grammar = False, None, False, None
        self.params = SimpleNamespace(max_new_tokens=512, temperature=0.0)
        self.spec = None

    @property
    def seq_len(self):
        return len(self.input_ids) + len(self.output_ids)

    def tokens(self, a, b):
        return (self.input_ids + self.output_ids)[a:b]


class _Cfg:
    speculative_algorithm, speculative_num_draft_tokens, speculative_disable_by_batch_size = "NGRAM", 8, 8
    page_size = 1


def _decoder(tok):
    kv = SimpleNamespace(req_pool=SimpleNamespace(max_context=4096))
    dec = SpecDecoder(_Cfg, kv, None, SimpleNamespace(tokenizer=tok), cost=CPU)
    for _ in range(60):  # a run of failed weak drafts (open chat) before
        for src in ("ngram1", "ngram2", "text_weak"):
            dec.accept.record([src] * 4, 0)
    return dec


def _chains(dec, req):
    e = StepEntry(req, 1, req.seq_len - 1)
    assert dec.budget.open_step([e], 1)  # a one-request decode step: the may_pay gate at (1, 1, CPU)
    found = dec.proposer.lookup(e, dec._room(e), dec.budget)
    lens = choose(1, 1, [[_prod(dec, req, src[:i + 1]) for i in range(len(c))] for c, src in found], CPU)
    return found, lens


def _prod(dec, req, srcs):
    p = 1.0
    for s in srcs:
        p *= dec.accept.rate(s, req.spec.own)
    return p


def test_a_copy_still_drafts_after_a_run_of_failures(real_tokenizer):
    tok = real_tokenizer
    para = ("The city council met on Tuesday evening to discuss the new library budget. After two hours "
            "of debate, the members agreed to extend the opening hours on weekends.")
    prompt = tok.encode("Rewrite this paragraph: " + para + "\nAnswer: ")
    copy = tok.encode(para)
    dec = _decoder(tok)
    assert AcceptModel().rate("ngram1") > dec.accept.rate("ngram1")  # poisoned
    # open text first: weak or no candidates, the request backs off
    req = _Req(prompt, tok.encode("Sure! Here is a different version of it, with a new start"))
    for _ in range(BACKOFF_AFTER + 3):
        req.spec = req.spec or SpecState()
        req.spec.missed()
    assert req.spec.wait == BACKOFF_MAX
    # the output starts copying: a 3-token n-gram match looks despite the wait, and drafts
    req.output_ids += copy[:4]
    found, lens = _chains(dec, req)
    assert found and found[0][0][:4] == copy[4:8] and lens[0] >= 1, (found, lens)
    # in backoff, a step without a strong match skips the text lookup (and weak n-grams do not pay)
    req2 = _Req(prompt, tok.encode("Sure! Here is a different version"))
    req2.spec = SpecState(misses=BACKOFF_AFTER + 3, wait=BACKOFF_MAX)
    e2 = StepEntry(req2, 1, req2.seq_len - 1)
    assert dec.proposer.lookup(e2, dec._room(e2), dec.budget) == [] and req2.spec.wait == BACKOFF_MAX - 1


def test_engine_copy_drafts_after_failures_and_stays_greedy_identical(ngram_pair, monkeypatch):
    from tests.speculative.prompts import COPY_PROMPTS

    base, spec = ngram_pair
    dec = spec.scheduler.spec
    if dec.cost is None:
        pytest.skip("no measured step cost on this runner (the backoff is part of the cost policy)")
    monkeypatch.setattr(spec_state, "BACKOFF_AFTER", 0)  # every miss backs off at once
    saved = {k: list(v) for k, v in dec.accept.counts.items()}
    try:
        for _ in range(60):
            for src in ("ngram1", "ngram2", "text_weak"):
                dec.accept.record([src] * 4, 0)
        sp = {"max_new_tokens": 48, "temperature": 0}
        open_q = spec.generate(COPY_PROMPTS[3], sp)
        assert open_q["output_ids"] == base.generate(COPY_PROMPTS[3], sp)["output_ids"]
        for p in COPY_PROMPTS[:3]:
            got = spec.generate(p, sp)
            assert got["output_ids"] == base.generate(p, sp)["output_ids"]
        before = dict(dec.stats)
        got = spec.generate(COPY_PROMPTS[0], sp)
        assert dec.stats["spec_accepted_tokens"] > before["spec_accepted_tokens"], got["meta_info"]
    finally:
        for k, v in saved.items():
            dec.accept.counts[k] = v


# ---------------------------------------------------------------------- owners: budget, proposer, scratch rows
def test_both_draft_budgets_implement_the_protocol():
    from sglite.runtime.speculative.budget import UNLIMITED, DraftBudget, MeasuredCost, RowBlock

    members = [m for m in vars(DraftBudget) if not m.startswith("_")] + list(DraftBudget.__annotations__)
    for budget in (RowBlock(8), MeasuredCost(CPU, AcceptModel())):
        assert not [m for m in members if not hasattr(budget, m)], type(budget).__name__
    st = SpecState(cap=2)
    rb, mc = RowBlock(8), MeasuredCost(CPU, AcceptModel())
    assert (rb.cap(st, 6), rb.cap(st, 6, trusted=True), rb.match_cap(2)) == (2, 6, 4)  # capped at build time
    assert (mc.cap(st, 6), mc.match_cap(2), mc.weak_rows(6)) == (6, UNLIMITED, 6)  # cut later, by choose
    assert rb.open_step([StepEntry(req=None, n=1, start=0)], 1) and rb.weak_rows(8) == 3  # 7 left, 4 cheap


def test_kv_manager_scratch_rows_copy_reorder_and_account():
    import torch

    from sglite.runtime.kv_manager import KVManager
    from sglite.runtime.kv_pool import ReqToTokenPool, TokenToKVPool

    kvm = KVManager(ReqToTokenPool(4, 16), TokenToKVPool(32, 1, 1, 1, 4, torch.float32), 1)
    table = kvm.req_to_token
    table[0, :6] = torch.tensor([5, 6, 7, 8, 9, 10], dtype=torch.int32)
    assert kvm.req_pool.alloc() == 0
    rows = kvm.borrow_rows(5)  # 3 rows left in the table: fewer than asked
    assert len(rows) == 3 and kvm.borrowed_rows == rows
    kvm.fill_scratch_row(rows[0], 0, 3, 4, 2)  # prefix 5, 6, 7, then slots at positions 4, 5
    assert table[rows[0], :5].tolist() == [5, 6, 7, 9, 10]
    kvm.reorder_slots(0, 3, [2, 0, 1])
    assert table[0, :6].tolist() == [5, 6, 7, 10, 8, 9]
    with pytest.raises(AssertionError, match="still borrowed"):
        kvm.check_rows([])
    kvm.return_rows(rows[:1] + [99])  # a row not borrowed is ignored
    assert kvm.borrowed_rows == rows[1:]
    kvm.return_rows()
    kvm.req_pool.free(0)
    kvm.check_rows([])
    with kvm.probe_row(4) as row:
        assert table[row, :4].tolist() == [1, 2, 3, 4]
    assert not table[row].any() and kvm.req_pool.available() == 4
