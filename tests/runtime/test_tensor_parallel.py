"""Tensor parallelism: shard layout, in-process ranks (threads over gloo) against the unsharded
forward, and engines with ``tp_size`` worker processes against ``tp_size=1`` (slow)."""
import threading

import pytest
import torch

from sglite.runtime.parallel.parallel_state import TPComm, TPLayout, load_shard, make_tp_group
from sglite.errors import InvalidRequestError
from sglite.runtime.forward_batch import ForwardBatch
from sglite.runtime.kv_pool import TokenToKVPool
from sglite.runtime.model_loader import load_checkpoint, load_state_dict
from sglite.runtime.models import registry
from sglite.runtime.models.llama import LlamaArch, LlamaModel


class Cfg:
    def __init__(self, hq, hkv, inter=128, vocab=100, hidden=64):
        self.num_attention_heads, self.num_key_value_heads = hq, hkv
        self.intermediate_size, self.vocab_size, self.hidden_size = inter, vocab, hidden


def test_layout_splits_heads_and_replicates_kv_heads():
    lay = [TPLayout.make(Cfg(9, 3, inter=1536, vocab=49152), r, 3) for r in range(3)]
    assert [(x.q_start, x.num_heads, x.kv_start, x.num_kv_heads) for x in lay] == [(0, 3, 0, 1), (3, 3, 1, 1), (6, 3, 2, 1)]
    assert [x.v_start for x in lay] == [0, 16384, 32768] and lay[0].intermediate == 512
    # tp 4 > 2 KV heads: each KV head on two ranks, the query heads of a rank all in its group
    lay = [TPLayout.make(Cfg(8, 2), r, 4) for r in range(4)]
    assert [x.kv_start for x in lay] == [0, 0, 1, 1] and all(x.num_kv_heads == 1 for x in lay)
    for x in lay:
        group = 8 // 2
        assert {h // group for h in range(x.q_start, x.q_start + x.num_heads)} == {x.kv_start}
    assert TPLayout.make(Cfg(4, 2, vocab=101), 1, 2).vocab == 51  # padded vocabulary rows


@pytest.mark.parametrize("hq,hkv,tp,msg", [(9, 3, 2, "attention heads"), (4, 4, 8, "attention heads"),
                                           (6, 3, 6, "intermediate"), (8, 4, 8, "intermediate"),
                                           (12, 3, 2, "KV heads")])
def test_layout_rejects_bad_splits(hq, hkv, tp, msg):
    inter = 96 if msg != "intermediate" else 100
    with pytest.raises(InvalidRequestError, match=msg) as ei:
        TPLayout.make(Cfg(hq, hkv, inter=inter), 0, tp)
    assert ei.value.field == "tp_size"


def test_shards_reassemble_the_full_weights(tiny_model_dir):
    ckpt = load_checkpoint(tiny_model_dir)
    full = load_state_dict(ckpt, torch.float32)
    shards = [load_shard(ckpt, TPLayout.make(ckpt.hf_config, r, 2), torch.float32) for r in range(2)]
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        assert torch.equal(torch.cat([s[name] for s in shards]), full[name])
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([s[name] for s in shards], dim=1), full[name])
    emb = torch.cat([s["model.embed_tokens.weight"] for s in shards])
    assert torch.equal(emb[:full["model.embed_tokens.weight"].shape[0]], full["model.embed_tokens.weight"])
    assert torch.equal(shards[1]["model.norm.weight"], full["model.norm.weight"])


def two_steps():
    """A 7-token prefill (row 0, slots 1..7) and then one decode token: ForwardBatch makers."""
    table = torch.zeros(2, 16, dtype=torch.int32)
    table[0, :8] = torch.arange(1, 9, dtype=torch.int32)
    i64 = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    ids = [1, 504, 3458, 282, 4649, 314, 253]
    prefill = ForwardBatch(i64(ids), i64(range(7)), i64(range(1, 8)), table, i64([0]), i64([0]), i64([7]),
                           i64([]), i64([]), i64([6]))
    decode = ForwardBatch(i64([1345]), i64([7]), i64([8]), table, i64([]), i64([]), i64([]), i64([0]), i64([8]),
                          i64([0]))
    return [prefill, decode]


def run_model(model, arch):
    pool = TokenToKVPool(32, 1, arch.num_layers, arch.num_kv_heads, arch.head_dim, torch.float32)
    return [model.forward(fb, pool.k_buffers, pool.v_buffers) for fb in two_steps()]


def tp_logits_in_threads(ckpt, tp):
    """Run ``tp`` ranks as threads of this process (gloo over a HashStore); rank 0's logits."""
    import torch.distributed as dist

    store, out, errors = dist.HashStore(), {}, []

    def rank(r):
        try:
            lay = TPLayout.make(ckpt.hf_config, r, tp)
            arch = registry.arch_from_hf_config(lay.local_hf_config(ckpt.hf_config))  # Llama or a family
            model = registry.model_class(arch)(arch, load_shard(ckpt, lay, torch.float32), torch.float32)
            model.tp = TPComm(lay, make_tp_group(store, r, tp, "cpu"))
            out[r] = run_model(model, arch)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for r in range(1, tp):  # every rank ends with the same gathered logits
        assert all(torch.equal(a, b) for a, b in zip(out[0], out[r]))
    return out[0]


@pytest.mark.parametrize("model,tp", [("tiny_model_dir", 2), ("tiny_model_dir", 4), ("tiny_qwen_dir", 2)])
def test_tp_ranks_match_the_unsharded_forward(request, model, tp):
    """4 > the tiny model's 2 KV heads: replicated KV heads; Qwen2: sharded q/k/v biases."""
    ckpt = load_checkpoint(request.getfixturevalue(model))
    arch = LlamaArch.from_hf_config(ckpt.hf_config)
    ref = run_model(LlamaModel(arch, load_state_dict(ckpt, torch.float32), torch.float32), arch)
    got = tp_logits_in_threads(ckpt, tp)
    for a, b in zip(ref, got):
        assert a.shape == b.shape
        assert ((a - b).abs().max() / a.abs().max()).item() < 1e-3
        assert torch.equal(a.argmax(-1), b.argmax(-1))


# ---------------------------------------------------------------- worker processes (slow)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = {"max_new_tokens": 12, "temperature": 0}


def raw_logits(engine):
    """Logits of the two hand-made steps through ``engine.runner`` (cache flushed first, so the
    slots written are free; flushed again after)."""
    assert engine.flush_cache()
    out = [engine.runner.forward(fb) for fb in two_steps()]
    assert engine.flush_cache()
    return out


def close(a, b):
    return ((a - b).abs().max() / a.abs().max()).item() < 1e-3


@pytest.mark.slow
def test_tp2_engine_matches_tp1_on_a_tiny_model(tiny_model_dir):
    from sglite import Engine

    kw = dict(dtype="float32", max_total_tokens=2048, max_running_requests=8, log_level="warning")
    with Engine(str(tiny_model_dir), **kw) as e1:
        ref = e1.generate(PROMPTS, GREEDY)
        ref_logits = raw_logits(e1)
    with Engine(str(tiny_model_dir), tp_size=2, **kw) as e2:
        assert e2.runner.tp_size == 2 and e2.get_server_info()["max_total_tokens"] == 2048
        got = e2.generate(PROMPTS, GREEDY)
        got_logits = raw_logits(e2)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in ref]
    assert all(close(a, b) for a, b in zip(ref_logits, got_logits))


@pytest.mark.slow
def test_tp3_engine_matches_tp1_on_the_default_model():
    """9 query / 3 KV heads over 3 workers: 3 query heads and 1 KV head each (dense weights: the
    GGUF file dequantized, ``quantization="none"`` for the TP=1 reference too)."""
    from sglite import Engine

    kw = dict(dtype="float32", max_total_tokens=4096, log_level="warning")
    with Engine(quantization="none", **kw) as e1:
        ref = e1.generate(PROMPTS, GREEDY)
        ref_logits = raw_logits(e1)
    with pytest.raises(InvalidRequestError, match="quantization"):
        Engine(tp_size=3, quantization="fp8", **kw)
    with Engine(tp_size=3, **kw) as e3:
        got = e3.generate(PROMPTS, GREEDY)
        got_logits = raw_logits(e3)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in ref]
    assert all(close(a, b) and torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(ref_logits, got_logits))


@pytest.mark.slow
def test_tp_engine_reports_a_dead_worker(tiny_model_dir):
    from sglite import Engine

    with Engine(str(tiny_model_dir), tp_size=2, dtype="float32", max_total_tokens=1024, log_level="warning") as e:
        e.runner._procs[1].kill()
        e.runner._procs[1].join()
        out = e.generate("Hello", GREEDY)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "worker rank 1 exited" in out["meta_info"]["finish_reason"]["message"]


@pytest.mark.slow
@pytest.mark.timeout(300)  # a node that dies at start-up must fail the test, not hang the suite
def test_two_nodes_on_one_machine(tiny_model_dir):
    """--nnodes 2: node 0 (this engine) runs rank 0 and the scheduler, ``sglite serve --node-rank 1``
    (another process, same --dist-init-addr) runs rank 1; output equals tp_size=1."""
    import subprocess
    import sys

    from sglite import Engine
    from sglite.runtime.parallel.ports import free_port

    addr = f"127.0.0.1:{free_port()}"
    kw = dict(dtype="float32", max_total_tokens=1024, log_level="warning")
    node1 = subprocess.Popen([sys.executable, "-m", "sglite.launch_server", "--model-path", str(tiny_model_dir),
                              "--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
                              "--dtype", "float32", "--max-total-tokens", "1024", "--log-level", "warning"])
    try:
        with Engine(str(tiny_model_dir), **kw) as e1:
            ref = e1.generate(PROMPTS, GREEDY)
        with Engine(str(tiny_model_dir), tp_size=2, nnodes=2, dist_init_addr=addr, **kw) as e2:
            got = e2.generate(PROMPTS, GREEDY)
        assert [r["output_ids"] for r in got] == [r["output_ids"] for r in ref]
        assert node1.wait(timeout=120) == 0  # its worker stopped with the engine
    finally:
        if node1.poll() is None:
            node1.kill()
    with pytest.raises(InvalidRequestError, match="node_rank"):
        Engine(str(tiny_model_dir), tp_size=2, nnodes=2, node_rank=1, dist_init_addr=addr, **kw)
