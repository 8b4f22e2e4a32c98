"""CPU cost of one long prompt's prefill per chunked-prefill size, kernel by kernel (issue 33).

For each ``--chunks`` size C, the prefill of a ``--prompt-len`` prompt in chunks of C tokens runs
one layer of the default model (layer 0's weights, a head-major pool as the engine's) per chunk:
the QKV, O, gate_up and down matmuls, RoPE + KV store, extend attention over the chunk's prefix,
SiLU-mul and the two residual-add norms, each through ``sglite.kernels``. Each chunk's kernels are
timed on ONE thread (``torch.set_num_threads(1)``: no pool workers, so ``time.thread_time`` is the
work itself, little moved by other processes on a shared machine), best of ``--repeats``; the
prompt's total is the per-layer sum times the layer count. Prints one row per chunk size with the
GEMM / attention / elementwise split, in CPU milliseconds per prompt.

Usage::

    .venv/bin/python scripts/chunk_size_cost.py [--prompt-len 2048] [--chunks 512,1024,2048]
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the default model")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--chunks", default="512,1024,2048")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()

    import torch

    from sglite import Engine, kernels

    e = Engine(model_path=a.model_path, num_threads=1, log_level="warning")
    m = e.runner.model
    e.shutdown()
    torch.set_num_threads(1)
    ar, L, dt = m.arch, m.layers[0], m.dtype
    Hq, Hkv, D, H = ar.num_heads, ar.num_kv_heads, ar.head_dim, ar.hidden_size
    P = a.prompt_len
    kb = torch.zeros(Hkv, P + 16, D, dtype=dt).transpose(0, 1)  # [S, Hkv, D], head-major as the pool
    vb = torch.zeros(Hkv, P + 16, D, dtype=dt).transpose(0, 1)
    table = torch.arange(P + 16, dtype=torch.int32)[None]  # one request's slot row
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(P, H, generator=g).to(dt)

    def best(f) -> float:
        f()
        out = float("inf")
        for _ in range(a.repeats):
            t = time.thread_time()
            f()
            out = min(out, time.thread_time() - t)
        return out

    print(f"{P}-token prompt, {ar.num_layers} layers, one thread, best of {a.repeats} (CPU ms per prompt)")
    for C in (int(c) for c in a.chunks.split(",")):
        cost = {"GEMM": 0.0, "attention": 0.0, "elementwise": 0.0}
        for start in range(0, P, C):
            n = min(C, P - start)
            x = x_all[start:start + n]
            pos = torch.arange(start, start + n)
            cos, sin = m.cos[pos].to(dt), m.sin[pos].to(dt)
            loc = torch.arange(start, start + n)
            h = kernels.rms_norm(x, L["in_norm"], ar.rms_norm_eps)
            qkv = kernels.linear(h, L["qkv"])
            qk, v = qkv.split([(Hq + Hkv) * D, Hkv * D], dim=-1)
            qk, v = qk.view(-1, Hq + Hkv, D), v.view(-1, Hkv, D)
            q = kernels.rope_store_kv(qk, v, cos, sin, kb, vb, loc, Hq)
            ext = (table, torch.tensor([0]), torch.tensor([start]), torch.tensor([n]), m.sm_scale)
            o = kernels.extend_attention(q, kb, vb, *ext)
            o2 = kernels.linear(o.reshape(n, Hq * D), L["o"])
            s, h2 = kernels.add_rms_norm(x, o2, L["post_norm"], ar.rms_norm_eps)
            gu = kernels.linear(h2, L["gate_up"])
            gg, uu = gu.chunk(2, dim=-1)
            act = kernels.silu_mul(gg, uu)
            d = kernels.linear(act, L["down"])
            cost["GEMM"] += sum(best(lambda w=w, i=i: kernels.linear(i, L[w]))
                                for w, i in (("qkv", h), ("o", o.reshape(n, Hq * D)), ("gate_up", h2), ("down", act)))
            cost["attention"] += best(lambda: kernels.extend_attention(q, kb, vb, *ext))
            cost["elementwise"] += (best(lambda: kernels.rope_store_kv(qk, v, cos, sin, kb, vb, loc, Hq))
                                    + best(lambda: kernels.add_rms_norm(x, o2, L["post_norm"], ar.rms_norm_eps))
                                    + best(lambda: kernels.silu_mul(gg, uu))
                                    + best(lambda: kernels.add_rms_norm(s, d, L["in_norm"], ar.rms_norm_eps)))
        tot = sum(cost.values())
        parts = ", ".join(f"{k} {v * ar.num_layers * 1e3:.0f}" for k, v in cost.items())
        print(f"chunk {C:5d}: {P // C + (P % C > 0)} steps, total {tot * ar.num_layers * 1e3:.0f} ms ({parts})")


if __name__ == "__main__":
    main()
