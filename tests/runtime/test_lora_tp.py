"""LoRA adapters under tensor parallelism (:mod:`sglite.runtime.parallel.lora_tp`): each rank's
shard of an adapter, summed over ranks as the model sums them, gives the full delta (fast; with
replicated KV heads too); and engines with ``tp_size=2`` worker processes against ``tp_size=1`` on a
batch mixing two adapters and the base model, with run-time load and unload (slow)."""
import json

import pytest
import torch

from sglite.lora import load_adapter
from sglite.runtime.models.llama import LlamaArch
from sglite.runtime.parallel.lora_tp import shard_adapter
from sglite.runtime.parallel.parallel_state import TPLayout
from tests.kernels.test_decode_fused_lora import write_adapter

SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _delta(parts, x, out_w):
    """x [N, in] -> [N, out_w]: the sum of the parts' (x Aᵀ) Bᵀ at their rows."""
    y = torch.zeros(x.shape[0], out_w, dtype=torch.float64)
    for p in parts:
        y[:, p.row:p.row + p.b.shape[0]] += (x @ p.a.double().t()) @ p.b.double().t()
    return y


@pytest.mark.parametrize("tp", [2, 4])  # 4 > the 2 KV heads: each rank one replicated KV head
@pytest.mark.parametrize("modules", [SEVEN, ("qkv_proj", "gate_up_proj", "o_proj")])
def test_shards_sum_to_the_full_delta(tiny_model_dir, tmp_path, tp, modules):
    from sglite.runtime.model_loader import load_checkpoint

    hf = load_checkpoint(str(tiny_model_dir)).hf_config
    arch = LlamaArch.from_hf_config(hf)
    path = write_adapter(tmp_path / "a", json.loads((tiny_model_dir / "config.json").read_text()), 4, modules, 1)
    full = load_adapter("a", str(path), arch, 8, torch.float32, 5)
    D, H, I = arch.head_dim, arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * D, arch.num_kv_heads * D
    g = torch.Generator().manual_seed(0)
    for (layer, key), parts in full.parts.items():
        in_w = {"qkv": H, "o": q, "gate_up": H, "down": I}[key]
        out_w = {"qkv": q + 2 * kv, "o": H, "gate_up": 2 * I, "down": H}[key]
        x = torch.randn(3, in_w, generator=g, dtype=torch.float64)
        want = _delta(parts, x, out_w)
        summed = torch.zeros_like(want)
        for r in range(tp):
            lay = TPLayout.make(hf, r, tp)
            shard = shard_adapter(full, lay, arch)
            assert shard.uid == 5 and shard.name == "a"
            sp = shard.parts[(layer, key)]
            if key == "qkv":  # column-parallel: the rank's own rows, exactly
                rows = torch.cat([torch.arange(lay.q_start * D, (lay.q_start + lay.num_heads) * D),
                                  q + torch.arange(lay.kv_start * D, (lay.kv_start + lay.num_kv_heads) * D),
                                  q + kv + torch.arange(lay.kv_start * D, (lay.kv_start + lay.num_kv_heads) * D)])
                torch.testing.assert_close(_delta(sp, x, rows.numel()), want[:, rows])
            elif key == "gate_up":
                rows = torch.cat([torch.arange(lay.i_start, lay.i_start + lay.intermediate),
                                  I + torch.arange(lay.i_start, lay.i_start + lay.intermediate)])
                torch.testing.assert_close(_delta(sp, x, rows.numel()), want[:, rows])
            else:  # row-parallel: partial sums over the rank's input columns, all-reduced
                cols = (slice(lay.q_start * D, (lay.q_start + lay.num_heads) * D) if key == "o"
                        else slice(lay.i_start, lay.i_start + lay.intermediate))
                summed += _delta(sp, x[:, cols], out_w)
        if key in ("o", "down"):
            torch.testing.assert_close(summed, want)


def test_manager_mirrors_loads_and_unloads(tiny_model_dir, tmp_path):
    """The scheduler's manager repeats add / remove to its mirror (the workers); a failed load
    leaves the adapter unserved."""
    from sglite.lora import LoraManager
    from sglite.runtime.model_loader import load_checkpoint

    arch = LlamaArch.from_hf_config(load_checkpoint(str(tiny_model_dir)).hf_config)
    path = write_adapter(tmp_path / "a", json.loads((tiny_model_dir / "config.json").read_text()), 4, SEVEN, 1)
    calls = []

    class Mirror:
        fail = False

        def load_lora(self, name, path, uid):
            calls.append(("load", name, uid))
            if self.fail:
                raise RuntimeError("worker failed")

        def unload_lora(self, name):
            calls.append(("unload", name))

    mirror = Mirror()
    m = LoraManager(arch, torch.float32, "cpu", 2, 4, mirror)
    a = m.read("a", str(path))
    m.add(a)
    m.remove("a")
    assert calls == [("load", "a", a.uid), ("unload", "a")]
    mirror.fail = True
    with pytest.raises(RuntimeError, match="worker failed"):
        m.add(m.read("a", str(path)))
    assert m.names() == []


# ---------------------------------------------------------------- worker processes (slow)
PROMPTS = ["The sea is calm and", "Once upon a time there was", "def fibonacci(n):", "A list of colours: red,"]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def _run(e, names):
    outs = e.generate(prompt=PROMPTS[:len(names)], sampling_params=GREEDY, lora_path=names, return_logprob=True,
                      logprob_start_len=0)
    return [(o["output_ids"], torch.tensor([x[0] for x in o["meta_info"]["input_token_logprobs"][1:]]
                                           + [x[0] for x in o["meta_info"]["output_token_logprobs"]]))
            for o in outs]


def _same(got, want):
    for (ids, lp), (wids, wlp) in zip(got, want):
        assert ids == wids
        torch.testing.assert_close(lp, wlp, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_tp2_adapters_match_tp1(tiny_model_dir, tmp_path):
    """A batch mixing adapters a, b and the base model; then c loaded and a unloaded at run time."""
    from sglite import Engine
    from sglite.errors import InvalidRequestError

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    paths = {n: str(write_adapter(tmp_path / n, cfg, 4, SEVEN if n != "b" else ("q_proj", "v_proj", "down_proj"), s))
             for n, s in (("a", 1), ("b", 2), ("c", 3))}
    kw = dict(dtype="float32", max_total_tokens=2048, max_running_requests=8, log_level="warning",
              lora_paths={"a": paths["a"], "b": paths["b"]})
    names = ["a", None, "b", "a"]
    with Engine(str(tiny_model_dir), **kw) as e1:
        ref = _run(e1, names)
        e1.load_lora_adapter("c", paths["c"])
        ref_c = _run(e1, ["c", "b", None])
    assert len({tuple(i) for i, _ in ref[:3]}) == 3  # the adapters change the tokens
    with Engine(str(tiny_model_dir), tp_size=2, **kw) as e2:
        _same(_run(e2, names), ref)
        assert e2.load_lora_adapter("c", paths["c"]) == ["a", "b", "c"]
        _same(_run(e2, ["c", "b", None]), ref_c)
        assert e2.unload_lora_adapter("a") == ["b", "c"]
        with pytest.raises(InvalidRequestError, match="lora_path"):
            e2.generate(prompt=PROMPTS[0], sampling_params=GREEDY, lora_path="a")
        _same(_run(e2, ["c", "b", None]), ref_c)  # the workers dropped a, kept b and c
        e2.load_lora_adapter("a", paths["a"])  # again, under a new uid
        _same(_run(e2, ["a"]), ref[:1])
