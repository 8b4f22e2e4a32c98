"""Scheduler, KVManager and StepPlan with a fake runner: no model, no tokenizer files.

The fake model stores each token id in its KV slot and predicts ``1 + (sum of the token ids it
can see through the slot table) % 26``, so a wrong slot, a stale prefix or a misplaced row changes
the output; the oracle computes the same function from the plain token sequence. Letters a..z are
tokens 1..26, token 0 is EOS.
"""
import random

import pytest
import torch

from sglite.config import EngineConfig
from sglite.errors import CapacityError
from sglite.runtime.detokenizer import IncrementalDetokenizer
from sglite.runtime.forward_batch import ForwardBatch
from sglite.runtime.kv_manager import KVManager, KVState
from sglite.runtime.kv_pool import ReqToTokenPool, TokenToKVPool
from sglite.runtime.logprob_options import NO_LOGPROBS, LogprobOptions
from sglite.runtime.req import Req
from sglite.runtime.scheduler import Scheduler
from sglite.runtime.step_plan import StepEntry, StepPlan
from sglite.sampling_params import SamplingParams

V = 32


class FakeTokenizer:
    eos_token_ids = frozenset({0})

    def id_to_text(self, i: int) -> str:
        return chr(96 + i) if 1 <= i <= 26 else ""

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True) -> str:
        return "".join(self.id_to_text(i) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) - 96 for c in text]


def predict(visible: list[int]) -> int:
    return 1 + sum(visible) % 26


class FakeRunner:
    """Implements :class:`~sglite.runtime.runner_protocol.RunnerProtocol` over a one-number-per-slot
    'KV' (tests/runtime/test_runner_contract.py checks it against the real runners' contract)."""

    device = "cpu"
    dtype = torch.float32
    vocab_size = V
    measure_forward = False  # its time says nothing about a model

    def __init__(self, tokens: int, page_size: int = 1, max_reqs: int = 16, context: int = 512):
        self.req_to_token_pool = ReqToTokenPool(max_reqs, context)
        self.token_to_kv_pool = TokenToKVPool(tokens, page_size, 1, 1, 1, torch.float32)
        self.context_length = context
        self.max_total_tokens = self.token_to_kv_pool.capacity
        self.bytes_per_token = self.token_to_kv_pool.bytes_per_token
        self.store = torch.full(((self.token_to_kv_pool.num_pages + 1) * page_size,), -1, dtype=torch.int64)
        self.batches = []
        self.closed = False

    def close(self):
        self.closed = True

    def forward(self, fb):
        self.batches.append(fb)
        assert len(set(fb.out_cache_loc.tolist())) == fb.out_cache_loc.numel(), "two tokens share a slot"
        assert 0 not in fb.out_cache_loc.tolist(), "the padding slot was handed out"
        self.store[fb.out_cache_loc] = fb.input_ids
        rows = []  # (req row, visible length) per token
        for row, pre, n in zip(fb.ext_req_pool_indices.tolist(), fb.ext_prefix_lens.tolist(),
                               fb.ext_extend_lens.tolist()):
            rows.extend((row, pre + j + 1) for j in range(n))
        rows.extend(zip(fb.dec_req_pool_indices.tolist(), fb.dec_seq_lens.tolist()))
        assert [length - 1 for _, length in rows] == fb.positions.tolist()
        logits = torch.zeros(len(fb.logits_indices), V)
        for k, i in enumerate(fb.logits_indices.tolist()):
            row, length = rows[i]
            visible = self.store[fb.req_to_token[row, :length].long()].tolist()
            assert -1 not in visible, "attention reads a slot that was never written"
            logits[k, predict(visible)] = 10.0
        return logits


def oracle(ids: list[int], max_new: int) -> list[int]:
    seq, out = list(ids), []
    for _ in range(max_new):
        out.append(predict(seq))
        seq.append(out[-1])
    return out


def make(tokens=4096, page_size=1, **cfg):
    config = EngineConfig(page_size=page_size, **cfg)
    runner = FakeRunner(tokens, page_size, max_reqs=cfg.get("max_running_requests", 64) + 8)
    return Scheduler(config, runner, FakeTokenizer()), runner


def req(rid, ids, max_new, grammar=None, logprobs=NO_LOGPROBS, **sp):
    events = []
    r = Req(rid=rid, input_ids=list(ids), params=SamplingParams(max_new_tokens=max_new, temperature=0,
            ignore_eos=True, **sp), sink=events.append, seed=0, grammar=grammar, logprobs=logprobs,
            detok=IncrementalDetokenizer(FakeTokenizer()))
    r.events = events
    return r


def run(sched, reqs, check=True, max_steps=10_000):
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_work():
        assert sched.step() or not sched.has_work(), "scheduler stalled with work left"
        if check:
            sched.check_invariants()
        steps += 1
        assert steps < max_steps
    return steps


def workload(n, seed, shared_len=40):
    rng = random.Random(seed)
    shared = [[rng.randrange(1, 27) for _ in range(shared_len)] for _ in range(3)]
    out = []
    for i in range(n):
        own = [rng.randrange(1, 27) for _ in range(rng.randint(1, 30))]
        out.append(((rng.choice(shared) if rng.random() < 0.7 else []) + own, rng.randint(1, 12)))
    return out


@pytest.mark.parametrize("page_size,chunk,radix", [(1, 16, True), (4, 16, True), (1, None, True), (1, 8, False)])
def test_outputs_equal_oracle_under_chunking_sharing_and_pressure(page_size, chunk, radix):
    work = workload(40, seed=page_size * 7 + (chunk or 0))
    longest = max(len(ids) + m for ids, m in work)
    sched, runner = make(tokens=3 * longest, page_size=page_size, chunked_prefill_size=chunk,
                         max_running_requests=12, disable_radix_cache=not radix)
    reqs = [req(f"r{i}", ids, m) for i, (ids, m) in enumerate(work)]
    run(sched, reqs)
    for r, (ids, m) in zip(reqs, work):
        assert r.output_ids == oracle(ids, m), r.rid
        assert r.events[-1].meta_info["finish_reason"]["type"] == "length"
        assert r.kv == KVState()
    assert sched.kv.available_tokens() == sched.kv.kv_pool.capacity
    if radix:
        assert sched.stats["cached_tokens"] > 0
    assert sched.flush_cache() and sched.kv.free_tokens() == sched.kv.kv_pool.capacity


def test_admission_caps_running_requests_and_keeps_fifo_order():
    sched, runner = make(max_running_requests=2, chunked_prefill_size=None)
    reqs = [req(f"r{i}", [i + 1] * 5, 3) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    admitted = []
    while sched.has_work():
        sched.step()
        assert len(sched.running) <= 2
        for r in sched.running:
            if r.rid not in admitted:
                admitted.append(r.rid)
    assert admitted == [r.rid for r in reqs]


def test_chunked_prefill_sizes_and_decode_priority():
    sched, runner = make(chunked_prefill_size=16, decode_steps_per_chunk=2)
    short = req("short", [3, 4, 5], 20)
    sched.add_request(short)
    sched.step()  # prefill of the short one; it is decoding now
    long = req("long", list(range(1, 27)) * 2, 2)  # 52 tokens: chunks 16, 16, 16, 4
    sched.add_request(long)
    kinds = []
    while long.finished is None:
        plan = sched.schedule()
        kinds.append(sorted(e.n for e in plan.entries))
        logits = runner.forward(ForwardBatch.from_plan(plan, sched.kv.req_to_token))
        sched.process(plan, logits, sched.sample(plan, logits))
        sched.check_invariants()
    chunk_steps = [k for k in kinds if max(k) > 1]
    assert [max(k) for k in chunk_steps] == [16, 16, 16, 4]
    # after every step that carried a chunk beside the decoding request: two decode-only steps
    i = kinds.index(chunk_steps[0])
    assert kinds[i + 1] == [1] and kinds[i + 2] == [1]
    assert long.output_ids == oracle(long.input_ids, 2)


def test_short_arrivals_are_not_held_behind_decode_only_steps():
    """A prompt shorter than the prefill budget, admitted beside a decoding request, does not earn
    decode-only steps: the next arrival is admitted at the very next step (its TTFT is one step)."""
    sched, runner = make(chunked_prefill_size=16, decode_steps_per_chunk=2)
    first = req("first", [3, 4, 5], 20)
    sched.add_request(first)
    sched.step()  # first is decoding now
    kinds = []
    for i, name in enumerate(("a", "b")):
        sched.add_request(req(name, [6 + i, 7, 8, 9, 10], 4))  # 5 tokens < the 16-token budget
        plan = sched.schedule()
        kinds.append(sorted(e.n for e in plan.entries))
        logits = runner.forward(ForwardBatch.from_plan(plan, sched.kv.req_to_token))
        sched.process(plan, logits, sched.sample(plan, logits))
    assert kinds == [[1, 5], [1, 1, 5]]  # each arrival prefilled in the step right after it came


def test_retraction_requeues_newest_and_resumes_identically():
    work = [([1 + i] * 30, 40) for i in range(4)]
    sched, runner = make(tokens=150, chunked_prefill_size=None, max_running_requests=8)
    reqs = [req(f"r{i}", ids, m) for i, (ids, m) in enumerate(work)]
    run(sched, reqs)
    assert sched.stats["retractions"] > 0
    assert max(r.retracted for r in reqs) > 0 and reqs[0].retracted == 0  # the oldest is never the victim
    for r, (ids, m) in zip(reqs, work):
        assert r.output_ids == oracle(ids, m)


def test_single_request_larger_than_pool_raises_capacity_error():
    sched, _ = make(tokens=20, chunked_prefill_size=None)
    sched.add_request(req("big", [1] * 10, 30))
    with pytest.raises(CapacityError, match="too small"):
        for _ in range(40):
            sched.step()


class ForcingMatcher:
    """A fake grammar: after the first token, the string 'xyz' is forced; then free for 2 tokens."""

    def __init__(self, accepted=None):
        self.accepted = list(accepted or [])

    def accept_token(self, tok):
        self.accepted.append(tok)
        return True

    def find_jump_forward_string(self):
        return "xyz" if len(self.accepted) == 1 else ""

    def fork(self):
        return ForcingMatcher(self.accepted)

    def forces_token_text(self, tok):
        return True

    def is_terminated(self):
        return len(self.accepted) >= 6

    def mask_is_cached(self):
        return True

    def fill_next_token_bitmask(self, bitmask, i):
        pass


def test_jump_forward_tokens_run_as_decode_rows_of_one_step():
    sched, runner = make(chunked_prefill_size=None)
    r = req("g", [5, 6, 7], 10, grammar=ForcingMatcher())
    run(sched, [r])
    x, y, z = FakeTokenizer().encode("xyz")
    first = predict([5, 6, 7])
    assert r.output_ids[:4] == [first, x, y, z]
    assert len(r.output_ids) == 6 and r.events[-1].meta_info["finish_reason"]["type"] == "stop"
    assert r.output_ids[4] == predict([5, 6, 7, first, x, y, z])
    jump_step = runner.batches[1]  # the step after the prefill computes 4 pending tokens at once
    assert jump_step.input_ids.tolist() == [first, x, y, z]
    assert jump_step.num_extend_tokens == 0 and jump_step.dec_seq_lens.tolist() == [4, 5, 6, 7]
    assert jump_step.logits_indices.tolist() == [3]
    assert len(runner.batches) == 3  # prefill, jump step, last token: 6 tokens in 3 forwards


def per_list_batch(plan, table):
    """ForwardBatch.from_plan as first written (one tensor per index list, slots sliced per entry):
    the reference the one-tensor build must equal."""
    ids, pos, locs, ext, dec_rows, dec_lens = [], [], [], ([], [], []), [], []
    for e in plan.entries:
        r, start, n = e.req, e.start, e.n
        ids.extend(r.tokens(start, start + n))
        locs.append(table[r.kv.row, start:start + n])
        pos.extend(range(start, start + n))
        if e.decode_rows:
            dec_rows.extend([r.kv.row] * n)
            dec_lens.extend(range(start + 1, start + n + 1))
        else:
            for part, v in zip(ext, (r.kv.row, start, n)):
                part.append(v)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return [t(ids), t(pos), torch.cat(locs).long(), *map(t, ext), t(dec_rows), t(dec_lens), t(plan.logits_offsets())]


def test_forward_batch_from_plan_equals_the_per_list_build():
    sched, runner = make(chunked_prefill_size=16, decode_steps_per_chunk=0)
    reqs = [req("a", [5, 6, 7], 12, grammar=ForcingMatcher()), req("c", [9] * 5, 6), req("b", list(range(1, 27)), 3)]
    kinds = set()
    for step in range(100):
        if step < 3:
            sched.add_request(reqs[step])  # b (two chunks, extend rows) arrives while a and c decode
        if not sched.has_work():
            break
        plan = sched.schedule()
        fb = ForwardBatch.from_plan(plan, sched.kv.req_to_token)
        names = ["input_ids", "positions", "out_cache_loc", "ext_req_pool_indices", "ext_prefix_lens",
                 "ext_extend_lens", "dec_req_pool_indices", "dec_seq_lens", "logits_indices"]
        for name, want in zip(names, per_list_batch(plan, sched.kv.req_to_token)):
            got = getattr(fb, name)
            assert got.dtype == torch.int64 and torch.equal(got, want), name
        kinds.add((fb.num_extend_tokens > 0, fb.dec_req_pool_indices.numel() > 0,
                   max(e.n for e in plan.entries if e.decode_rows) if any(e.decode_rows for e in plan.entries) else 0))
        logits = runner.forward(fb)
        sched.process(plan, logits, sched.sample(plan, logits))
    assert (True, True, 1) in kinds  # a prefill chunk beside a decode row
    assert any(k[2] > 1 for k in kinds)  # jump-forward tokens as several decode rows of one entry
    assert reqs[1].output_ids == oracle([9] * 5, 6) and reqs[2].output_ids == oracle(list(range(1, 27)), 3)


def test_deterministic_mode_runs_every_token_as_a_decode_row():
    work = workload(12, seed=3)
    outs = {}
    for det in (False, True):
        sched, runner = make(chunked_prefill_size=16, enable_deterministic_inference=det)
        reqs = [req(f"r{i}", ids, m) for i, (ids, m) in enumerate(work)]
        run(sched, reqs)
        outs[det] = [r.output_ids for r in reqs]
        ext = sum(fb.num_extend_tokens for fb in runner.batches)
        assert (ext == 0) if det else (ext > 0)
    assert outs[True] == outs[False] == [oracle(ids, m) for ids, m in work]


def test_input_logprob_rows_follow_the_plan_layout():
    sched, runner = make(chunked_prefill_size=4)
    r = req("lp", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 1, logprobs=LogprobOptions(return_logprob=True, logprob_start_len=0))
    run(sched, [r])
    # one entry per prompt token (the first has no logprob) + none for the output
    assert len(r.input_token_logprobs) == 10 and r.input_token_logprobs[0][0] is None
    # the fake model is one-hot: a prompt token has logprob 0 exactly when the model predicted it
    for p in range(1, 10):
        predicted = predict(r.input_ids[:p]) == r.input_ids[p]
        assert (r.input_token_logprobs[p][0] > -1.0) == predicted


def test_plan_layout_orders_extends_first_and_numbers_rows():
    a, b, c = req("a", [1] * 20, 3), req("b", [2] * 3, 3), req("c", [3] * 12, 3)
    a.kv.kv_len, b.kv.kv_len, c.kv.kv_len = 0, 3, 0
    b.output_ids = [4]
    plan = StepPlan([StepEntry(b, 1, 3), StepEntry(a, 20, 0), StepEntry(c, 10, 0)]).layout()
    assert [e.req.rid for e in plan.entries] == ["a", "c", "b"]
    assert [e.decode_rows for e in plan.entries] == [False, False, True]
    assert [e.sample_row for e in plan.entries] == [0, None, 1]  # c's chunk is not its last
    assert plan.logits_offsets() == [19, 30]
    assert [e.req.rid for e in plan.sampling] == ["a", "b"]
    det = StepPlan([StepEntry(a, 20, 0)]).layout(None)
    assert det.entries[0].decode_rows


def test_kv_manager_failed_admission_leaves_no_state():
    req_pool = ReqToTokenPool(1, 64)
    kv = KVManager(req_pool, TokenToKVPool(8, 1, 1, 1, 1, torch.float32), page_size=1)
    r = req("a", [1] * 20, 1)
    prefix, node = kv.match_prefix(r.input_ids)
    assert not kv.admit(r, prefix, node, 20)  # 20 tokens do not fit in 8
    assert r.kv == KVState() and req_pool.available() == 1 and kv.free_tokens() == 8
    assert kv.admit(r, prefix, node, 5) and r.kv.alloc_len == 5 and r.kv.kv_len == 0
    other = req("b", [2] * 3, 1)
    assert not kv.admit(other, *kv.match_prefix(other.input_ids), 1)  # no row left
    assert other.kv == KVState()
    kv.commit(r, 5)
    kv.release(r)
    assert r.kv == KVState() and req_pool.available() == 1
    assert kv.available_tokens() == 8
    kv.check_invariants([])


def test_batch_log_lines_as_sglang_words_them(caplog):
    sched, _ = make(chunked_prefill_size=8, decode_log_interval=2)
    reqs = [req("a", [1] * 12, 6), req("b", [2] * 5, 6)]
    with caplog.at_level("INFO", logger="sglite.scheduler"):
        run(sched, reqs)
    lines = [r.getMessage() for r in caplog.records]
    prefill = [x for x in lines if x.startswith("Prefill batch.")]
    decode = [x for x in lines if x.startswith("Decode batch.")]
    assert prefill[0].startswith("Prefill batch. #new-seq: 1, #new-token: 8, #cached-token: 0, token usage: ")
    assert all("#running-req: " in x and "#queue-req: " in x for x in prefill)
    assert decode and all("gen throughput (token/s): " in x and "token usage: " in x for x in decode)
    assert sum(int(x.split("#new-token: ")[1].split(",")[0]) for x in prefill) == 12 + 5


def test_decode_log_interval_is_validated():
    from sglite.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="decode_log_interval"):
        EngineConfig(decode_log_interval=0)
