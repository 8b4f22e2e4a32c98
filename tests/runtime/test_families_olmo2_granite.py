"""OLMo 2 and Granite against transformers on tiny random checkpoints (float32, eager attention):
greedy tokens and prompt logprobs, with the radix cache on and off, chunked prefill and not, each
prompt alone and inside a batch of mixed lengths (issue 27's oracle for every family)."""
import pytest

from tests.runtime.family_parity import MATRIX, build_family, check_matrix, check_refusals, check_tokens_and_logprobs

FAMILIES = {
    "olmo2": ("olmo2", "Olmo2ForCausalLM", dict(attention_bias=False)),
    "granite": ("granite", "GraniteForCausalLM", dict(
        embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
        attention_bias=False, mlp_bias=False)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, real_checkpoint):
    """(name, model dir, prompts, HF greedy tokens, HF prompt log-softmax) of one family."""
    return build_family(request.param, FAMILIES, tmp_path_factory, real_checkpoint)


def test_tokens_and_prompt_logprobs_match_hf(family):
    check_tokens_and_logprobs(family, {"olmo2": "Olmo2Model", "granite": "GraniteModel"}[family[0]])


@pytest.mark.parametrize("radix,chunk", MATRIX)
def test_matrix_alone_and_batched(family, radix, chunk):
    check_matrix(family, radix, chunk)


def test_tensor_parallel_refused_for_olmo2(family):
    """OLMo 2's QK-norm spans every head: ``tp_size > 1`` refused (Granite shards:
    tests/runtime/test_tp_families.py)."""
    if family[0] != "olmo2":
        pytest.skip("Granite runs tensor-parallel")
    check_refusals(family, quantized_kv_refused=False, tp_refused=True)
