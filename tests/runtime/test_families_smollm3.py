"""SmolLM3 (NoPE layers: no rotation where ``no_rope_layers[i]`` is 0) against transformers on a tiny
random checkpoint (4 layers, NoPE at layers 1 and 3; float32, eager attention): greedy tokens and
prompt logprobs, with the radix cache on and off, chunked prefill and not, each prompt alone and
inside a batch of mixed lengths (the families' parity harness). The NoPE flags matter: the same
checkpoint with every layer rotating gives other tokens."""
import pytest

from tests.runtime.family_parity import MATRIX, build_family, check_matrix, check_tokens_and_logprobs

FAMILIES = {"smollm3": ("smollm3", "SmolLM3ForCausalLM", dict(
    num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0], attention_bias=False, mlp_bias=False))}


@pytest.fixture(scope="module")
def family(tmp_path_factory, real_checkpoint):
    """(name, model dir, prompts, HF greedy tokens, HF prompt log-softmax)."""
    return build_family("smollm3", FAMILIES, tmp_path_factory, real_checkpoint)


def test_tokens_and_prompt_logprobs_match_hf(family):
    check_tokens_and_logprobs(family, "SmolLM3Model")


@pytest.mark.parametrize("radix,chunk", MATRIX)
def test_matrix_alone_and_batched(family, radix, chunk):
    check_matrix(family, radix, chunk)


def test_nope_flags_are_read_and_matter(family):
    """The arch carries the config's flags; rotating every layer changes the model's output (so the
    parity above checks the NoPE layers, not only the Llama ones)."""
    import json

    from sglite.runtime.models import registry
    from sglite.testing import hf_greedy

    name, d, prompts, outs, _ = family
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(d))
    assert registry.arch_from_hf_config(cfg).nope_layers == (False, True, False, True)
    conf = json.loads((d / "config.json").read_text())
    conf["no_rope_layers"] = [1, 1, 1, 1]
    (d / "config.json").write_text(json.dumps(conf))
    try:
        all_rope, _ = hf_greedy(d, prompts[:3], 16)
    finally:
        conf["no_rope_layers"] = [1, 0, 1, 0]
        (d / "config.json").write_text(json.dumps(conf))
    assert all_rope != outs[:3]


def test_sliding_window_and_bad_flags_refused(family):
    from transformers import AutoConfig

    from sglite.errors import InvalidRequestError
    from sglite.runtime.models import smollm3

    cfg = AutoConfig.from_pretrained(str(family[1]))
    for field, value in (("use_sliding_window", True), ("no_rope_layers", [1, 0])):
        bad = AutoConfig.from_pretrained(str(family[1]))
        setattr(bad, field, value)
        with pytest.raises(InvalidRequestError, match=field) as e:
            smollm3.arch_from_hf_config(bad)
        assert e.value.field == "model_path"
    assert smollm3.arch_from_hf_config(cfg).family == "smollm3"
