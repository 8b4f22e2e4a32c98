"""Speculative decoding, third pass (issue 17): drafts chosen from a measured step-cost curve
(``speculative.policy``) and verify steps as decode rows through the fused CPU decode.

Oracles: the expected-throughput rule worked by hand on small cases (linear and flat costs), the
interpolation of the measured cost curve, greedy output token for token against the engine
without speculation (fp32, quantized tiny model, so the fused decode runs), and the fused verify
rows' logits against the per-op path on the same batch (fp32, relative error <= 1e-5).
"""
import pytest

from sglite import Engine
from sglite.kernels import quant_cpu
from sglite.runtime.speculative.policy import AcceptModel, StepCost, choose, probe_forward

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


# ---------------------------------------------------------------------- engine: fused verify rows
@pytest.fixture(scope="module")
def quantized_tiny4(tiny_model_dir, tmp_path_factory):
    from sglite.quant.calibrate import QuantOptions
    from sglite.quant.quantize_cli import quantize

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
