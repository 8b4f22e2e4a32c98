"""LoRA adapters with the rest of the engine (issue 30's "works with the rest"), on the tiny random
model with rank-4 q/v adapters: constrained decoding (regex and JSON schema), n > 1 sampling,
streaming, speculative decoding (STANDALONE, EAGLE and NGRAM drafts run without the adapter; verified
with the request's adapter they give the non-speculative adapter's greedy tokens) and unloading (the adapter's
radix entries go, the base model's stay). Quantized bases: tests/runtime/test_lora_fused_peft.py."""
import json
import re

import pytest

from tests.server.test_lora_server import tiny_adapter

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
PROMPTS = ["The sea is calm and", "Once upon a time there was"]


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    from sglite import Engine

    root = tmp_path_factory.mktemp("lora_paths")
    paths = {"a": str(tiny_adapter(root / "a", 1)), "b": str(tiny_adapter(root / "b", 2))}
    kw = dict(dtype="float32", max_total_tokens=4096, check_invariants=True)
    with Engine(str(tiny_model_dir), lora_paths={"a": paths["a"]}, **kw) as e:
        yield e, paths, kw


def _ids(outs):
    return [o["output_ids"] for o in outs]


def test_regex_and_json_schema_with_an_adapter(setup):
    e, _, _ = setup
    regex = r"[a-z]{1,6}( [a-z]{1,6}){2}\."
    sp = {"max_new_tokens": 32, "temperature": 0, "regex": regex}
    alone = {lp: e.generate(prompt=PROMPTS[0], sampling_params=sp, lora_path=lp)["text"] for lp in ("a", None)}
    assert all(re.fullmatch(regex, t) for t in alone.values()), alone
    assert alone["a"] != alone[None]  # the adapter changed the constrained choice
    mixed = e.generate(prompt=[PROMPTS[0]] * 2, sampling_params=sp, lora_path=["a", None])  # one batch
    assert [o["text"] for o in mixed] == [alone["a"], alone[None]]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "w": {"type": "string", "maxLength": 6}},
              "required": ["n", "w"]}
    js = {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema)}
    outs = e.generate(prompt=["Answer:"] * 2, sampling_params=js, lora_path=["a", None])
    objs = [json.loads(o["text"]) for o in outs]
    assert all(isinstance(o["n"], int) and isinstance(o["w"], str) for o in objs)
    assert outs[0]["text"] == e.generate(prompt="Answer:", sampling_params=js, lora_path="a")["text"]


def test_n_greedy_and_sampled_with_an_adapter(setup):
    e, _, _ = setup
    want = e.generate(prompt=PROMPTS[0], sampling_params=GREEDY, lora_path="a")["output_ids"]
    assert want != e.generate(prompt=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
    assert _ids(e.generate(prompt=PROMPTS[0], sampling_params=dict(GREEDY, n=3), lora_path="a")) == [want] * 3
    # sampled: sample j of an n=2 request is the single request seeded with sample_seed(seed, j)
    # (each sample of the fork runs with the parent's adapter), and differs from the base model's
    from sglite.runtime.engine_protocol import sample_seed

    sp = dict(GREEDY, temperature=1.0, sampling_seed=7)
    got = _ids(e.generate(prompt=PROMPTS[0], sampling_params=dict(sp, n=2), lora_path="a"))
    one = [e.generate(prompt=PROMPTS[0], sampling_params=dict(sp, sampling_seed=sample_seed(7, j)),
                      lora_path="a")["output_ids"] for j in range(2)]
    base = _ids(e.generate(prompt=PROMPTS[0], sampling_params=dict(sp, n=2)))
    assert got == one and got != base and got[0] != got[1]


def test_streaming_with_an_adapter(setup):
    e, _, _ = setup
    for n in (1, 2):
        sp = dict(GREEDY, n=n)
        final = e.generate(prompt=PROMPTS[1], sampling_params=sp, lora_path="a")
        finals = final if n > 1 else [final]
        events = list(e.generate(prompt=PROMPTS[1], sampling_params=sp, lora_path="a", stream=True))
        for j in range(n):
            mine = [ev for ev in events if ev.get("index", 0) == j]
            texts = [ev["text"] for ev in mine]
            assert len(mine) > 1 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
            assert mine[-1]["output_ids"] == finals[j]["output_ids"]
    base = e.generate(prompt=PROMPTS[1], sampling_params=GREEDY)["output_ids"]
    assert finals[0]["output_ids"] != base


def test_unload_drops_only_the_adapters_cache_entries(setup):
    e, paths, _ = setup
    cache = e.scheduler.kv.cache
    e.flush_cache()
    e.generate(prompt=PROMPTS, sampling_params=GREEDY)
    base_only = cache.total_size()
    assert e.load_lora_adapter("b", paths["b"]) == ["a", "b"]
    e.generate(prompt=PROMPTS, sampling_params=GREEDY, lora_path="b")
    assert cache.total_size() > base_only
    assert e.unload_lora_adapter("b") == ["a"]
    assert cache.total_size() == base_only  # b's entries gone, the base model's kept
    e.check_invariants()
    hit = e.generate(prompt=PROMPTS[0], sampling_params=GREEDY)["meta_info"]["cached_tokens"]
    assert hit > 0


def _draft(alg, tiny_model_dir, root):
    """The draft of ``alg`` for the tiny model: itself (STANDALONE), a random EAGLE head, or none (NGRAM)."""
    if alg == "STANDALONE":
        return {"speculative_draft_model_path": str(tiny_model_dir), "speculative_num_steps": 3}
    if alg == "EAGLE":
        import torch

        from sglite.runtime.speculative.heads import EagleHead, save_heads

        cfg = json.loads((tiny_model_dir / "config.json").read_text())
        torch.manual_seed(0)
        head = EagleHead(dict(hidden_size=cfg["hidden_size"], intermediate_size=96, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=cfg["vocab_size"], rms_norm_eps=1e-6,
                              rope_theta=10000.0))
        save_heads(head, root / "eagle")
        return {"speculative_draft_model_path": str(root / "eagle"), "speculative_num_steps": 3}
    return {"speculative_num_draft_tokens": 4}


@pytest.mark.parametrize("alg", ["STANDALONE", pytest.param("EAGLE", marks=pytest.mark.slow),
                                 pytest.param("NGRAM", marks=pytest.mark.slow)])  # NGRAM fast: test_lora_units
def test_speculative_drafts_are_verified_with_the_adapter(alg, setup, tiny_model_dir, tmp_path):
    """Greedy tokens (plain and regex) with speculation equal the engine's without it, per adapter,
    in a batch mixing an adapter and the base model. The drafts run without adapters (STANDALONE:
    the base model itself, so the base row keeps more of its drafts than the adapter's rows)."""
    from sglite import Engine

    e, paths, kw = setup
    prompts = PROMPTS + ["A B C A B C A B C A B"]
    loras = ["a", None, "a"]
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    rx = {"max_new_tokens": 32, "temperature": 0, "regex": r"[a-z]{1,6}( [a-z]{1,6}){2}\."}
    want = _ids(e.generate(prompt=prompts, sampling_params=sp, lora_path=loras))
    want_rx = e.generate(prompt=PROMPTS[0], sampling_params=rx, lora_path="a")["text"]
    with Engine(str(tiny_model_dir), lora_paths={"a": paths["a"]}, speculative_algorithm=alg,
                **_draft(alg, tiny_model_dir, tmp_path), **kw) as s:
        got = s.generate(prompt=prompts, sampling_params=sp, lora_path=loras)
        assert _ids(got) == want
        assert all(g["meta_info"]["spec_verify_ct"] > 0 for g in got)
        if alg == "STANDALONE":
            assert got[1]["meta_info"]["spec_accept_length"] > got[0]["meta_info"]["spec_accept_length"]
        assert s.generate(prompt=PROMPTS[0], sampling_params=rx, lora_path="a")["text"] == want_rx
        assert s.get_server_info()["spec_draft_tokens"] > 0
