"""Round-to-nearest (RTN) group quantization: the grid every integer scheme here shares.

For a slice of weights ``w`` [N, M] (one group per row), ``bits`` b, ``maxq = 2**b - 1``:
    asymmetric: ``lo = min(w, 0)``, ``hi = max(w, 0)`` per row, ``scale = (hi - lo) / maxq``,
                ``zero = round(-lo / scale)`` (clamped to ``[min_zero, maxq]``);
    symmetric:  ``hi = max(|w|)``, ``scale = 2 hi / maxq``, ``zero = (maxq + 1) / 2``;
    ``code = clamp(round(w / scale) + zero, 0, maxq)``, ``w ~= scale * (code - zero)``.
Scales are rounded to float16 before the codes are computed (the checkpoint stores float16
scales, so the codes are optimal for the stored scale). A row of zeros gets scale 1.
This is the quantizer of GPTQ's reference code (Frantar et al. 2022) and AutoGPTQ.
"""
from __future__ import annotations

import torch

from .hf_formats import GroupQuant


def group_params(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale [N] float32, zero [N] float32)`` for rows of ``w`` [N, M] (module docstring)."""
    maxq = (1 << bits) - 1
    w = w.float()
    lo = torch.clamp(w.min(dim=1).values, max=0)
    hi = torch.clamp(w.max(dim=1).values, min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    empty = (hi - lo) == 0
    scale = torch.where(empty, torch.ones_like(hi), (hi - lo) / maxq)
    scale = scale.to(torch.float16).float().clamp(min=6.2e-5)  # float16-representable, normal, > 0
    if sym:
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        zero = torch.clamp(torch.round(-lo / scale), min_zero, maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (float32 integers in [0, 2**bits)) of ``w`` [N, M] with per-row ``scale``/``zero`` [N]."""
    maxq = (1 << bits) - 1
    return torch.clamp(torch.round(w.float() / scale[:, None]) + zero[:, None], 0, maxq)


def fake_quant(w: torch.Tensor, bits: int, group_size: int, sym: bool = False) -> torch.Tensor:
    """``w`` [N, K] quantized and dequantized group by group (float32); ``group_size`` -1 = K."""
    return rtn(w, bits, group_size, sym).dequantize()


def rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool = False, min_zero: int = 0) -> GroupQuant:
    """Round-to-nearest quantization of ``w`` [N, K] in contiguous groups of ``group_size`` input
    channels (-1 = one group).

    Raises:
        ValueError: ``group_size`` does not divide K (names ``group_size``)."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    if gs <= 0 or k % gs:
        raise ValueError(f"group_size: {group_size} does not divide in_features={k}")
    wg = w.float().reshape(n * (k // gs), gs)
    scale, zero = group_params(wg, bits, sym, min_zero)
    codes = quantize_codes(wg, scale, zero, bits)
    g = k // gs
    return GroupQuant(codes.reshape(n, k).to(torch.uint8), zero.reshape(n, g).to(torch.int32),
                      scale.reshape(n, g), torch.arange(k, dtype=torch.int32) // gs, bits, gs)
