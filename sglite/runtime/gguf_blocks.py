"""GGUF block types -> :class:`sglite.kernels.QuantLinearWeight`: the byte layouts of the matmul
tensor types sglite keeps quantized (:data:`NATIVE_TYPES`) and their exact mapping onto the
kernels' one representation ``w = s[g] * q + m[g]`` (unsigned codes ``q``, float32 scale and
offset per group of ``group_size`` channels; :mod:`sglite.kernels.quant_linear`).

Layouts (ggml's ``block_*`` structs, little endian; a ``GGUFReader`` tensor of such a type is a
uint8 array [N, K / block weights * block bytes], ggml's shape ``[K, N]``):

32-weight blocks:
    Q4_0 (18 B) ``{f16 d; u8 qs[16]}``, w = d (q - 8); Q4_1 (20 B) ``{f16 d, m; u8 qs[16]}``,
    w = d q + m: ``qs[j]`` holds weight j (low nibble) and j + 16 (high) -> bits 4, group 32
    (the nibbles are the kernels' own 4-bit packing, kept verbatim).
    Q8_0 (34 B) ``{f16 d; i8 qs[32]}``, w = d q -> bits 8, codes q + 128, s = d, m = -128 d.
    Q5_0 (22 B) ``{f16 d; u8 qh[4]; u8 qs[16]}``, Q5_1 (24 B) ``{f16 d, m; u8 qh[4]; u8 qs[16]}``:
    5-bit ``q = nibble | bit << 4`` with the nibbles as in Q4 and bit ``i`` of the little-endian
    32-bit ``qh`` the fifth bit of weight ``i``; w = d (q - 16) (Q5_0), d q + m (Q5_1)
    -> bits 8 (one 5-bit code a byte), group 32, s = d, m = -16 d (Q5_0) or m (Q5_1).
K-quants (super-blocks of 256 weights, so K % 256 == 0):
    Q4_K (144 B) ``{f16 d, dmin; u8 scales[12]; u8 qs[128]}``: eight sub-blocks of 32 with 6-bit
    scale ``sc_j`` and min ``m_j`` packed in ``scales`` (:func:`k_scale_min`: j < 4 the low 6 bits
    of bytes j and j + 4; j >= 4 the low / high nibble of byte j + 4 plus the top 2 bits of bytes
    j - 4 / j); ``qs`` byte ``32 c + i`` holds weight ``64 c + i`` (low nibble) and
    ``64 c + 32 + i`` (high); w = (d sc_j) q - (dmin m_j) -> bits 4, group 32, s = d sc_j,
    m = -(dmin m_j).
    Q5_K (176 B) ``{f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}``: Q4_K's scales and
    nibbles, plus a fifth bit: bit ``2 c`` of ``qh[i]`` for weight ``64 c + i``, bit ``2 c + 1`` for
    ``64 c + 32 + i`` -> bits 8 (5-bit codes), group 32, s and m as Q4_K.
    Q6_K (210 B) ``{u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}``: 6-bit ``q = ql | qh << 4``
    (weight ``128 h + 64 s + i`` takes nibble ``s`` of ``ql[64 h + i]``; weight ``128 h + 32 s + i``
    bits ``2 s, 2 s + 1`` of ``qh[32 h + i]``), w = (d scales_j) (q - 32) over sixteen sub-blocks
    of 16 -> bits 8, group 16, s = d scales_j, m = -32 s.

Every mapping is bit-exact against ``gguf.quants.dequantize`` (tests/quant/test_gguf_kquants.py): a
float16 times an integer of <= 8 bits is exact in float32, so ``s q + m`` rounds once where the
oracle rounds once. The 5-bit types spend a byte a code (8 bits where the file spends 5.5-6): the
kernels' codes are 4 or 8 bits wide, and 8 keeps every path (fused decode, int8 GEMV and GEMM,
Triton) on the same code; Q6_K's 16-weight groups are read by the kernels as two scales per
32-block (bits 8 only).
"""
from __future__ import annotations

import numpy as np
import torch

from sglite.kernels.quant_linear import QuantLinearWeight

QK_K = 256  # weights per K-quant super-block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_WEIGHTS = {t: (QK_K if t.endswith("_K") else 32) for t in BLOCK_BYTES}
NATIVE_TYPES = tuple(BLOCK_BYTES)  # GGUF tensor types kept quantized


def blocks_to_weight(type_name: str, data: np.ndarray, k: int) -> QuantLinearWeight:
    """One GGUF tensor's raw blocks -> :class:`QuantLinearWeight` (module docstring).

    Args:
        type_name: one of :data:`NATIVE_TYPES`.
        data: uint8 [N, K / block weights * block bytes] (``ReaderTensor.data``).
        k: K (input features).
    Raises:
        ValueError: another type (names it and the native ones), or a byte count that does not
            match K (K must be a multiple of the block's weights: 32, or 256 for K-quants).
    """
    if type_name not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {type_name} is not kept quantized (native: {NATIVE_TYPES})")
    qk, nb = BLOCK_WEIGHTS[type_name], BLOCK_BYTES[type_name]
    if k % qk or data.ndim != 2 or data.shape[1] != k // qk * nb:
        raise ValueError(f"GGUF {type_name} tensor: {data.shape} bytes do not hold rows of K={k} "
                         f"({nb}-byte blocks of {qk} weights)")
    n, g = data.shape[0], k // qk
    b = np.ascontiguousarray(data).reshape(n, g, nb)
    if type_name in _DECODERS:
        return _DECODERS[type_name](b, n, k)
    d = _f16(b[:, :, 0:2])  # [N, G]
    if type_name == "Q8_0":
        codes = torch.from_numpy(b[:, :, 2:].copy().reshape(n, k) ^ np.uint8(0x80))  # signed q -> q + 128
        return QuantLinearWeight(codes, d, -128.0 * d, 8, 32, k, fmt="gguf:Q8_0")
    off = 4 if type_name == "Q4_1" else 2
    qs = torch.from_numpy(b[:, :, off:].copy().reshape(n, k // 2))  # already our Q4 packing
    mins = _f16(b[:, :, 2:4]) if type_name == "Q4_1" else -8.0 * d
    return QuantLinearWeight(qs, d, mins, 4, 32, k, fmt=f"gguf:{type_name}")


def _f16(b: np.ndarray) -> torch.Tensor:
    """Little-endian float16 bytes [..., 2] -> float32 [...]."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def _shifts(*s: int) -> np.ndarray:
    return np.array(s, dtype=np.uint8)


def k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 packed bytes [..., 12] -> 6-bit ``(scales, mins)`` uint8 [..., 8]."""
    a, m, hi = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = np.concatenate([a & 0x3F, (hi & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (hi >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, mins


def _k_scales(b: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K per-32 scales ``d sc_j`` and mins ``-(dmin m_j)``, float32 [N, K / 32]."""
    d, dmin = _f16(b[:, :, 0:2]), _f16(b[:, :, 2:4])  # [N, G]
    sc, mn = k_scale_min(b[:, :, 4:16])  # [N, G, 8]
    scales = (d[:, :, None] * torch.from_numpy(sc.astype(np.float32))).reshape(n, k // 32)
    mins = -(dmin[:, :, None] * torch.from_numpy(mn.astype(np.float32))).reshape(n, k // 32)
    return scales, mins


def _k_nibbles(qs: np.ndarray, n: int, g: int) -> np.ndarray:
    """Q4_K / Q5_K ``qs`` [N, G, 128] -> low 4 bits of the codes [N, G, 4, 2, 32] (chunk, half, i)."""
    return (qs.reshape(n, g, 4, 1, 32) >> _shifts(0, 4).reshape(1, 1, 1, 2, 1)) & 0x0F


def _q4_k(b: np.ndarray, n: int, k: int) -> QuantLinearWeight:
    scales, mins = _k_scales(b, n, k)
    codes = torch.from_numpy(_k_nibbles(b[:, :, 16:], n, k // QK_K).reshape(n, k))
    return QuantLinearWeight.from_codes(codes, scales, mins, 4, 32, fmt="gguf:Q4_K")


def _q5_k(b: np.ndarray, n: int, k: int) -> QuantLinearWeight:
    g = k // QK_K
    scales, mins = _k_scales(b, n, k)
    qh = b[:, :, 16:48].reshape(n, g, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 4, 2, 1)
    codes = _k_nibbles(b[:, :, 48:], n, g) | ((qh & 1) << 4)
    return QuantLinearWeight.from_codes(torch.from_numpy(codes.reshape(n, k)), scales, mins, 8, 32, fmt="gguf:Q5_K")


def _q5(b: np.ndarray, n: int, k: int, with_min: bool) -> QuantLinearWeight:
    g, off = k // 32, 4 if with_min else 2
    d = _f16(b[:, :, 0:2])
    qh = np.ascontiguousarray(b[:, :, off:off + 4]).view("<u4")  # [N, G, 1]
    hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, G, 32]
    lo = (b[:, :, off + 4:].reshape(n, g, 1, 16) >> _shifts(0, 4).reshape(1, 1, 2, 1)) & 0x0F
    codes = torch.from_numpy((lo.reshape(n, g, 32) | (hi << 4)).reshape(n, k))
    mins = _f16(b[:, :, 2:4]) if with_min else -16.0 * d
    return QuantLinearWeight.from_codes(codes, d, mins, 8, 32, fmt=f"gguf:Q5_{int(with_min)}")


def _q6_k(b: np.ndarray, n: int, k: int) -> QuantLinearWeight:
    g = k // QK_K
    ql = b[:, :, 0:128].reshape(n, g, 2, 1, 64) >> _shifts(0, 4).reshape(1, 1, 1, 2, 1)
    qh = b[:, :, 128:192].reshape(n, g, 2, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 1, 4, 1)
    q = (ql & 0x0F).reshape(n, g, 2, 128) | ((qh & 0x03).reshape(n, g, 2, 128) << 4)
    sc = torch.from_numpy(b[:, :, 192:208].copy().view(np.int8).astype(np.float32))  # [N, G, 16]
    scales = (_f16(b[:, :, 208:210])[:, :, None] * sc).reshape(n, k // 16)
    return QuantLinearWeight.from_codes(torch.from_numpy(q.reshape(n, k)), scales, -32.0 * scales, 8, 16,
                                        fmt="gguf:Q6_K")


_DECODERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
             "Q5_0": lambda b, n, k: _q5(b, n, k, False), "Q5_1": lambda b, n, k: _q5(b, n, k, True)}
