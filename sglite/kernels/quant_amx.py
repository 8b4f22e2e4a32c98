"""BF16 GEMM on the AMX tile units (Intel Sapphire Rapids and later: ``amx_bf16``) for
group-quantized weights in 16-row tiles (source ``csrc/quant_amx.cpp``): the many-row product
(prefill chunks, large decode batches) of a :class:`.quant_linear.QuantLinearWeight`, without a
dequantized copy of the weight.

``gemm(x, w)``: x [M, K] bf16 (any M >= 1; the stored channel order is applied here) -> [M, N] bf16,
``~ x @ W.T + bias``:
    1. per pair of 16-row weight tiles (32 output channels), every 32-block of the two tiles is
       dequantized inside the K loop of the pair's first 32 rows, ``KLOOP_AHEAD`` blocks ahead of
       the block the tiles multiply (the vector units dequantize while the tile unit multiplies; the
       next pair's codes are prefetched into L2), into a per-thread buffer in the AMX "B" layout:
       ``fma(code, scale, min)`` in float32 (4-bit codes to float32 through a 16-entry ``VPERMPS``
       table), rounded once to bf16 (round to nearest even), the bf16 pairs of channels (2p, 2p + 1)
       side by side. 2 x K / 32 KiB a pair (36 KiB at K = 576); later row chunks reuse it, and the
       weight's codes (~0.6 bytes a weight at 4 bits) stream from memory once per call whatever M;
    2. every 32 activation rows (zero-padded to a multiple of 32) meet the pair in four 16 x 16
       float32 accumulator tiles, one ``TDPBF16PS`` per (row tile, weight tile, 32-block): 16 x 16 x 32
       multiply-adds an instruction;
    3. the accumulators are rounded once to bf16 (``VCVTNEPS2BF16``), a chunk's rows written while
       the next chunk's products run. With K <= 640 each pair sweeps the chunks of a 128-row block
       in turn (its tiles stay in L1; the activation tiles stream from L2).
``gemm_silu_mul(x, w)``: a fused gate/up weight's product written as SwiGLU's activation
``silu(g) * u`` [M, I] by step 3 (no [M, 2I] output, no second pass), bit-identical to :func:`gemm`
then ``silu_mul``; the ``llama`` MLP takes it through ``kernels.linear_silu``.
So the dequantization (about 9 vector instructions per 32 weights) runs beside the tile products;
below :data:`.gemm_paths.AMX_MIN_ROWS` rows the int8 GEMV/GEMM of :mod:`.quant_gemm` is used (the
dispatcher's threshold, measured).

Numerics: the product of bf16 activations with the bf16-rounded dequantized weight, summed in
float32 (tile order) -- the dequantized bf16 path (``W_stored`` rounded to bf16, ``F.linear``) up to
float32 summation order, and unlike :mod:`.quant_gemm` no int8 rounding of the activations.
:func:`reference` is that product in float32.

Availability: ``/proc/cpuinfo`` lists ``amx_tile`` and ``amx_bf16`` (plus the AVX-512 set of
:mod:`.quant_gemm`), the build (``-mamx-tile -mamx-bf16``) loaded, and Linux granted the process
the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, asked once at load).
:func:`available` is False otherwise and the dispatcher keeps the VNNI GEMM. Threads: the tile pairs
split over the persistent pool of ``csrc/thread_pool.h`` (``torch.get_num_threads()`` workers).
Source of the tile instructions: Intel Architecture Instruction Set Extensions Programming
Reference, ch. 3 (AMX).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import gemm_paths
from .cpu_build import load_cpp, read_source
from .device import cpu_flags
from .quant_gemm import CFLAGS as VNNI_CFLAGS, REQUIRED_FLAGS as VNNI_FLAGS, call_tiled, check_tiled
from .quant_gemm import supports as tiled_ok
from .quant_layout import gather_input

if TYPE_CHECKING:
    from .quant_linear import QuantLinearWeight

REQUIRED_FLAGS = VNNI_FLAGS + ("avx512dq", "amx_tile", "amx_bf16")  # avx512dq: the SwiGLU stage's VREDUCEPS
CFLAGS = VNNI_CFLAGS + ("-mavx512dq", "-mamx-tile", "-mamx-bf16")


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module with the process granted the AMX tile state, or None when the CPU lacks
    :data:`REQUIRED_FLAGS`, the build failed (one warning logged) or the kernel refused the tiles."""
    if not all(f in cpu_flags() for f in REQUIRED_FLAGS):
        return None
    mod = load_cpp("sglite_quant_amx", read_source("quant_amx.cpp"), CFLAGS,
                   functions=["quant_gemm_amx", "quant_gemm_amx_silu", "quant_amx_pack", "quant_amx_init"])
    if mod is None or not mod.quant_amx_init():
        return None
    return mod


def available() -> bool:
    """True when the AMX build loaded and the tile state is granted on this CPU."""
    return load() is not None


def supports(w: QuantLinearWeight) -> bool:
    """Whether :func:`gemm` takes ``w`` (the tiles of :mod:`.quant_gemm`, same rule)."""
    return tiled_ok(w)


def gemm(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    """``x @ W.T + bias`` on the AMX tiles (module docstring).

    Args:
        x: [M, K] bf16 (float32 is rounded to bf16 first), logical channel order.
        w: a tiled weight (:func:`supports`).
    Returns:
        [M, N] in x's dtype.
    Raises:
        RuntimeError: AMX is unavailable here or ``w`` is not tiled (names the field)."""
    mod = _loaded_for(w)
    if x.shape[0] == 0:
        return x.new_zeros((0, w.shape[0]))
    packed = packed_arg(w)
    return call_tiled(lambda *a: mod.quant_gemm_amx(*a, packed), gather_input(x, w).to(torch.bfloat16), x, w,
                      x.dtype == torch.bfloat16)


def gemm_silu_mul(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    """SwiGLU's activation straight from a fused gate/up weight on the AMX tiles: ``silu(g) * u`` for
    ``g, u = (x @ W.T).chunk(2, -1)``, written by the GEMM's output stage instead of a [M, 2I] product
    and a second pass (each up pair's 32 x 32 sums meet the gate pair's in a per-thread buffer).
    Bit-identical to :func:`gemm`'s bf16 output followed by :func:`.cpu_gemv.silu_mul` (its formula:
    bf16 g and u, silu rounded to bf16, then the product rounded); :func:`silu_reference` in torch.

    Args:
        x: [M, K] bf16, logical channel order.
        w: a tiled gate/up weight [2I, K] (:func:`supports`), gate rows first, no bias, I % 32 == 0.
    Returns:
        [M, I] bf16.
    Raises:
        RuntimeError: AMX is unavailable here or ``w`` is not tiled (names the field).
        ValueError: ``x`` is not bf16, ``w`` has a bias, or 2I is not a multiple of 64."""
    mod = _loaded_for(w)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"quant_amx.gemm_silu_mul: x must be bf16, got {x.dtype}")
    if w.bias is not None or w.shape[0] % 64:
        raise ValueError(f"quant_amx.gemm_silu_mul: the gate/up weight needs no bias and out_features % 64 == 0, "
                         f"got {w.shape[0]} (bias {w.bias is not None})")
    if x.shape[0] == 0:
        return x.new_zeros((0, w.shape[0] // 2))
    mins = torch.empty(0) if w.mins is None else w.mins
    return mod.quant_gemm_amx_silu(gather_input(x, w), w.qweight, w.scales, mins, w.bits, w.group_size, packed_arg(w))


def silu_reference(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    """Torch reference of :func:`gemm_silu_mul`: :func:`reference`'s sums rounded to bf16, split into
    g and u, then ``F.silu(g)`` rounded to bf16 times u, rounded to bf16; [M, I] bf16."""
    g, u = reference(x, w).bfloat16().float().chunk(2, dim=-1)
    return (F.silu(g).bfloat16().float() * u).bfloat16()


NO_PACKED = torch.empty(0, dtype=torch.int16)  # the C++ ops' "no repacked copy": dequantize per call


def packed_arg(w: QuantLinearWeight) -> torch.Tensor:
    """The ``packed`` argument of the C++ tile GEMMs (``quant_gemm_amx``, the fused decode's
    ``amx_packed``): ``w.amx_packed`` (:func:`pack`), or the empty int16 :data:`NO_PACKED`."""
    return NO_PACKED if w.amx_packed is None else w.amx_packed


def _loaded_for(w: QuantLinearWeight):
    """The compiled module; RuntimeError (naming the field) when AMX is unavailable or ``w`` is not tiled."""
    mod = load()
    check_tiled("quant_amx", mod is not None, "the AMX kernel is unavailable on this CPU (needs amx_tile + amx_bf16)", w)
    return mod


def pack(w: QuantLinearWeight) -> torch.Tensor:
    """``w`` dequantized once into :func:`gemm`'s B layout: int16 (bf16 bits) [P * 2 * K / 32 * 512]
    for P = ceil(N / 32) tile pairs (a lone last tile's partner zero), 64-byte aligned; the values
    :func:`gemm` would dequantize on every call, so its output is unchanged. Raises RuntimeError
    as :func:`gemm`."""
    return _loaded_for(w).quant_amx_pack(w.qweight, w.scales, torch.empty(0) if w.mins is None else w.mins, w.bits, w.group_size)


def repack(ws: list[QuantLinearWeight]) -> int:
    """Give each tiled weight of ``ws`` its :func:`pack` copy (``w.amx_packed``, 2 bytes a weight)
    when AMX is here and :func:`.gemm_paths.amx_repack` asks for it (``SGLITE_AMX_REPACK=1``, A/B
    runs only: the K loop on the codes is faster); returns how many got one."""
    ws = [w for w in ws if w.tiled and w.amx_packed is None and supports(w)]
    if not ws or not available() or not gemm_paths.amx_repack():
        return 0
    for w in ws:
        w.amx_packed = pack(w)
    return len(ws)


def reference(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    """Torch reference of :func:`gemm`: bf16 activations times ``W_stored`` rounded to bf16, in
    float32 (+ bias); [M, N] float32."""
    xs = gather_input(x, w).to(torch.bfloat16).float()
    wb = w.dequantize_stored(torch.float32).to(torch.bfloat16).float()
    y = F.linear(xs, wb)
    return y if w.bias is None else y + w.bias.float()
