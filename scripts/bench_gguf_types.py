"""Per GGUF native type, one thread: the int8 GEMV (1 row) and the VNNI int8 GEMM (32 bf16 rows) on
random valid blocks of a 1536 x 512 weight in 16-row tiles, best of 15 (ms), and Q6_K on the
old reference path. Usage: PYTHONPATH=. python scripts/bench_gguf_types.py (noisy on shared machines)."""
import time, torch
from sglite.kernels import quant_cpu, quant_gemm
from sglite.kernels.quant_layout import compact_scales, tile_rows
from sglite.runtime.gguf_blocks import NATIVE_TYPES, blocks_to_weight
from sglite.testing import random_gguf_blocks
torch.set_num_threads(1)
n, k = 1536, 512  # a SmolLM2-135M gate_proj shape (N=1536, K=576 is not a multiple of 256)
def best(f, reps=15):
    f(); t = []
    for _ in range(reps):
        a = time.perf_counter(); f(); t.append(time.perf_counter() - a)
    return min(t) * 1e3
for tn in NATIVE_TYPES:
    w = blocks_to_weight(tn, random_gguf_blocks(tn, n, k, seed=1), k); compact_scales(w); tile_rows(w)
    x1, x32 = torch.randn(1, k), torch.randn(32, k).bfloat16()
    g1 = best(lambda: quant_cpu.gemv_q8(x1, w))
    g32 = best(lambda: quant_gemm.gemm(x32, w))
    print(f"{tn:5s} bits={w.bits} gs={w.group_size} MB={w.nbytes()/1e6:.2f} gemv_q8 M=1 {g1:.3f} ms  vnni_gemm M=32 {g32:.3f} ms")
from sglite.kernels.quant_linear import reference_linear
w = blocks_to_weight("Q6_K", random_gguf_blocks("Q6_K", n, k, seed=1), k)
x1 = torch.randn(1, k)
print(f"Q6_K before (quant_ref: dequantize + F.linear), M=1: {best(lambda: reference_linear(x1, w)):.3f} ms")
