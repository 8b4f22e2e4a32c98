"""Int8 GEMM on AVX-512 VNNI for group-quantized weights (source ``csrc/quant_gemm.cpp``): the
many-row product (prefill chunks, decode batches past :data:`.quant_cpu.GEMV_MAX_ROWS`) of a
:class:`.quant_linear.QuantLinearWeight` in 16-row tiles, without dequantizing the weight.

``gemm(x, w)``: x [M, K] bf16 | float32 (any M >= 1; stored channel order is applied here) ->
[M, N] in x's dtype, ``~ x @ W.T + bias``:
    1. activations quantized per row and 32-channel block as GGUF's Q8 blocks (llama.cpp quantizes
       a row the same way before its integer dots): ``d = max|x| / 127``, ``xq = round(x / d)`` in
       [-127, 127], ``sx = d * sum(xq)`` -- bit for bit :func:`quantize_act_q8_reference`;
    2. per pair of weight tiles (32 output channels) and 32-block, ``VPDPBUSD`` (unsigned codes x
       signed int8 activations, int32 sums: exact) in a 4-row x 2-tile register block: each
       broadcast of 4 activation bytes feeds both tiles, each code vector all 4 rows (4-bit codes:
       high nibbles shifted down once per vector); every activation row passes a tile pair while it
       sits in L1/L2, so the codes stream from memory once per call whatever M;
    3. per block ``y += float(idot) * (s * d) + m * sx`` in float32 (scales/mins float32 or
       float16), rounded once to bf16 (``VCVTNEPS2BF16``) for bf16 x. Group 16 (8-bit codes, GGUF
       Q6_K): two int32 dots per block (channels 0..15, 16..31), each with its group's scale, and
       ``sx`` per 16-group.
Threads split the tile pairs (``at::parallel_for``; honours ``torch.set_num_threads``). The layout
is :func:`.quant_layout.tile_rows` (``csrc/quant_tiles.h``, the fused decode's: the weight is
repacked into it once, at load, and the decode GEMV and this GEMM read the same bytes).

Numerics: not bf16-exact. The only approximation is step 1; per block the activation error is at
most ``d / 2 = max|x_block| / 254`` per element, so ``|y - y_ref| <= sum_b (max|x_b| / 254) *
sum_{k in b} |W[n, k]|`` against the float32 product of the dequantized weight (the tests check
that bound against :func:`reference` -- the int8 product in float32 -- to summation-order
tolerance, and against :func:`.quant_linear.reference_linear` to the bound).

End to end (default GGUF, bf16, ``sglite bench quant --parts agreement --agreement-dtype bfloat16
--num-threads 1``, greedy vs the dequantized bf16 model): batches of 16 prompts, whose decode
already ran int8 activations in the fused decode, 55.5 % of positions equal before this GEMM and
56.2 % with it; 48 prompts (decode batches past 32 rows, formerly dequantized float) 95.9 % before,
60.3 % with it -- every bf16 batch size now has the int8-activation numerics of the fused decode
(as llama.cpp's Q4/Q8 dots). float32 models never take this path (their weights stay in the row
layout), and ``SGLITE_GEMM=torch`` restores the dequantize path.

Availability: built with ``-mavx512vnni`` when ``/proc/cpuinfo`` lists ``avx512_vnni`` and the
AVX-512-BF16 set (:data:`.quant_cpu.AVX_FLAGS`); :func:`available` is False otherwise (the
dispatcher then keeps the dequantize + ``F.linear`` path). On AMX CPUs the dispatcher gives bf16
products of :data:`.gemm_paths.AMX_MIN_ROWS` rows or more to :mod:`.quant_amx` instead (AMX-BF16
tiles over the same weight tiles); an AMX-INT8 microkernel is not built (per-32-block scales need a rescale of every 16x16 int32 tile
per block, which costs more than the bf16 tiles' dequantization from 48 rows up).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .cpu_build import load_cpp, read_source
from .device import cpu_flags
from .quant_layout import BLOCK, TILE, gather_input, tileable_group

if TYPE_CHECKING:
    from .quant_linear import QuantLinearWeight

REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "f16c")
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-mf16c",
          "-ffp-contract=off")


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module, or None when the CPU lacks :data:`REQUIRED_FLAGS` or the build failed
    (one warning logged)."""
    if not all(f in cpu_flags() for f in REQUIRED_FLAGS):
        return None
    return load_cpp("sglite_quant_gemm", read_source("quant_gemm.cpp"), CFLAGS,
                    functions=["quant_gemm_q8", "quant_gemm_vnni"])


def available() -> bool:
    """True when the VNNI build loaded on this CPU."""
    m = load()
    return m is not None and bool(m.quant_gemm_vnni())


def supports(w: QuantLinearWeight) -> bool:
    """Whether :func:`gemm` takes ``w``: CPU, 16-row tiles (``w.tiled``: N % 16 == 0, group size 32,
    or 16 with 8-bit codes -- GGUF Q6_K, two scales per 32-block)."""
    return w.tiled and tileable_group(w.group_size, w.bits) and w.shape[0] % TILE == 0 and w.device.type == "cpu"


def gemm(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    """``x @ W.T + bias`` with x quantized to int8 per 32-block (module docstring).

    Args:
        x: [M, K] bf16 or float32 (other float dtypes run as float32), logical channel order.
        w: a tiled weight (:func:`supports`).
    Returns:
        [M, N] in x's dtype.
    Raises:
        RuntimeError: the kernel is unavailable or ``w`` is not tiled (names the field)."""
    mod = load()
    check_tiled("quant_gemm", mod is not None, "the VNNI kernel is unavailable on this CPU (see the logged warning)", w)
    if x.shape[0] == 0:
        return x.new_zeros((0, w.shape[0]))
    xs = gather_input(x, w)
    if xs.dtype not in (torch.bfloat16, torch.float32):
        xs = xs.float()
    return call_tiled(mod.quant_gemm_q8, xs, x, w, xs.dtype == torch.bfloat16)


def check_tiled(name: str, loaded: bool, why: str, w: "QuantLinearWeight") -> None:
    """Raise RuntimeError (prefixed ``name``) when the kernel did not load (``why``) or ``w`` is not
    a tiled weight this module's GEMMs take (:func:`supports`), naming the fields."""
    if not loaded:
        raise RuntimeError(f"{name}: {why}")
    if not supports(w):
        raise RuntimeError(f"{name}: weight must be CPU, tiled, group_size 32 (16 at 8 bits), N % 16 == 0; got tiled={w.tiled} "
                           f"group_size={w.group_size} N={w.shape[0]} device={w.device}")


def call_tiled(op, xs: torch.Tensor, x: torch.Tensor, w: "QuantLinearWeight", out_bf16: bool) -> torch.Tensor:
    """``op(xs, codes, scales, mins, bits, group_size, out_bf16)`` of a tiled-weight GEMM op (the
    VNNI or the AMX one) on the gathered rows ``xs``, returned in x's dtype with the bias added."""
    mins = torch.empty(0) if w.mins is None else w.mins
    y = op(xs, w.qweight, w.scales, mins, w.bits, w.group_size, out_bf16)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if w.bias is None else y + w.bias.to(x.dtype)


def quantize_act_q8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of the int8 activation quantization (what :func:`gemv_q8` applies to x):
    per row and 32-block of x [M, K] float32, ``d = max|x| / 127``, ``xq = round(x * (1 / d))``
    (round half to even; 0 where d is 0) clamped to [-127, 127], ``sx = d * sum(xq)``, all float32
    (GGUF's Q8_1 activation blocks, as llama.cpp quantizes a row before its integer dots).

    Returns (xq int8 [M, K], d float32 [M, K/32], sx float32 [M, K/32])."""
    m, k = x.shape
    b = x.float().reshape(m, k // 32, 32)
    d = b.abs().amax(dim=-1) / 127.0  # [M, K/32]
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    xq = torch.round(b * inv[..., None]).clamp(-127, 127)
    return xq.to(torch.int8).reshape(m, k), d, d * xq.sum(dim=-1)


def gemv_q8_reference(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    """Torch reference of :func:`.quant_cpu.gemv_q8` (and of this GEMM): ``F.linear`` in float32 of the dequantized int8
    activations (``d * xq`` per block) and ``W_stored``; [M, N] float32."""
    xq, d, _ = quantize_act_q8_reference(x)
    xd = (xq.float().reshape(x.shape[0], -1, 32) * d[..., None]).reshape(x.shape)
    return F.linear(xd, w.dequantize_stored(torch.float32))


def reference(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    """Torch reference of :func:`gemm`: the int8-quantized activations (``d * xq`` per block,
    :func:`quantize_act_q8_reference`) times ``W_stored`` in float32 (+ bias), [M, N]
    float32."""
    y = gemv_q8_reference(gather_input(x, w).float(), w)
    return y if w.bias is None else y + w.bias.float()


def error_bound(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    """[M, N] float32: the worst-case ``|gemm - exact product|`` from the activation rounding alone,
    ``sum_b (max|x_b| / 254) * sum_{k in b} |W_stored[n, k]|`` (module docstring)."""
    xs = gather_input(x, w).float()
    m, k = xs.shape
    half_step = xs.reshape(m, k // BLOCK, BLOCK).abs().amax(-1) / 254.0  # [M, K/32]
    wabs = w.dequantize_stored(torch.float32).abs().reshape(w.shape[0], k // BLOCK, BLOCK).sum(-1)  # [N, K/32]
    return F.linear(half_step, wabs)
