"""Fused C++ CPU kernels for paged attention: decode (one query token per request) and extend
(prefill of new tokens after a cached prefix), GQA, reading the pool in place.

``decode_attention`` has the signature and result of :func:`.reference.decode_attention`:
    q            [B, Hq, D]  float32 | bfloat16 (any strides, unit stride along D)
    k/v_buffer   [S, Hkv, D] float32 | bfloat16 pool of one layer, any strides with unit stride along
                 D: the engine's head-major pool (``[Hkv, S, D]`` storage seen as ``[S, Hkv, D]``,
                 strides (D, S*D, 1)) and contiguous buffers (strides (Hkv*D, D, 1)) both work
    req_to_token [R, Lmax] int32 slot table; req_pool_indices [B] and seq_lens [B] int64 (each >= 1)
    returns      [B, Hq, D] in q's dtype; Hq % Hkv == 0, D <= 256.

Work splits over (request, KV head) with ``at::parallel_for`` (honours ``torch.set_num_threads``).
Each task walks the request's slots twice, reading the pool in place (no gather copies): pass 1
loads each K row once and scores it against all G = Hq / Hkv query heads of the group; a float32
softmax (max-subtracted, the two-pass form of Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax", without the online rescaling) turns scores into weights; pass 2 loads
each V row once and accumulates the G outputs. All arithmetic is float32 (bf16 widened as
``uint16 << 16``; q is pre-multiplied by ``sm_scale`` in float32; the output is rounded to q's
dtype once). The reference instead rounds bf16 scores and weights to bf16 (HF eager), so the two
agree to bf16 rounding, and this kernel is the closer one to a float64 computation.

Batch invariance: a request's output depends only on its own query, KV rows and length: each
(request, KV head) task runs alone on one thread, and the order of every sum (4-token score
groups, 16-lane softmax chunks, the V accumulation) is fixed by that request's length, never by
the batch size, the longest request or the thread split (checked in tests/runtime/test_deterministic.py).

Build: compiled on first use by :func:`.cpu_build.load_cpp` (``-O3 -march=native``; AVX-512
intrinsics when the compiler targets AVX-512F/BW/VL, register-tiled for padded D of 64 or 128 with
G <= 8, portable scalar loops otherwise) into the sglite cache's ``torch_extensions/`` folder,
under a name that hashes the source, flags, torch version and CPU flags, so later processes reuse
the build and another CPU never loads it. Fallback: if the build fails
(no compiler, no ninja, ...) one warning is logged and every call runs the torch reference; inputs
the kernel does not cover (other devices or dtypes, D > 256) go to the reference too.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch

from . import reference
from .cpu_build import load_cpp, read_source

log = logging.getLogger(__name__)

_LIB = "sglite_cpu_attention"  # torch.ops namespace the extension registers
_DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 256



@functools.lru_cache(maxsize=None)
def load():
    """The compiled ops namespace (built once per process, cached on disk by
    :func:`.cpu_build.load_cpp`), or None after one logged warning."""
    return load_cpp("sglite_cpu_attention", read_source("cpu_attention.cpp"), ("-O3", "-march=native"),
                    ops_namespace=_LIB)


def available() -> bool:
    """True when the extension compiled (or was already built) and loaded."""
    return load() is not None


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel covers these inputs (CPU, float32/bfloat16 q, a float32/bfloat16 pool or,
    for the decode, float8_e4m3fn codes (their scales are the caller's: :mod:`.kv_quant_cpu`),
    D <= 256, unit stride along D)."""
    return (q.device.type == "cpu" and k.device.type == "cpu" and v.device.type == "cpu"
            and q.dtype in _DTYPES and k.dtype in _DTYPES + (torch.float8_e4m3fn,) and v.dtype == k.dtype
            and q.dim() == 3 and k.dim() == 3 and q.shape[-1] <= MAX_HEAD_DIM
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1)


CASCADE_MIN = 64  # shared keys from which a decode batch's common prefix is attended once (AMX)


def default_cascade_min() -> int:
    """The ``cascade_min`` of :func:`decode_attention` by default: :data:`CASCADE_MIN` when bf16
    attention may use the AMX tiles (:func:`amx_mode`; the kernel takes them where granted, else
    the bf16 dot-product tiles where built: :func:`dot_cascade_built`), else 0 (off)."""
    return CASCADE_MIN if amx_mode() else 0


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, sm_scale: float, window: int = 0,
                     softcap: float = 0.0, cascade_min: Optional[int] = None) -> torch.Tensor:
    """Fused paged decode attention; same contract as :func:`.reference.decode_attention`.

    Args/returns: see the module docstring (q [B, Hq, D], pools [S, Hkv, D] float32/bfloat16,
    req_to_token [R, Lmax] int32, req_pool_indices/seq_lens [B] int64 → [B, Hq, D] in q's dtype).
    ``window`` > 0 (sliding-window layers): a request reads only its last ``window`` slots (the
    walk starts there, so slots before it are never touched: they may be freed); ``softcap`` > 0:
    ``cap * tanh(score / cap)`` on the scaled scores before the softmax (Gemma 2).
    ``cascade_min`` (None: :func:`default_cascade_min`; 0: off): on a bf16 pool with no window,
    rows whose slot rows share their first P >= cascade_min keys (a radix-cache prefix, found per
    call: :func:`shared_prefix_groups`) attend those keys once per group (the group's rows x G heads
    as one query block) on the AMX tiles where granted, else, on a build with AVX512-BF16 and an
    even head dim, on the bf16 dot-product tiles (``csrc/decode_dot_cascade.h``: query rows in the
    lanes, each shared key broadcast once to all of them; negative ``cascade_min``: these tiles
    from ``-cascade_min`` keys even where AMX is granted, for tests and A/B runs), then each row its own keys, the two merged
    by their softmax maxima and sums (the cascade / shared-prefix decomposition of Hydragen,
    Juravsky et al. 2024, section 3; FlashInfer's cascade attention). Not batch-invariant (a
    row's rounding depends on its group): deterministic callers pass 0. The C++ op also takes the
    groups as an argument (``shared_prefix_groups``' int64 tensor, from the same slot table, rows
    and lengths): the fused decode finds them once per step for its 30 layer calls.
    Raises:
        ValueError: mismatched shapes, Hq not a multiple of Hkv, a seq_len outside [1, Lmax].
        IndexError: a request row or a slot outside the table / pool.
    Falls back to the reference when the extension is unavailable or the inputs are not covered.
    """
    ops = load()
    if ops is None or not supported(q, k_buffer, v_buffer):
        return reference.decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices,
                                          seq_lens, sm_scale, window, softcap)
    if req_to_token.dtype != torch.int32 or req_to_token.stride(-1) != 1:
        req_to_token = req_to_token.to(torch.int32).contiguous()
    return ops.decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices.to(torch.int64).contiguous(),
                                seq_lens.to(torch.int64).contiguous(), float(sm_scale), int(window), float(softcap),
                                int(default_cascade_min() if cascade_min is None else cascade_min))


def shared_prefix_groups(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         min_shared: int = CASCADE_MIN) -> list[tuple[int, list[int]]]:
    """The groups :func:`decode_attention` attends once: ``[(P, [batch rows])]``, rows whose slot
    rows agree on keys ``[0, P)``, ``P >= min_shared``, each row keeping >= 1 key of its own: the
    rows whose first ``min_shared`` slots agree form one group (>= 2 rows), ``P`` their whole common
    prefix (at most each row's length - 1); groups in the lexicographic order of those slots, rows
    ascending.

    Args:
        req_to_token: int32 [pool rows, max context], the slot table.
        req_pool_indices: [B] integer, each batch row's table row.
        seq_lens: [B] integer, each batch row's length in keys.
        min_shared: keys two rows must share from position 0 to group (``P`` is in keys too).
    Raises:
        ValueError: malformed inputs (shapes, dtypes, rows outside the table).
        RuntimeError: the C++ attention extension is unavailable."""
    ops = load()
    if ops is None:
        raise RuntimeError("the C++ attention extension is unavailable")
    flat = ops.shared_prefix_groups(req_to_token.to(torch.int32).contiguous(), req_pool_indices.to(torch.int64).contiguous(),
                                    seq_lens.to(torch.int64).contiguous(), int(min_shared)).tolist()
    out, i = [], 1
    for _ in range(flat[0]):  # [count, then per group P, k, its k rows]
        out.append((flat[i], flat[i + 2:i + 2 + flat[i + 1]]))
        i += 2 + flat[i + 1]
    return out


@functools.lru_cache(maxsize=None)
def load_extend():
    """The compiled extend-attention ops namespace (``csrc/cpu_extend_attention.cpp``, built once
    per process and cached on disk like :func:`load`), or None after one logged warning."""
    return load_cpp("sglite_cpu_extend", read_source("cpu_extend_attention.cpp"), ("-O3", "-march=native"),
                    ops_namespace="sglite_cpu_extend")


def amx_mode() -> bool:
    """Whether bf16-pool attention may run on the AMX tiles (``csrc/amx_attention.h``):
    ``SGLITE_ATTN_AMX`` = ``auto`` (default: yes where the build has the AMX path and Linux grants
    the tile state; the kernels check both) or ``0`` (the AVX-512 paths). Read per call."""
    mode = os.environ.get("SGLITE_ATTN_AMX", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"SGLITE_ATTN_AMX={mode!r}: expected auto, 0 or 1")
    return mode != "0"


def describe() -> str:
    """One line for the start-up log: which path a bf16 pool's attention takes here."""
    if not amx_mode() or not amx_ready():
        why = "SGLITE_ATTN_AMX=0" if not amx_mode() else "no AMX tiles here"
        dot = "; extend on bf16 dot products (AVX512-BF16)" if bf16_dot_built() else ""
        return f"bf16 KV pool attention: AVX-512 ({why}){dot}"
    return (f"bf16 KV pool attention: extend on the AMX tiles; decode rows sharing >= {CASCADE_MIN} cached "
            "keys attend them once per group on the tiles (SGLITE_ATTN_AMX=auto)")


def dot_cascade_built() -> bool:
    """True when the decode kernel's build has the shared-prefix pass on the bf16 dot-product
    tiles (AVX512-BF16)."""
    ops = load()
    return bool(ops is not None and ops.dot_cascade_built())


def bf16_dot_built() -> bool:
    """True when the extend kernel's build has the bf16 dot-product path (AVX512-BF16)."""
    ops = load_extend()
    return bool(ops is not None and ops.dot_built())


def amx_ready() -> bool:
    """True when the extend kernel's build has the AMX attention path and the tiles are granted."""
    ops = load_extend()
    return bool(ops is not None and ops.amx_ready())


def extend_available() -> bool:
    """True when the extend-attention extension compiled (or was already built) and loaded."""
    return load_extend() is not None


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     prefix_lens: torch.Tensor, extend_lens: torch.Tensor, sm_scale: float,
                     window: int = 0, softcap: float = 0.0, amx: Optional[bool] = None,
                     pack_kv: bool = True, fuse: bool = True, bf16_dot: bool = True) -> torch.Tensor:
    """Paged extend (prefill) attention in C++; same contract as :func:`.reference.extend_attention`.

    Args:
        q: [N, Hq, D] float32 | bfloat16 queries of the new tokens, requests concatenated
            (N = extend_lens.sum()), unit stride along D.
        k_buffer, v_buffer: [S, Hkv, D] float32 | bfloat16 pool of one layer (any strides with unit
            stride along D; head-major storage works), the new tokens' K/V already stored.
        req_to_token: [R, Lmax] int32 slot table; req_pool_indices, prefix_lens, extend_lens: [B]
            int64 (prefix >= 0, extend >= 1, prefix + extend <= Lmax).
        sm_scale: softmax scale.
        window: > 0 (sliding-window layers): new token at position p sees keys ``p - window < s <= p``
            only; a task starts at the tile of its first row's first visible key (keys before it
            are never read: they may be freed). 0: every key.
        softcap: > 0: ``cap * tanh(score / cap)`` on the scaled scores before the softmax (Gemma 2).
        amx: bf16 pools on the AMX tiles (``csrc/amx_attention.h``) where the build has them and
            Linux grants the tile state; None: :func:`amx_mode` (``SGLITE_ATTN_AMX``); False: the
            AVX-512 path below.
        pack_kv: on the AMX path, pack each request's K/V into tile layout once per call (per KV
            head, blocks of 256 keys, in parallel over blocks; requests with one task per head and
            any past 256 MB of packed keys pack per task) instead of once per task; False: every
            task packs the keys it reads (the results are bitwise the same: a test compares).
        fuse: with ``pack_kv`` on the AMX path, a request of 2 to 16 blocks of ``64 // G`` new
            tokens (e.g. an agent's 70-token turn over its cached history) runs as fused tasks:
            each packs a 256-key block once into its thread's scratch and multiplies it by all its
            query blocks (their rows' own block calls, so the same bits), instead of reading the
            call-wide packed buffer once per query block; the fused tasks hold 16, 8, 4 or 2 query blocks
            (the most that leave >= 3 tasks a thread; none if 2 does not). False: the call-wide packing only.
        bf16_dot: off the AMX tiles, a bf16 pool with an even head dim runs on the bf16 dot-product
            tiles (``csrc/extend_dot.h``, VDPBF16PS) where the build has AVX512-BF16
            (:func:`bf16_dot_built`); False: the float32 tiles (A/B runs, tests).
    Returns:
        [N, Hq, D] in q's dtype. New token i of request b sees keys 0 .. prefix_lens[b] + i
        (the last ``window`` of them with a window).
    Raises:
        ValueError: mismatched shapes, Hq not a multiple of Hkv, lengths outside the table, N not the
            sum of extend_lens.
        IndexError: a request row or a slot outside the table / pool.

    Algorithm: flash attention's tiled online softmax (Dao et al. 2022, "FlashAttention", Alg. 1;
    Milakov & Gimelshein 2018). Work splits into tasks of (request, KV head, block of up to
    ``64 // G`` new tokens); threads (``at::parallel_for``, ``torch.set_num_threads``) pull tasks,
    longest first, from a shared counter. A task's rows (tokens x the G heads of the group) walk
    the keys 0 .. its last visible one in tiles of 64 slots read through ``req_to_token`` (no
    gather of the context), widened to float32 once per tile and shared by all rows: scores as
    an outer-product micro-kernel (AVX-512, 4 keys x up to 64 rows in registers), a running max,
    sum and output per row, causal masking only on the tiles that cross a row's position. All
    arithmetic is float32 (q pre-scaled by ``sm_scale``; one rounding to q's dtype at the end);
    the reference (SDPA in the pool dtype) rounds bf16 intermediates, so the two agree to bf16
    rounding. A row's result depends only on its own query, position and keys (tiles are anchored
    at key 0 of the request), never on the batch, the block it shares or the thread split.
    Head dims are padded to 64, 128 or 256 inside the kernel.

    The AMX path (bf16 pools, G <= 64): the same tasks and anchoring, keys in blocks of up to 256;
    S = Q K^T and P V run on TDPBF16PS tiles from K^T and V packed into tile layout (16 x 16
    transposes of bf16 pairs; key pairs interleaved per dimension) once per call for each request
    and KV head (``pack_kv``), not once per task (a request of 2-16 query blocks: once per fused
    task, ``fuse``), the masks and the online softmax in
    float32 on AVX-512. The scaled query and the weights P are rounded to bf16 once (float32
    sums): the same order of error as the reference's bf16 scores, and a row still depends only on
    its own query, position and keys. 1.9-5.9x the AVX-512 path per layer on a 2-core Sapphire
    Rapids VM (``SGLITE_ATTN_AMX=0`` compares; docs/benchmarks.md).

    The bf16 dot-product path (``bf16_dot``; bf16 pools, even D, AVX512-BF16 without AMX, e.g. AMD
    Zen 4): the same tasks of up to 128 query rows, tiles and online softmax, with S = Q K^T
    (query rows in the lanes, each key's (d, d + 1) pair broadcast from the pool: no widened copy
    of K) and P V (head dims in the lanes, two keys' weights broadcast against their values,
    interleaved once per tile) on VDPBF16PS: two bf16 products per float32 lane and instruction,
    twice a float32 FMA's. The queries stay as stored (float32 ones are rounded to bf16 once) and
    the scale multiplies the float32 scores; P is rounded to bf16 as on the tiles.
    Falls back to the reference when the extension is unavailable or the inputs are not covered.
    """
    ops = load_extend()
    if ops is None or not supported(q, k_buffer, v_buffer) or k_buffer.dtype not in _DTYPES:  # no fp8 extend
        return reference.extend_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices,
                                          prefix_lens, extend_lens, sm_scale, window, softcap)
    if req_to_token.dtype != torch.int32 or req_to_token.stride(-1) != 1:
        req_to_token = req_to_token.to(torch.int32).contiguous()
    args = (q, k_buffer, v_buffer, req_to_token, req_pool_indices.to(torch.int64).contiguous(),
            prefix_lens.to(torch.int64).contiguous(), extend_lens.to(torch.int64).contiguous(), float(sm_scale))
    mode = int(amx_mode() if amx is None else amx)
    if mode:
        mode = 2 if not pack_kv else (1 if fuse else 3)
    return ops.extend_attention(*args, int(window), float(softcap), mode, bool(bf16_dot))
