"""Group-quantized integer weights (:class:`QuantLinearWeight`): one in-memory representation for
GGUF ``Q4_0`` / ``Q4_1`` / ``Q8_0`` blocks and GPTQ / AWQ checkpoints, served by ``kernels.linear``
as more implementations of :data:`sglite.kernels.matmul.IMPLS` (``quant_ref``, ``quant_cpp``,
``quant_invariant``, ``quant_triton``).

The representation (every format maps onto it at load; nothing format-specific survives)
-----------------------------------------------------------------------------------------
A weight ``W`` [N, K] (out x in features) is stored as unsigned integer codes ``q`` in
``[0, 2**bits)`` with, per row ``n`` and per group ``g`` of ``group_size`` consecutive (stored)
input channels, a float32 scale ``s[n, g]`` and an optional float32 additive offset ``m[n, g]``::

    W_stored[n, k] = s[n, k // group_size] * q[n, k] + m[n, k // group_size]      (m = 0 if None)

computed in float32 (the product first, rounded, then the sum: :meth:`QuantLinearWeight.dequantize`
is the spec). With an input permutation ``perm`` (act-order), stored column ``j`` holds logical
input channel ``perm[j]``: ``W[:, perm] = W_stored``, so ``y = x @ W.T = x[:, perm] @ W_stored.T``
(the kernels gather x's columns; the weight is permuted once, at load).

Fields:
    qweight: uint8, CPU or CUDA, contiguous.
        ``bits == 8``: [N, K], one code per byte.
        ``bits == 4``: [N, K // 2], packed per block of 32 stored channels in GGUF's Q4 order
        (:mod:`.quant_layout`).
    scales: float32 [N, K // group_size] (float16 after :func:`compact_scales`, see below).
    mins: float32 [N, K // group_size] or None (symmetric formats may still use it, see below).
    bits: 4 or 8.  group_size: a multiple of 32 dividing K (so K % 32 == 0), or 16 with 8-bit
    codes (GGUF Q6_K's sub-blocks; K % 32 == 0 still: the kernels read two scales per 32-block).
    perm: int64 [K] (a permutation of range(K)) or None.   bias: [N] (activation dtype) or None.
    tiled: bool, the 16-row tile layout (:mod:`.quant_layout`); False until :func:`tile_rows`.

How the formats map (all exact in float32, because a float16 scale times an integer of <= 8 bits
has <= 19 significant bits):
    GGUF Q4_0 (32-blocks ``{half d; u8 qs[16]}``, w = d * (q - 8)):   bits 4, gs 32, s = d, m = -8 d.
    GGUF Q4_1 (``{half d, m; u8 qs[16]}``, w = d * q + m):             bits 4, gs 32, s = d, m = m.
    GGUF Q8_0 (``{half d; i8 qs[32]}``, w = d * q, q signed):          bits 8, gs 32, codes q + 128,
                                                                        s = d, m = -128 d.
    GGUF Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K: :mod:`sglite.runtime.gguf_blocks` (5-bit codes as bits 8;
    Q6_K bits 8, gs 16).
    GPTQ / AWQ (w = s * (q - z) per group of 32/64/128, 4 or 8 bits; z the unpacked zero point, +1
    for GPTQ's stored zeros as its kernels do): s = scales, m = -(s * z) (float32), codes as they are;
    act-order ``g_idx``: ``perm = argsort(g_idx, stable)`` so each group's channels are contiguous,
    codes and columns taken in ``perm`` order. (AWQ's interleaved nibble order is undone at load.)

Layout transforms (the 4-bit packing, float16 scales, 16-row tiles) live in :mod:`.quant_layout`
(:func:`compact_scales`, :func:`tile_rows`, re-exported here); :meth:`QuantLinearWeight.untiled`
gives the row layout back (a copy): every consumer that does not read tiles (the float GEMV, the
dequantizer, Triton, the reference) goes through it.

Build one with :meth:`QuantLinearWeight.from_codes` (unpacked codes [N, K] uint8 in stored order),
concatenate along N with :func:`cat_rows` (fused QKV / gate-up), reorder rows with
:meth:`QuantLinearWeight.permute_rows`.

Implementations (``QuantLinearWeight.impl``, registered in :data:`sglite.kernels.matmul.IMPLS`;
:meth:`QuantLinearWeight.use` maps the float names the model runner picks -- ``torch`` / ``fp16`` / ``cpp`` -> the best available quantized path,
``invariant`` -> ``quant_invariant``):
    ``quant_ref``        :func:`reference_linear`: dequantize to float32, ``F.linear`` in float32,
                         round to x's dtype (the spec; also the fallback everywhere).
    ``quant_cpp``        CPU: 1..8 rows through the C++ GEMV on the codes
                         (:mod:`.quant_cpu`), more rows dequantize (C++) then ``F.linear``.
    ``quant_invariant``  CPU: the GEMV's per-row arithmetic for every row count (batch-invariant).
    ``quant_triton``     CUDA: the Triton kernel (:mod:`.triton_quant`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .device import triton_available
from .quant_layout import (BITS, BLOCK, SUB_BLOCK, TILE, check_bits, compact_scales,  # noqa: F401  (re-exported)
                           gather_input, pack_codes, tile_rows, tile_views, tileable_group, unpack_codes)

QUANT_IMPLS = ("quant_ref", "quant_cpp", "quant_invariant", "quant_triton")


@dataclass(eq=False)
class QuantLinearWeight:
    """A group-quantized matmul weight (the representation is in the module docstring).

    Attributes:
        qweight: uint8 [N, K * bits // 8] packed codes.
        scales: float32 [N, K // group_size].
        mins: float32 [N, K // group_size] or None.
        bits: 4 or 8.
        group_size: channels per scale (multiple of 32 dividing K, or 16 with bits 8).
        in_features: K.
        perm: int64 [K] input permutation (stored column j = logical channel perm[j]) or None.
        bias: [N] or None (added in the activation dtype, as ``F.linear``).
        impl: a name of :data:`QUANT_IMPLS`; set through :meth:`use`.
        fmt: where it came from (``"gguf:Q4_1"``, ``"gptq"``, ...); reporting only.
        tiled: codes, scales and mins in 16-row tiles (:func:`tile_rows`).
        amx_packed: None, or the weight dequantized once into the AMX tile GEMM's bf16 B layout
            (bf16 bits as int16 [ceil(N / 32) * 2 * K / 32 * 512], 64-byte aligned;
            :func:`.quant_amx.repack`); read instead of the codes by the ``amx_gemm`` path only.
            Set after construction; a copy made with ``dataclasses.replace`` starts without it.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: Optional[torch.Tensor]
    bits: int
    group_size: int
    in_features: int
    perm: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    impl: str = "quant_ref"
    fmt: str = ""
    tiled: bool = False
    # derived from the codes (init=False: never passed, never carried by dataclasses.replace)
    amx_packed: Optional[torch.Tensor] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.validate()

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor], bits: int,
                   group_size: int, perm: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                   fmt: str = "") -> "QuantLinearWeight":
        """Build from unpacked codes [N, K] (uint8-valued, stored channel order), scales and mins
        [N, K // group_size] (cast to float32). Raises ValueError naming the bad field."""
        k = codes.shape[1] if codes.dim() == 2 else -1
        return cls(pack_codes(codes, bits), scales.to(torch.float32).contiguous(),
                   None if mins is None else mins.to(torch.float32).contiguous(), bits, group_size, k,
                   None if perm is None else perm.to(torch.int64).contiguous(), bias, fmt=fmt)

    def validate(self) -> None:
        """Check shapes and dtypes against each other. Raises ValueError naming the field."""
        check_bits(self.bits)
        k, gs = self.in_features, self.group_size
        if gs <= 0 or k % gs or k % BLOCK or (gs % BLOCK and not tileable_group(gs, self.bits)):
            raise ValueError(f"quantized weight: group_size must be a multiple of {BLOCK} dividing in_features={k} "
                             f"(a multiple of {BLOCK}), or {SUB_BLOCK} with bits 8; got {gs} with bits {self.bits}")
        if self.qweight.dtype != torch.uint8 or self.qweight.dim() != 2 or self.qweight.shape[1] * 8 != k * self.bits:
            raise ValueError(f"quantized weight: qweight must be uint8 [N, {k * self.bits // 8}], got "
                             f"{self.qweight.dtype} {tuple(self.qweight.shape)}")
        n = self.qweight.shape[0]
        for name in ("scales", "mins"):
            t = getattr(self, name)
            if t is None and name == "mins":
                continue
            if t.dtype not in (torch.float32, torch.float16) or tuple(t.shape) != (n, k // gs):
                raise ValueError(f"quantized weight: {name} must be float32 (or float16) [{n}, {k // gs}], got "
                                 f"{t.dtype} {tuple(t.shape)}")
        if self.mins is not None and self.mins.dtype != self.scales.dtype:
            raise ValueError(f"quantized weight: mins dtype {self.mins.dtype} differs from scales dtype {self.scales.dtype}")
        if self.perm is not None and (self.perm.dtype != torch.int64 or tuple(self.perm.shape) != (k,)):
            raise ValueError(f"quantized weight: perm must be int64 [{k}], got {self.perm.dtype} {tuple(self.perm.shape)}")
        if self.bias is not None and tuple(self.bias.shape) != (n,):
            raise ValueError(f"quantized weight: bias must be [{n}], got {tuple(self.bias.shape)}")
        if self.tiled and (n % TILE or not tileable_group(gs, self.bits)):
            raise ValueError(f"quantized weight: the tiled layout needs out_features % {TILE} == 0 and group_size "
                             f"{BLOCK} (or {SUB_BLOCK} at 8 bits), got {n} and {gs}")

    # -- the LinearWeight interface ---------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        """[N, K] of the logical weight."""
        return torch.Size((self.qweight.shape[0], self.in_features))

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def use(self, impl: str) -> "QuantLinearWeight":
        """Switch implementation; returns self. Float names map: ``invariant`` -> ``quant_invariant``;
        ``torch`` / ``fp16`` / ``cpp`` (or ``auto``) -> :func:`best_impl` for this weight.

        Raises:
            ValueError: an unknown name (lists the known ones)."""
        if impl == "invariant":
            impl = "quant_invariant"
        elif impl in ("torch", "fp16", "cpp", "auto"):
            impl = best_impl(self)
        if impl not in QUANT_IMPLS:
            raise ValueError(f"linear: unknown quantized implementation {impl!r}; known: {list(QUANT_IMPLS)}")
        self.impl = impl
        return self

    def numel(self) -> int:
        """Logical elements (N * K, + bias)."""
        return self.shape.numel() + (0 if self.bias is None else self.bias.numel())

    def nbytes(self) -> int:
        """Resident bytes: codes, scales, mins, perm, bias and the AMX copy."""
        ts = (self.qweight, self.scales, self.mins, self.perm, self.bias, self.amx_packed)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def to(self, device) -> "QuantLinearWeight":
        """A copy on ``device`` (same impl)."""
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, qweight=mv(self.qweight), scales=mv(self.scales), mins=mv(self.mins),
                       perm=mv(self.perm), bias=mv(self.bias))

    # -- reference ----------------------------------------------------------------------------------
    def _tile_views(self) -> tuple:
        """:func:`.quant_layout.tile_views` of this (tiled) weight: (codes, scales, mins) indexed
        ``[tile, lane]``. No copy."""
        return tile_views(self.qweight, self.scales, self.mins, self.in_features)

    def untiled(self) -> "QuantLinearWeight":
        """This weight in the row layout: self when not tiled, else a copy with ``tiled=False``."""
        if not self.tiled:
            return self
        n = self.shape[0]
        q, s, m = (None if t is None else t.reshape(n, -1).contiguous() for t in self._tile_views())
        return replace(self, qweight=q, scales=s, mins=m, tiled=False)

    def codes(self) -> torch.Tensor:
        """Unpacked codes [N, K] uint8, stored channel order (row layout)."""
        return unpack_codes(self.untiled().qweight, self.bits)

    def dequantize_stored(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W_stored`` [N, K] (stored channel order): ``s * q + m`` in float32, then cast to dtype."""
        w = self.untiled()
        n, k, gs = w.shape[0], w.in_features, w.group_size
        q = w.codes().to(torch.float32).view(n, k // gs, gs)
        out = q * w.scales.float()[:, :, None]
        if w.mins is not None:
            out = out + w.mins.float()[:, :, None]
        return out.view(n, k).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The logical weight ``W`` [N, K] (input permutation undone) in ``dtype``."""
        w = self.dequantize_stored(torch.float32)
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm] = w
            w = out
        return w.to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of ``W`` dequantized, [len(ids), K] in ``dtype`` (an embedding lookup of a
        tied embedding / LM head). On CPU the C++ gather of :func:`.cpu_elementwise.dequant_rows`
        (the same bits as the torch ops below, in one call instead of a dozen)."""
        if self.perm is None and self.qweight.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            from . import cpu_elementwise

            out = cpu_elementwise.dequant_rows(self, ids, dtype)
            if out is not None:
                return out
        return self.rows_reference(ids, dtype)

    def rows_reference(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`rows` in torch ops (the reference of the C++ gather)."""
        if self.tiled:  # gather the rows out of their tiles (only those rows' bytes are read)
            t, r = ids // TILE, ids % TILE
            q, s, m = (None if v is None else v[t, r].reshape(ids.numel(), -1).contiguous() for v in self._tile_views())
            sub = replace(self, qweight=q, scales=s, mins=m, bias=None, tiled=False)
        else:
            sub = replace(self, qweight=self.qweight[ids], scales=self.scales[ids],
                          mins=None if self.mins is None else self.mins[ids], bias=None)
        return sub.dequantize(dtype)

    def permute_rows(self, idx: torch.Tensor) -> "QuantLinearWeight":
        """A weight whose row ``i`` is this weight's row ``idx[i]`` (exact: rows are independent); row layout."""
        if self.tiled:
            return self.untiled().permute_rows(idx)
        return replace(self, qweight=self.qweight[idx].contiguous(), scales=self.scales[idx].contiguous(),
                       mins=None if self.mins is None else self.mins[idx].contiguous(),
                       bias=None if self.bias is None else self.bias[idx].contiguous())


def widen(w: QuantLinearWeight, bits: int, group_size: int) -> QuantLinearWeight:
    """``w`` with ``bits`` >= its bits and a ``group_size`` dividing its own: the same codes as 8-bit
    bytes and each scale / min repeated over the smaller groups -- exact (the same ``s * q + m`` per
    weight). Row layout. Raises ValueError when that is not a widening."""
    w = w.untiled()
    if bits < w.bits or w.group_size % group_size:
        raise ValueError(f"widen: bits {w.bits}->{bits}, group_size {w.group_size}->{group_size} is not a widening")
    if (bits, group_size) == (w.bits, w.group_size):
        return w
    r = w.group_size // group_size
    rep = lambda t: None if t is None else t.repeat_interleave(r, dim=1).contiguous()  # noqa: E731
    return replace(w, qweight=pack_codes(w.codes(), bits), scales=rep(w.scales), mins=rep(w.mins), bits=bits,
                   group_size=group_size)


def cat_rows(ws: Sequence[QuantLinearWeight], bias: Optional[torch.Tensor] = None) -> QuantLinearWeight:
    """Concatenate weights along N (fused QKV / gate-up): same K and perm; mins present in all or
    none (a None mins becomes zeros when others have them). Parts of different bits or group sizes
    (a GGUF Q4_K_M's Q4_K q / k with a Q6_K v) are first widened exactly (:func:`widen`) to the
    widest code and the smallest group when that is a valid weight (group 16 needs 8 bits). The
    result is in the row layout (tiled inputs are untiled).

    Raises:
        ValueError: the weights disagree (names the field)."""
    ws = [w.untiled() for w in ws]
    bits, gs = max(w.bits for w in ws), min(w.group_size for w in ws)
    if all(w.group_size % gs == 0 for w in ws) and (gs % BLOCK == 0 or tileable_group(gs, bits)):
        ws = [widen(w, bits, gs) for w in ws]
    a = ws[0]
    for w in ws[1:]:
        for f in ("bits", "group_size", "in_features"):
            if getattr(w, f) != getattr(a, f):
                raise ValueError(f"cat_rows: {f} differs ({getattr(a, f)} vs {getattr(w, f)})")
        if (w.perm is None) != (a.perm is None) or (w.perm is not None and not torch.equal(w.perm, a.perm)):
            raise ValueError("cat_rows: perm differs")
    mins = None
    if any(w.mins is not None for w in ws):
        mins = torch.cat([w.mins if w.mins is not None else torch.zeros_like(w.scales) for w in ws])
    fmts = sorted({w.fmt for w in ws})
    return QuantLinearWeight(torch.cat([w.qweight for w in ws]), torch.cat([w.scales for w in ws]), mins,
                             a.bits, a.group_size, a.in_features, a.perm, bias, impl=a.impl, fmt="+".join(fmts))


def reference_linear(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    """The spec of every quantized linear: ``F.linear(x, w.dequantize(), bias)`` in float32, then
    x's dtype. x [M, K] -> [M, N]."""
    y = F.linear(x.to(torch.float32), w.dequantize(torch.float32))
    y = y.to(x.dtype)
    return y if w.bias is None else y + w.bias.to(x.dtype)


def best_impl(w: QuantLinearWeight) -> str:
    """The fastest available implementation for ``w``'s device: ``quant_cpp`` on CPU when the C++
    kernel loads (:mod:`.quant_cpu`), ``quant_triton`` on CUDA when triton imports
    (:mod:`.triton_quant`), else ``quant_ref``. Every group size :meth:`validate` accepts runs on
    the kernels (group 16 only with 8-bit codes, read as two scales per 32-block)."""
    if w.device.type == "cpu":
        from . import quant_cpu

        if quant_cpu.available():
            return "quant_cpp"
    elif w.device.type == "cuda":
        if triton_available():
            return "quant_triton"
    return "quant_ref"
