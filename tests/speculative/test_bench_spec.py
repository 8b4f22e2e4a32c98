"""``sglite bench spec`` (issue 29): every batch on an empty radix cache unless ``--reuse-cache``,
and a held-out prompt set disjoint from the tuned workloads, reported beside them."""
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
    assert a.reuse_cache is False and a.speculative_verify == "token"
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
