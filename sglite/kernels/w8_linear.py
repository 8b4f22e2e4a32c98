"""8-bit matmul weights with one float32 scale per output channel, served by ``kernels.linear`` as
more implementations (registered in :data:`sglite.kernels.matmul.IMPLS`, the one registry):

:class:`Fp8LinearWeight` (``--quantization fp8``): weight-only FP8 E4M3 (``torch.float8_e4m3fn``,
    max 448), ``W[n, k] = scale[n] * w8[n, k]``; when quantized here (at load, or by ``sglite quantize
    --method rtn --format fp8``) ``scale[n]`` is the least-squares choice of :func:`fp8_channel_scales`
    within ``[max_k |W[n, k]| / 448, 2 * max / 448)`` (checkpoints bring their own scales).
    ``fp8``: ``F.linear(x, w8.to(x.dtype))`` times the scale in float32 -- the per-output-channel
    scale commutes with the sum, and E4M3 values (3 mantissa bits) convert exactly to bf16 / fp16 /
    fp32, so the only rounding besides oneDNN's is the final multiply. ``fp8_ref``: dequantize to float32, F.linear.
:class:`Fp8BlockLinearWeight` (``quant_method: fp8`` checkpoints with ``weight_block_size``
    [bn, bk], DeepSeek-V3 / SGLang block-wise FP8): E4M3 weight [N, K] and one scale per row and
    K tile of ``block_k`` channels (the [ceil(N/bn), ceil(K/bk)] tile scales expanded over each
    tile's rows at load, so fused QKV / gate-up rows concatenate whatever bn is).
    ``fp8_block``: per K tile ``F.linear(x[:, tile], w8[:, tile].to(x.dtype))`` in float32 times the
    tile's per-row scale, summed in float32; ``fp8_block_ref``: dequantize to float32, F.linear.
:class:`Int8LinearWeight` (``--quantization w8a8_int8``): W8A8 as in SmoothQuant (Xiao et al.
    2023; the smoothing itself is done offline by ``sglite quantize --method smoothquant``):
    weights symmetric per-channel int8 (``W = w_scale[n] * q[n, k]``), activations quantized per
    token at run time (``a_scale[m] = max_k |x[m, k]| / 127``, ``xq = round(x / a_scale)``),
    ``y = (xq @ q.T) * a_scale[m] * w_scale[n]`` with the product accumulated exactly in int32.
    ``w8a8``: ``torch._int_mm`` (int8 x int8 -> int32; oneDNN on CPU, VNNI where the CPU has it;
    cuBLASLt on CUDA) -- falls back to ``w8a8_ref`` where ``_int_mm`` refuses the shape;
    ``w8a8_ref``: the same integer products summed in float64 (exact: |sum| < 2**53).

Both carry the ``LinearWeight`` interface the model uses: ``shape``, ``bias``, ``use(impl)``,
``numel()``, ``nbytes()``, ``dequantize(dtype)``, ``to(device)`` and :meth:`concat` (fused QKV /
gate-up).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .linear_invariant import linear_invariant

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127


class _ChannelScaledWeight:
    """What the 8-bit weights share: ``weight`` [N, K] (fp8 / int8 codes), ``scale`` [N] float32
    (one per output channel, w = code * scale), ``bias`` [N] or None."""

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def numel(self) -> int:
        """Elements read per product (weight + bias)."""
        return self.weight.numel() + (0 if self.bias is None else self.bias.numel())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in ``dtype``: ``weight * scale[:, None]`` computed in float32."""
        return (self.weight.float() * self.scale[:, None]).to(dtype)


SCALE_SEARCH_STEPS = 16  # candidate per-channel FP8 scales per binade (fp8_channel_scales)


def fp8_channel_scales(w: torch.Tensor, steps: int = SCALE_SEARCH_STEPS) -> torch.Tensor:
    """float32 [N] per-output-channel scales for E4M3 codes of ``w`` [N, K] (float32).

    Among ``max_k |w[n, k]| / 448 * 2 ** (j / steps)`` for j = 0..steps-1 -- one binade upwards
    from the smallest scale that clips nothing, so no weight clips and every alignment of E4M3's
    grid (3 mantissa bits) to the row is tried -- each row takes the scale whose rounding error
    ``sum_k (w[n, k] - s * e4m3(w[n, k] / s))^2`` is least (the first on ties: j = 0, the plain
    ``max / 448``, unless another is strictly better). ``steps = 1`` is plain max scaling. An
    all-zero row gets 1. A least-squares scale search per channel, as llama.cpp's integer
    quantizers and GPTQ's ``mse`` grid option do for integer grids; here the float grid makes the
    scale's mantissa, not a clipping range, the thing searched. On the default model (weights
    dequantized from GGUF Q4_1, so few distinct values per block) it cuts the weights' relative
    error from ~2.6 % to ~2.4 % and the perplexity increase of ``--quantization fp8`` from +2.09 %
    to +0.83 % (docs/benchmarks.md, "FP8 at load").

    Args:
        w: float weight [N, K] (any float dtype; computed in float32).
        steps: candidate scales per binade (>= 1).
    Returns:
        float32 [N] scales, each in ``[max_n / 448, 2 * max_n / 448)``.

    Raises:
        ValueError: ``steps`` < 1."""
    if steps < 1:
        raise ValueError(f"fp8 scale search: steps must be >= 1, got {steps}")
    w = w.float()
    amax = w.abs().amax(1)
    base = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if steps == 1:
        return base.contiguous()
    def err(wc: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # [rows] squared rounding error
        v = wc / s[:, None]  # as the codes are made; |v| <= 448: nothing clips
        return v.to(torch.float8_e4m3fn).float().sub_(v).square_().sum(1).mul_(s * s)

    best = base.clone()
    rows = max(1, (1 << 18) // max(1, w.shape[1]))  # row chunks of ~1 MB: every candidate while in cache
    for r0 in range(0, w.shape[0], rows):
        wc, bc = w[r0:r0 + rows], best[r0:r0 + rows]  # bc: a view, updated in place
        best_err = err(wc, bc)
        for j in range(1, steps):
            s = base[r0:r0 + rows] * 2.0 ** (j / steps)
            e = err(wc, s)
            better = e < best_err
            bc.copy_(torch.where(better, s, bc))
            best_err = torch.where(better, e, best_err)
    return best


@dataclass(eq=False)
class Fp8LinearWeight(_ChannelScaledWeight):
    """FP8 E4M3 weight [N, K] + float32 per-output-channel scale [N] (module docstring)."""

    weight: torch.Tensor
    scale: torch.Tensor
    bias: Optional[torch.Tensor] = None
    impl: str = "fp8"

    @classmethod
    def quantize(cls, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 search_steps: int = SCALE_SEARCH_STEPS) -> "Fp8LinearWeight":
        """From a float weight [N, K]: per-channel scales of :func:`fp8_channel_scales` (``search_steps``
        1: plain ``max|w_n| / 448``), codes ``e4m3(w / scale)``."""
        wf = w.float()
        scale = fp8_channel_scales(wf, search_steps)
        w8 = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return cls(w8.contiguous(), scale.contiguous(), bias)

    def use(self, impl: str) -> "Fp8LinearWeight":
        """``invariant`` -> ``fp8_invariant`` (the float batch-invariant matmul on the E4M3 values
        converted to x's dtype, then the scale); other float names -> ``fp8``; ``fp8_ref`` kept."""
        self.impl = {"invariant": "fp8_invariant"}.get(impl, impl if impl in ("fp8", "fp8_ref") else "fp8")
        return self

    def nbytes(self) -> int:
        ts = (self.weight, self.scale, self.bias)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def to(self, device) -> "Fp8LinearWeight":
        return replace(self, weight=self.weight.to(device), scale=self.scale.to(device),
                       bias=None if self.bias is None else self.bias.to(device))

    @staticmethod
    def concat(ws: Sequence["Fp8LinearWeight"]) -> "Fp8LinearWeight":
        """Rows of every weight stacked (N concatenated); biases are set by the caller."""
        return Fp8LinearWeight(torch.cat([w.weight for w in ws]), torch.cat([w.scale for w in ws]))


@dataclass(eq=False)
class Int8LinearWeight(_ChannelScaledWeight):
    """int8 weight [N, K] + float32 per-output-channel scale [N] (W8A8; module docstring).
    ``weight_t`` is the [K, N] contiguous int8 tensor ``torch._int_mm`` reads (made at
    construction); ``weight`` becomes its transposed view, so one copy is resident."""

    weight: torch.Tensor
    scale: torch.Tensor
    bias: Optional[torch.Tensor] = None
    impl: str = "w8a8"
    weight_t: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.weight.dtype != torch.int8 or self.weight.dim() != 2:
            raise ValueError(f"w8a8: weight must be int8 [N, K], got {self.weight.dtype} {tuple(self.weight.shape)}")
        if tuple(self.scale.shape) != (self.weight.shape[0],):
            raise ValueError(f"w8a8: weight_scale must have {self.weight.shape[0]} entries, got {tuple(self.scale.shape)}")
        self.scale = self.scale.float().contiguous()
        if self.weight_t is None:
            self.weight_t = self.weight.t().contiguous()
        self.weight = self.weight_t.t()  # a view: one int8 copy resident

    @classmethod
    def quantize(cls, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "Int8LinearWeight":
        """From a float weight [N, K]: symmetric per-channel, ``scale = max|w_n| / 127``."""
        wf = w.float()
        s = (wf.abs().amax(1) / INT8_MAX).clamp(min=1e-10)
        q = torch.clamp(torch.round(wf / s[:, None]), -INT8_MAX, INT8_MAX).to(torch.int8)
        return cls(q, s, bias)

    def use(self, impl: str) -> "Int8LinearWeight":
        """Float impl names map to ``w8a8`` (``invariant`` too: integer sums are exact and every
        other step is per row, so a row's result never depends on the batch); ``w8a8_ref`` kept."""
        self.impl = impl if impl in ("w8a8", "w8a8_ref") else "w8a8"
        return self

    def nbytes(self) -> int:
        """Resident bytes (``weight`` is a view of ``weight_t``: counted once)."""
        ts = (self.weight_t, self.scale, self.bias)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def to(self, device) -> "Int8LinearWeight":
        return Int8LinearWeight(self.weight.to(device), self.scale.to(device),
                                None if self.bias is None else self.bias.to(device), self.impl)

    @staticmethod
    def concat(ws: Sequence["Int8LinearWeight"]) -> "Int8LinearWeight":
        return Int8LinearWeight(torch.cat([w.weight for w in ws]), torch.cat([w.scale for w in ws]),
                                weight_t=torch.cat([w.weight_t for w in ws], dim=1).contiguous())


@dataclass(eq=False)
class Fp8BlockLinearWeight:
    """FP8 E4M3 weight [N, K] with block-wise scales (module docstring).

    Attributes:
        weight: float8_e4m3fn [N, K].  scale: float32 [N, ceil(K / block_k)] (row n, K tile t).
        block_k: input channels per tile.  bias: [N] or None.  impl: ``fp8_block`` | ``fp8_block_ref``.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    block_k: int
    bias: Optional[torch.Tensor] = None
    impl: str = "fp8_block"

    def __post_init__(self):
        n, k = self.weight.shape
        if self.weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8: weight must be float8_e4m3fn, got {self.weight.dtype}")
        if self.block_k < 1 or tuple(self.scale.shape) != (n, -(-k // self.block_k)):
            raise ValueError(f"fp8: block scales must be [{n}, ceil({k} / block_k={self.block_k})], "
                             f"got {tuple(self.scale.shape)}")
        self.scale = self.scale.float().contiguous()

    @classmethod
    def from_tiles(cls, weight: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int],
                   bias: Optional[torch.Tensor] = None) -> "Fp8BlockLinearWeight":
        """From a checkpoint's tile scales ``weight_scale_inv`` [ceil(N/bn), ceil(K/bk)] and
        ``weight_block_size`` ``(bn, bk)``: W[n, k] = weight[n, k] * scale_inv[n // bn, k // bk].

        Raises:
            ValueError: the tile grid disagrees with the weight's shape."""
        bn, bk = int(block[0]), int(block[1])
        n, k = weight.shape
        want = (-(-n // bn), -(-k // bk))
        if tuple(scale_inv.shape) != want:
            raise ValueError(f"fp8: weight_scale_inv {tuple(scale_inv.shape)} disagrees with weight "
                             f"{(n, k)} and weight_block_size {[bn, bk]} (expected {want})")
        return cls(weight, scale_inv.float().repeat_interleave(bn, 0)[:n], bk, bias)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def numel(self) -> int:
        return self.weight.numel() + (0 if self.bias is None else self.bias.numel())

    def nbytes(self) -> int:
        ts = (self.weight, self.scale, self.bias)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in ``dtype``: ``weight * scale`` (expanded over each tile) in float32."""
        k = self.weight.shape[1]
        full = self.scale.repeat_interleave(self.block_k, 1)[:, :k]
        return (self.weight.float() * full).to(dtype)

    def use(self, impl: str) -> "Fp8BlockLinearWeight":
        """``invariant`` -> ``fp8_block_invariant`` (the float batch-invariant matmul per tile);
        ``fp8_block_ref`` kept; other names -> ``fp8_block``."""
        self.impl = {"invariant": "fp8_block_invariant"}.get(
            impl, impl if impl in ("fp8_block", "fp8_block_ref", "fp8_block_invariant") else "fp8_block")
        return self

    def to(self, device) -> "Fp8BlockLinearWeight":
        return replace(self, weight=self.weight.to(device), scale=self.scale.to(device),
                       bias=None if self.bias is None else self.bias.to(device))

    @staticmethod
    def concat(ws: Sequence["Fp8BlockLinearWeight"]) -> "Fp8BlockLinearWeight":
        """Rows stacked (same K and block_k); biases are set by the caller.

        Raises:
            ValueError: block_k differs."""
        if len({w.block_k for w in ws}) != 1:
            raise ValueError(f"fp8: cannot fuse weights with block_k {[w.block_k for w in ws]}")
        return Fp8BlockLinearWeight(torch.cat([w.weight for w in ws]), torch.cat([w.scale for w in ws]), ws[0].block_k)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8: ``(xq int8 [M, K], a_scale float32 [M])``, ``x ~= xq * a_scale``."""
    xf = x.float()
    s = (xf.abs().amax(1) / INT8_MAX).clamp(min=1e-10)
    return torch.clamp(torch.round(xf / s[:, None]), -INT8_MAX, INT8_MAX).to(torch.int8), s


def _finish(y: torch.Tensor, x: torch.Tensor, bias) -> torch.Tensor:
    y = y.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)


def fp8_linear(x: torch.Tensor, w: Fp8LinearWeight) -> torch.Tensor:
    """x [M, K] -> [M, N]: ``F.linear(x, w8.to(x.dtype))`` times the float32 scale, then x's dtype
    (+ bias)."""
    return _finish(F.linear(x, w.weight.to(x.dtype)).float() * w.scale, x, w.bias)


def fp8_invariant(x: torch.Tensor, w: Fp8LinearWeight) -> torch.Tensor:
    """Batch-invariant ``fp8``: :func:`.linear_invariant.linear_invariant` (the float ``invariant``
    product) on the converted weight, then the per-channel scale (row-local)."""
    return _finish(linear_invariant(x, w.weight.to(x.dtype)).float() * w.scale, x, w.bias)


def fp8_reference(x: torch.Tensor, w: Fp8LinearWeight) -> torch.Tensor:
    """The spec: float32 ``F.linear(x, dequantize())``, rounded to x's dtype, + bias."""
    return _finish(F.linear(x.float(), w.dequantize(torch.float32)), x, w.bias)


def w8a8_reference(x: torch.Tensor, w: Int8LinearWeight) -> torch.Tensor:
    """The spec of W8A8: per-token int8 x, exact integer dot products (float64), both scales."""
    xq, s = quantize_per_token(x)
    acc = xq.double() @ w.weight.double().T
    return _finish((acc * s.double()[:, None] * w.scale.double()[None, :]).float(), x, w.bias)


def w8a8_linear(x: torch.Tensor, w: Int8LinearWeight) -> torch.Tensor:
    """W8A8 through ``torch._int_mm`` (int32 accumulation); ``w8a8_reference`` when it refuses."""
    if x.shape[0] == 0:
        return w8a8_reference(x, w)
    xq, s = quantize_per_token(x)
    try:
        acc = torch._int_mm(xq, w.weight_t)  # [M, N] int32
    except RuntimeError:  # e.g. CUDA's M > 16 / multiple-of-8 shape rules
        return w8a8_reference(x, w)
    return _finish(acc.float() * s[:, None] * w.scale[None, :], x, w.bias)


def fp8_block_linear(x: torch.Tensor, w: Fp8BlockLinearWeight, invariant: bool = False) -> torch.Tensor:
    """x [M, K] -> [M, N]: sum over K tiles of ``F.linear(x_t, w8_t.to(x.dtype))`` (float32) times
    the tile's per-row scale; then x's dtype (+ bias). ``invariant``: each tile's product through
    :func:`.linear_invariant.linear_invariant` (batch-invariant)."""
    bk, k = w.block_k, w.weight.shape[1]
    y = None
    for t in range(w.scale.shape[1]):
        xt, wt = x[:, t * bk:min(k, (t + 1) * bk)], w.weight[:, t * bk:min(k, (t + 1) * bk)].to(x.dtype)
        part = linear_invariant(xt.contiguous(), wt.contiguous()) if invariant else F.linear(xt, wt)
        part = part.float() * w.scale[:, t]
        y = part if y is None else y + part
    return _finish(y, x, w.bias)


def fp8_block_invariant(x: torch.Tensor, w: Fp8BlockLinearWeight) -> torch.Tensor:
    """Batch-invariant :func:`fp8_block_linear` (``invariant=True``)."""
    return fp8_block_linear(x, w, invariant=True)


def fp8_block_reference(x: torch.Tensor, w: Fp8BlockLinearWeight) -> torch.Tensor:
    """The spec: float32 ``F.linear(x, dequantize())``, rounded to x's dtype, + bias."""
    return _finish(F.linear(x.float(), w.dequantize(torch.float32)), x, w.bias)

