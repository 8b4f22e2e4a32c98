"""Ahead-of-time compile of every Triton kernel for an NVIDIA target, no GPU needed.

The CPU interpreter checks what the kernels compute but not that they compile: this lowers each
kernel (in the launch configurations the ops use) through Triton's full pipeline down to PTX and
cubin for ``sm_<arch>`` with the ptxas that ships in the triton wheel, so type errors, unsupported
ops and register/shared-memory blow-ups show up on CPU-only machines too.

Run: ``python -m sglite.kernels.triton_compile_check [--arch 90]`` (with ``TRITON_INTERPRET``
unset: interpreted kernels cannot be compiled). Prints one line per kernel; exit status 1 on
any failure.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Tuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import kv_quant_triton as KQ
from . import triton_attention as A
from . import triton_quant as Q
from . import triton_sampling as S

# (label, kernel, pointer/scalar types by argument name, constexprs, num_warps)
Spec = Tuple[str, object, Dict[str, str], Dict[str, object], int]


def kernel_specs() -> List[Spec]:
    """The kernel configurations the ops launch on a GPU (bf16/fp32 KV, SmolLM2/Llama heads)."""
    specs: List[Spec] = []
    for dt in ("bf16", "fp32"):
        specs.append((f"store_kv {dt}", A._store_kv_kernel,
                      dict(KBuf="*" + dt, VBuf="*" + dt, Loc="*i64", K="*" + dt, V="*" + dt),
                      dict(D=128, HD=1024, BLOCK_T=4, BLOCK_HD=1024), 4))
        for group, d in ((3, 64), (4, 128)):
            specs.append((f"decode partial {dt} G={group} D={d}", A._decode_partial_kernel,
                          dict(Q="*" + dt, KBuf="*" + dt, VBuf="*" + dt, ReqToToken="*i32",
                               ReqIdx="*i64", SeqLens="*i64", MidO="*fp32", MidLse="*fp32",
                               sm_scale="fp32"),
                          dict(GROUP=group, BLOCK_G=16, D=d, BLOCK_D=d, BLOCK_N=64, NUM_SPLITS=8,
                               UPCAST=False, IEEE=dt == "fp32"), 4))
            specs.append((f"extend {dt} G={group} D={d}", A._extend_kernel,
                          dict(Q="*" + dt, KBuf="*" + dt, VBuf="*" + dt, Out="*" + dt,
                               ReqToToken="*i32", ReqIdx="*i64", PrefixLens="*i64",
                               ExtendLens="*i64", QStart="*i64", sm_scale="fp32"),
                          dict(GROUP=group, D=d, BLOCK_D=d, BLOCK_M=64, BLOCK_N=64, UPCAST=False,
                               IEEE=dt == "fp32"), 4))
        specs.append((f"decode reduce {dt}", A._decode_reduce_kernel,
                      dict(MidO="*fp32", MidLse="*fp32", Out="*" + dt),
                      dict(NUM_SPLITS=8, BLOCK_S=8, D=128, BLOCK_D=128), 4))
    specs.append(("bitmask", S._bitmask_kernel, dict(Logits="*fp32", Mask="*i32", Indices="*i64"),
                  dict(HAS_INDICES=True, BLOCK_V=4096), 4))
    for has_mask in (True, False):
        specs.append((f"sample mask={has_mask}", S._sample_kernel,
                      dict(Logits="*fp32", Mask="*i32", Temp="*fp32", TopP="*fp32", TopK="*i64",
                           MinP="*fp32", Seed="*i64", Pos="*i64", Out="*i64"),
                      dict(HAS_MASK=has_mask, ROWS=1, BLOCK_V=2048, BLOCK_S=512, RADIX=16,
                           N_PASSES=8), 8))
    for dt in ("bf16", "fp32"):
        for bits in (4, 8):
            specs.append((f"quant linear {dt} {bits}-bit", Q._quant_kernel,
                          dict(X="*" + dt, Q="*u8", S="*fp32", Mn="*fp32", Bias="*" + dt, Y="*" + dt),
                          dict(BITS=bits, HAS_MINS=True, HAS_BIAS=False, UPCAST=False, IEEE=dt == "fp32",
                               BLOCK_M=Q.BM, BLOCK_N=Q.BN), 4))
    for bits in (8, 4):
        specs.append((f"kv quant decode bf16 {bits}-bit", KQ._qdecode_kernel,
                      dict(Q="*bf16", KD="*u8", VD="*u8", KS="*fp16", VS="*fp16", RK="*bf16", RV="*bf16",
                           RT="*i32", Rows="*i64", Lens="*i64", Sealed="*i64", Out="*bf16", sm_scale="fp32"),
                      dict(QG=3, BLOCK_QG=4, D=64, GROUP=128, BITS=bits, BLOCK_N=32), 4))
    return specs


def compile_spec(spec: Spec, arch: int):
    """Compile one spec to cubin; returns the compiled kernel (raises on failure)."""
    _, fn, types, consts, warps = spec
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "num_stages": 2})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    p.add_argument("--only", default="", help="substring filter on kernel labels")
    p.add_argument("--quick", action="store_true", help="skip the fp32 attention variants (slow to build)")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    failed = 0
    for spec in kernel_specs():
        if a.only not in spec[0] or (a.quick and "fp32" in spec[0]):
            continue
        t0 = time.perf_counter()
        try:
            k = compile_spec(spec, a.arch)
            meta = k.metadata
            print(f"ok   {spec[0]:<36} {time.perf_counter() - t0:5.1f}s  shared memory {meta.shared} B",
                  flush=True)
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            print(f"FAIL {spec[0]}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
