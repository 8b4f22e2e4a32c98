"""Speculative decoding (issue 17): verify steps as decode rows through the fused CPU decode.

Oracles: the fused verify rows' logits against the per-op path on the same batch (fp32, relative
error <= 1e-5), greedy output token for token against the engine without speculation (fp32 and
bf16, quantized tiny model, so the fused decode runs), and the step plan's row layout by hand.
"""
import pytest

from sglite import Engine
from sglite.kernels import quant_cpu
from sglite.runtime.speculative.policy import probe_forward


# ---------------------------------------------------------------------- engine: fused verify rows
@pytest.fixture(scope="module")
def quantized_tiny4(tiny_model_dir, tmp_path_factory):
    from sglite.quant.calibrate import QuantOptions
    from sglite.quantize import quantize

    return quantize(str(tiny_model_dir), tmp_path_factory.mktemp("spec3") / "rtn4",
                    QuantOptions(method="rtn", bits=4, group_size=32), n_samples=1, seq_len=16)


PROMPTS = [[504, 3458, 3502, 314, 253, 5426] * 3, [1314, 28, 5248, 11633, 28, 690, 9095, 30, 378] * 2]


@pytest.mark.skipif(not quant_cpu.available(), reason="the C++ quant kernel did not build here")
def test_verify_rows_go_through_the_fused_decode_exactly(quantized_tiny4):
    kw = dict(model_path=str(quantized_tiny4), dtype="float32", max_total_tokens=2048, check_invariants=True)
    sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    with Engine(**kw) as base:
        want = [o["output_ids"] for o in base.generate(input_ids=PROMPTS, sampling_params=sp)]
    with Engine(**kw, speculative_algorithm="NGRAM") as spec:
        dec = spec.scheduler.spec
        assert dec.cost is not None  # CPU: drafts follow step costs (a flat curve in tests: conftest)
        # the start-up probe on this engine: one time per row count, positive (not a timing test)
        fwd = probe_forward(spec.runner, spec.scheduler.kv, rows=(1, 4, 9), reps=1)
        assert sorted(fwd) == [1, 4, 9] and min(fwd.values()) > 0
        assert spec.scheduler.kv.req_pool.available() == spec.scheduler.kv.req_pool.req_to_token.shape[0]
        model = spec.runner.model
        fused = model.decode_fused
        assert fused is not None
        verify_steps = []

        class Checked:  # every fused step checked against the per-op path on the same batch
            def forward(self, fb, kb, vb):
                got = fused.forward(fb, kb, vb)
                assert got is not None or fb.num_extend_tokens, "a decode-row step left the fused path"
                if got is not None:
                    ref = model._forward(fb, kb, vb)  # rewrites the same KV slots
                    assert (got - ref).abs().max().item() <= 1e-5 * (ref.abs().max().item() + 1e-6)
                    rows = fb.dec_req_pool_indices.tolist()
                    if len(rows) > len(set(rows)):  # several rows of one request: a verify step
                        verify_steps.append(len(rows))
                return got

        model.decode_fused = Checked()
        got = [o["output_ids"] for o in spec.generate(input_ids=PROMPTS, sampling_params=sp)]
        accepted = spec.get_server_info()["spec_accepted_tokens"]
    assert got == want
    assert verify_steps and accepted > 0  # drafts were verified on the fused path and kept


def test_verify_entries_are_decode_rows():
    from sglite.runtime.step_plan import StepEntry, StepPlan

    class R:
        prefilling, params, finished = False, type("P", (), {"max_new_tokens": 9})(), None

        def __init__(self, seq_len):
            self.seq_len = seq_len

        def wants_input_logprobs(self):
            return False

    e = StepEntry(R(12), n=11, start=11, draft=tuple(range(10)))  # 1 pending + 10 drafts: > small_extend
    plain = StepEntry(R(20), n=11, start=9)  # a jump-forward run of 11 tokens: an extend
    plan = StepPlan([e, plain]).layout(8)
    assert e.decode_rows and not plain.decode_rows
    assert plan.entries == [plain, e] and plan.verifying == [e] and e.sample_row == 1


@pytest.mark.skipif(not quant_cpu.available(), reason="the C++ quant kernel did not build here")
def test_bf16_greedy_identical_on_the_fused_decode(quantized_tiny4):
    """bf16 without deterministic mode: a verify row through the fused decode is computed as the
    plain run's one-row decode step computes that token (each row's activations quantized and
    multiplied on their own), so greedy output is identical token for token."""
    kw = dict(model_path=str(quantized_tiny4), dtype="bfloat16", max_total_tokens=2048)
    sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    with Engine(**kw) as base:
        assert base.runner.model.decode_fused is not None
        want = [base.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in PROMPTS]
    with Engine(**kw, speculative_algorithm="NGRAM") as spec:
        got = [spec.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in PROMPTS]
        accepted = spec.get_server_info()["spec_accepted_tokens"]
    assert got == want and accepted > 0
