"""Sizing the hybrid sliding-window pool (sglite/runtime/swa_pool.py): the full pool holds only the
global layers' K/V and its token count comes from their bytes per token, so the memory of a
full-attention pool buys several times more full-pool tokens; the local slots are sized from the
window and the running rows. Checked on a tiny random Gemma 3 with Gemma 3's layer pattern (5 of 6
layers local, window 8): per-token bytes, capacities, greedy tokens equal transformers' on a
request longer than 4x the window, and its local slots freed while it runs."""
import pytest

from sglite.kv_estimate import estimate
from sglite.runtime.kv_pool import kv_bytes_per_token
from sglite.runtime.swa_pool import SWATokenToKVPool, split_budget, swa_pool_tokens
from tests.runtime.family_parity import GREEDY
from tests.runtime.test_families_gemma import FAMILIES

WINDOW = 8
LAYERS = ["sliding_attention"] * 5 + ["full_attention"]  # Gemma 3's pattern: every 6th layer global


def test_split_budget_unit():
    """Budget = local slots x local bytes + full tokens x global bytes; a budget too small for
    the local slots wanted falls back to full attention's split (never fewer tokens)."""
    g, l, w, rows, ctx, page = 100, 500, 8, 4, 100, 4
    want = rows * (2 * w + 2 * page) + 2 * ctx  # 296
    full, local = split_budget(10_000 * 600, g, l, w, rows, ctx, page)
    assert local == want == swa_pool_tokens(full, w, rows, ctx, page)
    assert full == (10_000 * 600 - want * l) // g // page * page == 58_520
    assert full * g + local * l <= 10_000 * 600
    assert split_budget(250 * 600, g, l, w, rows, ctx, page) == (248, 248)  # the full-attention split, whole pages
    assert split_budget(10_000 * 600, g, l, w, rows, ctx, page, max_full=20_000) == (20_000, want)
    assert split_budget(1000 * l, 0, l, w, rows, ctx, page) == (1000, want)  # no global layer
    with pytest.raises(ValueError, match="local_bytes"):
        split_budget(1000, g, 0, w, rows, ctx, page)


def test_kv_estimate_reports_both_capacities(capsys, tmp_path):
    """Gemma 3 270M's shape (3 global of 18 layers): the memory of 16 x 4096 full-attention
    tokens holds a full pool of (budget - local slots x local bytes) / global bytes tokens;
    with much memory the factor nears 18 / 3 = 6."""
    import json

    from sglite.cli import main

    g3 = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 640, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 256, "num_hidden_layers": 18, "sliding_window": 512,
          "sliding_window_pattern": 6}
    e = estimate(g3, seq_len=4096, batch=16, dtype="bfloat16")
    per_layer = 2 * 256 * 2
    local = 16 * (2 * 512 + 2) + 2 * 4096
    full, swa = e.pool_capacity()
    assert swa == local and full == (18 * per_layer * 16 * 4096 - local * 15 * per_layer) // (3 * per_layer)
    big, _ = e.pool_capacity(1 << 36)
    assert 5.9 < big / ((1 << 36) // e.bytes_per_token) <= 6.0
    assert estimate(dict(g3, architectures=["LlamaForCausalLM"]), 4096, 16).pool_capacity() == (16 * 4096, 0)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(g3))
    assert main(["kv-estimate", "--config", str(p), "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert (f"full pool {full} tokens (3 global layers, {3 * per_layer} bytes per token), {local} local slots "
            f"({15 * per_layer} bytes per token): {full / 65536:.1f}x the tokens") in out


@pytest.fixture(scope="module")
def gemma3_6(tmp_path_factory, real_checkpoint):
    """(model dir, two prompts longer than 4x the window, HF's greedy tokens for them)."""
    from sglite.runtime.tokenizer import Tokenizer
    from sglite.testing import hf_greedy, make_tiny_family, word_prompts

    model_type, arch, fields = FAMILIES["gemma3"]
    d = make_tiny_family(tmp_path_factory.mktemp("g3six"), model_type, arch, seed=5,
                         vocab_from=real_checkpoint.model_dir, **dict(fields, num_hidden_layers=6, layer_types=LAYERS))
    prompts = word_prompts(Tokenizer.from_dir(d), 2, 4 * WINDOW + 5, 5 * WINDOW + 3, seed=7, exact=True)
    refs, _ = hf_greedy(d, prompts, GREEDY["max_new_tokens"])
    return d, prompts, refs


def test_full_pool_counts_global_layers_only(gemma3_6, caplog):
    """Same --max-total-tokens memory: the full pool's bytes per token are the one global
    layer's, its buffers exist for that layer only (local layers: local slots), its capacity is
    (T x 6 - local slots x 5) layer-tokens, several times T; long requests stay HF's and give
    their out-of-window local slots back while they run."""
    from sglite import Engine

    d, prompts, refs = gemma3_6
    T = 2048
    with caplog.at_level("INFO", logger="sglite"):
        e = Engine(model_path=str(d), dtype="float32", check_invariants=True, max_total_tokens=T,
                   context_length=128, max_running_requests=2, disable_radix_cache=True,
                   chunked_prefill_size=WINDOW)
    with e:
        pool = e.runner.token_to_kv_pool
        assert isinstance(pool, SWATokenToKVPool)
        layer = kv_bytes_per_token("auto", 1, 2, 16, 4)  # 2 KV heads x head_dim 16, float32
        assert (pool.global_bytes_per_token, pool.local_bytes_per_token) == (layer, 5 * layer)
        assert e.runner.bytes_per_token == 6 * layer  # full attention's, the budget's unit
        slots = (pool.num_pages + 1) * pool.page_size
        for loc, k, v in zip(pool.local_layers, pool.k_buffers, pool.v_buffers):
            rows = pool.swa_capacity + 1 if loc else slots
            assert k.shape[0] == v.shape[0] == rows
        want = (2 + 8) * (2 * WINDOW + 2 * pool.page_size) + 2 * 128
        assert pool.swa_capacity == want
        assert pool.capacity == (T * 6 - want * 5) // pool.page_size * pool.page_size
        assert pool.capacity * layer + pool.swa_capacity * 5 * layer <= T * 6 * layer
        assert pool.capacity > 4 * T and e.runner.max_total_tokens == pool.capacity
        assert any(f"full pool {pool.capacity} tokens (1 global layers" in r.getMessage() for r in caplog.records)
        peak = []
        real = pool.begin_step

        def spy(fb):
            real(fb)
            peak.append(pool.swa_used_tokens())
        pool.begin_step = spy
        out = e.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in out] == refs
        assert min(len(p) for p in prompts) > 4 * WINDOW
        assert max(peak) <= 2 * (2 * WINDOW + 1)  # two requests, about a window each (chunks of one window)
        e.check_invariants()
        assert pool.swa_used_tokens() == 0 and len(pool.free_page_set()) == pool.num_pages
