"""The fused CPU decode over an int8 / int4 KIVI KV pool (sglite.kernels.decode_fused,
``FusedDecode.quant_pool_args``, ``csrc/decode_kv_quant.h``): every fused step's logits against
the per-op path on the same batch (float32, a tiny random Llama quantized to 32-groups, key groups
of 16 so that requests cross several groups; fp8_e4m3 pools with their scales), the groups the C++ sealed bit for bit
equal to ``kv_quant.quantize_keys`` / ``quantize_values`` of the same residual rows, greedy tokens
identical to the per-op path, and the steps it declines."""
import pytest
import torch

from sglite.kernels import decode_fused, kv_quant, kv_quant_cpu, quant_cpu
from tests.kernels.builds import built
from tests.kernels.test_decode_fused import PROMPTS, check_fused_steps

@pytest.fixture(autouse=True, scope="module")
def _kernels():
    """The C++ builds these tests run (a skip without a compiler or ninja; with them, a failed build fails)."""
    for load in (quant_cpu.load, kv_quant_cpu.load, decode_fused.load):
        built(load)


GROUP = 16
SP = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def quantized_4bit(tiny_model_dir, tmp_path_factory):
    from sglite.quant.calibrate import QuantOptions
    from sglite.quantize import quantize

    return quantize(str(tiny_model_dir), tmp_path_factory.mktemp("fused_kvq") / "rtn4",
                    QuantOptions(method="rtn", bits=4, group_size=32), n_samples=1, seq_len=16)


def _engine(model_dir, kind, dtype="float32"):
    from sglite import Engine

    return Engine(model_path=str(model_dir), dtype=dtype, max_total_tokens=2048, kv_cache_dtype=kind,
                  kv_cache_quant_group_size=GROUP)


def check_sealed(layers, fb):
    """Every group a row of ``fb`` completed: the pool's codes and scales equal the torch
    quantization of the residual rows the fused step left (positions 0..G-1 of the row's window)."""
    done = (fb.dec_seq_lens % GROUP == 0).nonzero().squeeze(1).tolist()
    for i in done:
        row, slot0 = int(fb.dec_req_pool_indices[i]), int(fb.out_cache_loc[i]) // GROUP * GROUP
        for L in layers:
            kq, ks = kv_quant.quantize_keys(L.res_k[row][None], L.bits)
            vq, vs = kv_quant.quantize_values(L.res_v[row], L.bits)
            assert torch.equal(L.k_data[slot0:slot0 + GROUP], kq[0])
            assert torch.equal(L.k_scale[slot0 // GROUP].view(torch.int16), ks[0].view(torch.int16))
            assert torch.equal(L.v_data[slot0:slot0 + GROUP], vq)
            assert torch.equal(L.v_scale[slot0:slot0 + GROUP].view(torch.int16), vs.view(torch.int16))
    return len(done)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_fused_steps_over_a_quantized_pool_match_per_op(quantized_4bit, kind):
    e = _engine(quantized_4bit, kind)
    try:
        model = e.runner.model
        layers = list(e.runner.token_to_kv_pool.k_buffers)
        fused = model.decode_fused
        seen, sealed = [], []

        class Checked:  # the fused step, its sealed groups, then the per-op path on the same batch
            def forward(self, fb, kb, vb):
                got = fused.forward(fb, kb, vb)
                if got is not None:
                    sealed.append(check_sealed(layers, fb))
                    ref = model._forward(fb, kb, vb)  # rewrites the same residual rows and groups
                    err = (got - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
                    assert err <= 1e-5, err
                    seen.append(fb.input_ids.shape[0])
                return got

        model.decode_fused = Checked()
        got = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=SP)]
        assert seen.count(3) >= 30  # every three-row step over the int pool took the fused path
        assert sum(sealed) >= 6  # rows completed groups 16, 32 (and 48) inside fused steps
        model.decode_fused = None  # the per-op path alone
        ref = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=SP)]
        assert got == ref
    finally:
        e.shutdown()


def test_bf16_model_over_int8_pool_stays_close(quantized_4bit):
    e = _engine(quantized_4bit, "int8", dtype="bfloat16")
    try:
        seen = []
        check_fused_steps(e.runner.model, 0.05, seen)  # the bf16 path's int8 activations, as test_decode_fused
        e.generate(input_ids=PROMPTS, sampling_params=SP)
        assert seen.count(3) >= 30
    finally:
        e.shutdown()


def test_quant_pool_args(quantized_4bit, monkeypatch):
    e = _engine(quantized_4bit, "int8")
    try:
        fused = e.runner.model.decode_fused
        layers = list(e.runner.token_to_kv_pool.k_buffers)

        class FB:  # two decode rows: request rows 0 and 1 at lengths 5 and 32 (row 1 completes a group)
            dec_req_pool_indices = torch.tensor([0, 1])
            dec_seq_lens = torch.tensor([5, 2 * GROUP])
            out_cache_loc = torch.tensor([GROUP + 4, 4 * GROUP + GROUP - 1])

        kb, vb, loc, (kvq, pool_loc, bits) = fused.quant_pool_args(FB, layers)
        assert (bits, len(kvq), len(kb)) == (8, 6 * len(layers), len(layers))
        assert loc.tolist() == [0 * GROUP + 4, 1 * GROUP + GROUP - 1] and pool_loc.tolist() == FB.out_cache_loc.tolist()
        assert kb[0].shape == (layers[0].res_k.shape[0] * GROUP, *layers[0].res_k.shape[2:])
        assert kb[0].data_ptr() == layers[0].res_k.data_ptr() and vb[1].data_ptr() == layers[1].res_v.data_ptr()
        monkeypatch.setattr(type(fused), "quant_kv", False)  # a layer that declines quantized steps (Gemma's)
        assert fused.quant_pool_args(FB, layers) is None
        monkeypatch.setattr(type(fused), "quant_kv", True)
        monkeypatch.setattr(kv_quant_cpu, "available", lambda: False)  # no C++ attention: per-op
        assert fused.quant_pool_args(FB, layers) is None
    finally:
        e.shutdown()


def test_fp8_pool_fused_steps_match_per_op(quantized_4bit):
    """fp8_e4m3 pools in the fused decode (``_fp8_pool_args``: codes stored as ``x / scale``, q scaled
    by the key scales, the output by the value scales), with scales other than 1: every fused step's
    logits against the per-op path on the same batch, greedy tokens identical."""
    e = _engine(quantized_4bit, "fp8_e4m3")
    try:
        for i, L in enumerate(e.runner.token_to_kv_pool.k_buffers):
            L.k_scale.copy_(torch.tensor([0.5, 2.0, 1.25, 0.75][:L.k_scale.numel()]) * (1 + i / 10))
            L.v_scale.copy_(torch.tensor([1.5, 0.25, 1.0, 3.0][:L.v_scale.numel()]))
        seen = []
        # a float8 code a float32 rounding apart between the two paths moves a logit by ~1e-3 of its range
        check_fused_steps(e.runner.model, 1e-3, seen)
        got = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=SP)]
        assert seen.count(3) >= 30
        e.runner.model.decode_fused = None
        assert got == [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=SP)]
    finally:
        e.shutdown()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_short_extend_across_a_key_group_matches_per_op(quantized_4bit, kind):
    """A short extend (at most step_plan.SMALL_EXTEND tokens: a prefill chunk, a cached prompt's tail,
    a jump-forward) runs as several decode rows of one request; when they cross a key group (a
    20-token prompt in chunks of 7: the last chunk, positions 14..19, completes the group at 16), the
    rows past the group's end would overwrite its residual rows before the group is sealed. Greedy
    tokens equal the per-op path's (which reads the step's stash), and equal the unchunked run's."""
    from sglite import Engine

    e = Engine(model_path=str(quantized_4bit), dtype="float32", max_total_tokens=1024, kv_cache_dtype=kind,
               kv_cache_quant_group_size=GROUP, chunked_prefill_size=7)
    try:
        prompt = torch.randint(100, 5000, (20,), generator=torch.Generator().manual_seed(0)).tolist()
        sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        got = e.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
        e.flush_cache()
        model = e.runner.model
        fused, model.decode_fused = model.decode_fused, None
        ref = e.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
        model.decode_fused = fused
        assert got == ref
    finally:
        e.shutdown()


def test_quant_pool_args_declines_rows_of_one_request_across_a_group(quantized_4bit):
    e = _engine(quantized_4bit, "int8")
    try:
        fused = e.runner.model.decode_fused
        layers = list(e.runner.token_to_kv_pool.k_buffers)

        def fb(rows, lens):
            return type("FB", (), dict(dec_req_pool_indices=torch.tensor(rows), dec_seq_lens=torch.tensor(lens),
                                       out_cache_loc=torch.tensor(lens) - 1 + 4 * GROUP))

        assert fused.quant_pool_args(fb([0, 0, 1], [GROUP - 1, GROUP, GROUP + 1]), layers) is not None  # one group each
        assert fused.quant_pool_args(fb([0, 0, 0], [GROUP - 1, GROUP, GROUP + 1]), layers) is None  # 15, 16 | 17
        assert fused.quant_pool_args(fb([1, 0, 0], [GROUP, GROUP, GROUP + 1]), layers) is None
    finally:
        e.shutdown()
