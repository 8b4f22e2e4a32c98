"""Engine vs HF transformers on the same weights: greedy tokens and prefill logprobs.

The correctness matrix (issue 3): radix cache on/off × chunked prefill (16) or not × page size
1 or 16 × alone or inside a batch of 8 mixed-length requests, on a tiny random Llama; plus
Qwen2's qkv-bias path.
"""
import itertools

import pytest
import torch

from sglite.testing import hf_greedy, word_prompts

NEW = 32


def _hf_greedy(model_dir, prompts_ids, new=NEW):
    return hf_greedy(model_dir, prompts_ids, new, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def tiny_ref(tiny_model_dir):
    from sglite.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    prompts = word_prompts(tok, 8, 5, 300, seed=1)
    prompts[0] = prompts[0][:5]
    outs, logps = _hf_greedy(tiny_model_dir, prompts)
    return prompts, outs, logps


def _engine(model_dir, **kw):
    from sglite import Engine

    kw.setdefault("max_total_tokens", 8192)
    return Engine(model_path=str(model_dir), dtype="float32", check_invariants=True, **kw)


GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


def test_batch_of_four_matches_hf_tokens_and_prefill_logprobs(tiny_model_dir, tiny_ref):
    prompts, outs, logps = tiny_ref
    with _engine(tiny_model_dir) as e:
        res = e.generate(input_ids=prompts[:4], sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    for i, r in enumerate(res):
        assert r["output_ids"] == outs[i], f"prompt {i} ({len(prompts[i])} tokens) diverges from HF"
        lp = r["meta_info"]["input_token_logprobs"]
        assert lp[0][0] is None and len(lp) == len(prompts[i])
        ours = torch.tensor([e[0] for e in lp[1:]])
        ref = logps[i][torch.arange(len(prompts[i]) - 1), torch.tensor(prompts[i][1:])]
        assert torch.allclose(ours, ref, atol=1e-3), f"prefill logprobs differ by {(ours - ref).abs().max()}"


# the fast tier runs a pairwise cover of radix x chunk x page (every pair of two options' values
# once: 4 engines); the slow tier the other 4 of the full matrix
PAIRWISE = {(True, 16, 1), (True, None, 16), (False, 16, 16), (False, None, 1)}
MATRIX = [c if c in PAIRWISE else pytest.param(*c, marks=pytest.mark.slow)
          for c in itertools.product([True, False], [16, None], [1, 16])]


@pytest.mark.parametrize("radix,chunk,page", MATRIX)
def test_correctness_matrix(tiny_model_dir, tiny_ref, radix, chunk, page):
    prompts, outs, _ = tiny_ref
    with _engine(tiny_model_dir, disable_radix_cache=not radix, chunked_prefill_size=chunk or -1,
                 page_size=page) as e:
        alone = [e.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts[:3]]
        batch = e.generate(input_ids=prompts, sampling_params=GREEDY)
        again = e.generate(input_ids=prompts[1], sampling_params=GREEDY)  # from the cache when on
        e.check_invariants()
        info = e.get_server_info()
    for i in range(3):
        assert alone[i] == outs[i], f"alone: prompt {i} diverges"
    for i, r in enumerate(batch):
        assert r["output_ids"] == outs[i], f"batch: prompt {i} diverges"
    assert again["output_ids"] == outs[1]
    if radix:
        assert again["meta_info"]["cached_tokens"] >= (len(prompts[1]) - 1) // page * page - page
    else:
        assert again["meta_info"]["cached_tokens"] == 0
    assert info["available_tokens"] == info["max_total_tokens"]


def test_qwen2_bias_path_matches_hf(tiny_qwen_dir):
    from sglite.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_qwen_dir)
    prompts = word_prompts(tok, 2, 10, 40, seed=3)
    outs, _ = _hf_greedy(tiny_qwen_dir, prompts, new=16)
    with _engine(tiny_qwen_dir) as e:
        res = e.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=16))
    assert [r["output_ids"] for r in res] == outs


def test_same_prompt_twice_reports_cached_tokens(tiny_model_dir):
    from sglite.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    ids = word_prompts(tok, 1, 200, 200, seed=5)[0]
    assert len(ids) == 200
    with _engine(tiny_model_dir) as e:
        a = e.generate(input_ids=ids, sampling_params=GREEDY)
        b = e.generate(input_ids=ids, sampling_params=GREEDY)
    assert a["meta_info"]["cached_tokens"] == 0
    assert b["meta_info"]["cached_tokens"] == b["meta_info"]["prompt_tokens"] - 1 == 199
    assert a["output_ids"] == b["output_ids"]
