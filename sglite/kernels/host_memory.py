"""The one host (CPU) allocator for large buffers: the KV pool (zeroed, untouched until used) and the
packed matmul weights (transparent huge pages, 2 MiB).

Why huge pages for the weights: the C++ GEMV (:mod:`.cpu_gemv`) streams each weight once per step;
with 4 KiB pages the hardware prefetcher stops at every page boundary and the TLB misses every 4 KiB
(measured: the SmolLM2 LM head read at 18 GB/s from 4 KiB pages, 32 GB/s from huge pages).

Why 4 KiB pages for the KV pool: it is written a token at a time into head-major planes (one plane
per layer, K or V, and KV head), so the first prompt that reaches a fresh region of the pool touches
one page per plane: with 2 MiB pages that is 180 pages (360 MB zeroed) for SmolLM2's 30 x 2 x 3
planes against ~47 MB of K/V written. Measured on the 2-core AMX VM (2026-12-06, eighth pass,
`scripts/step_timeline.py --workload shared-prefix --mode inproc`, alternated): huge pages made the
decode steps ~3 % faster (3,325 / 3,142 against 3,316 / 3,427 ms for 63 steps) and the mixed
prefill steps ~25 % slower (1,649 / 1,627 against 1,271 / 1,345 ms), 5.36 / 5.14 against 4.97 /
5.12 s in all; a fresh 2,048-token prompt took 898 against 645 ms. (Until then the pool was meant
to take huge pages but did not: it was a shared anonymous mapping, which transparent huge pages
skip; an earlier measurement of huge pages on the pool, a batch-64 bf16 decode step 2-4 % faster,
did not count their first-touch cost.) Populating the whole 4.5 GiB pool at start-up instead took
6.2 s here in 4 KiB pages (``MADV_POPULATE_WRITE``), 11.8 s in huge pages.

Best effort everywhere: the memory is advised before its first touch (``torch.empty`` of a large
block maps fresh pages), so the kernel can back it with huge pages; small buffers (< 4 MiB) and
non-Linux hosts get plain allocations. No C++ is involved (``ctypes`` calls libc's ``madvise``).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import sys

import torch

HUGE_PAGE = 2 << 20  # bytes
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
MIN_BYTES = 2 * HUGE_PAGE  # smaller buffers are not worth the alignment padding


def available_host_bytes() -> int:
    """Available host memory in bytes: ``MemAvailable`` of /proc/meminfo, else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _madvise_hugepage(ptr: int, nbytes: int) -> bool:
    libc = _libc()
    if libc is None or nbytes <= 0:
        return False
    try:
        return libc.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def empty_hugepage(nbytes: int) -> torch.Tensor:
    """An uninitialised ``uint8 [nbytes]`` CPU buffer, 2 MiB aligned and advised for huge pages
    (a view of a slightly larger buffer that it keeps alive). Below :data:`MIN_BYTES`, or off
    Linux, a plain ``torch.empty`` (64-byte aligned by torch's allocator).

    Raises:
        ValueError: ``nbytes`` < 0.
    """
    if nbytes < 0:
        raise ValueError(f"empty_hugepage: nbytes must be >= 0, got {nbytes}")
    if nbytes < MIN_BYTES or not sys.platform.startswith("linux"):
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # [nbytes + 2 MiB], pages not touched yet
    off = (-raw.data_ptr()) % HUGE_PAGE
    buf = raw[off:off + nbytes]
    _madvise_hugepage(buf.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE)
    return buf


def zeros_untouched(shape, dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype)`` on the CPU without touching its pages: a private anonymous
    ``mmap`` (zero-filled by the kernel on first touch), 2 MiB aligned, so a large KV pool costs no
    time and no resident memory until its pages are used (a 4.5 GiB pool zeroed up front took 41 s
    of start-up on a loaded 2-core machine). Advised ``MADV_NOHUGEPAGE``: 4 KiB pages even where
    the host's THP setting is ``always`` (see the module docstring). Below :data:`MIN_BYTES`, or
    off Linux, plain ``torch.zeros``. Returns a contiguous tensor of ``shape`` (a view that keeps
    the mapping alive; it is unmapped when the last view goes)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    # private (Python's default for -1 is MAP_SHARED: shared memory, which the THP advice skips)
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # [nbytes + 2 MiB], keeps `mm` alive
    off = (-raw.data_ptr()) % HUGE_PAGE
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_NOHUGEPAGE, off, nbytes // HUGE_PAGE * HUGE_PAGE)
        except OSError:  # no THP here: 4 KiB pages anyway
            pass
    return raw[off:off + nbytes].view(dtype).view(shape)


def hugepage_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (CPU) packed into one :func:`empty_hugepage` buffer, each copy
    contiguous and 64-byte aligned. The copies share one storage, so the buffer lives while any of
    them does; release the originals to avoid holding both."""
    offs, total = [], 0
    for t in tensors:
        offs.append(total)
        total += (t.numel() * t.element_size() + 63) // 64 * 64
    buf = empty_hugepage(max(total, 64))  # [total] uint8
    if buf.data_ptr() % 64:  # plain torch.empty is 64-aligned; keep the promise if it ever is not
        buf = empty_hugepage(max(total, 64) + 64)
        buf = buf[(-buf.data_ptr()) % 64:]
    out = []
    for t, o in zip(tensors, offs):
        n = t.numel() * t.element_size()
        out.append(buf[o:o + n].view(t.dtype).view(t.shape).copy_(t))
    return out
