"""FP8 (E4M3) weight quantizers for ``sglite quantize --format fp8``: round-to-nearest and
GPTQ's error-compensated column loop with the E4M3 grid as the quantizer, per-output-channel or
block-wise (``weight_block_size``) scales.

The grid: ``torch.float8_e4m3fn`` (OCP 8-bit floating point spec, "E4M3": 4 exponent bits, 3
mantissa bits, max 448, no infinities). A weight row ``n`` is stored as ``w8[n, k]`` with
``W[n, k] ~= scale[n] * w8[n, k]``, ``scale[n] = max_k |W[n, k]| / 448`` (per channel), or with one
scale per ``[bn, bk]`` tile (block-wise, DeepSeek-V3's fp8 checkpoints: ``weight_scale_inv``
[ceil(N / bn), ceil(K / bk)], SGLang / vLLM ``quantization_config.weight_block_size``; tiles at
the edges are partial).

Round to nearest on a floating-point grid has a relative error of up to ``2**-4`` for every
weight, wherever it lies in its channel's range, so the per-channel RTN error is about 2.5 % of the
weights' norm however the scales are chosen (finer scale blocks only help the subnormal tail). The
per-channel RTN of :func:`rtn_fp8` still searches each row's scale mantissa for the least squared
error (:func:`sglite.kernels.w8_linear.fp8_channel_scales`, ~8 % less error on the default model's
discrete GGUF-derived weights; :func:`gptq_fp8` keeps ``max / 448``). What can be reduced is the error's effect on the layer's OUTPUT: :func:`gptq_fp8` runs GPTQ
(Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", Algorithm 1 and §4; :mod:`.gptq`) with ``q(w) = scale * e4m3(w / scale)`` as the
quantizer: each column's rounding error is compensated on the not-yet-quantized columns through
the inverse Hessian of the calibration inputs, minimizing ``||W X - Q X||^2`` instead of
``||W - Q||^2``. This is what llm-compressor's ``GPTQModifier`` does for its FP8 schemes
(per-channel scales fixed from the original weights before the column loop).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from sglite.kernels.w8_linear import fp8_channel_scales

from .gptq import obs_columns, prepare

FP8_MAX = 448.0


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest E4M3 value (saturating at +-448), as float32."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def channel_scales(w: torch.Tensor) -> torch.Tensor:
    """float32 [N]: ``max_k |w[n, k]| / 448`` (1 for an all-zero row); ``w`` [N, K]. The plain
    scales (GPTQ-FP8's); :func:`rtn_fp8` searches them (``fp8_channel_scales`` with its default)."""
    return fp8_channel_scales(w, steps=1)


def block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [ceil(N / bn), ceil(K / bk)]: each tile's ``max |w| / 448`` (1 for an all-zero tile).

    Raises:
        ValueError: a block dimension < 1."""
    bn, bk = block
    if bn < 1 or bk < 1:
        raise ValueError(f"weight_block_size: both entries must be >= 1, got {list(block)}")
    n, k = w.shape
    pad = torch.zeros(math.ceil(n / bn) * bn, math.ceil(k / bk) * bk)
    pad[:n, :k] = w.float().abs()
    amax = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).amax(dim=(1, 3))
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def expand_block_scales(s: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Tile scales [ceil(N / bn), ceil(K / bk)] -> per-weight float32 [N, K]."""
    n, k = shape
    bn, bk = block
    return s.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]


def rtn_fp8(w: torch.Tensor, block: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest FP8 of ``w`` [N, K].

    Returns:
        ``(w8 float8_e4m3fn [N, K], scale)``: scale float32 [N] (``block`` None: the searched
        per-channel scales of :func:`sglite.kernels.w8_linear.fp8_channel_scales`, as
        ``--quantization fp8`` at load) or the tile scales of :func:`block_scales`."""
    s = fp8_channel_scales(w) if block is None else block_scales(w, block)
    full = s[:, None] if block is None else expand_block_scales(s, tuple(w.shape), block)
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def gptq_fp8(w: torch.Tensor, h: torch.Tensor, act_order: bool = False, damp_percent: float = 0.01,
             block_size: int = 128, block: Optional[tuple[int, int]] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ with the E4M3 grid (module docstring) for ``w`` [N, K], Hessian ``h`` [K, K].

    The scales are fixed from the ORIGINAL weights (per channel, or per tile with ``block``); a
    compensated weight that leaves the scaled range saturates at +-448.

    Args:
        act_order: columns by decreasing ``diag(h)`` (only with per-channel scales: a tile's columns
            must be contiguous in processing order).
        damp_percent: dampening as a fraction of ``mean(diag h)``.  block_size: lazy-batch width.
    Returns:
        ``(w8 float8_e4m3fn [N, K] in logical channel order, scale)`` as :func:`rtn_fp8`.
    Raises:
        ValueError: ``h`` not [K, K]; act_order with block scales; a non-positive-definite Hessian.
    """
    if act_order and block is not None:
        raise ValueError("gptq fp8: act_order needs per-channel scales (weight_block_size tiles are "
                         "contiguous in the input channels)")
    s = channel_scales(w) if block is None else block_scales(w, block)
    full = s[:, None].expand_as(w) if block is None else expand_block_scales(s, tuple(w.shape), block)
    W, Hinv, perm = prepare(w, h, act_order, damp_percent)
    full = full[:, perm].contiguous()
    w8 = torch.zeros(W.shape, dtype=torch.float8_e4m3fn)

    def quant_col(col: int, W1: torch.Tensor, i: int) -> torch.Tensor:
        sc = full[:, col]
        q = (W1[:, i] / sc).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        w8[:, col] = q
        return q.float() * sc

    obs_columns(W, Hinv, quant_col, block_size)
    return w8[:, torch.argsort(perm)].contiguous(), s
