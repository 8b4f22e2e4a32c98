"""Speculative decoding, second pass (issue 17): text-level prompt lookup, the CPU row budget,
greedy grammar verification without per-draft masks, token-tree scratch rows on failures,
quantized self-speculation.

Oracles: greedy output token for token against the engine without speculation (fp32), the KV
and slot-table row accounting (``check_invariants``) after failures, and prefix matching against
fully masked rows for the lazy grammar walk.
"""
import json

import pytest
import torch

from sglite import Engine
from sglite.runtime.speculative.text_lookup import TextLookup
from sglite.runtime.speculative.verify import greedy_walk

SOURCE = ("Maria Gonzalez lives in Seville and works as a veterinarian. You can reach Maria at "
          "maria.gonzalez@example.com. Extract the name, email, city and job of this person as JSON.")


# ---------------------------------------------------------------------- text lookup (unit)
def test_text_lookup_copies_across_json_punctuation():
    look = TextLookup(SOURCE)
    # the model spelled the value's start with a token the prompt never had ("mar" after a quote)
    (m,) = look.find('{"name":"Maria Gonzalez","email":"mar', 12)
    assert m.cont == "ia.gonzalez@" and m.chars == 3 and m.aligned
    # a one-character start: word-aligned occurrences ("Seville") rank before the latest one
    # ("JSON", mid-word)
    got = look.find('","city":"S', 6, candidates=3)
    assert got[0].cont == "eville" and got[0].aligned
    assert any(g.cont.startswith("ON.") and not g.aligned for g in got)
    assert look.find('":"', 5) == []  # JSON punctuation alone matches nothing in the prompt
    assert look.longest_suffix("xyz Seville and") == len(" Seville and")
    assert look.find("qqq", 4) == [] and look.find("Maria", 0) == []


def test_text_lookup_continuations_are_distinct_and_bounded():
    look = TextLookup("ab cd ab cd ab ce")
    got = look.find("ab c", 3, candidates=5)
    assert [g.cont for g in got] == ["e", "d a"]  # latest first, duplicates dropped
    assert all(len(g.cont) <= 3 for g in got)


# ---------------------------------------------------------------------- lazy greedy grammar walk
class _Grammar:
    """Allows the tokens of ``allowed`` (a function of the accepted tokens so far)."""

    def __init__(self, allowed):
        self.allowed, self.acc, self.fills = allowed, [], 0

    def fill_next_token_bitmask(self, m, row=0):
        self.fills += 1
        m[row].zero_()
        for t in self.allowed(self.acc):
            m[row, t // 32] |= 1 << (t % 32)

    def accept_token(self, t):
        if t not in self.allowed(self.acc):
            return False
        self.acc.append(t)
        return True

    def is_terminated(self):
        return False

    def rollback(self, n):
        if n:
            del self.acc[-n:]


def test_greedy_walk_equals_prefix_matching_on_masked_rows():
    from sglite.kernels.reference import bitmask_to_additive
    from sglite.runtime.speculative.verify import verify_chain
    from sglite.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    V, W = 40, 2
    for trial in range(200):
        allowed_sets = [set(torch.randperm(V, generator=gen)[:12].tolist()) for _ in range(6)]
        allowed = lambda acc: allowed_sets[len(acc)]  # noqa: E731
        x = torch.randn(6, V, generator=gen)
        draft = []
        for i in range(5):  # draft: often the masked argmax, sometimes another allowed token
            masked = x[i].clone()
            masked[[t for t in range(V) if t not in allowed_sets[i]]] = float("-inf")
            pick = int(masked.argmax()) if trial % 3 else sorted(allowed_sets[i])[0]
            draft.append(pick)
        g = _Grammar(allowed)
        child = lambda row, t: row + 1 if row < len(draft) and draft[row] == t else None  # noqa: E731
        toks, rows = greedy_walk(x, child, g, W)
        assert g.acc == []  # rolled back
        # the oracle: every row masked by the grammar state after the draft tokens above it
        bm = torch.zeros(6, W, dtype=torch.int32)
        for i in range(6):
            for t in allowed_sets[i]:
                bm[i, t // 32] |= 1 << (t % 32)
        want, a = verify_chain(x + bitmask_to_additive(bm, V), draft, SamplingParams(max_new_tokens=8, temperature=0))
        assert toks == want and rows == list(range(a + 1))


def test_greedy_walk_rolls_back_when_the_grammar_raises():
    class Boom(_Grammar):
        def accept_token(self, t):
            if len(self.acc) == 2:
                raise RuntimeError("grammar failure")
            return super().accept_token(t)

    g = Boom(lambda acc: set(range(10)))
    x = torch.zeros(5, 10)
    x[:, 3] = 1.0
    with pytest.raises(RuntimeError):
        greedy_walk(x, lambda row, t: row + 1 if row < 4 else None, g, 1)
    assert g.acc == []


# ---------------------------------------------------------------------- engine
def test_json_extraction_greedy_identical_with_text_drafts(ngram_pair):
    """Copy-into-JSON prompts, batched and alone: same tokens as without speculation."""
    base, spec = ngram_pair
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "city"],
              "properties": {"name": {"type": "string", "maxLength": 20}, "city": {"type": "string", "maxLength": 20}}}
    prompts = [SOURCE + ' {"name":"Maria Gonzalez","city":"Seville"} again:',
               "Tom Becker lives in Hamburg. " * 3 + "JSON:"]
    sps = [{"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema)},
           {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema), "frequency_penalty": 0.3}]
    want = [o["output_ids"] for o in base.generate(prompts, sps)]
    assert [o["output_ids"] for o in spec.generate(prompts, sps)] == want
    assert [spec.generate(p, s)["output_ids"] for p, s in zip(prompts, sps)] == want


def test_failed_verify_step_returns_tree_rows_and_kv(ngram_pair):
    """A step that raises with a token tree in flight (scratch rows borrowed, draft KV reserved)
    fails its requests and leaves no row or slot behind; the engine keeps serving."""
    _, spec = ngram_pair
    sched = spec.scheduler
    runner = sched.runner
    orig = runner.forward
    fired = []

    def forward(batch):
        if sched.spec._borrowed and not fired:
            fired.append(len(sched.spec._borrowed))
            raise RuntimeError("injected failure mid-verify")
        return orig(batch)

    runner.forward = forward
    try:
        prompt = "alpha beta gamma delta alpha beta gamma epsilon alpha beta gamma delta alpha beta"
        out = spec.generate(prompt, {"max_new_tokens": 40, "temperature": 0})
    finally:
        runner.forward = orig
    assert fired, "no token tree was drafted"
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    spec.scheduler.check_invariants()  # rows: none borrowed, none lost
    pool = sched.kv.req_pool
    assert pool.available() == pool.req_to_token.shape[0]
    # still serving, with identical output
    base, _ = ngram_pair
    sp = {"max_new_tokens": 20, "temperature": 0}
    assert spec.generate(prompt, sp)["output_ids"] == base.generate(prompt, sp)["output_ids"]


def test_scratch_row_accounting_detects_a_leak(ngram_pair):
    _, spec = ngram_pair
    dec = spec.scheduler.spec
    row = dec._scratch_rows(1)
    assert row and dec._borrowed == row
    with pytest.raises(AssertionError, match="still borrowed"):
        dec.check_invariants([])
    dec.release_scratch()
    dec.check_invariants([])
    lost = dec.kv.req_pool.alloc()  # a row nobody accounts for
    with pytest.raises(AssertionError, match="rows lost"):
        dec.check_invariants([])
    dec.kv.req_pool.free(lost)


def test_row_budget_keeps_drafts_in_the_gemv_block():
    from sglite.runtime.speculative.decoder import SpecDecoder
    from sglite.runtime.step_plan import StepEntry

    class Cfg:
        speculative_algorithm, speculative_num_draft_tokens, speculative_disable_by_batch_size = "NGRAM", 8, 8
        page_size = 1

    dec = SpecDecoder(Cfg, None, None, None, row_block=8)
    mk = lambda n: StepEntry(req=None, n=n, start=0)  # noqa: E731
    assert dec._step_rows([mk(1)]) == 7  # one decode row: 7 draft rows fit the block
    assert dec._step_rows([mk(4)]) == 4  # jump-forward pending tokens take their rows first
    assert dec._step_rows([mk(1)] * 8) == 0  # a full block: drafting would start a new one
    assert dec._step_rows([mk(40)]) > 8  # a GEMM step: rows are cheap
    assert SpecDecoder(Cfg, None, None, None)._step_rows([mk(1)] * 8) > 8  # no block (GPU)
    assert SpecDecoder._fit([[1, 2, 3, 4, 5], [6, 7, 8], [9]], 6) == [[1, 2, 3, 4, 5], [], []]
    assert SpecDecoder._fit([[1, 2], [6, 7, 8], [9]], 6) == [[1, 2], [6, 7], [9]]  # later: half of what is left


@pytest.mark.slow
def test_self_speculation_with_the_quantized_gguf_as_draft(real_checkpoint):
    """STANDALONE self-speculation: the default model's GGUF, kept quantized (Q4/Q8 blocks), drafts
    for the same model dequantized (``quantization="none"``, float32). Greedy output equals the
    target's own (requests with logprobs are never drafted: the same engine's baseline) and the
    quantized copy's drafts are mostly kept."""
    from sglite.kernels.quant_linear import QuantLinearWeight

    e = Engine(dtype="float32", quantization="none", max_total_tokens=8192, check_invariants=True,
               speculative_algorithm="STANDALONE", speculative_draft_model_path=real_checkpoint.source,
               speculative_num_steps=4)
    try:
        draft, target = e.scheduler.spec.draft_model.runner.model, e.runner.model
        assert isinstance(draft.embed, QuantLinearWeight)  # the draft really runs the quantized blocks
        assert not isinstance(target.embed, QuantLinearWeight)
        prompts = [e.apply_chat_template([{"role": "user", "content": m}])
                   for m in ("Why is the sky blue?", "Write a haiku about autumn leaves.")]
        sp = {"max_new_tokens": 32, "temperature": 0}
        want = [e.generate(p, sp, return_logprob=True)["output_ids"] for p in prompts]
        got = e.generate(prompts, sp)
        assert [g["output_ids"] for g in got] == want
        assert min(g["meta_info"]["spec_accept_length"] for g in got) > 1.5
    finally:
        e.shutdown()


# ---------------------------------------------------------------------- abort, retraction
def test_abort_while_speculating_frees_everything(ngram_pair):
    import asyncio

    _, spec = ngram_pair
    prompt = "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta alpha beta"

    async def main():
        p = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}
        it = await spec.async_generate(prompt, p, stream=True, rid="spec-victim")
        n, last, aborted = 0, None, []
        async for ev in it:
            n += 1
            last = ev
            if ev["meta_info"].get("spec_verify_ct", 0) >= 2 and not aborted:
                aborted.append(n)
                spec.abort("spec-victim")
            if ev["meta_info"]["finish_reason"] is not None:
                break
        return last

    ev = asyncio.run(main())
    assert ev["meta_info"]["finish_reason"]["type"] == "abort"
    assert ev["meta_info"]["completion_tokens"] < 300 and ev["meta_info"]["spec_verify_ct"] > 0
    spec.scheduler.check_invariants()
    info = spec.get_server_info()
    assert info["available_tokens"] == info["max_total_tokens"]


def test_retraction_while_speculating_greedy_identical(tiny_model_dir):
    """A pool too small for the batch: requests are retracted (their draft slots included) and
    resumed; output equals the run without speculation, KV accounted after every step."""
    kw = dict(dtype="float32", device="cpu", max_total_tokens=160, check_invariants=True, page_size=1)
    prompts = ["alpha beta gamma delta alpha beta gamma delta alpha beta", "1, 2, 3, 1, 2, 3, 1, 2",
               "one two one two one two one", "x y z x y z x y z x"]
    sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    base = Engine(str(tiny_model_dir), **kw)
    want = [o["output_ids"] for o in base.generate(prompts, sp)]
    base.shutdown()
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", **kw)
    try:
        got = spec.generate(prompts, sp)
        info = spec.get_server_info()
    finally:
        spec.shutdown()
    assert [o["output_ids"] for o in got] == want
    assert info["retractions"] > 0 and info["spec_accepted_tokens"] > 0


@pytest.mark.slow
def test_bf16_deterministic_greedy_identical_regex_and_json(tiny_model_dir):
    """bf16 with ``enable_deterministic_inference``: plain, regex and JSON-schema requests batched
    together give the same tokens with and without speculation (text drafts and the lazy grammar
    walk included)."""
    kw = dict(dtype="bfloat16", device="cpu", max_total_tokens=2048, enable_deterministic_inference=True)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "city"],
              "properties": {"name": {"type": "string", "maxLength": 20}, "city": {"type": "string", "maxLength": 20}}}
    prompts = ["alpha beta gamma delta alpha beta gamma delta alpha beta", "abab abab abab ab",
               SOURCE + ' {"name":"Maria Gonzalez","city":"Seville"} again:']
    sps = [{"max_new_tokens": 30, "temperature": 0},
           {"max_new_tokens": 30, "temperature": 0, "regex": r"(ab ){2,8}(abab|ba)"},
           {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema)}]
    base = Engine(str(tiny_model_dir), **kw)
    want = [o["output_ids"] for o in base.generate(prompts, sps)]
    base.shutdown()
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", **kw)
    try:
        got = spec.generate(prompts, sps)
        assert [o["output_ids"] for o in got] == want
        assert [spec.generate(p, s)["output_ids"] for p, s in zip(prompts, sps)] == want
        assert spec.get_server_info()["spec_accepted_tokens"] > 0
    finally:
        spec.shutdown()
