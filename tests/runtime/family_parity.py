"""The parity harness every model family's test file shares (issue 27's oracle): a tiny random
checkpoint of the family, its prompts, transformers' greedy tokens and prompt log-softmax in
float32, and the checks: greedy tokens and prompt logprobs equal HF's; radix cache on and off,
chunked prefill and not, each prompt alone and inside a batch of mixed lengths."""
import itertools

import pytest
import torch

NEW = 16
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
#: the fast tier runs one configuration (radix on, chunked); the slow tier the rest of the matrix
MATRIX = [pytest.param(r, c, marks=() if (r, c) == (True, 16) else pytest.mark.slow)
          for r, c in itertools.product([True, False], [16, None])]


def prompts_of(tok, n, lo, hi, seed):
    """:func:`sglite.testing.word_prompts`, the first prompt cut to 5 tokens."""
    from sglite.testing import word_prompts

    out = word_prompts(tok, n, lo, hi, seed)
    out[0] = out[0][:5]
    return out


def build_family(name, families, tmp_path_factory, real_checkpoint):
    """(name, model dir, prompts, HF greedy tokens, HF prompt log-softmax) of ``families[name]``
    = (model_type, architecture, config fields)."""
    from sglite.runtime.tokenizer import Tokenizer
    from sglite.testing import hf_greedy, make_tiny_family

    model_type, arch, fields = families[name]
    d = make_tiny_family(tmp_path_factory.mktemp(name), model_type, arch, seed=3,
                         vocab_from=real_checkpoint.model_dir, **fields)
    prompts = prompts_of(Tokenizer.from_dir(d), 6, 5, 90, seed=7)
    outs, logps = hf_greedy(d, prompts, NEW)
    assert len({tuple(o) for o in outs}) > 1 and all(len(set(o)) > 1 for o in outs)  # non-degenerate
    return name, d, prompts, outs, logps


def engine(model_dir, **kw):
    from sglite import Engine

    return Engine(model_path=str(model_dir), dtype="float32", check_invariants=True, max_total_tokens=4096, **kw)


def check_tokens_and_logprobs(family, model_class: str):
    """The first four prompts batched: HF's greedy tokens, prompt logprobs within 1e-4, on the
    family's own model class and the per-op path (float weights: no fused decode, and
    ``decode_fused.prepare`` refuses to build one: checked here, in this engine, for
    :func:`check_refusals`)."""
    from sglite.kernels import decode_fused

    name, d, prompts, outs, logps = family
    with engine(d) as e:
        assert type(e.runner.model).__name__ == model_class
        assert e.runner.model.decode_fused is None
        assert decode_fused.prepare(e.runner.model) is None
        res = e.generate(input_ids=prompts[:4], sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    for i, r in enumerate(res):
        assert r["output_ids"] == outs[i], f"{name}: prompt {i} diverges from HF"
        lp = r["meta_info"]["input_token_logprobs"]
        ours = torch.tensor([x[0] for x in lp[1:]])
        ref = logps[i][torch.arange(len(prompts[i]) - 1), torch.tensor(prompts[i][1:])]
        assert torch.allclose(ours, ref, atol=1e-4), f"{name}: prompt logprobs differ by {(ours - ref).abs().max()}"


def check_matrix(family, radix: bool, chunk):
    """Alone, batched and again (from the radix cache when on): HF's greedy tokens."""
    name, d, prompts, outs, _ = family
    with engine(d, disable_radix_cache=not radix, chunked_prefill_size=chunk or -1) as e:
        alone = [e.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts[:2]]
        batch = e.generate(input_ids=prompts, sampling_params=GREEDY)
        again = e.generate(input_ids=prompts[1], sampling_params=GREEDY)
        e.check_invariants()
    assert alone == outs[:2], f"{name}: alone diverges"
    assert [r["output_ids"] for r in batch] == outs, f"{name}: batched diverges"
    assert again["output_ids"] == outs[1]
    assert (again["meta_info"]["cached_tokens"] > 0) == radix


def check_refusals(family, quantized_kv_refused: bool, tp_refused: bool = False):
    """Where the family lacks them, ``tp_size > 1`` (OLMo 2 only: the others shard, see
    tests/runtime/test_tp_families.py) and a quantized KV cache are refused naming the field,
    before weights load. That float weights never take the fused decode is checked in
    :func:`check_tokens_and_logprobs`'s engine (the families' quantized weights do take it:
    tests/kernels/test_decode_family.py)."""
    from sglite.errors import InvalidRequestError

    d = family[1]
    refused = ([("tp_size", dict(tp_size=2))] if tp_refused else []) + ([("kv_cache_dtype", dict(kv_cache_dtype="fp8_e4m3"))]
                                                if quantized_kv_refused else [])
    for field, kw in refused:
        with pytest.raises(InvalidRequestError) as ei:
            engine(d, **kw)
        assert ei.value.field == field


def check_greedy_and_prompt_logprobs(res, prompts, outs, logps, atol: float = 1e-4):
    """Engine results ``res`` (``return_logprob``, ``logprob_start_len=0``) against HF's greedy
    tokens ``outs`` and prompt log-softmax ``logps`` (:func:`sglite.testing.hf_greedy`): tokens equal,
    prompt logprobs within ``atol``."""
    for i, r in enumerate(res):
        assert r["output_ids"] == outs[i], f"prompt {i} diverges"
        ours = torch.tensor([x[0] for x in r["meta_info"]["input_token_logprobs"][1:]])
        want = logps[i][torch.arange(len(prompts[i]) - 1), torch.tensor(prompts[i][1:])]
        assert torch.allclose(ours, want, atol=atol), (ours - want).abs().max()
