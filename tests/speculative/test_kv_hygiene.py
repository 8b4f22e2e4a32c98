"""Speculative decoding (issue 17): KV and slot-table rows stay accounted for. Draft slots are
reserved and trimmed page by page; a step that fails with a token tree in flight, an abort while
speculating and retraction of a speculating request leave no slot or scratch row behind, and the
row accounting catches a leak.

Oracles: the KV manager's and the decoder's invariants (``check_invariants``) after every step,
the pool's free counts, and greedy output against the engine without speculation afterwards.
"""
import pytest
import torch

from sglite import Engine


# ---------------------------------------------------------------------- KV manager (unit)
def test_reserve_more_and_trim_free_rejected_pages():
    from sglite.runtime.kv_manager import KVManager
    from sglite.runtime.kv_pool import ReqToTokenPool, TokenToKVPool

    class R:
        rid, kv = "r", None

        def tokens(self, a, b):
            return list(range(a, b))

    kvm = KVManager(ReqToTokenPool(2, 64), TokenToKVPool(64, 4, 1, 1, 4, torch.float32), 4)
    r = R()
    prefix, node = kvm.match_prefix([])
    assert kvm.admit(r, prefix, node, 6)
    kvm.commit(r, 5, share=False)  # 5 computed, 1 reserved (the pending token)
    free0 = kvm.free_tokens()
    assert kvm.reserve_more(r, 7)  # drafts: alloc 6 -> 13 = pages 0..3
    assert r.kv.alloc_len == 13 and kvm.free_tokens() == free0 - 8
    kvm.commit(r, 3, share=False)  # pending + 2 accepted: kv_len 8
    kvm.trim(r)
    assert r.kv.alloc_len == 8 and kvm.free_tokens() == free0  # the pages of tokens 8..12 freed
    kvm.check_invariants([r])
    assert not kvm.reserve_more(r, 10_000)  # beyond the pool: refused, nothing reserved
    assert r.kv.alloc_len == 8
    kvm.release(r)
    kvm.check_invariants([])


# ---------------------------------------------------------------------- failures, scratch rows
def test_failed_verify_step_returns_tree_rows_and_kv(ngram_pair):
    """A step that raises with a token tree in flight (scratch rows borrowed, draft KV reserved)
    fails its requests and leaves no row or slot behind; the engine keeps serving."""
    _, spec = ngram_pair
    sched = spec.scheduler
    runner = sched.runner
    orig = runner.forward
    fired = []

    def forward(batch):
        if sched.kv.borrowed_rows and not fired:
            fired.append(len(sched.kv.borrowed_rows))
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
    row = dec.kv.borrow_rows(1)
    assert row and dec.kv.borrowed_rows == row
    with pytest.raises(AssertionError, match="still borrowed"):
        dec.check_invariants([])
    dec.release_scratch()
    dec.check_invariants([])
    lost = dec.kv.req_pool.alloc()  # a row nobody accounts for
    with pytest.raises(AssertionError, match="rows lost"):
        dec.check_invariants([])
    dec.kv.req_pool.free(lost)


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
