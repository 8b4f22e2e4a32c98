"""C++ CPU kernels for :class:`.quant_linear.QuantLinearWeight` (source ``csrc/quant_gemv.cpp``):
a few-row GEMV straight on the packed codes and a dequantizer for the GEMM path.

``gemv(x, w)``: x [M, K] bf16 | float32 (1 <= M <= 8; float16 runs as float32) -> [M, N] in x's
dtype, ``= x @ W.T + bias``. Per weight row and group ``g`` the kernel computes
``s[n, g] * sum_k x[m, k] q[n, k]`` and adds ``sum_g mins[n, g] * sum_{k in g} x[m, k]``: the codes
are read once per call whatever M (each 32-code block is unpacked once and folded into all M rows).
    AVX-512-BF16 build: a 4-bit block (16 bytes) becomes 32 bf16 integers through one
    ``VPERMW`` table lookup (an 8-bit block through float32 conversion; integers <= 255 are exact
    in bf16), and ``VDPBF16PS`` multiplies them by x in bf16: exact products, float32 sums. A
    float32 x is split into three bf16 planes (hi + mid + lo, exact up to 2^-24 relative), so
    float32 activations keep float32 accuracy (three VDPBF16PS per block instead of one).
    Portable build (no AVX-512-BF16): the same formula in plain float loops.
Results equal :func:`.quant_linear.reference_linear` up to float32 summation order (the tests
check it, with tolerances scaled to K).

``dequantize(w, dtype)``: ``W_stored`` [N, K] (stored channel order) as ``s * q + m`` in float32,
rounded once to bf16 when ``dtype`` is bf16 (what the GEMM path feeds ``F.linear``).

``linear(x, w, invariant=False)``: the ``quant_cpp`` / ``quant_invariant`` implementations: x's
columns gathered into stored order, 1..8 rows -> :func:`gemv`, up to :data:`GEMV_MAX_ROWS` rows ->
:func:`gemv` per block of 8 rows (the codes stream once per block), more rows -> ``F.linear`` on
:func:`dequantize` (oneDNN's GEMM on the weight dequantized once per call; at prefill sizes the
dequantization is a small part of the product). Measured (one thread, bf16, 16 SmolLM2-shaped
Q4 matrices): M=16 GEMV blocks 17 ms vs dequantize+GEMM 22 ms, M=32 26 vs 32, M=64 59 vs 46,
M=128 140 vs 81. A weight in 16-row tiles (``w.tiled``; bf16 models on VNNI CPUs, see
:mod:`.decode_fused`) runs 1..32 rows through :func:`gemv_q8` instead (int8 activations), more rows
through the dequantized GEMM -- except where :mod:`.gemm_paths` picks ``vnni_gemm`` (VNNI CPUs,
more than 8 rows by default): :func:`.quant_gemm.gemm`, the int8 GEMM straight on the tiles (no
weight dequantized per call). ``invariant=True`` runs every row through the GEMV
in blocks of 8 rows (a row's arithmetic does not depend on M: batch-invariant).

Build: :func:`.cpu_build.load_cpp`, with ``-mavx512f -mavx512bw -mavx512vl -mavx512bf16`` when
``/proc/cpuinfo`` lists those features, else ``-O3`` alone (the portable build). Without a compiler
:func:`available` is False and ``QuantLinearWeight`` runs ``quant_ref``.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from . import gemm_paths, quant_amx, quant_gemm
from .quant_gemm import gemv_q8_reference, quantize_act_q8_reference  # noqa: F401  (re-exported)
from .cpu_build import load_cpp, read_source
from .device import cpu_flags, serial_torch
from .quant_layout import gather_input

if TYPE_CHECKING:
    from .quant_linear import QuantLinearWeight

MAX_ROWS = 8  # rows of x per kernel call (register budget)
GEMV_MAX_ROWS = 32  # up to this many rows: GEMV calls in blocks of 8; more: dequantize + GEMM
AVX_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c")
CFLAGS_AVX = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mf16c", "-ffp-contract=off")
VNNI_FLAG = "avx512_vnni"  # with it the AVX build adds -mavx512vnni (VPDPBUSD for int8 activations)
CFLAGS_PORTABLE = ("-O3", "-ffp-contract=off")


@functools.lru_cache(maxsize=None)
def load(portable: bool = False):
    """The compiled module (AVX-512-BF16 build when the CPU has :data:`AVX_FLAGS` and ``portable``
    is False, else the portable build), or None when the build failed (one warning logged)."""
    simd = not portable and all(f in cpu_flags() for f in AVX_FLAGS)
    flags = CFLAGS_AVX + (("-mavx512vnni",) if VNNI_FLAG in cpu_flags() else ()) if simd else CFLAGS_PORTABLE
    return load_cpp("sglite_quant_gemv" + ("" if simd else "_portable"), read_source("quant_gemv.cpp"), flags,
                    functions=["quant_gemv", "quant_dequant", "quant_simd", "quant_gemv_q8", "quant_q8_act",
                               "quant_vnni"])


def available() -> bool:
    """True when a build of the kernel loaded on this CPU."""
    return load() is not None


def _mod(portable: bool):
    m = load(portable)
    if m is None:
        raise RuntimeError("quant_cpu: the C++ kernel is unavailable (see the logged build warning)")
    return m


_NATIVE = (torch.bfloat16, torch.float32)
_NO_MINS = torch.empty(0)


def _mins(w: QuantLinearWeight) -> torch.Tensor:
    return _NO_MINS if w.mins is None else w.mins.float()  # the kernel reads an empty tensor as "no offsets"


def _scales(w: QuantLinearWeight) -> torch.Tensor:
    return w.scales.float()  # float16 (compact) scales widened, exactly; float32 ones as they are
  # activation dtypes the kernel takes as they are


def gemv(x: torch.Tensor, w: QuantLinearWeight, portable: bool = False) -> torch.Tensor:
    """x [M, K] (stored channel order, 1 <= M <= 8) @ W_stored.T (+ bias) -> [M, N], x's dtype
    (float32 sums rounded once)."""
    xin = x if x.dtype in _NATIVE else x.float()
    w = w.untiled()  # the float GEMV reads rows (a tiled weight takes gemv_q8 in linear())
    y = _mod(portable).quant_gemv(xin, w.qweight, _scales(w), _mins(w), w.bits, w.group_size)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if w.bias is None else y + w.bias.to(x.dtype)


def gemv_q8(x: torch.Tensor, w: QuantLinearWeight, portable: bool = False) -> torch.Tensor:
    """x [M, K] (stored channel order, 1 <= M <= 32, blocks of 8; cast to float32) @ W_stored.T with x rounded to
    int8 per 32-block (:func:`quantize_act_q8_reference`) and integer dot products (``VPDPBUSD``
    on the codes as unsigned bytes when the build has AVX-512 VNNI, plain loops otherwise), per
    block ``s * d * idot + m * sx`` summed in float32 -> [M, N] float32 (bias not added).
    group_size must be 32 (GGUF blocks), or 16 with 8-bit codes (GGUF Q6_K: per 16-group dots). Not bf16-exact: error of the order of the int8 step. Reads
    the row layout and the 16-row tiles (``w.tiled``, ``csrc/quant_tiles.h``) alike.

    Raises:
        RuntimeError: the kernel is unavailable or the inputs break the contract."""
    mins = _NO_MINS if w.mins is None else w.mins  # float32 or float16 (compact), read as stored
    return _mod(portable).quant_gemv_q8(x.float().contiguous(), w.qweight, w.scales, mins, w.bits,
                                        w.group_size, portable, w.tiled)


def vnni() -> bool:
    """True when the loaded (non-portable) build runs :func:`gemv_q8` on AVX-512 VNNI."""
    m = load()
    return m is not None and bool(m.quant_vnni())


def dequantize(w: QuantLinearWeight, dtype: torch.dtype = torch.float32, portable: bool = False) -> torch.Tensor:
    """``W_stored`` [N, K] in ``dtype`` (float32 math; bf16 rounded once from it)."""
    w = w.untiled()
    out = _mod(portable).quant_dequant(w.qweight, _scales(w), _mins(w), w.bits, w.group_size, dtype == torch.bfloat16)
    return out if out.dtype == dtype else out.to(dtype)


def linear_silu_mul(x: torch.Tensor, w: QuantLinearWeight) -> Optional[torch.Tensor]:
    """SwiGLU's activation [M, I] of a fused gate/up weight [2I, K] through the AMX GEMM's silu
    output stage (:func:`.quant_amx.gemm_silu_mul`) when :func:`linear` would take ``amx_gemm`` for
    these rows and :func:`.gemm_paths.amx_silu` allows it (tiled, no bias, 2I % 64 == 0, bf16 x);
    x: [M, K] bf16 -> [M, I] bf16; None otherwise (the caller runs :func:`linear` and ``silu_mul``).
    Every condition is checked here, so :func:`.quant_amx.gemm_silu_mul`'s errors are not reached."""
    m = x.shape[0]
    if not (w.tiled and m >= 1 and x.dtype == torch.bfloat16 and w.bias is None and w.shape[0] % 64 == 0
            and gemm_paths.amx_silu() and quant_amx.available()):
        return None
    if gemm_paths.quant_path(m, True, quant_gemm.available(), True) != "amx_gemm":
        return None
    return quant_amx.gemm_silu_mul(x, w)


def linear(x: torch.Tensor, w: QuantLinearWeight, invariant: bool = False, portable: bool = False) -> torch.Tensor:
    """``x @ W.T + bias`` for x [M, K] (any M >= 0) on CPU; see the module docstring."""
    m = x.shape[0]
    if w.tiled and m >= 1 and not invariant and not portable:
        amx_ok = x.dtype == torch.bfloat16 and quant_amx.available()
        path = gemm_paths.quant_path(m, True, quant_gemm.available(), amx_ok)  # rows x layout x CPU features
        if path == "amx_gemm":
            return quant_amx.gemm(x, w)  # the AMX tile GEMM: weight tiles dequantized in L1/L2 only
        if path == "vnni_gemm":
            return quant_gemm.gemm(x, w)  # the int8 GEMM on the tiles: no dequantized copy
    else:
        path = "gemv_q8" if m <= GEMV_MAX_ROWS else "dequant_gemm"
    if w.tiled and 1 <= m <= GEMV_MAX_ROWS and not invariant and path == "gemv_q8":  # the tiles' int8 GEMV
        y = gemv_q8(gather_input(x, w), w, portable)
        with serial_torch():  # a [M, V] LM-head cast: torch's OpenMP team stalls on a busy machine
            y = y.to(x.dtype)
            return y if w.bias is None else y + w.bias.to(x.dtype)
    if 1 <= m <= MAX_ROWS and w.perm is None and w.bias is None and x.dtype in _NATIVE and not portable and not w.tiled:
        return _mod(False).quant_gemv(x, w.qweight, _scales(w), _mins(w), w.bits, w.group_size)  # decode fast path
    xs = gather_input(x, w)
    if m == 0:
        return x.new_zeros((0, w.shape[0]))
    if m <= MAX_ROWS:
        return gemv(xs, w, portable)
    if invariant or m <= GEMV_MAX_ROWS:
        return torch.cat([gemv(xs[i:i + MAX_ROWS], w, portable) for i in range(0, m, MAX_ROWS)])
    return F.linear(xs, dequantize(w, x.dtype, portable), None if w.bias is None else w.bias.to(x.dtype))
