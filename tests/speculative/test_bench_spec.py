"""``sglite bench spec`` (issue 29): every batch on an empty radix cache unless ``--reuse-cache``,
and a held-out prompt set disjoint from the tuned workloads, reported beside them."""
import json

import pytest
import torch

from sglite import Engine
from sglite.bench import spec as bench


def test_heldout_prompts_are_new_and_are_workloads():
    held = bench.heldout()
    w = bench.workloads(8)
    assert len(held["chat"]) >= 8 and len(held["copy_edit"]) >= 4
    assert not set(held["chat"]) & set(bench.CHAT)
    tuned = {m for name, (items, _) in w.items() if "heldout" not in name for m, _ in items}
    held_items = [m for name in ("chat_heldout", "copy_edit_heldout") for m, _ in w[name][0]]
    assert len(held_items) == 12 and not set(held_items) & tuned
    assert all(par not in m for _, par in held["copy_edit"] for m in tuned)


def test_fresh_cache_by_default_and_reuse_on_request(tiny_model_dir):
    a = bench.build_parser().parse_args([])
    assert a.reuse_cache is False and a.speculative_verify == ["token"] and a.speculative_algorithm == ["NGRAM"]
    assert bench.build_parser().parse_args(["--reuse-cache"]).reuse_cache is True
    e = Engine(str(tiny_model_dir), dtype="float32", device="cpu", max_total_tokens=2048)
    try:
        prompts, sps = ["alpha beta gamma delta epsilon"] * 2, [{"max_new_tokens": 2, "temperature": 0}] * 2
        reused, _ = bench._run(e, prompts, sps, 1)
        assert reused[1]["meta_info"]["cached_tokens"] > 0  # the second request hit the first's prefix
        fresh, _ = bench._run(e, prompts, sps, 1, fresh=True)
        assert [o["meta_info"]["cached_tokens"] for o in fresh] == [0, 0]
        assert [o["output_ids"] for o in fresh] == [o["output_ids"] for o in reused]
    finally:
        e.shutdown()


@pytest.mark.slow
def test_bench_spec_runs_eagle_and_medusa_beside_ngram_with_both_verifiers(tiny_model_dir, tmp_path):
    """One plain engine, one spec engine per (algorithm, verifier); greedy fp32 outputs equal
    plain's (block verification falls back to per-token checks for greedy requests)."""
    from sglite.runtime.speculative.heads import EagleHead, MedusaHeads, save_heads

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    torch.manual_seed(0)
    save_heads(EagleHead(dict(hidden_size=h, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                              vocab_size=v)), tmp_path / "eagle")
    save_heads(MedusaHeads(dict(hidden_size=h, vocab_size=v, medusa_num_heads=2)), tmp_path / "medusa")
    a = bench.build_parser().parse_args([
        "--model-path", str(tiny_model_dir), "--dtype", "float32", "--max-total-tokens", "1024",
        "--speculative-algorithm", "NGRAM", "EAGLE", "MEDUSA", "--speculative-verify", "token", "block",
        "--speculative-draft-model-path", f"EAGLE={tmp_path / 'eagle'}", f"medusa={tmp_path / 'medusa'}",
        "--workloads", "chat", "--num-prompts", "1", "--rounds", "1", "--max-new-tokens", "6"])
    assert bench._draft_paths(a) == {"EAGLE": str(tmp_path / "eagle"), "MEDUSA": str(tmp_path / "medusa")}
    res = bench.run(a)
    labels = [f"{alg}/{ver}" for alg in ("NGRAM", "EAGLE", "MEDUSA") for ver in ("token", "block")]
    assert sorted(res) == sorted(f"chat {lab}" for lab in labels)
    for r in res.values():
        assert r["identical"] == "1/1" and r["tokens"][0] == r["tokens"][1] > 0
        assert r["speedup"] > 0 and len(r["pair_ratios"]) == 1
    assert res["chat EAGLE/token"]["accept_length"] >= 1.0  # the heads drafted and were verified


def test_draft_paths_name_one_algorithm_or_all_that_take_one():
    p = bench.build_parser()
    a = p.parse_args(["--speculative-algorithm", "NGRAM", "STANDALONE", "EAGLE", "--speculative-draft-model-path", "d"])
    assert bench._draft_paths(a) == {"STANDALONE": "d", "EAGLE": "d"}
    a = p.parse_args(["--speculative-algorithm", "EAGLE", "MEDUSA", "--speculative-draft-model-path", "medusa=m"])
    assert bench._draft_paths(a) == {"MEDUSA": "m"}
