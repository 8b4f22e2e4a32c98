"""Decode attention alone at the serving workloads' shapes, per layer call (issue 33, eighth pass).

Cases (SmolLM2-135M's heads: 9 query, 3 KV, head dim 64; bf16 head-major pools as the engine's
(untouched until used, 4 KiB pages), ``--layers`` of them cycled so that each call finds its pool out of the
core's caches as in a step; float32 queries and outputs as the fused decode passes them):

* ``shared``: 64 rows in 4 groups of 16 continuing one 530-token system prompt each, every row with
  40-104 keys of its own (a ~40-token question, then the tokens decoded so far). Slots as the pool
  hands them out: each prompt a contiguous run, then one slot per row per decode step (the 64 rows'
  decoded keys interleaved; ``--own-contiguous``: each row's own keys one run instead, to see what
  the scattered slots cost). The groups are found once (as the fused decode does per step) and
  passed to every call; ``cascade_min`` 64.
* ``offline``: 48 rows of 100-300 keys, nothing shared (prompt runs, then interleaved decode slots).
* ``engine-shared`` / ``engine-offline``: the real thing: the default engine runs the workload of
  ``scripts/step_timeline.py`` (after its warm-up) and the slot table, rows and lengths of its
  ``--engine-step``-th all-decode step are kept; the calls then read the engine's own 30 layers'
  pools (the K/V the model wrote), with random float32 queries; ``--page-size``: the engine's (the
  slot layout: a page of N slots per request keeps its decoded keys together).
* ``extend-shared`` (the prefill side, ``extend_attention``): 16 requests of 40 new tokens over a
  528-token cached prompt, 4 groups of 4 sharing it (a prefill step of the shared-prefix workload),
  bf16 queries, the ``--layers`` pools; the ref side is the other checkout's
  ``cpu_extend_attention.cpp``.

Printed per side (``--ref-root``: another checkout's ``cpu_attention.cpp``, built beside this one
under its own op namespace, called alternately on the same inputs): median ms per call over
``--repeats`` rounds of all layers (wall, and the process CPU time, both threads' spin included),
GB/s (the distinct K/V bytes a call must read: each group's shared keys once per KV head, each
row's own keys once), GFLOP/s (2 flops per multiply-add of Q K^T and P V over every row's keys),
and whether the two sides' outputs agree bit for bit.

    python scripts/decode_attn_cost.py [--threads 1,2] [--ref-root /work/main] [--cases shared,offline]
    python scripts/decode_attn_cost.py --cases engine-shared,engine-offline --ref-root /work/main
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
HQ, HKV, D = 9, 3, 64


def ref_ops(root: Path, source: str = "cpu_attention.cpp", ns: str = "sglite_cpu_attention"):
    """``source`` of ``root`` with its headers spliced in, built under the op namespace ``ns + "_ref"``
    (None when it does not build)."""
    from sglite.kernels import cpu_build

    src = cpu_build.read_source(source, root / "sglite" / "kernels" / "csrc")
    src = re.sub(rf"\b{ns}\b", ns + "_ref", src)
    return cpu_build.load_cpp(ns + "_ref", src, ("-O3", "-march=native"), ops_namespace=ns + "_ref")


def layout(prompt_lens, shared, decoded, contiguous=False):
    """Slot table of requests whose prompts (``shared[b]``: a group id whose run of
    ``prompt_lens[b][0]`` keys the request shares, or -1) were prefilled one after another and then
    decoded ``decoded[b]`` tokens in lockstep (one slot per live row per step; ``contiguous``: each
    request's own keys then moved to one run of fresh slots)."""
    B = len(prompt_lens)
    L = [sum(p) + d for p, d in zip(prompt_lens, decoded)]
    rt = torch.zeros(B, max(L), dtype=torch.int32)
    nxt, runs, pos = 1, {}, [0] * B
    for b in range(B):
        pre, own = prompt_lens[b]
        if shared[b] >= 0:
            if shared[b] not in runs:
                runs[shared[b]] = torch.arange(nxt, nxt + pre, dtype=torch.int32)
                nxt += pre
            rt[b, :pre] = runs[shared[b]]
        else:
            rt[b, :pre] = torch.arange(nxt, nxt + pre, dtype=torch.int32)
            nxt += pre
        rt[b, pre:pre + own] = torch.arange(nxt, nxt + own, dtype=torch.int32)
        nxt, pos[b] = nxt + own, pre + own
    for step in range(max(decoded)):
        for b in range(B):
            if step < decoded[b]:
                rt[b, pos[b]] = nxt
                nxt, pos[b] = nxt + 1, pos[b] + 1
    if contiguous:
        for b in range(B):
            n = L[b] - prompt_lens[b][0]
            rt[b, prompt_lens[b][0]:L[b]] = torch.arange(nxt, nxt + n, dtype=torch.int32)
            nxt += n
    return rt, torch.tensor(L, dtype=torch.int64), nxt + 8


def engine_case(workload, step, g, page_size=1):
    """The ``step``-th all-decode step of ``workload`` in the default engine: (q, the engine's
    (K, V) pools of every layer, slot table, rows, lengths, distinct K/V bytes, flops)."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from step_timeline import prompts
    from sglite.runtime.engine import Engine

    engine = Engine(page_size=page_size)
    runner, seen, cap = engine.scheduler.runner, [0], {}
    fwd0 = runner.forward

    def forward(fb):
        if fb.ext_req_pool_indices.numel() == 0 and fb.dec_seq_lens.numel() > 0:
            seen[0] += 1
            if seen[0] == step:
                cap.update(rt=fb.req_to_token.clone(), rows=fb.dec_req_pool_indices.clone(),
                           lens=fb.dec_seq_lens.clone())
        return fwd0(fb)

    runner.forward = forward
    ps, warm = prompts(workload)
    sp = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    try:
        engine.generate(warm, sp)
        engine.flush_cache()
        seen[0] = 0
        engine.generate(ps, sp)
        kv = runner.token_to_kv_pool
        pools = list(zip(kv.k_buffers, kv.v_buffers))
    finally:
        engine.shutdown()
    rt, rows, lens = cap["rt"], cap["rows"], cap["lens"]
    _, hkv, d = pools[0][0].shape
    groups = load_groups(rt, rows, lens)
    shared = sum(P for P, _ in groups)
    distinct = shared + int(lens.sum()) - sum(P * len(r) for P, r in groups)
    hq = hkv * 3
    q = torch.randn(len(lens), hq, d, generator=g)
    return q, pools, rt, rows, lens, distinct * hkv * d * 2 * 2, float(lens.sum()) * hq * d * 4


def load_groups(rt, rows, lens):
    from sglite.kernels import cpu_attention

    return cpu_attention.shared_prefix_groups(rt, rows, lens, 64)


def case(name, layers, g, contiguous=False):
    """(q, pools, rt, rows, lens, distinct K/V bytes per call, flops per call)."""
    from sglite.kernels.host_memory import zeros_untouched

    if name == "shared":
        B, P = 64, 530
        own = torch.randint(40, 105, (B,), generator=g).tolist()
        q_len = [40] * B
        prompt = [(P, q) for q in q_len]
        shared = [b % 4 for b in range(B)]
        dec = [o - q for o, q in zip(own, q_len)]
        distinct = 4 * P + sum(own)
    else:
        B = 48
        lens = torch.randint(100, 301, (B,), generator=g).tolist()
        dec = torch.randint(0, 64, (B,), generator=g).tolist()
        prompt = [(1, n - d - 1) for n, d in zip(lens, dec)]
        shared = [-1] * B
        distinct = sum(lens)
    rt, lens, S = layout(prompt, shared, dec, contiguous)
    def plane():  # the engine's pool storage (kv_pool.py): head-major, untouched, 4 KiB pages
        t = zeros_untouched((HKV, S, D), torch.bfloat16)
        t.copy_(torch.randn(HKV, S, D, generator=g))
        return t.transpose(0, 1)
    pools = [(plane(), plane()) for _ in range(layers)]
    q = torch.randn(B, HQ, D, generator=g)
    return q, pools, rt, torch.arange(B), lens, distinct * HKV * D * 2 * 2, float(lens.sum()) * HQ * D * 4


def groups_list(flat):
    """The group count of shared_prefix_groups' int64 tensor (None: no groups)."""
    return [] if flat is None else [0] * int(flat[0])


def extend_case(layers, g):
    """(q, pools, rt, rows, prefix lens, extend lens, distinct K/V bytes, flops) of ``extend-shared``."""
    B, P, E = 16, 528, 40
    prompt = [(P, E)] * B
    rt, lens, S = layout(prompt, [b % 4 for b in range(B)], [0] * B)
    from sglite.kernels.host_memory import zeros_untouched

    def plane():
        t = zeros_untouched((HKV, S, D), torch.bfloat16)
        t.copy_(torch.randn(HKV, S, D, generator=g))
        return t.transpose(0, 1)
    pools = [(plane(), plane()) for _ in range(layers)]
    q = torch.randn(B * E, HQ, D, generator=g).bfloat16()
    pre, ext = torch.full((B,), P), torch.full((B,), E)
    flops = B * E * HQ * (P + (E + 1) / 2) * D * 4
    return q, pools, rt, torch.arange(B), pre, ext, (4 * P + B * E) * HKV * D * 4, flops


def alternate(sides, call, pools, repeats):
    """Per side: (wall ms, process CPU ms) per layer call of each round, sides alternated in order
    round by round; and each side's last output. ``call(ops, k, v)`` runs one layer call."""
    res, outs = {s: ([], []) for s in sides}, {}
    for r in range(repeats):
        for s in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            w, c = time.perf_counter(), time.process_time()
            for k, v in pools:
                outs[s] = call(sides[s], k, v)
            res[s][0].append((time.perf_counter() - w) * 1e3 / len(pools))
            res[s][1].append((time.process_time() - c) * 1e3 / len(pools))
    return res, outs


def extend_rows(a, g):
    """Time ``extend-shared`` on this checkout's extend op and, with ``--ref-root``, the other's."""
    from sglite.kernels import cpu_attention

    sides = {"this": cpu_attention.load_extend()}
    if a.ref_root:
        sides = {"ref": ref_ops(Path(a.ref_root), "cpu_extend_attention.cpp", "sglite_cpu_extend"), **sides}
    q, pools, rt, rows, pre, ext, nbytes, flops = extend_case(a.layers, g)
    for th in [int(t) for t in a.threads.split(",")]:
        torch.set_num_threads(th)
        res, outs = alternate(sides, lambda ops, k, v: ops.extend_attention(q, k, v, rt, rows, pre, ext, D ** -0.5, 0, 0.0, 1),
                              pools, a.repeats)
        print(f"extend-shared: 16 x 40 new over 528 cached, 4 groups, {nbytes / 1e6:.2f} MB K/V and "
              f"{flops / 1e9:.3f} GFLOP a call, threads={th}")
        for s, (wall, cpu) in res.items():
            mw = statistics.median(wall)
            print(f"  {s:5s} wall {mw:.3f} ms (q1 {sorted(wall)[len(wall) // 4]:.3f}), cpu {statistics.median(cpu):.3f} ms;"
                  f" {flops / mw / 1e6:.1f} GFLOP/s (wall)")
        if len(outs) == 2:
            x, y = outs.values()
            print(f"  outputs bit-identical: {torch.equal(x, y)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--cases", default="shared,offline")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=15, help="rounds of all layers per side per thread count")
    ap.add_argument("--own-contiguous", action="store_true", help="shared / offline: each row's own keys one run")
    ap.add_argument("--page-size", type=int, default=1, help="engine-* cases: the engine's --page-size (slot layout)")
    ap.add_argument("--engine-step", type=int, default=32, help="engine-* cases: which all-decode step")
    ap.add_argument("--ref-root", default=None, help="another checkout (e.g. /work/main) for an A/B")
    a = ap.parse_args()
    from sglite.kernels import cpu_attention

    sides = {"this": cpu_attention.load()}
    if a.ref_root:
        sides = {"ref": ref_ops(Path(a.ref_root)), **sides}
    g = torch.Generator().manual_seed(0)
    for name in a.cases.split(","):
        if name == "extend-shared":
            extend_rows(a, g)
            continue
        if name.startswith("engine-"):
            q, pools, rt, rows, lens, nbytes, flops = engine_case(name[7:].replace("shared", "shared-prefix"),
                                                                  a.engine_step, g, a.page_size)
        else:
            q, pools, rt, rows, lens, nbytes, flops = case(name, a.layers, g, a.own_contiguous)
        groups = sides["this"].shared_prefix_groups(rt, rows, lens, 64) if "shared" in name else None
        cmin = 64 if "shared" in name else 0
        for th in [int(t) for t in a.threads.split(",")]:
            torch.set_num_threads(th)
            res, outs = alternate(sides, lambda ops, k, v: ops.decode_attention(q, k, v, rt, rows, lens, D ** -0.5, 0, 0.0, cmin,
                                                                                groups), pools, a.repeats)
            print(f"{name}: B={len(lens)}, {len(groups_list(groups))} groups, keys {int(lens.min())}-{int(lens.max())}, {nbytes / 1e6:.2f} MB K/V"
                  f" and {flops / 1e9:.3f} GFLOP a call, threads={th}")
            for s, (wall, cpu) in res.items():
                mw, mc = statistics.median(wall), statistics.median(cpu)
                print(f"  {s:5s} wall {mw:.3f} ms (q1 {sorted(wall)[len(wall) // 4]:.3f}), cpu {mc:.3f} ms;"
                      f" {nbytes / mw / 1e6:.1f} GB/s, {flops / mw / 1e6:.1f} GFLOP/s (wall)")
            if len(outs) == 2:
                x, y = outs.values()
                print(f"  outputs bit-identical: {torch.equal(x, y)}; max |diff| {(x - y).abs().max().item():.3g}")


if __name__ == "__main__":
    os.environ.setdefault("SGLITE_LOG_LEVEL", "WARNING")
    main()
