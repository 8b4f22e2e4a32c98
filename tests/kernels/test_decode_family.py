"""The families' fused CPU decode (sglite.kernels.decode_family) against the per-op path (the
reference, itself equal to transformers in tests/runtime/test_families_*.py) on tiny random Gemma 2,
Gemma 3, OLMo 2, Granite, SmolLM3 (NoPE layers as identity-table local layers) (and Qwen3's per-head
QK-norm on the Llama layer) checkpoints quantized to 32-groups (RTN): float32 logits of every fused
step close to the per-op step on the same batch, greedy tokens identical, sliding-window layers
(window 8, shorter than the prompts) with the hybrid pool's local slots; the bf16 int8 path close;
options the C++ layer lacks refused; the thread pool's bitwise invariance on Gemma 3."""
import pytest
import torch

from sglite.kernels import decode_family, decode_fused, quant_cpu
from tests.runtime.test_families_gemma import FAMILIES as GEMMA
from tests.runtime.test_families_olmo2_granite import FAMILIES as OTHERS
from tests.runtime.test_families_smollm3 import FAMILIES as SMOLLM3
from tests.kernels.test_decode_fused import check_fused_steps

pytestmark = pytest.mark.skipif(not quant_cpu.available(), reason="the C++ quant kernel did not build here")
FAMILIES = {**GEMMA, **OTHERS, **SMOLLM3, "qwen3": ("qwen3", "Qwen3ForCausalLM", dict(attention_bias=False))}  # QK-norm on the Llama layer
PROMPTS = [[504, 3458, 3502, 314, 253, 5426, 28, 690, 9095, 30, 378, 12, 99, 17],
           [1314, 28, 5248, 11633, 28, 690, 9095, 30, 378], [357, 12, 99]]
SP = {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True}  # past the window of 8


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, real_checkpoint):
    """{family: RTN 4-bit group-32 checkpoint folder}, each built on first use (~5 s)."""
    from sglite.quant.calibrate import QuantOptions
    from sglite.quantize import quantize
    from sglite.testing import make_tiny_family

    class Lazy(dict):
        def __missing__(self, name):
            model_type, arch, fields = FAMILIES[name]
            root = tmp_path_factory.mktemp(name)
            d = make_tiny_family(root / "hf", model_type, arch, seed=3, vocab_from=real_checkpoint.model_dir, **fields)
            self[name] = quantize(str(d), root / "rtn4", QuantOptions(method="rtn", bits=4, group_size=32),
                                  n_samples=1, seq_len=16)
            return self[name]

    return Lazy()


def _checked(model, atol_rel, seen):
    assert isinstance(model.decode_fused, decode_family.FamilyFusedDecode)
    return check_fused_steps(model, atol_rel, seen)


# the fast tier: Gemma 3 (sandwich norms, per-head QK-norm, local layers and RoPE, GeGLU); the slow
# tier the rest (Gemma 2's soft-capping, OLMo 2's post-norms and full-width QK-norm, Granite's scales)
@pytest.mark.parametrize("name", [n if n == "gemma3" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(FAMILIES)])
def test_fused_float32_matches_per_op(quantized, name):
    from sglite import Engine

    seen = []
    with Engine(model_path=str(quantized[name]), dtype="float32", max_total_tokens=2048) as e:
        model = e.runner.model
        assert (type(model).__name__ == "LlamaModel") == (name == "qwen3")
        if name.startswith("gemma"):
            assert e.runner.token_to_kv_pool.__class__.__name__ == "SWATokenToKVPool"  # local slots in their own space
        _checked(model, 1e-5, seen)
        def run():
            batch = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=SP)]
            return batch + [e.generate(input_ids=PROMPTS[0], sampling_params=SP)["output_ids"]]

        got = run()
        assert 3 in seen and 1 in seen  # batched and single-row steps went through the fused path
        model.decode_fused = None  # the per-op path alone
        ref = run()
    assert got == ref


@pytest.mark.parametrize("name", ["gemma3", pytest.param("granite", marks=pytest.mark.slow)])
def test_fused_bf16_close_to_per_op(quantized, name):
    from sglite import Engine

    seen = []
    with Engine(model_path=str(quantized[name]), dtype="bfloat16", max_total_tokens=2048) as e:
        fused = _checked(e.runner.model, 0.1, seen)  # int8 activations on VNNI CPUs: close, not bf16-exact
        e.generate(input_ids=PROMPTS, sampling_params=SP)
        assert seen
        if name == "gemma3" and fused.amx_min():  # AMX CPUs: 40-row steps fused, their GEMMs on the tiles
            many = [[100 + 37 * i, 7 + i, 2000 + i] for i in range(40)]
            e.generate(input_ids=many, sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
            assert 40 in seen


def test_thread_count_does_not_change_logits(quantized):
    """Gemma 3 (QK-norm, local layers, GeGLU): one thread and two give the same logits bit for bit."""
    from sglite import Engine

    with Engine(model_path=str(quantized["gemma3"]), dtype="float32", max_total_tokens=2048) as e:
        model = e.runner.model
        fused = model.decode_fused
        fused.attn_split_min = 0  # split the attention too
        outs = {}

        class Record:
            def forward(self, fb, kb, vb):
                got = fused.forward(fb, kb, vb)
                if got is not None:
                    fused.threads = 1
                    one = fused.forward(fb, kb, vb)
                    fused.threads = 2
                    two = fused.forward(fb, kb, vb)
                    outs.setdefault("pairs", []).append((one, two))
                return got

        model.decode_fused = Record()
        e.generate(input_ids=PROMPTS, sampling_params={**SP, "max_new_tokens": 4})
    assert outs["pairs"] and all(torch.equal(a, b) for a, b in outs["pairs"])


def test_unsupported_options_keep_the_per_op_path(quantized):
    """A quantized family model takes the family layer; an option the C++ layer lacks (here an
    unknown MLP activation), SGLITE_KERNEL=torch, or MoE's ``fused_decode_ok = False`` keep the
    per-op path (prepare returns None)."""
    import dataclasses

    from sglite import Engine
    from sglite.runtime.models.moe import MoeModel

    assert MoeModel.fused_decode_ok is False
    with Engine(model_path=str(quantized["gemma3"]), dtype="float32", max_total_tokens=2048) as e:
        model = e.runner.model
        assert isinstance(decode_family.prepare(model), decode_family.FamilyFusedDecode)
        assert decode_fused.prepare(model) is None  # the Llama layer alone refuses it
        arch = model.arch
        try:
            model.arch = dataclasses.replace(arch, mlp_act="relu")
            assert not decode_family.supported(model) and decode_family.prepare(model) is None
        finally:
            model.arch = arch


def test_gemma3_fused_with_lora_adapters_matches_per_op(quantized, tmp_path):
    """LoRA in the families' C++ layer (issue 30): a Gemma 3 batch mixing the base model and two
    adapters (all seven projections at rank 4; q/v at rank 8) runs its decode steps fused, each
    step's float32 logits within 1e-5 of the per-op LoRA path on the same batch, the greedy tokens
    identical to the per-op path's."""
    import json

    from sglite import Engine
    from tests.kernels.test_decode_fused_lora import ADAPTERS, write_adapter

    cfg = json.loads((quantized["gemma3"] / "config.json").read_text())
    paths = {n: str(write_adapter(tmp_path / n, cfg, *ADAPTERS[n], seed=i)) for i, n in enumerate(("all4", "qv8"))}
    names = ["all4", None, "qv8"]
    seen = []
    with Engine(model_path=str(quantized["gemma3"]), dtype="float32", max_total_tokens=2048, lora_paths=paths,
                max_loras_per_batch=2) as e:
        model = e.runner.model
        _checked(model, 1e-5, seen)
        got = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=SP, lora_path=names)]
        assert 3 in seen  # the mixed batch's decode steps ran fused
        model.decode_fused = None
        ref = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=SP, lora_path=names)]
        base = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=SP)]
    assert got == ref
    assert got[0] != base[0] and got[1] == base[1]  # the adapter changed its row, the base row is the base
