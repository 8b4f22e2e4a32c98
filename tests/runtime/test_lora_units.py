"""LoRA units without PEFT (the fast tier's share of issue 30; the PEFT oracles are in
tests/runtime/test_lora.py): radix-cache namespaces, adapter files checked field by field, the
device slots and per-step batches against plain per-row math, ``lora_paths`` parsing and flags,
and the engine on the tiny model (an adapter with zero B is the base model; max_loras_per_batch)."""
import json

import pytest
import torch
from safetensors.torch import save_file

from sglite.config import EngineConfig, parse_lora_paths
from sglite.errors import InvalidRequestError
from sglite.lora import LoraManager, load_adapter
from sglite.runtime.kv_pool import TokenToKVPool
from sglite.runtime.models.llama import LlamaArch
from sglite.runtime.radix_cache import RadixCache

ARCH = LlamaArch(vocab_size=100, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True)
SHAPES = {"q_proj": (16, 16), "k_proj": (16, 8), "v_proj": (16, 8), "o_proj": (16, 16), "gate_proj": (16, 24),
          "up_proj": (16, 24), "down_proj": (24, 16)}  # (in, out)


def write_adapter(path, r=2, modules=("q_proj", "v_proj"), layers=(0, 1), seed=0, config=None, extra=None,
                  zero_b=False):
    """A PEFT-layout adapter folder written by hand; returns (path, {(layer, module): (A, B)})."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors, weights = {}, {}
    for i in layers:
        for m in modules:
            fin, fout = SHAPES[m]
            a, b = torch.randn(r, fin, generator=g), torch.randn(fout, r, generator=g) * (0 if zero_b else 1)
            part = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            pre = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[pre + ".lora_A.weight"], tensors[pre + ".lora_B.weight"] = a, b
            weights[(i, m)] = (a, b)
    tensors.update(extra or {})
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"r": r, "lora_alpha": 2 * r, "target_modules": list(modules), "bias": "none", **(config or {})}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path, weights


def test_radix_namespaces_never_share_and_drop():
    pool = TokenToKVPool(64, 1, num_layers=1, n_kv_heads=1, head_dim=2, dtype=torch.float32)
    c = RadixCache(pool)
    ids = [5, 6, 7, 8]
    for ns in (None, 1, 2):
        slots = pool.alloc_extend(None, 0, len(ids))
        assert c.insert(ids, slots, ns) == 0  # nothing shared with the other namespaces
    assert c.total_size() == 12
    assert len(c.match_prefix(ids, 3)[0]) == 0
    m1, node = c.match_prefix(ids, 1)
    m2, _ = c.match_prefix(ids, 2)
    assert len(m1) == 4 and set(m1.tolist()).isdisjoint(m2.tolist())
    c.inc_lock_ref(node)
    c.check_invariants()
    with pytest.raises(AssertionError):
        c.drop_namespace(1)  # a running request reads it
    c.dec_lock_ref(node)
    free = pool.free_tokens()
    assert c.drop_namespace(1) == 4 and pool.free_tokens() == free + 4
    assert len(c.match_prefix(ids, 1)[0]) == 0 and len(c.match_prefix(ids)[0]) == 4
    c.check_invariants()
    assert c.evict(100) == 8  # the remaining namespaces' entries are evictable
    c.check_invariants()


def test_adapter_parts_and_scaling(tmp_path):
    path, w = write_adapter(tmp_path / "a", r=2, modules=("q_proj", "v_proj", "up_proj", "down_proj"))
    ad = load_adapter("a", str(path), ARCH, 8, torch.float32, 7)
    assert ad.uid == 7 and ad.rank == 2 and ad.scaling == 2.0 and ad.keys == {"qkv", "gate_up", "down"}
    q, v = sorted(ad.parts[(0, "qkv")], key=lambda p: p.block)
    assert (q.block, q.row, v.block, v.row) == (0, 0, 2, 24)  # v after q (16) and k (8)
    torch.testing.assert_close(v.b, w[(0, "v_proj")][1] * 2.0)
    up = ad.parts[(1, "gate_up")][0]
    assert (up.block, up.row) == (1, 24)
    rs = load_adapter("b", str(write_adapter(tmp_path / "b", r=4, config={"use_rslora": True})[0]), ARCH, 8,
                      torch.float32, 8)
    assert rs.scaling == pytest.approx(8 / 2)  # lora_alpha / sqrt(r)


@pytest.mark.parametrize("kw,field,text", [
    (dict(r=16), "max_lora_rank", "r=16 exceeds max_lora_rank=8"),
    (dict(config={"target_modules": ["q_proj", "fc9"]}), "target_modules", "fc9"),
    (dict(config={"use_dora": True}), "use_dora", "DoRA"),
    (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save", "modules_to_save"),
    (dict(layers=(0, 5)), "num_hidden_layers", "layer 5"),
    (dict(extra={"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 16),
                 "base_model.model.lm_head.lora_B.weight": torch.zeros(99, 2)}), "vocab_size", "vocab_size=100"),
    (dict(extra={"base_model.model.model.layers.0.mlp.fc1.lora_A.weight": torch.zeros(2, 16)}), "target_modules",
     "fc1"),
])
def test_adapter_errors_name_adapter_and_field(tmp_path, kw, field, text):
    path, _ = write_adapter(tmp_path / "x", **kw)
    with pytest.raises(InvalidRequestError, match=text) as ei:
        load_adapter("mine", str(path), ARCH, 8, torch.float32, 1)
    assert ei.value.field == field and "'mine'" in str(ei.value)


def test_wrong_width_names_hidden_size(tmp_path):
    path, _ = write_adapter(tmp_path / "x", modules=("q_proj",))
    wide = LlamaArch(**{**ARCH.__dict__, "hidden_size": 32})
    with pytest.raises(InvalidRequestError, match="'w'.*hidden_size") as ei:
        load_adapter("w", str(path), wide, 8, torch.float32, 1)
    assert ei.value.field == "hidden_size"


def test_pool_batch_is_per_row_lora(tmp_path):
    """Two adapters (ranks 2 and 3, different targets) and base rows in one step: each row's qkv
    output gains exactly its adapter's scaled B·A·x; base rows and untargeted matmuls unchanged."""
    m = LoraManager(ARCH, torch.float32, "cpu", max_loras_per_batch=2, max_lora_rank=4)
    pa, wa = write_adapter(tmp_path / "a", r=2, modules=("q_proj", "k_proj", "v_proj"), seed=1)
    pb, wb = write_adapter(tmp_path / "b", r=3, modules=("v_proj", "down_proj"), seed=2)
    a, b = m.read("a", str(pa)), m.read("b", str(pb))
    m.add(a)
    m.add(b)
    segs = [(2, a), (1, None), (3, b), (1, a)]
    batch = m.batch(segs)
    x = torch.randn(7, 16)
    y0 = torch.randn(7, 32)
    y = batch.apply(y0.clone(), x, 1, "qkv")
    want = y0.clone()
    rows = [a, a, None, b, b, b, a]
    for i, ad in enumerate(rows):
        if ad is None:
            continue
        w = wa if ad is a else wb
        for mod, lo in (("q_proj", 0), ("k_proj", 16), ("v_proj", 24)):
            if (1, mod) in w:
                A, B = w[(1, mod)]
                want[i, lo:lo + B.shape[0]] += 2.0 * (B @ (A @ x[i]))
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    y2 = torch.randn(7, 16)
    assert batch.apply(y2, x, 0, "o") is y2  # no adapter changes o
    assert m.batch([(4, None)]) is None  # a step without adapters takes today's path
    c = m.read("c", str(write_adapter(tmp_path / "c", seed=3)[0]))
    m.add(c)
    with pytest.raises(RuntimeError, match="max_loras_per_batch=2"):
        m.batch([(1, a), (1, b), (1, c)])
    assert m.batch([(1, c), (1, b)]) is not None and m.pool.loads == 3  # c took a's slot


def test_lora_paths_parsing_and_flags(tmp_path):
    assert parse_lora_paths({"a": "/x"}) == (("a", "/x"),)
    assert parse_lora_paths(["a=/x", "/y"]) == (("a", "/x"), ("/y", "/y"))
    with pytest.raises(InvalidRequestError, match="unique"):
        parse_lora_paths(["a=/x", "a=/y"])
    with pytest.raises(InvalidRequestError) as ei:
        EngineConfig(lora_paths=["a=/no/such/dir"])
    assert ei.value.field == "lora_paths"
    with pytest.raises(InvalidRequestError) as ei:
        EngineConfig(max_loras_per_batch=0)
    assert ei.value.field == "max_loras_per_batch"
    import argparse

    from sglite.flags import add_engine_args, engine_kwargs

    p = add_engine_args(argparse.ArgumentParser())
    kw = engine_kwargs(p.parse_args(["--lora-paths", f"a={tmp_path}", f"b={tmp_path}", "--max-lora-rank", "8"]))
    assert EngineConfig(**kw).lora_paths == (("a", str(tmp_path)), ("b", str(tmp_path))) and kw["max_lora_rank"] == 8


def test_engine_zero_adapter_is_base_and_max_loras_per_batch(tiny_model_dir, tmp_path):
    """On the tiny model: an adapter whose B is zero gives the base model's tokens; with
    max_loras_per_batch=1 two adapters never share a step (the second waits), outputs unchanged."""
    from sglite import Engine

    paths = {f"z{i}": str(write_adapter(tmp_path / f"z{i}", zero_b=True, r=2, modules=(), layers=())[0])
             for i in range(2)}
    for i in range(2):  # a real (zero) weight so the folder is a valid adapter
        hidden, inter = 64, 128
        save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, hidden),
                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 2),
                   "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight": torch.randn(2, inter),
                   "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight": torch.zeros(64, 2)},
                  str(tmp_path / f"z{i}" / "adapter_model.safetensors"))
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    ids = [[5, 6, 7, 8, 9], [10, 11, 12, 13]]
    with Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=2048, check_invariants=True,
                lora_paths=paths, max_loras_per_batch=1) as e:
        base = [r["output_ids"] for r in e.generate(input_ids=ids, sampling_params=greedy)]
        steps = e.scheduler.counters["steps"]
        lora = [r["output_ids"] for r in e.generate(input_ids=ids, sampling_params=greedy, lora_path=["z0", "z1"])]
        assert lora == base
        assert e.scheduler.counters["steps"] - steps >= 2 * (steps - 0)  # one adapter per step: serialised
        with pytest.raises(InvalidRequestError) as ei:
            e.generate(input_ids=ids[0], sampling_params=greedy, lora_path="nope")
        assert ei.value.field == "lora_path"


def test_adapter_with_speculation_and_grammar(tiny_model_dir, tmp_path):
    """With NGRAM speculative decoding, an adapter's greedy tokens are those of the engine without
    it (drafts are verified with the request's adapter); a JSON-schema request with an adapter
    returns valid JSON."""
    import json as _json

    from sglite import Engine
    from tests.server.test_lora_server import tiny_adapter

    a = str(tiny_adapter(tmp_path / "a", 3))
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    ids = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [10, 11, 12, 13]]
    kw = dict(dtype="float32", max_total_tokens=2048, check_invariants=True, lora_paths={"a": a})
    with Engine(str(tiny_model_dir), **kw) as e:
        want = [r["output_ids"] for r in e.generate(input_ids=ids, sampling_params=greedy, lora_path=["a", None])]
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        out = e.generate(prompt="Answer:", sampling_params={"max_new_tokens": 16, "temperature": 0,
                                                            "json_schema": _json.dumps(schema)}, lora_path="a")
        assert isinstance(_json.loads(out["text"])["ok"], bool)
    with Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, **kw) as e:
        got = [r["output_ids"] for r in e.generate(input_ids=ids, sampling_params=greedy, lora_path=["a", None])]
    assert got == want


def test_qk_lora_on_a_partial_rotary_model_is_refused(tmp_path):
    """Q / K rows of a partial-rotary model (Phi-4-mini) are reordered at load (models/rope.py), so a
    q/k/qkv LoRA is refused naming target_modules; v_proj and the MLP still load."""
    import dataclasses

    from sglite.runtime.models.rope import RopeSpec

    arch = dataclasses.replace(ARCH, rope=RopeSpec(dim=2, head_dim=ARCH.head_dim))
    with pytest.raises(InvalidRequestError, match="q_proj LoRA on a partial-rotary model") as e:
        load_adapter("a", str(write_adapter(tmp_path / "a")[0]), arch, 8, torch.float32, 1)
    assert e.value.field == "target_modules"
    ok = load_adapter("v", str(write_adapter(tmp_path / "v", modules=("v_proj",))[0]), arch, 8, torch.float32, 2)
    assert ok.parts
