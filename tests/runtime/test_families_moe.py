"""Mixtral, Qwen2-MoE and Qwen3-MoE against transformers on tiny random checkpoints (float32, eager
attention; 4 experts, top-2): greedy tokens and prompt logprobs, radix cache on and off, chunked
prefill and not, alone and batched (issue 27's oracle). Qwen2-MoE has the sigmoid-gated shared
expert and renormalises nothing (``norm_topk_prob=False``); Qwen3-MoE renormalises, has per-head
QK-norm and a dense first layer (``mlp_only_layers``). Routing ties: checkpoints whose routers give
three experts identical logits, so every token's top-2 breaks a tie, against transformers token for
token; the shared-expert gate scaled up so its sigmoid spans (0, 1)."""
import pytest
import torch

from tests.runtime.family_parity import (GREEDY, MATRIX, build_family, check_matrix,
                                         check_tokens_and_logprobs, engine)

FAMILIES = {
    "mixtral": ("mixtral", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                      intermediate_size=48)),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        norm_topk_prob=False, qkv_bias=True)),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[0], attention_bias=False)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, real_checkpoint):
    """(name, model dir, prompts, HF greedy tokens, HF prompt log-softmax) of one family."""
    return build_family(request.param, FAMILIES, tmp_path_factory, real_checkpoint)


def test_tokens_and_prompt_logprobs_match_hf(family):
    check_tokens_and_logprobs(family, "MoeModel")


@pytest.mark.parametrize("radix,chunk", MATRIX)
def test_matrix_alone_and_batched(family, radix, chunk):
    check_matrix(family, radix, chunk)


def test_deterministic_inference_alone_equals_batched(family):
    """``enable_deterministic_inference``: the router, experts and shared expert run the
    batch-invariant matmuls, so each prompt's greedy tokens alone equal those inside the batch."""
    name, d, prompts, outs, _ = family
    with engine(d, enable_deterministic_inference=True) as e:
        assert {lw.impl for lw in e.runner.model.linear_weights()} == {"invariant"}
        batch = [r["output_ids"] for r in e.generate(input_ids=prompts[:4], sampling_params=GREEDY)]
        alone = [e.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts[:4]]
    assert batch == alone


def _tie_routers(model_dir, shared_gate_scale: float) -> None:
    """Rewrite ``model_dir``'s routers so experts 0, 1 and 2 get identical logits in every layer
    (each token's top-2 then breaks a three-way tie), the shared-expert gates scaled."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    sd = load_file(str(path))
    for name in list(sd):
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            w = sd[name].clone()
            w[1] = w[0]
            w[2] = w[0]
            sd[name] = w
        elif name.endswith("shared_expert_gate.weight"):
            sd[name] = sd[name] * shared_gate_scale
    save_file(sd, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow),
                                  pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_routing_ties_and_shared_gate_match_hf(name, tmp_path, real_checkpoint):
    """Tie-breaking as ``torch.topk`` in transformers' routers, token for token; the shared
    expert's sigmoid gate (Qwen2-MoE) on gate logits of a few units."""
    from sglite.runtime.tokenizer import Tokenizer
    from sglite.testing import hf_greedy, make_tiny_family
    from tests.runtime.family_parity import prompts_of

    model_type, arch, fields = FAMILIES[name]
    d = make_tiny_family(tmp_path / name, model_type, arch, seed=5, vocab_from=real_checkpoint.model_dir, **fields)
    _tie_routers(d, shared_gate_scale=6.0)
    prompts = prompts_of(Tokenizer.from_dir(d), 2, 5, 40, seed=11)
    outs, logps = hf_greedy(d, prompts, 10)
    with engine(d) as e:
        res = e.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 10},
                         return_logprob=True, logprob_start_len=0)
        model = e.runner.model
    for i, r in enumerate(res):
        assert r["output_ids"] == outs[i], f"{name}: prompt {i} diverges from HF under routing ties"
        lp = torch.tensor([x[0] for x in r["meta_info"]["input_token_logprobs"][1:]])
        ref = logps[i][torch.arange(len(prompts[i]) - 1), torch.tensor(prompts[i][1:])]
        assert torch.allclose(lp, ref, atol=1e-4)
    router = next(L["moe"].router.weight for L in model.layers if "moe" in L)
    assert torch.equal(router[0], router[1]) and torch.equal(router[0], router[2])  # the ties are real


def test_unsupported_configs_refused_naming_the_field(tmp_path, real_checkpoint):
    """Refused at load, before any weight is read, naming the config field."""
    from sglite.errors import InvalidRequestError
    from sglite.runtime.models.registry import arch_from_hf_config
    from transformers import AutoConfig

    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=64, vocab_size=100)
    cases = [("mixtral", dict(num_local_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
             ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16), "sliding_window"),
             ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, hidden_act="gelu"), "hidden_act"),
             ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, attention_bias=True), "attention_bias"),
             ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=0),
              "shared_expert_intermediate_size")]
    arch_names = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM"}
    for model_type, fields, field in cases:
        cfg = AutoConfig.for_model(model_type, **base, **fields)
        cfg.architectures = [arch_names[model_type]]
        with pytest.raises(InvalidRequestError, match=field) as ei:
            arch_from_hf_config(cfg)
        assert ei.value.field == "model_path"
