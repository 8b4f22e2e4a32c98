"""The memory layout of group-quantized weights (:class:`.quant_linear.QuantLinearWeight`): its
constants and the packing, tiling and column-order helpers that every quantized implementation
(:mod:`.quant_linear`, :mod:`.quant_cpu`, :mod:`.triton_quant`, :mod:`.decode_fused`) shares. A leaf
of ``sglite.kernels``: it imports nothing of sglite at run time (the weight type only for typing),
so the implementations read the layout without importing the weight's module back.

Codes: unsigned integers in ``[0, 2**bits)``, ``bits`` in :data:`BITS`.
    ``bits == 8``: [N, K] uint8, one code per byte.
    ``bits == 4``: [N, K // 2] uint8, packed per block of :data:`BLOCK` (32) stored channels in
    GGUF's Q4 order: byte ``j`` (0..15) of block ``b`` holds channel ``32 b + j`` in its low nibble
    and channel ``32 b + j + 16`` in its high nibble (a Q4_0/Q4_1 block's ``qs`` bytes verbatim).
    :func:`pack_codes` / :func:`unpack_codes` convert between [N, K] codes and this layout.

Column order: with an input permutation ``perm`` (act-order), stored column ``j`` holds logical
input channel ``perm[j]``; :func:`gather_input` puts an activation's columns into stored order.

Compact scales: :func:`compact_scales` stores scales and mins as float16 when that is exact (GGUF's
are float16 in the file), 4 bytes less per group for the fused decode's int8-activation GEMV,
which reads them as they are; every other consumer widens them to float32 first (exact).

16-row tiles: :func:`tile_rows` interleaves a group-32 weight's (or an 8-bit group-16 one's: GGUF
Q6_K) codes, scales and mins in tiles of :data:`TILE` (16) rows (``tiled=True``; N % 16 == 0), the layout of the int8-activation GEMV of the
fused CPU decode (``csrc/quant_tiles.h``: one ``VPDPBUSD`` covers 4 channels of 16 rows, no per-row
horizontal sum, every array streams in order). Same bytes, same meaning; ``qweight`` / ``scales`` /
``mins`` keep their shapes but hold the tiled order::

    row-layout qweight.view(N // 16, 16, K // 32, C, 4).permute(0, 2, 3, 1, 4)   (C = bits: groups of 4
        code bytes per row and block -- 8 at 8 bits, 4 at 4 bits)
    row-layout scales / mins.view(N // 16, 16, G).permute(0, 2, 1)   (G = K // group_size groups)

:func:`tile_views` reads a tiled weight back in row order without a copy.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from .quant_linear import QuantLinearWeight

BLOCK = 32  # channels per packing block (GGUF's QK4_0/QK4_1/QK8_0); group_size is a multiple
SUB_BLOCK = 16  # smallest group: GGUF Q6_K's 16-weight sub-blocks (8-bit codes only: two scales per block)
BITS = (4, 8)
TILE = 16  # rows per tile of the tiled layout (tile_rows)


def check_bits(bits: int) -> None:
    """Raises ValueError unless ``bits`` is one of :data:`BITS`."""
    if bits not in BITS:
        raise ValueError(f"quantized weight: bits must be one of {BITS}, got {bits}")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unpacked codes [N, K] uint8 (values < 2**bits, K % 32 == 0) into the stored layout
    (see the module docstring): bits 8 -> the same [N, K]; bits 4 -> [N, K // 2].

    Raises:
        ValueError: bits not 4/8, K not a multiple of 32, or a code out of range."""
    check_bits(bits)
    if codes.dim() != 2 or codes.shape[1] % BLOCK:
        raise ValueError(f"quantized weight: codes must be [N, K] with K % {BLOCK} == 0, got {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    if codes.numel() and int(codes.max()) >= 16:
        raise ValueError(f"quantized weight: a 4-bit code is {int(codes.max())} (must be < 16)")
    n, k = codes.shape
    b = codes.view(n, k // BLOCK, 2, BLOCK // 2)  # [N, blocks, lo/hi half, 16]
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: [N, K] uint8 codes in stored channel order.

    Raises:
        ValueError: bits not 4/8."""
    check_bits(bits)
    if bits == 8:
        return qweight
    n, kb = qweight.shape
    b = qweight.view(n, kb // (BLOCK // 2), BLOCK // 2)
    return torch.stack((b & 0xF, b >> 4), dim=2).reshape(n, kb * 2)


def gather_input(x: torch.Tensor, w: "QuantLinearWeight") -> torch.Tensor:
    """x [M, K] with its columns in the weight's stored order (``x[:, perm]``), contiguous."""
    return (x if w.perm is None else x[:, w.perm]).contiguous()


def tile_views(qweight: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
               in_features: int) -> tuple:
    """Views of a tiled weight's (codes, scales, mins) indexed ``[tile, lane]`` like the row
    layout's rows (``row = 16 * tile + lane``): codes [N/16, 16, K/32, C, 4] uint8 (C = bits groups
    of 4 bytes per block), scales / mins [N/16, 16, G] (G groups; mins None when absent). No copy."""
    n, nb = qweight.shape[0], in_features // BLOCK
    lanes = lambda t: None if t is None else t.view(n // TILE, -1, TILE).permute(0, 2, 1)  # noqa: E731
    q = qweight.view(n // TILE, nb, -1, TILE, 4).permute(0, 3, 1, 2, 4)
    return q, lanes(scales), lanes(mins)


def compact_scales(w: "QuantLinearWeight") -> bool:
    """Store ``w``'s scales and mins as float16 when every value survives the round trip exactly;
    returns whether it did (False: left float32). In place; the weight means the same."""
    parts = [t for t in (w.scales, w.mins) if t is not None]
    if any(t.dtype != torch.float32 for t in parts):
        return all(t.dtype == torch.float16 for t in parts)
    halves = [t.half() for t in parts]
    if not all(torch.equal(h.float(), t) for h, t in zip(halves, parts)):
        return False
    w.scales = halves[0]
    if w.mins is not None:
        w.mins = halves[1]
    return True


def tileable_group(group_size: int, bits: int) -> bool:
    """Whether the kernels that read one or two scales per 32-block (the tiles, the int8 GEMV and
    GEMM, the fused decode) take this group size: 32, or 16 with 8-bit codes (GGUF Q6_K)."""
    return group_size == BLOCK or (group_size == SUB_BLOCK and bits == 8)


def tile_rows(w: "QuantLinearWeight") -> bool:
    """Interleave ``w``'s codes, scales and mins in 16-row tiles (module docstring) when it is in
    the row layout with N % 16 == 0 and a :func:`tileable_group`; returns whether ``w`` is tiled
    now. In place (one copy of each array); the weight means the same."""
    if w.tiled:
        return True
    n, ng = w.shape[0], w.in_features // w.group_size
    if n % TILE or not tileable_group(w.group_size, w.bits):
        return False
    tile = lambda t: t.view(n // TILE, TILE, ng).permute(0, 2, 1).reshape(n, ng).contiguous()  # noqa: E731
    w.qweight = w.qweight.view(n // TILE, TILE, w.in_features // BLOCK, -1, 4).permute(0, 2, 3, 1, 4).reshape(n, -1).contiguous()
    w.scales = tile(w.scales)
    if w.mins is not None:
        w.mins = tile(w.mins)
    w.tiled = True
    return True
