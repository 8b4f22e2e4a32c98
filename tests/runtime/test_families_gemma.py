"""Gemma 2 and Gemma 3 text models against transformers on tiny random checkpoints (float32, eager
attention): greedy tokens and prompt logprobs, radix cache on and off, chunked prefill and not, alone
and batched (issue 27's oracle). ``sliding_window=8`` is shorter than most prompts, so the local
layers' window is exercised on prefill chunks, cached prefixes and decode, with the local layers'
K/V in the hybrid pool's window-sized slot space (sglite/runtime/swa_pool.py; out-of-window slots
freed while requests run, prefix matches cut where a window was freed); Gemma 2 also soft-caps
attention and final logits, Gemma 3 has per-head QK-norm and a separate local RoPE base."""
import pytest

from tests.runtime.family_parity import MATRIX, NEW, build_family, check_matrix, check_refusals, check_tokens_and_logprobs

FAMILIES = {
    "gemma2": ("gemma2", "Gemma2ForCausalLM", dict(
        query_pre_attn_scalar=24, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", dict(
        query_pre_attn_scalar=24, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, real_checkpoint):
    """(name, model dir, prompts, HF greedy tokens, HF prompt log-softmax) of one family."""
    fam = build_family(request.param, FAMILIES, tmp_path_factory, real_checkpoint)
    assert sum(len(p) > 8 + NEW for p in fam[2]) >= 3  # the window bites on prefill too
    assert sum(len(p) >= 4 * 8 for p in fam[2]) >= 3  # prompts of 4x the window: local slots freed mid-prompt
    return fam


def test_tokens_and_prompt_logprobs_match_hf(family):
    check_tokens_and_logprobs(family, "GemmaModel")


@pytest.mark.parametrize("radix,chunk", MATRIX)
def test_matrix_alone_and_batched(family, radix, chunk):
    check_matrix(family, radix, chunk)


def test_quantized_kv_cache_refused(family):
    check_refusals(family, quantized_kv_refused=True)
