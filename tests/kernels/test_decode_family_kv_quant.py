"""The families' fused CPU decode (sglite.kernels.decode_family) over quantized KV pools (issue 33):
tiny random Qwen3 (per-head QK-norm), OLMo 2 (post-norms, full-width QK-norm) and Granite (scales)
checkpoints quantized to 32-groups, with int8 / int4 KIVI pools (key groups of 16, so requests cross
several groups) and fp8_e4m3 pools (scales other than 1): every fused step's float32 logits against
the per-op path on the same batch, the groups the C++ sealed bit for bit equal to the torch
quantizer's, greedy tokens identical to the per-op path's; a family model with local layers or
attention soft-capping (Gemma 2 / 3) declines quantized steps (the per-op path, which refuses them)
instead of running them in C++."""
import pytest
import torch

from sglite.kernels import decode_family, decode_fused, kv_quant_cpu, quant_cpu
from sglite.runtime.kv_quant import make_pool
from tests.kernels.builds import built
from tests.kernels.test_decode_family import PROMPTS, quantized  # noqa: F401  (the checkpoints fixture)
from tests.kernels.test_decode_fused_kv_quant import GROUP, check_sealed


@pytest.fixture(autouse=True, scope="module")
def _kernels():
    """The C++ builds these tests run (a skip without a compiler or ninja; with them, a failed build fails)."""
    for load in (quant_cpu.load, kv_quant_cpu.load, decode_fused.load):
        built(load)


SP = {"max_new_tokens": 36, "temperature": 0, "ignore_eos": True}  # the rows cross positions 16, 32 (and 48)
FP8_SCALES = ([0.5, 2.0, 1.25, 0.75], [1.5, 0.25, 1.0, 3.0])
# the fast tier: each family once and each pool kind once; the slow tier the other pairs
CASES = [("qwen3", "int8"), ("olmo2", "int4"), ("granite", "fp8_e4m3")]
SLOW = [(n, k) for n in ("qwen3", "olmo2", "granite") for k in ("int8", "int4", "fp8_e4m3") if (n, k) not in CASES]


def _engine(model_dir, kind):
    from sglite import Engine

    return Engine(model_path=str(model_dir), dtype="float32", max_total_tokens=2048, kv_cache_dtype=kind,
                  kv_cache_quant_group_size=GROUP)


@pytest.mark.parametrize("name,kind", CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW])
def test_family_fused_steps_over_a_quantized_pool_match_per_op(quantized, name, kind):
    e = _engine(quantized[name], kind)
    try:
        model = e.runner.model
        fused = model.decode_fused
        assert isinstance(fused, decode_family.FamilyFusedDecode) and fused.quant_kv
        layers = list(e.runner.token_to_kv_pool.k_buffers)
        if kind == "fp8_e4m3":
            for i, L in enumerate(layers):
                L.k_scale.copy_(torch.tensor(FP8_SCALES[0][:L.k_scale.numel()]) * (1 + i / 10))
                L.v_scale.copy_(torch.tensor(FP8_SCALES[1][:L.v_scale.numel()]))
        # a float8 code a float32 rounding apart between the two paths moves a logit by ~1e-3 of its range
        tol = 1e-3 if kind == "fp8_e4m3" else 1e-5
        seen, sealed = [], []

        class Checked:  # the fused step, its sealed groups, then the per-op path on the same batch
            def forward(self, fb, kb, vb):
                got = fused.forward(fb, kb, vb)
                if got is not None:
                    if kind != "fp8_e4m3":
                        sealed.append(check_sealed(layers, fb))
                    ref = model._forward(fb, kb, vb)  # rewrites the same slots (residual rows and groups)
                    err = (got - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
                    assert err <= tol, err
                    seen.append(fb.input_ids.shape[0])
                return got

        model.decode_fused = Checked()
        got = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=SP)]
        got.append(e.generate(input_ids=PROMPTS[0], sampling_params=SP)["output_ids"])
        assert seen.count(3) >= 25 and seen.count(1) >= 25  # the batched and single-row steps ran fused
        if kind != "fp8_e4m3":
            assert sum(sealed) >= 6  # rows completed groups 16 and 32 inside fused steps
        model.decode_fused = None  # the per-op path alone
        ref = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=SP)]
        ref.append(e.generate(input_ids=PROMPTS[0], sampling_params=SP)["output_ids"])
        assert got == ref
    finally:
        e.shutdown()


@pytest.mark.parametrize("name", ["gemma3", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_local_layers_or_softcap_decline_quantized_steps(quantized, name):
    """Gemma 3 (local layers) and Gemma 2 (local layers, attention soft-capping): the family layer
    keeps its float-pool steps but declines every quantized pool's (``quant_pool_args`` None, so
    ``forward`` returns None and the per-op path runs, which raises its ValueError); the C++ refuses
    them too when called directly."""
    from sglite import Engine

    with Engine(model_path=str(quantized[name]), dtype="float32", max_total_tokens=2048) as e:
        fused, r = e.runner.model.decode_fused, e.runner
        assert isinstance(fused, decode_family.FamilyFusedDecode) and not fused.quant_kv
        a = r.arch
        fb = type("FB", (), dict(dec_req_pool_indices=torch.tensor([0]), dec_seq_lens=torch.tensor([GROUP]),
                                 out_cache_loc=torch.tensor([2 * GROUP - 1])))
        for kind in ("int8", "int4", "fp8_e4m3"):
            pool = make_pool(kind, 1024, GROUP, a.num_layers, a.num_kv_heads, a.head_dim, r.dtype, r.device, GROUP, 8)
            assert fused.quant_pool_args(fb, pool.k_buffers) is None
            fused.quant_kv = True  # what the C++ would be given: refused there as well
            try:
                args = fused.quant_pool_args(fb, pool.k_buffers)
            finally:
                fused.quant_kv = False
            m = e.runner.model
            x = torch.zeros(1, a.hidden_size)
            cs = m.cos[:1].contiguous()
            with pytest.raises(RuntimeError, match="neither local layers nor soft-capping"):
                decode_fused.load().decode_family_forward(
                    x, fused.norms, fused.norm_mask, fused.qk_norms, fused.qk_kind, fused.lin, fused.bits,
                    fused.final_norm, cs, cs, cs, cs, fused.local, fused.window, float(a.attn_softcap), 1.0, fused.act,
                    args[0], args[1], args[2], r.req_to_token_pool.req_to_token, fb.dec_req_pool_indices, args[2],
                    r.req_to_token_pool.req_to_token, fb.dec_req_pool_indices, fb.dec_seq_lens, a.num_heads,
                    a.num_kv_heads, a.head_dim, 1e-6, 1.0, fused.q8, fused.tiled, 1, 0, [], torch.empty(0, dtype=torch.int64),
                    [], 0, 0, [], 0, *args[3])
