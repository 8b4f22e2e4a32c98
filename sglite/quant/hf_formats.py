"""GPTQ and AWQ checkpoint tensors as AutoGPTQ / AutoAWQ write them: packing, unpacking, the
``quantization_config`` entry, and the map onto :class:`sglite.kernels.QuantLinearWeight`.

The unpacked form (what our quantizers produce, :class:`GroupQuant`) of a weight ``W`` [N, K]
(out x in features), ``bits`` in {4, 8}, ``G = K / group_size`` groups::

    W[n, k] ~= scales[n, g_idx[k]] * (codes[n, k] - zeros[n, g_idx[k]])

codes uint8 [N, K] in [0, 2**bits), zeros int [N, G] (the integer zero point), scales float [N, G]
(stored as float16), g_idx int [K] (the group of input channel k; ``k // group_size`` without
act-order).

GPTQ (AutoGPTQ's ``QuantLinear``, ``checkpoint_format: "gptq"``, i.e. "v1"), ``pf = 32 / bits``:
    qweight int32 [K / pf, N]: packed along K -- word ``qweight[r, n]`` holds ``codes[n, r*pf + j]``
        in bits ``[bits*j, bits*(j+1))``, j = 0..pf-1 (little end first).
    qzeros  int32 [G, N / pf]: packed along N the same way, each zero stored MINUS ONE
        (``(z - 1) & (2**bits - 1)``; readers add 1 back, unmasked, as AutoGPTQ's kernels do).
    scales  float16 [G, N].   g_idx int32 [K].
AWQ (AutoAWQ's ``WQLinear_GEMM``, ``version: "gemm"``, 4-bit only):
    qweight int32 [K, N / 8]: packed along N with the interleaved order ``AWQ_ORDER`` =
        [0, 2, 4, 6, 1, 3, 5, 7]: nibble j of word ``qweight[k, c]`` holds ``codes[8c + AWQ_ORDER[j], k]``.
    qzeros  int32 [G, N / 8]: the zeros packed the same way (no offset).
    scales  float16 [G, N].   No g_idx (groups are contiguous).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GPTQ_BITS = (4, 8)
AWQ_BITS = (4,)
GROUP_SIZES = (32, 64, 128, -1)


@dataclass
class GroupQuant:
    """One weight quantized in groups (unpacked; the formula is in the module docstring).

    Attributes:
        codes: uint8 [N, K].  zeros: int32 [N, G].  scales: float32 [N, G] (float16-representable).
        g_idx: int32 [K].  bits: 4 or 8.  group_size: channels per group (K for per-channel).
    """

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        g = self.g_idx.long()
        return self.scales[:, g] * (self.codes.float() - self.zeros[:, g].float())


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same bit pattern."""
    v = v & 0xFFFFFFFF
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


def pack_along_rows(v: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[R, C] integers < 2**bits -> int32 [R * bits / 32, C]: word r holds rows r*pf .. r*pf+pf-1
    (``order[j]``-th row of the pack in slot j; natural order when None)."""
    pf = 32 // bits
    r, c = v.shape
    if r % pf:
        raise ValueError(f"pack: {r} rows is not a multiple of {pf} ({bits}-bit values per int32)")
    v = v.to(torch.int64).view(r // pf, pf, c)
    if order is not None:
        v = v[:, list(order)]
    shifts = (torch.arange(pf, dtype=torch.int64) * bits).view(1, pf, 1)
    return _to_int32((v << shifts).sum(1))


def unpack_along_rows(packed: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """Inverse of :func:`pack_along_rows`: int32 [R', C] -> int32 [R' * 32 / bits, C]."""
    pf = 32 // bits
    shifts = (torch.arange(pf, dtype=torch.int32) * bits).view(1, pf, 1)
    v = (packed.to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # arithmetic shift, masked
    if order is not None:
        inv = [0] * pf
        for j, o in enumerate(order):
            inv[o] = j
        v = v[:, inv]
    return v.reshape(-1, packed.shape[1])


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# ------------------------------------------------------------------ GPTQ
def pack_gptq(q: GroupQuant) -> dict[str, torch.Tensor]:
    """``{"qweight", "qzeros", "scales", "g_idx"}`` of AutoGPTQ's v1 format (module docstring).

    Raises:
        ValueError: bits not in (4, 8), or K / N not multiples of 32 / bits."""
    _check(q.bits in GPTQ_BITS, f"gptq: bits must be one of {GPTQ_BITS}, got {q.bits}")
    mask = (1 << q.bits) - 1
    return {
        "qweight": pack_along_rows(q.codes.T.to(torch.int64), q.bits),
        "qzeros": _pack_cols(((q.zeros.to(torch.int64) - 1) & mask).T, q.bits),
        "scales": q.scales.T.to(torch.float16).contiguous(),
        "g_idx": q.g_idx.to(torch.int32).contiguous(),
    }


def _pack_cols(v: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[R, C] -> int32 [R, C * bits / 32], packed along columns."""
    return pack_along_rows(v.T, bits, order).T.contiguous()


def _unpack_cols(v: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    return unpack_along_rows(v.T.contiguous(), bits, order).T.contiguous()


def unpack_gptq(t: dict[str, torch.Tensor], bits: int, group_size: int, name: str = "") -> GroupQuant:
    """Read AutoGPTQ v1 tensors back (zeros + 1, unmasked). ``group_size`` -1 = one group.

    Raises:
        ValueError: naming ``name`` and the tensor whose shape disagrees with the others / the
            config (bits, group_size), or a g_idx out of range."""
    _check(bits in GPTQ_BITS, f"{name}: gptq bits must be one of {GPTQ_BITS}, got {bits}")
    pf = 32 // bits
    for k in ("qweight", "qzeros", "scales"):
        _check(k in t, f"{name}.{k}: missing from the checkpoint")
    qw, qz, sc = t["qweight"], t["qzeros"], t["scales"]
    k_in, n = qw.shape[0] * pf, qw.shape[1]
    gs, g = _groups(name, k_in, n, group_size, qw, sc)
    _check(tuple(qz.shape) == (g, n // pf) and n % pf == 0,
           f"{name}.qzeros: shape {tuple(qz.shape)} disagrees with qweight {tuple(qw.shape)} and "
           f"bits={bits} (expected {(g, n // pf)})")
    g_idx = t.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(k_in, dtype=torch.int32) // gs
    _check(tuple(g_idx.shape) == (k_in,), f"{name}.g_idx: shape {tuple(g_idx.shape)}, expected ({k_in},)")
    _check(bool((g_idx >= 0).all()) and bool((g_idx < g).all()), f"{name}.g_idx: values outside [0, {g})")
    codes = unpack_along_rows(qw, bits).T.to(torch.uint8).contiguous()
    zeros = _unpack_cols(qz, bits) + 1
    return GroupQuant(codes, zeros.T.contiguous(), sc.float().T.contiguous(), g_idx.to(torch.int32), bits, gs)


def _groups(name: str, k_in: int, n: int, group_size: int, qw: torch.Tensor, sc: torch.Tensor) -> tuple[int, int]:
    """(group size, group count) of a [K=k_in, N=n] layer (``group_size`` -1 = one group over K),
    checking it divides K and that ``scales`` is [groups, N].

    Raises:
        ValueError: naming ``name``, the option and the disagreeing tensor."""
    gs = k_in if group_size == -1 else group_size
    _check(k_in % gs == 0, f"{name}: group_size={group_size} does not divide in_features={k_in} "
           f"(quantization_config.group_size)")
    g = k_in // gs
    _check(tuple(sc.shape) == (g, n), f"{name}.scales: shape {tuple(sc.shape)} disagrees with qweight "
           f"{tuple(qw.shape)} and group_size={group_size} (expected {(g, n)})")
    return gs, g


# ------------------------------------------------------------------ AWQ
def pack_awq(q: GroupQuant) -> dict[str, torch.Tensor]:
    """``{"qweight", "qzeros", "scales"}`` of AutoAWQ's GEMM format (module docstring).

    Raises:
        ValueError: bits != 4, N not a multiple of 8, or act-order groups (AWQ has no g_idx)."""
    _check(q.bits in AWQ_BITS, f"awq: bits must be one of {AWQ_BITS}, got {q.bits}")
    k_in = q.codes.shape[1]
    _check(torch.equal(q.g_idx.long(), torch.arange(k_in) // q.group_size),
           "awq: groups must be contiguous (AWQ has no g_idx / act-order)")
    return {
        "qweight": _pack_cols(q.codes.T.to(torch.int64), 4, AWQ_ORDER),
        "qzeros": _pack_cols(q.zeros.T.to(torch.int64), 4, AWQ_ORDER),
        "scales": q.scales.T.to(torch.float16).contiguous(),
    }


def unpack_awq(t: dict[str, torch.Tensor], bits: int, group_size: int, name: str = "") -> GroupQuant:
    """Read AutoAWQ GEMM tensors back.

    Raises:
        ValueError: naming ``name`` and the tensor that disagrees, or bits != 4."""
    _check(bits in AWQ_BITS, f"{name}: awq bits must be one of {AWQ_BITS} (AutoAWQ GEMM packing), got {bits}")
    for k in ("qweight", "qzeros", "scales"):
        _check(k in t, f"{name}.{k}: missing from the checkpoint")
    qw, qz, sc = t["qweight"], t["qzeros"], t["scales"]
    k_in, n = qw.shape[0], qw.shape[1] * 8
    gs, g = _groups(name, k_in, n, group_size, qw, sc)
    _check(tuple(qz.shape) == (g, n // 8), f"{name}.qzeros: shape {tuple(qz.shape)} disagrees with qweight "
           f"{tuple(qw.shape)} (expected {(g, n // 8)})")
    codes = _unpack_cols(qw, 4, AWQ_ORDER).T.to(torch.uint8).contiguous()
    zeros = _unpack_cols(qz, 4, AWQ_ORDER).T.contiguous()
    g_idx = (torch.arange(k_in, dtype=torch.int32) // gs)
    return GroupQuant(codes, zeros, sc.float().T.contiguous(), g_idx, 4, gs)


# ------------------------------------------------------------------ config
def quantization_config(method: str, bits: int, group_size: int, desc_act: bool = False,
                        sym: bool = True, damp_percent: float = 0.01, true_sequential: bool = False) -> dict:
    """The ``config.json`` ``quantization_config`` entry as AutoGPTQ (``method="gptq"``) or AutoAWQ
    (``"awq"``) writes it. Raises ValueError for another method."""
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
                "sym": sym, "damp_percent": damp_percent, "true_sequential": true_sequential,
                "static_groups": False, "checkpoint_format": "gptq", "model_name_or_path": None,
                "model_file_base_name": "model"}
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": not sym,
                "version": "gemm", "modules_to_not_convert": None}
    raise ValueError(f"quantization_config: method must be gptq or awq, got {method!r}")


# ------------------------------------------------------------------ to the engine's representation
def to_quant_linear(q: GroupQuant, bias: Optional[torch.Tensor] = None, fmt: str = "", name: str = ""):
    """The :class:`sglite.kernels.QuantLinearWeight` of ``q`` (``s = scales``, ``m = -s * z``,
    exact in float32; act-order: ``perm = argsort(g_idx, stable)``).

    Raises:
        ValueError: naming ``name``: group size not a multiple of 32 or not dividing K (the
            option to change is ``--group-size`` / ``quantization_config.group_size``), or act-order
            groups that are not all ``group_size`` channels."""
    from sglite.kernels.quant_linear import BLOCK, QuantLinearWeight

    n, k_in = q.codes.shape
    gs = q.group_size
    if gs % BLOCK or k_in % gs:
        raise ValueError(f"{name}: group_size={gs} must be a multiple of {BLOCK} dividing in_features="
                         f"{k_in} (quantization_config.group_size / --group-size)")
    g_idx = q.g_idx.long()
    perm = None
    if not torch.equal(g_idx, torch.arange(k_in) // gs):
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], torch.arange(k_in) // gs):
            raise ValueError(f"{name}.g_idx: every group must hold exactly group_size={gs} channels")
    codes = q.codes if perm is None else q.codes[:, perm]
    s = q.scales.float()
    m = -(s * q.zeros.float())
    return QuantLinearWeight.from_codes(codes.contiguous(), s, m, q.bits, gs, perm=perm, bias=bias, fmt=fmt)
