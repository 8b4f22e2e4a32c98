"""Speculative decoding, fourth pass (issue 17): near-zero cost when a step drafts nothing.

Oracles: the backoff schedule worked by hand (misses -> waits 2, 4, 8, 8; a kept token resets it;
a strong signal looks anyway); :func:`policy.may_pay` never says no where :func:`policy.choose`
would draft (random chains under the bound); the byte-joined tail text equals the tokenizer's
decode and the backend encode its ids; a copy prompt still drafts after a run of failures, at the
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
from sglite.runtime.speculative.text_lookup import TextLookup, TokenText
from sglite.runtime.step_plan import StepEntry

# a CPU-like cost curve (ms): a second row ~10% of a step, 8 rows ~2.7x; a verify step +0.5 ms
CPU = StepCost({1: 7.5, 2: 8.3, 4: 11.7, 8: 20.3, 16: 38.9, 32: 73.2}, overhead=1.5)
CPU.verify_extra = 0.5


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


# ---------------------------------------------------------------------- tail text (unit)
def test_token_text_joins_bytes_like_the_tokenizer_decodes(real_tokenizer):
    tok = real_tokenizer
    text = "Héllo wörld — 日本語 tokens, \"quoted\" {json: 1}\n<|im_end|> next"
    ids = tok.encode(text)
    tt = TokenText(tok)
    tt.check(ids, tok.decode(ids, skip_special_tokens=False))
    assert tt._exact
    for a in range(0, len(ids), 3):
        for b in range(a + 1, min(len(ids), a + 12) + 1):
            assert tt.text(ids[a:b]) == tok.decode(ids[a:b], skip_special_tokens=False)
    for s in ("Seville\", \"job\": \"", " the members agreed", "<|im_start|>assistant\nHi"):
        assert tt.encode(s) == tok.encode(s)
    space = tok.encode(" members")[0]
    assert tt.starts_word(space) and not tt.starts_word(tok.encode("members")[0])


def test_text_lookup_min_chars_drops_short_unaligned_matches():
    look = TextLookup("the cat sat on the mat")
    assert look.find("xqat", 6)  # "qat": not in the source; "at" is (2 chars, mid-word in the tail)
    assert look.find("xqat", 6, min_chars=3) == []
    assert look.find("xx at", 6, min_chars=3)  # "at" starts a word in the tail: may be aligned
    assert look.find("on the m", 6, min_chars=3)[0].cont == "at"  # long enough: kept


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
    dec._gate = (1, 1, CPU)  # what _attach sets for a one-request decode step
    found = dec._ngram(e)
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
    assert dec._ngram(StepEntry(req2, 1, req2.seq_len - 1)) == [] and req2.spec.wait == BACKOFF_MAX - 1


def test_engine_copy_drafts_after_failures_and_stays_greedy_identical(ngram_pair, monkeypatch):
    from tests.speculative.test_exact_sampling import COPY_PROMPTS

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
