"""Which CPU matmul path serves a product, by rows x weight type x CPU features: the one place the
``linear`` implementations (:mod:`.matmul`, :mod:`.quant_cpu`) ask, so the choice is stated and
forced in one spot. A leaf of ``sglite.kernels`` (imports only :mod:`.device`).

Paths (names as logged):
    float weights (``LinearWeight``, impl ``onednn``):
        ``gemv``           1..8 rows: the C++ AVX-512-BF16 GEMV on the plain weight (:mod:`.cpu_gemv`);
        ``onednn_packed``  more rows: oneDNN's matmul on a weight reordered ONCE at load
                           (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``);
                           ``F.linear`` on the plain [N, K] tensor reorders it on every call.
    quantized weights (``QuantLinearWeight``, impl ``quant_cpp``), 16-row tiles (``w.tiled``):
        ``gemv_q8``        1..8 rows: the int8-activation GEMV over the tiles (:func:`.quant_cpu.gemv_q8`);
        ``vnni_gemm``      more rows: the int8 GEMM (:mod:`.quant_gemm`, AVX-512 VNNI);
        ``amx_gemm``       bf16 activations, :data:`AMX_MIN_ROWS` rows or more, AMX-BF16 CPUs: the
                           tile GEMM (:mod:`.quant_amx`, the codes dequantized block by block
                           inside its K loop; a repacked bf16 copy only on request, below);
        ``dequant_gemm``   more rows without VNNI (or forced): dequantize, then ``F.linear``.
    Row-layout quantized weights keep the float GEMV (1..32 rows) and ``dequant_gemm`` (more).
    The fused C++ decode (``decode_fused``) has no int8 GEMM: its tiled products take the AMX tiles
    from :func:`fused_amx_min` rows per weight (9 for every kind since the K-loop tiles; the
    per-kind constants stay as A/B knobs).

Deterministic inference (``invariant`` / ``quant_invariant``) never comes here: those impls keep
their batch-invariant kernels whatever this module says.

Forcing: environment variable ``SGLITE_GEMM`` (read on every call, so tests can flip it):
    ``auto`` (or unset)  the table above;
    ``torch``            the pre-GEMM paths: ``F.linear`` on the plain weight for float rows > 8,
                         ``gemv_q8`` up to 32 quantized rows and ``dequant_gemm`` above (A/B runs);
    ``cpp``              the new GEMMs for every row count they take (``vnni_gemm`` from 1 row,
                         ``onednn_packed`` from 1 row);
    ``vnni``             ``auto`` without the AMX path (A/B runs of the tile units).
An unknown value raises ValueError naming the variable and the known values.

SwiGLU from the gate/up product (``SGLITE_AMX_SILU``, read per call): ``auto`` (or unset) and ``1``
let an ``amx_gemm`` product of a fused gate/up weight write ``silu(g) * u`` from its output stage
(:func:`.quant_amx.gemm_silu_mul`, bit-identical), ``0`` keeps the product then ``silu_mul`` (A/B runs).

Repacking for AMX (``SGLITE_AMX_REPACK``, read when a model is prepared): ``auto`` (or unset) and
``0`` keep no second copy: the ``amx_gemm`` path reads the 4/8-bit codes and dequantizes each
32-block inside its K loop, beside the tile products (:mod:`.quant_amx`), which measured faster
than a bf16 copy repacked at load into the tiles' B layout at every row count tried (16-512 rows,
docs/benchmarks.md, 2026-12-06; the copy took 212 MB for the default model and streamed 2 bytes a
weight against ~0.6). ``1`` still keeps the copy (2 bytes a weight, :func:`.quant_amx.pack`), for
A/B runs: then ``amx_gemm`` reads the bf16 tiles instead (the small-row GEMV paths read the codes
either way).
"""
from __future__ import annotations

import os

from .device import cpu_flags

ENV = "SGLITE_GEMM"
MODES = ("auto", "torch", "cpp", "vnni")
FLOAT_GEMV_MAX_ROWS = 8  # cpu_gemv.MAX_ROWS (the register budget of the bf16 GEMV)
Q8_GEMV_MAX_ROWS = 8  # quant_cpu.MAX_ROWS: the tiles' GEMV at 1..8 rows, the VNNI GEMM above
# (measured, one thread, the 17 SmolLM2-shaped Q4 matrices: M=16 GEMM 14.2 ms vs GEMV blocks 14.6,
# M=32 34.6 vs 48.2 -- the GEMV re-streams the codes per 8-row block)
# quant_amx: from here the tile GEMM (the K loop on the codes) is faster than the VNNI GEMM. Measured
# 2026-12-06 on the AMX Xeon, one thread, CPU time, median of 7 alternated passes of kernels.linear
# over the default model's matrices (LM head included): 9 / 10 / 12 / 14 / 15 rows 15.8 / 15.6 /
# 16.4 / 16.1 / 16.5 ms from 9 rows against 17.4 / 18.5 / 17.2 / 20.4 / 20.9 from 16
# (docs/benchmarks.md). Below 9 rows the GEMV (Q8_GEMV_MAX_ROWS) keeps them.
AMX_MIN_ROWS = Q8_GEMV_MAX_ROWS + 1

# The fused decode (csrc/decode_layer.cpp ``gemv``; :meth:`.decode_fused.FusedDecode.amx_min`) has no
# int8 GEMM: below its AMX threshold, 9+ rows run the int8 GEMV in blocks of 8 rows, one pass over the
# weight's codes per block. So its threshold may depend on the weight (:func:`fused_amx_min`). With
# the tiles read from a repacked bf16 copy (before 2026-12-06) it did (a large LM head from 9 rows,
# 8-bit codes from 12, 4-bit ones from 16); with the K loop on the codes every kind wins from 9 rows.
# Measured on captured fused decode steps (scripts/fused_amx_crossover.py), one thread, CPU time,
# median of 5, GEMV blocks vs tiles: default model's layers at 9 / 10 / 12 / 16 rows 14.9 / 18.1 /
# 20.9 / 21.4 vs 13.8 / 13.5 / 15.6 / 16.2 ms (8 rows: 15.2 vs 14.6); Gemma 3 270M's (mostly 8-bit
# codes) 24.5 / 22.0 / 26.0 / 29.7 vs 16.3 / 17.4 / 16.5 / 19.1 ms; its 262,144 x 640 head 43.8 vs
# 22.4 ms at 9 rows (docs/models.md).
# The fused decode on VNNI CPUs without AMX: from here its tiled products run the int8 VNNI GEMM
# (quant_gemm_kernel.h: the codes streamed once for all rows) instead of the GEMV in 8-row blocks,
# and a fused step takes up to decode_fused.MAX_ROWS_AMX rows (else MAX_ROWS): the per-op path's
# crossover (Q8_GEMV_MAX_ROWS above), the same int8 activations.
FUSED_VNNI_MIN_ROWS = Q8_GEMV_MAX_ROWS + 1
FUSED_LARGE_BYTES = 8 << 20  # codes past the 2 MiB L2: every 8-row block streams them again from L3/DRAM
FUSED_AMX_MIN_ROWS_LARGE = Q8_GEMV_MAX_ROWS + 1
FUSED_AMX_MIN_ROWS_8BIT = Q8_GEMV_MAX_ROWS + 1


SILU_ENV = "SGLITE_AMX_SILU"


def amx_silu() -> bool:
    """Whether the ``amx_gemm`` path may write SwiGLU's activation straight from a fused gate/up
    product (:func:`.quant_amx.gemm_silu_mul`, bit-identical to the product then ``silu_mul``):
    ``SGLITE_AMX_SILU`` ``auto`` (or unset) or ``1`` yes, ``0`` no (A/B runs). Read per call. Raises
    ValueError for an unknown value (naming it and the known ones)."""
    v = os.environ.get(SILU_ENV, "").strip() or "auto"
    if v not in ("auto", "0", "1"):
        raise ValueError(f"{SILU_ENV} must be one of auto|0|1, got {v!r}")
    return v != "0"


REPACK_ENV = "SGLITE_AMX_REPACK"


def amx_repack() -> bool:
    """Whether to keep the bf16 B-layout copies of tiled weights (module docstring): only with
    ``SGLITE_AMX_REPACK=1``. Raises ValueError for an unknown value (naming it and the known ones)."""
    v = os.environ.get(REPACK_ENV, "").strip() or "auto"
    if v not in ("auto", "0", "1"):
        raise ValueError(f"{REPACK_ENV} must be one of auto|0|1, got {v!r}")
    return v == "1"


def mode() -> str:
    """``SGLITE_GEMM`` (default ``auto``). Raises ValueError for an unknown value."""
    m = os.environ.get(ENV, "").strip() or "auto"
    if m not in MODES:
        raise ValueError(f"{ENV} must be one of {'|'.join(MODES)}, got {m!r}")
    return m


def float_path(rows: int, gemv_ok: bool, packed_ok: bool) -> str:
    """``gemv`` | ``onednn_packed`` | ``torch`` for a float product of ``rows`` rows; ``gemv_ok``: the
    C++ GEMV takes these inputs; ``packed_ok``: the weight has its oneDNN-packed copy."""
    m = mode()
    if m == "torch":
        return "gemv" if gemv_ok and rows <= FLOAT_GEMV_MAX_ROWS else "torch"
    if gemv_ok and 1 <= rows <= FLOAT_GEMV_MAX_ROWS and m in ("auto", "vnni"):
        return "gemv"
    return "onednn_packed" if packed_ok and rows >= 1 else ("gemv" if gemv_ok and rows <= FLOAT_GEMV_MAX_ROWS else "torch")


def quant_path(rows: int, tiled: bool, vnni_gemm_ok: bool, amx_ok: bool = False) -> str:
    """``gemv_q8`` | ``vnni_gemm`` | ``amx_gemm`` | ``dequant_gemm`` | ``gemv`` (row layout, few rows)
    for a quantized product of ``rows`` rows (``rows >= 1``); ``vnni_gemm_ok``: :mod:`.quant_gemm`
    loaded; ``amx_ok``: :mod:`.quant_amx` loaded and the activations are bf16."""
    m = mode()
    if not tiled:
        return "gemv" if rows <= 32 else "dequant_gemm"
    if amx_ok and m == "auto" and rows >= AMX_MIN_ROWS:
        return "amx_gemm"
    if m == "cpp" and vnni_gemm_ok:
        return "vnni_gemm"
    if rows <= Q8_GEMV_MAX_ROWS:
        return "gemv_q8"
    if vnni_gemm_ok and m in ("auto", "vnni"):
        return "vnni_gemm"
    return "gemv_q8" if rows <= 32 else "dequant_gemm"  # the pre-GEMM paths (quant_cpu.GEMV_MAX_ROWS)


def fused_amx_min(n: int, k: int, bits: int) -> int:
    """Rows from which the fused decode's product with a tiled [n, k] weight of ``bits``-bit codes
    runs on the AMX tiles: :data:`FUSED_AMX_MIN_ROWS_LARGE` for codes of at least
    :data:`FUSED_LARGE_BYTES` (an LM head), :data:`FUSED_AMX_MIN_ROWS_8BIT` for 8-bit codes,
    :data:`AMX_MIN_ROWS` else (module constants read per call, so A/B probes can set them)."""
    if n * k * bits // 8 >= FUSED_LARGE_BYTES:
        return min(FUSED_AMX_MIN_ROWS_LARGE, AMX_MIN_ROWS)
    return min(FUSED_AMX_MIN_ROWS_8BIT, AMX_MIN_ROWS) if bits == 8 else AMX_MIN_ROWS


def fused_constants() -> tuple:
    """The module constants :func:`fused_amx_min` reads, as one tuple (a cache key for callers that
    fold it over a fixed list of weights once per change, not once per step)."""
    return AMX_MIN_ROWS, FUSED_LARGE_BYTES, FUSED_AMX_MIN_ROWS_LARGE, FUSED_AMX_MIN_ROWS_8BIT


def fused_layers_amx_min(weights) -> int:
    """One threshold for all the layer GEMMs of a fused step (the C++ call takes one): the
    :func:`fused_amx_min` of the (n, k, bits) ``weights`` that hold most of the weight elements
    (ties: the larger threshold). Raises ValueError on an empty list."""
    if not weights:
        raise ValueError("fused_layers_amx_min: weights must not be empty")
    share: dict = {}
    for n, k, bits in weights:
        r = fused_amx_min(n, k, bits)
        share[r] = share.get(r, 0) + n * k
    return max(share, key=lambda r: (share[r], r))


def describe(gemv_ok: bool, packed_ok: bool, vnni_gemm_ok: bool, amx_ok: bool = False) -> str:
    """One line for the start-up log: the mode, the CPU features that matter and the path chosen per
    row count (1, 9, 33 rows) for float weights and for tiled quantized ones."""
    f = cpu_flags()
    feats = ",".join(x for x in ("avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if x in f) or "none"
    rows = (1, 9, 33)
    fl = ", ".join(f"{r}+ rows {float_path(r, gemv_ok and r <= FLOAT_GEMV_MAX_ROWS, packed_ok)}" for r in rows)
    qrows = tuple(sorted({1, 9, AMX_MIN_ROWS})) if amx_ok else rows
    qu = ", ".join(f"{r}+ rows {quant_path(r, True, vnni_gemm_ok, amx_ok)}" for r in qrows)
    fu = (f"; fused decode (bf16): amx_gemm from {min(FUSED_AMX_MIN_ROWS_LARGE, AMX_MIN_ROWS)} rows for codes >= "
          f"{FUSED_LARGE_BYTES >> 20} MiB, {min(FUSED_AMX_MIN_ROWS_8BIT, AMX_MIN_ROWS)} for 8-bit codes, {AMX_MIN_ROWS} else"
          if amx_ok and mode() == "auto" else "")
    return f"{ENV}={mode()} cpu=[{feats}]; float weights: {fl}; quantized weights in 16-row tiles (bf16): {qu}{fu}"
