"""Attention on the AMX tiles against the AVX-512 paths, per layer call, SmolLM2's heads (9 query,
3 KV, head dim 64) and Gemma 3's (4, 1, 256), bf16 head-major pools (the engine's layout):

- extend: 8 requests x 62 new tokens over 700 cached (an agent's late turn), one 2,048-token
  prompt (causal), 4 x 100 over 300 (Gemma); each also with the K/V packed into tile layout once
  per call or per fused task (the default; the 8 x 62 case runs fused) against once per task
  (``pack_kv=False``);
- decode: 64 rows in 4 groups of 16 continuing one 600-token prefix each (the shared-prefix
  serving workload), cascade (``cascade_min`` 64) against per row (0);
- chunks (``--cases chunks`` only): the four calls of a 2,048-token prompt under the engine's
  512-token chunked prefill (512 new over 0, 512, 1,024 and 1,536 cached), AMX against AVX-512,
  and their sum (one layer of the prompt's prefill);
- agent (``--cases agent`` only): an agent's turn 10 (issue 34): 8 requests of 64-70 new tokens
  over 900-1,100 cached, the slots laid out as the pool hands them out (each turn a contiguous run
  per request, its decoded tokens interleaved across the 8), on one pool (hot) and cycling through
  30 layers' pools (cold, as in the engine), with fused tasks (the default) against the call-wide
  packing (``fuse=False``); and 512 new over 1,536 cached and over none, with GFLOP/s (2 flops
  per multiply-add of Q K^T and P V over each row's visible keys).

    .venv/bin/python benchmarks/cpu_attention_amx.py [--threads N] [--repeats R] [--clock cpu]

Median of R timed calls per side, the sides alternated three times; ms per call (one layer).
``--clock cpu`` times the process's CPU time (time.process_time, all threads) instead of the wall
clock: on a shared machine it leaves out the time other processes hold the cores (with one thread
it is the kernel's own time; with more it includes the pool's waits).
"""
import argparse
import inspect
import time

import torch

from sglite.kernels import cpu_attention


def pool(S, Hkv, D, g):
    return (torch.randn(Hkv, S, D, generator=g).bfloat16().transpose(0, 1),
            torch.randn(Hkv, S, D, generator=g).bfloat16().transpose(0, 1))


def extend_case(pre, ext, B, Hq, Hkv, D, g):
    S = B * (pre + ext) + 8
    k, v = pool(S, Hkv, D, g)
    rt = (torch.randperm(S - 1, generator=g)[:B * (pre + ext)] + 1).to(torch.int32).view(B, pre + ext)
    q = torch.randn(B * ext, Hq, D, generator=g).bfloat16()
    return (q, k, v, rt, torch.arange(B), torch.full((B,), pre), torch.full((B,), ext), D ** -0.5)


def agent_case(layers, g, Hq=9, Hkv=3, D=64):
    """Turn 10 of 8 agent conversations: (prefix, extend) per request, the slot table built turn by
    turn (a contiguous prefill run per request, then its decoded tokens one slot a step, the 8
    requests interleaved), ``layers`` pools of [Hkv, S, D] bf16 (head-major, as the engine's)."""
    pres, exts = [900, 950, 1000, 1030, 1060, 1080, 1100, 970], [64, 70, 66, 68, 70, 65, 69, 67]
    B, L = 8, [p + e for p, e in zip(pres, exts)]
    rt = torch.zeros(B, max(L), dtype=torch.int32)
    pos, nxt = [0] * B, 1
    while any(pos[b] < pres[b] for b in range(B)):
        for b in range(B):  # a turn's prefill: ~80 contiguous slots a request
            n = min(80, pres[b] - pos[b])
            rt[b, pos[b]:pos[b] + n] = torch.arange(nxt, nxt + n, dtype=torch.int32)
            nxt, pos[b] = nxt + n, pos[b] + n
        for _ in range(25):  # its answer: one slot per request per decode step
            for b in range(B):
                if pos[b] < pres[b]:
                    rt[b, pos[b]], nxt, pos[b] = nxt, nxt + 1, pos[b] + 1
    for b in range(B):  # this turn's new tokens
        rt[b, pres[b]:L[b]] = torch.arange(nxt, nxt + exts[b], dtype=torch.int32)
        nxt += exts[b]
    pools = [pool(nxt + 8, Hkv, D, g) for _ in range(layers)]
    q = torch.randn(sum(exts), Hq, D, generator=g).bfloat16()
    return pools, (q, rt, torch.arange(B), torch.tensor(pres), torch.tensor(exts), D ** -0.5)


def gflop(q, pre, ext, D):
    """Q K^T and P V flops over each new row's visible keys (causal), in GFLOP."""
    Hq = q.shape[1]
    return sum(e * Hq * (p * e + e * (e + 1) / 2) / e * D * 4 for p, e in zip(pre.tolist(), ext.tolist())) / 1e9


def agent_rows(a, clock, g):
    """The ``--cases agent`` rows: (name, new side, ms, old side, ms, GFLOP/s of the new side)."""
    rows = []
    cold, args = agent_case(30, g)
    # a build without fused tasks (an older checkout on PYTHONPATH, for A/B): both sides its default
    off = {"fuse": False} if "fuse" in inspect.signature(cpu_attention.extend_attention).parameters else {}
    for name, pools in [("agent turn 10: 8 x 64-70 new over 900-1,100 cached (9/3/64), one pool", cold[:1]),
                        ("the same cycling through 30 layers' pools (cold)", cold)]:
        def call(fuse, pools=pools):
            for k, v in pools:
                cpu_attention.extend_attention(args[0], k, v, *args[1:], amx=True, **({} if fuse else off))
        new, old = [], []
        for _ in range(3):
            new.append(timed(lambda: call(True), a.repeats, clock) / len(pools))
            old.append(timed(lambda: call(False), a.repeats, clock) / len(pools))
        rows.append((name, "fused tasks", min(new), "call-wide packing", min(old),
                     gflop(args[0], args[3], args[4], 64) / min(new) * 1e3))
    for pre in (1536, 0):
        c = extend_case(pre, 512, 1, 9, 3, 64, g)
        new, old = [], []
        for _ in range(3):
            new.append(timed(lambda: cpu_attention.extend_attention(*c, amx=True), a.repeats, clock))
            old.append(timed(lambda: cpu_attention.extend_attention(*c, amx=False), a.repeats, clock))
        rows.append((f"512 new over {pre} cached (9/3/64)", "AMX tiles", min(new), "AVX-512", min(old),
                     gflop(c[0], c[5], c[6], 64) / min(new) * 1e3))
    return rows


def shared_decode_case(groups, per, P, Hq, Hkv, D, g):
    B = groups * per
    own = torch.randint(10, 60, (B,), generator=g)
    S = groups * P + int(own.sum()) + 8
    k, v = pool(S, Hkv, D, g)
    perm = (torch.randperm(S - 1, generator=g) + 1).to(torch.int32)
    rt = torch.zeros(B, P + 60, dtype=torch.int32)
    nxt = groups * P
    for b in range(B):
        gi, n = b % groups, int(own[b])
        rt[b, :P] = perm[gi * P:(gi + 1) * P]
        rt[b, P:P + n] = perm[nxt:nxt + n]
        nxt += n
    q = torch.randn(B, Hq, D, generator=g).bfloat16()
    return (q, k, v, rt, torch.arange(B), P + own, D ** -0.5)


def timed(fn, repeats, clock=time.perf_counter):
    ts = []
    for _ in range(repeats):
        t = clock()
        fn()
        ts.append(clock() - t)
    return sorted(ts)[len(ts) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--cases", choices=("all", "extend", "decode", "chunks", "agent"), default="all",
                    help="which rows to time (the inputs of all / extend / decode are the same either way)")
    a = ap.parse_args()
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    torch.set_num_threads(a.threads)
    if not cpu_attention.amx_ready():
        raise SystemExit("no AMX attention here (needs amx_tile + amx_bf16 and the kernel build)")
    g = torch.Generator().manual_seed(0)
    rows = []
    if a.cases == "agent":
        rows = agent_rows(a, clock, g)
        print(f"threads={a.threads}, {a.clock} ms per call (one layer), best of 3 alternated medians of {a.repeats}")
        print("| case | new | ms | GFLOP/s | old | ms | old / new |\n|---|---|---|---|---|---|---|")
        for name, n1, t1, n0, t0, gf in rows:
            print(f"| {name} | {n1} | {t1:.2f} | {gf:.0f} | {n0} | {t0:.2f} | {t0 / t1:.2f}x |")
        return
    if a.cases == "chunks":
        tot_new = tot_old = 0.0
        for pre in (0, 512, 1024, 1536):
            args = extend_case(pre, 512, 1, 9, 3, 64, g)
            new, old = [], []
            for _ in range(3):
                new.append(timed(lambda: cpu_attention.extend_attention(*args, amx=True), a.repeats, clock))
                old.append(timed(lambda: cpu_attention.extend_attention(*args, amx=False), a.repeats, clock))
            rows.append((f"extend 512 new over {pre} cached (9/3/64)", "AMX tiles", min(new), "AVX-512", min(old)))
            tot_new, tot_old = tot_new + min(new), tot_old + min(old)
        rows.append(("the four chunks of a 2,048-token prompt (one layer)", "AMX tiles", tot_new, "AVX-512", tot_old))
    for name, args in [("extend 8 x 62 over 700 (9/3/64)", extend_case(700, 62, 8, 9, 3, 64, g)),
                       ("extend 2,048-token prompt (9/3/64)", extend_case(0, 2048, 1, 9, 3, 64, g)),
                       ("extend 4 x 100 over 300 (4/1/256)", extend_case(300, 100, 4, 4, 1, 256, g))]:
        if a.cases in ("decode", "chunks"):
            continue
        new, old, per_task = [], [], []
        for _ in range(3):
            new.append(timed(lambda: cpu_attention.extend_attention(*args, amx=True), a.repeats, clock))
            old.append(timed(lambda: cpu_attention.extend_attention(*args, amx=False), a.repeats, clock))
            per_task.append(timed(lambda: cpu_attention.extend_attention(*args, amx=True, pack_kv=False),
                                  a.repeats, clock))
        rows.append((name, "AMX tiles", min(new), "AVX-512", min(old)))
        rows.append((name, "K/V packed once (or fused)", min(new), "packed per task", min(per_task)))
    for name, args in [("decode 64 rows, 4 x 16 sharing 600 (9/3/64)", shared_decode_case(4, 16, 600, 9, 3, 64, g)),
                       ("decode 32 rows, 2 x 16 sharing 600 (4/1/256)", shared_decode_case(2, 16, 600, 4, 1, 256, g))]:
        if a.cases in ("extend", "chunks"):
            continue
        new, old = [], []
        for _ in range(3):
            new.append(timed(lambda: cpu_attention.decode_attention(*args, cascade_min=64), a.repeats, clock))
            old.append(timed(lambda: cpu_attention.decode_attention(*args, cascade_min=0), a.repeats, clock))
        rows.append((name, "cascade", min(new), "per row", min(old)))
    print(f"threads={a.threads}, {a.clock} ms per call (one layer), best of 3 alternated medians of {a.repeats}")
    print(f"| case | new | ms | old | ms | old / new |\n|---|---|---|---|---|---|")
    for name, n1, t1, n0, t0 in rows:
        print(f"| {name} | {n1} | {t1:.2f} | {n0} | {t0:.2f} | {t0 / t1:.1f}x |")


if __name__ == "__main__":
    main()
