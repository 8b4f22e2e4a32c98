"""OLMo 2 and Granite against transformers on tiny random checkpoints (float32, eager attention):
greedy tokens and prompt logprobs, with the radix cache on and off, chunked prefill and not, each
prompt alone and inside a batch of mixed lengths (issue 27's oracle for every family)."""
import itertools
import random

import pytest
import torch

NEW = 16
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
FAMILIES = {
    "olmo2": ("olmo2", "Olmo2ForCausalLM", dict(attention_bias=False)),
    "granite": ("granite", "GraniteForCausalLM", dict(
        embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
        attention_bias=False, mlp_bias=False)),
}


def _prompts(tok, n, lo, hi, seed):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "the", "cat", "sat", "on", "mat", "42", "é", "🙂", "\n"]
    out = []
    for _ in range(n):
        target = rng.randint(lo, hi)
        out.append(tok.encode(" ".join(rng.choice(words) for _ in range(target)))[:target])
    out[0] = out[0][:5]
    return out


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, real_checkpoint):
    """(name, model dir, prompts, HF greedy tokens, HF prompt log-softmax) of one family."""
    from sglite.runtime.tokenizer import Tokenizer
    from sglite.testing import hf_greedy, make_tiny_family

    model_type, arch, fields = FAMILIES[request.param]
    d = make_tiny_family(tmp_path_factory.mktemp(request.param), model_type, arch, seed=3,
                         vocab_from=real_checkpoint.model_dir, **fields)
    prompts = _prompts(Tokenizer.from_dir(d), 6, 5, 90, seed=7)
    outs, logps = hf_greedy(d, prompts, NEW)
    assert len({tuple(o) for o in outs}) > 1 and all(len(set(o)) > 1 for o in outs)  # non-degenerate
    return request.param, d, prompts, outs, logps


def _engine(model_dir, **kw):
    from sglite import Engine

    return Engine(model_path=str(model_dir), dtype="float32", check_invariants=True, max_total_tokens=4096, **kw)


def test_tokens_and_prompt_logprobs_match_hf(family):
    name, d, prompts, outs, logps = family
    with _engine(d) as e:
        assert type(e.runner.model).__name__ == {"olmo2": "Olmo2Model", "granite": "GraniteModel"}[name]
        assert e.runner.model.decode_fused is None
        res = e.generate(input_ids=prompts[:4], sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    for i, r in enumerate(res):
        assert r["output_ids"] == outs[i], f"{name}: prompt {i} diverges from HF"
        lp = r["meta_info"]["input_token_logprobs"]
        ours = torch.tensor([x[0] for x in lp[1:]])
        ref = logps[i][torch.arange(len(prompts[i]) - 1), torch.tensor(prompts[i][1:])]
        assert torch.allclose(ours, ref, atol=1e-4), f"{name}: prompt logprobs differ by {(ours - ref).abs().max()}"


# the fast tier runs one configuration (radix on, chunked); the slow tier the rest of the matrix
@pytest.mark.parametrize("radix,chunk", [pytest.param(r, c, marks=() if (r, c) == (True, 16) else pytest.mark.slow)
                                         for r, c in itertools.product([True, False], [16, None])])
def test_matrix_alone_and_batched(family, radix, chunk):
    name, d, prompts, outs, _ = family
    with _engine(d, disable_radix_cache=not radix, chunked_prefill_size=chunk or -1) as e:
        alone = [e.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts[:2]]
        batch = e.generate(input_ids=prompts, sampling_params=GREEDY)
        again = e.generate(input_ids=prompts[1], sampling_params=GREEDY)  # from the radix cache when on
        e.check_invariants()
    assert alone == outs[:2], f"{name}: alone diverges"
    assert [r["output_ids"] for r in batch] == outs, f"{name}: batched diverges"
    assert again["output_ids"] == outs[1]
    assert (again["meta_info"]["cached_tokens"] > 0) == radix


def test_fused_decode_and_tensor_parallel_refused(family):
    from sglite.errors import InvalidRequestError
    from sglite.kernels import decode_fused
    from sglite.runtime.models.family import FamilyModel

    assert FamilyModel.fused_decode_ok is False
    name, d = family[:2]
    with _engine(d) as e:
        assert decode_fused.prepare(e.runner.model) is None
    with pytest.raises(InvalidRequestError) as ei:
        _engine(d, tp_size=2)
    assert ei.value.field == "tp_size"
