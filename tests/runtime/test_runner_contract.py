"""The runner contract (:class:`sglite.runtime.runner_protocol.RunnerProtocol`), one suite over every
runner the scheduler drives: :class:`~sglite.runtime.model_runner.ModelRunner` (tiny model), the
scheduler unit tests' fake runner and :class:`~sglite.runtime.parallel.tp_client.TPRunnerClient`
(``tp_size=2`` worker processes on the tiny model)."""
import pytest
import torch

from sglite.config import EngineConfig
from sglite.runtime.forward_batch import ForwardBatch
from sglite.runtime.kv_pool import ReqToTokenPool, TokenToKVPool
from sglite.runtime.runner_protocol import RunnerProtocol

PROMPT = [504, 3458, 3502, 314, 253, 5426, 28]
KW = dict(device="cpu", dtype="float32", max_total_tokens=512, max_running_requests=4, log_level="warning")


def _model_runner(tiny_model_dir):
    from sglite.runtime.model_loader import load_checkpoint
    from sglite.runtime.model_runner import ModelRunner
    from sglite.runtime.quant_loader import load_weights

    ckpt = load_checkpoint(str(tiny_model_dir))
    cfg = EngineConfig(model_path=str(tiny_model_dir), **KW)
    return ModelRunner(cfg, ckpt.hf_config, load_weights(ckpt, None, torch.float32, "cpu"))


def _fake_runner(tiny_model_dir):
    from tests.runtime.test_scheduler_unit import FakeRunner

    return FakeRunner(512, page_size=1, max_reqs=12, context=256)


def _tp_client(tiny_model_dir):
    from sglite.runtime.parallel.tp_client import TPRunnerClient
    from sglite.runtime.model_loader import load_checkpoint

    cfg = EngineConfig(model_path=str(tiny_model_dir), tp_size=2, **KW)
    return TPRunnerClient(cfg, load_checkpoint(str(tiny_model_dir)))


@pytest.fixture(scope="module", params=[
    pytest.param(_model_runner, id="model_runner"),
    pytest.param(_fake_runner, id="fake_runner"),
    pytest.param(_tp_client, id="tp_client", marks=pytest.mark.slow),  # two worker processes: ~15 s on two cores
])
def runner(request, tiny_model_dir):
    r = request.param(tiny_model_dir)
    yield r
    r.close()


def _prompt_tokens(runner) -> list[int]:
    return [t % runner.vocab_size for t in PROMPT]


def _prefill_batch(runner, row: int, slots: torch.Tensor, ids: list[int]) -> ForwardBatch:
    """One extend request of ``ids`` at slot-table ``row`` (K/V into ``slots``), logits of its last token."""
    n = len(ids)
    table = runner.req_to_token_pool.req_to_token
    table[row, :n] = slots.to(torch.int32)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(input_ids=t(ids), positions=t(list(range(n))), out_cache_loc=slots, req_to_token=table,
                        ext_req_pool_indices=t([row]), ext_prefix_lens=t([0]), ext_extend_lens=t([n]),
                        dec_req_pool_indices=t([]), dec_seq_lens=t([]), logits_indices=t([n - 1]))


def _decode_batch(runner, row: int, slot: int, pos: int, tok: int) -> ForwardBatch:
    """One decode row of ``row``: token ``tok`` at position ``pos`` (K/V into ``slot``)."""
    table = runner.req_to_token_pool.req_to_token
    table[row, pos] = slot
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(input_ids=t([tok]), positions=t([pos]), out_cache_loc=t([slot]), req_to_token=table,
                        ext_req_pool_indices=t([]), ext_prefix_lens=t([]), ext_extend_lens=t([]),
                        dec_req_pool_indices=t([row]), dec_seq_lens=t([pos + 1]), logits_indices=t([0]))


def test_runner_has_every_member_of_the_protocol(runner):
    assert isinstance(runner, RunnerProtocol)
    assert isinstance(runner.req_to_token_pool, ReqToTokenPool)
    assert isinstance(runner.token_to_kv_pool, TokenToKVPool)
    assert isinstance(runner.vocab_size, int) and runner.vocab_size > 0
    assert isinstance(runner.device, str) and torch.device(runner.device).type in ("cpu", "cuda")
    assert runner.dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert isinstance(runner.context_length, int) and runner.context_length >= 16
    assert runner.max_total_tokens == runner.token_to_kv_pool.capacity > 0
    assert isinstance(runner.bytes_per_token, int) and runner.bytes_per_token > 0
    assert isinstance(runner.measure_forward, bool)
    assert runner.req_to_token_pool.max_context >= runner.context_length
    assert callable(runner.token_to_kv_pool.begin_step)  # the per-step pool hook (a no-op on the plain pool)


def test_forward_returns_float32_logits_on_the_cpu_for_each_logits_index(runner):
    pool, rows = runner.token_to_kv_pool, runner.req_to_token_pool
    ids = _prompt_tokens(runner)
    row = rows.alloc()
    slots = pool.alloc_extend(None, 0, len(ids) + 1)
    try:
        fb = _prefill_batch(runner, row, slots[:-1], ids)
        pool.begin_step(fb)  # what the runner calls; a no-op on the plain pool
        logits = runner.forward(fb)
        assert logits.shape == (1, runner.vocab_size) and logits.dtype == torch.float32
        assert logits.device.type == "cpu" and torch.isfinite(logits).all()
        again = runner.forward(_prefill_batch(runner, row, slots[:-1], ids))  # same K/V rewritten
        assert torch.equal(again, logits)
        nxt = int(logits.argmax())
        dec = runner.forward(_decode_batch(runner, row, int(slots[-1]), len(ids), nxt))
        assert dec.shape == (1, runner.vocab_size) and dec.dtype == torch.float32 and torch.isfinite(dec).all()
    finally:
        rows.req_to_token[row].zero_()
        rows.free(row)
        pool.free(slots)


def test_forward_of_a_two_request_step_matches_each_request_alone(runner):
    """A step of two requests gives each the logits it gets alone (rows are independent)."""
    pool, rows = runner.token_to_kv_pool, runner.req_to_token_pool
    a, b = _prompt_tokens(runner), _prompt_tokens(runner)[::-1][:5]
    ra, rb = rows.alloc(), rows.alloc()
    sa, sb = pool.alloc_extend(None, 0, len(a)), pool.alloc_extend(None, 0, len(b))
    try:
        alone = [runner.forward(_prefill_batch(runner, r, s, ids)) for r, s, ids in ((ra, sa, a), (rb, sb, b))]
        fa, fb_ = _prefill_batch(runner, ra, sa, a), _prefill_batch(runner, rb, sb, b)
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        both = ForwardBatch(input_ids=torch.cat([fa.input_ids, fb_.input_ids]),
                            positions=torch.cat([fa.positions, fb_.positions]),
                            out_cache_loc=torch.cat([sa, sb]), req_to_token=rows.req_to_token,
                            ext_req_pool_indices=t([ra, rb]), ext_prefix_lens=t([0, 0]),
                            ext_extend_lens=t([len(a), len(b)]), dec_req_pool_indices=t([]), dec_seq_lens=t([]),
                            logits_indices=t([len(a) - 1, len(a) + len(b) - 1]))
        out = runner.forward(both)
        assert out.shape == (2, runner.vocab_size)
        torch.testing.assert_close(out, torch.cat(alone), rtol=1e-4, atol=1e-4)
    finally:
        for r in (ra, rb):
            rows.req_to_token[r].zero_()
            rows.free(r)
        pool.free(torch.cat([sa, sb]))


def test_close_is_idempotent(runner):
    """Every runner's ``close`` may be called twice (the engine's loop and its finalizer may both).
    Runs last for each runner (pytest groups a module-scoped parametrised fixture's tests by
    parameter, in file order); a runner with workers refuses a step afterwards."""
    runner.close()
    runner.close()
    if getattr(runner, "tp_size", 1) > 1:
        ids = _prompt_tokens(runner)
        row = runner.req_to_token_pool.alloc()
        slots = runner.token_to_kv_pool.alloc_extend(None, 0, len(ids))
        with pytest.raises(RuntimeError, match="stopped"):
            runner.forward(_prefill_batch(runner, row, slots, ids))
