"""Benchmark: the int8-activation GEMV (issue 15) on the row layout vs 16-row tiles, timed in C++.

    python benchmarks/quant_gemv_layout.py [--threads 1] [--reps 10] [--rows 1 4 8]

Weights: 30 layers of the default model's shapes (QKV 960x576, O 576x576, gate/up 3072x576, down
576x1536; Q4 codes, float16 scales and mins: 68 MB, twice the L3 cache, as a decode step streams
them) and its Q8_0 LM head (49152x576, 30 MB: it fits the 32 MB L3 of these machines when timed
alone, so its GB/s here can exceed DRAM bandwidth). Random codes; the layout under test is built
with :func:`sglite.kernels.quant_linear.tile_rows`. One small C++ function (compiled with the same
flags as the kernels) calls ``sglite_quant::gemv_q8`` on every weight in turn, best of ``--reps``
passes, so no Python call overhead is in the numbers. Prints a markdown table: ms per pass and
weight bytes / time (GB/s) for each layout and row count.
"""
from __future__ import annotations

import argparse
import hashlib

import torch
from torch.utils.cpp_extension import load_inline

from sglite.kernels import quant_cpu
from sglite.kernels.cpu_build import cpu_flags, read_source
from sglite.kernels.quant_linear import QuantLinearWeight, compact_scales, tile_rows

HARNESS = r'''
#include <chrono>
// seconds of the best of `reps` passes of gemv_q8 over the weights (t: codes, scales, mins per weight)
double bench(std::vector<at::Tensor> t, std::vector<int64_t> bits, bool tiled, int64_t M, int64_t reps) {
  std::vector<sglite_quant::QW> ws;
  for (size_t i = 0; i < bits.size(); ++i) {
    const at::Tensor &q = t[3 * i], &s = t[3 * i + 1], &m = t[3 * i + 2];
    const int64_t N = q.size(0), K = q.size(1) * 8 / bits[i];
    ws.push_back(sglite_quant::QW{q.data_ptr<uint8_t>(), (const float*)s.data_ptr(), (const float*)m.data_ptr(),
                                  (int)bits[i], 32, N, K, true, tiled});
  }
  std::vector<float> x(8 * 4096), y(8 * 65536);
  for (size_t i = 0; i < x.size(); ++i) x[i] = (float)((i * 7919) % 255) / 128.f - 1.f;
  double best = 1e9;
  for (int64_t r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& w : ws) sglite_quant::gemv_q8(w, x.data(), M, y.data());
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}
'''
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def build():
    src = "#include <torch/extension.h>\n#include <ATen/Parallel.h>\n#include <c10/util/BFloat16.h>\n" \
          + read_source("quant_rows.h") + HARNESS
    flags = list(quant_cpu.CFLAGS_AVX) + (["-mavx512vnni"] if quant_cpu.VNNI_FLAG in cpu_flags() else [])
    name = "sglite_bench_layout_" + hashlib.sha1(src.encode()).hexdigest()[:10]
    return load_inline(name, cpp_sources=[src], functions=["bench"], extra_cflags=flags)


def weight(n: int, k: int, bits: int, tiled: bool, seed: int) -> QuantLinearWeight:
    g = torch.Generator().manual_seed(seed)
    w = QuantLinearWeight.from_codes(torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8),
                                     (torch.rand(n, k // 32, generator=g) * 0.01).half().float(),
                                     (torch.randn(n, k // 32, generator=g) * 0.01).half().float(), bits, 32)
    compact_scales(w)
    if tiled:
        tile_rows(w)
    return w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    a = p.parse_args()
    if not quant_cpu.vnni():
        raise SystemExit("this CPU (or build) has no AVX-512 VNNI: the tiles are not used here")
    torch.set_num_threads(a.threads)
    mod = build()
    print("| weights | rows | row layout ms | GB/s | 16-row tiles ms | GB/s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name, shapes, bits in (("30 layers (Q4, 68 MB)", LAYER * 30, 4), ("LM head (Q8_0, 30 MB)", [(49152, 576)], 8)):
        sets = {t: [weight(n, k, bits, t, i) for i, (n, k) in enumerate(shapes)] for t in (False, True)}
        for m in a.rows:
            res = {}
            for tiled, ws in sets.items():
                ts = [x for w in ws for x in (w.qweight, w.scales, w.mins)]
                sec = mod.bench(ts, [w.bits for w in ws], tiled, m, a.reps)
                res[tiled] = (sec * 1e3, sum(w.nbytes() for w in ws) / sec / 1e9)
            print(f"| {name} | {m} | {res[False][0]:.2f} | {res[False][1]:.1f} | {res[True][0]:.2f} | "
                  f"{res[True][1]:.1f} | {res[False][0] / res[True][0]:.2f}x |")


if __name__ == "__main__":
    main()
