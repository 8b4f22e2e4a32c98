"""KV pool prefault: ``host_memory.populate`` (madvise MADV_POPULATE_WRITE) and the pool's chunks
of it ahead of the allocator, which the engine loop runs while idle (``--kv-prefault-mb``).
Residency is read with ``mincore`` (deterministic: the pool's mapping is advised MADV_NOHUGEPAGE)."""
import ctypes
import sys
import threading
import time

import pytest
import torch

from sglite.config import EngineConfig
from sglite.errors import InvalidRequestError
from sglite.kernels.host_memory import PAGE, populate, zeros_untouched
from sglite.runtime.kv_pool import TokenToKVPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise / mincore: Linux only")


def resident(addr: int, nbytes: int) -> list[bool]:
    """Per 4 KiB page of ``[addr, addr + nbytes)`` (rounded out): whether it is resident (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    lo = addr // PAGE * PAGE
    n = -(-(addr + nbytes - lo) // PAGE)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(n * PAGE), vec) == 0, ctypes.get_errno()
    return [bool(b & 1) for b in vec]


def _need_populate(addr: int) -> None:
    if not populate(addr, 1):
        pytest.skip("MADV_POPULATE_WRITE unsupported on this kernel (< 5.14)")


def test_populate_makes_the_range_resident_and_keeps_contents():
    t = zeros_untouched((4 << 20,), torch.uint8)  # 4 MiB: the mmap path, untouched
    base = t.data_ptr()
    t[100] = 7  # page 0 written
    _need_populate(base)  # page 0 only (already resident)
    assert resident(base + PAGE, 300 * PAGE) == [False] * 300
    lo, n = base + 10 * PAGE + 123, 20 * PAGE  # unaligned: rounded out to pages 10 .. 30
    t[10 * PAGE + 5] = 3  # written before: kept
    assert populate(lo, n)
    got = resident(base + 9 * PAGE, 23 * PAGE)  # pages 9 .. 31
    assert got == [False] + [True] * 21 + [False], got
    expect = torch.zeros(4 << 20, dtype=torch.uint8)
    expect[100], expect[10 * PAGE + 5] = 7, 3
    assert torch.equal(t, expect)
    assert populate(lo, 0)  # nothing to do
    assert not populate(0, PAGE)  # no mapping there: refused (ENOMEM), not an error


def _pool(tokens=32768, page_size=16):
    # 2 layers x K/V x 2 heads x D 64 bf16: 1,024 bytes per token, 16 KiB per page; each head
    # plane [S, 64] bf16 holds 32 slots per 4 KiB OS page (two pool pages)
    return TokenToKVPool(tokens, page_size, 2, 2, 64, torch.bfloat16)


def _plane_pages(pool, s0, s1):
    """Residency of slots [s0, s1) in every head plane of every layer's K and V."""
    out = []
    for b in pool.k_buffers + pool.v_buffers:
        for h in range(b.shape[1]):
            out.append(resident(b[s0:s1, h].data_ptr(), (s1 - s0) * 128))
    return out


def test_pool_prefaults_ahead_of_high_water_in_bounded_chunks():
    pool = _pool()
    _need_populate(pool.k_buffers[0].data_ptr())
    pool.k_buffers[1][40, 1] = 2.0  # a written slot (page 2, head 1: 64 values): its contents stay
    assert pool.enable_prefault(1 << 20) == "prefault 1 MiB (1024 tokens) ahead of the allocator while idle"
    ends = [pool.prefault_end]
    while pool.prefault_step(max_bytes=10 * 16384):  # 10 pages per chunk
        ends.append(pool.prefault_end)
    ends.append(pool.prefault_end)
    assert ends[0] == 1 and ends[-1] == 1 + 64
    assert all(0 < b - a <= 10 for a, b in zip(ends, ends[1:-1]))
    assert not pool.prefault_step() and pool.prefault_end == 65  # stops there
    assert all(all(p) for p in _plane_pages(pool, 16, 65 * 16))  # pages 1 .. 64 of every plane
    assert not any(any(p) for p in _plane_pages(pool, 67 * 16, 200 * 16))  # beyond: untouched
    # the allocator moves past it: the prefault follows the high-water mark (from above it)
    slots = pool.alloc_extend(None, 0, 100 * 16)
    assert pool.high_water == 100 and int(slots.max()) == 101 * 16 - 1
    assert pool.prefault_step(max_bytes=10 * 16384) and pool.prefault_end == 111
    while pool.prefault_step():
        pass
    assert pool.prefault_end == 101 + 64
    assert all(all(p) for p in _plane_pages(pool, 101 * 16, 165 * 16))
    # freed pages go back on top of the stack: reusing them does not move the mark
    pool.free(slots)
    pool.alloc_extend(None, 0, 50 * 16)
    assert pool.high_water == 100 and not pool.prefault_step()
    assert bool((pool.k_buffers[1][40, 1] == 2.0).all()) and int(torch.count_nonzero(pool.k_buffers[1])) == 64


def test_prefault_stops_at_the_pool_end_and_is_off_when_not_asked():
    pool = _pool(tokens=4096)  # 256 pages: 1 MiB ahead covers them all
    _need_populate(pool.k_buffers[0].data_ptr())
    assert pool.enable_prefault(0) == "prefault off" and not pool.prefault_step()
    pool.enable_prefault(64 << 20)
    while pool.prefault_step():
        pass
    assert pool.prefault_end == pool.num_pages + 1


def test_quantized_and_sliding_window_pools_do_not_prefault():
    from sglite.runtime.kv_quant import QuantTokenToKVPool
    from sglite.runtime.swa_pool import SWATokenToKVPool

    q = QuantTokenToKVPool(32768, 128, 2, 2, 64, torch.bfloat16, kind="int8", group=128, max_reqs=4)
    s = SWATokenToKVPool(32768, 4096, 16, (True, False, True), 512, 2, 64, torch.bfloat16)
    for pool in (q, s):
        assert pool.enable_prefault(64 << 20).startswith("prefault off") and not pool.prefault_step()
        slots = pool.alloc_extend(None, 0, 300)
        assert slots is not None and pool.high_water == int(slots.max()) // pool.page_size
        assert not pool.prefault_step() and pool.prefault_end == 1


def test_flag_is_validated_and_reaches_the_config():
    from sglite.launch_server import build_parser, engine_kwargs

    assert EngineConfig().kv_prefault_mb == 512
    assert engine_kwargs(build_parser().parse_args(["--kv-prefault-mb", "0"])) == {"kv_prefault_mb": 0}
    with pytest.raises(InvalidRequestError, match="kv_prefault_mb: must be >= 0, got -1"):
        EngineConfig(kv_prefault_mb=-1)


def test_engine_serves_a_request_that_arrives_while_prefault_is_pending(tiny_model_dir):
    """The loop is held inside a prefault chunk until the request is queued: it is served
    between chunks, gives the tokens of an engine without prefault, and the prefault then
    finishes above the request's pages with the pool invariants intact."""
    from sglite import Engine

    kw = dict(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=65536, check_invariants=True)
    prompt, sp = list(range(5, 305)), {"max_new_tokens": 8, "temperature": 0}
    with Engine(**kw, kv_prefault_mb=0) as e:
        base = e.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
    e = Engine(**kw, kv_prefault_mb=16)
    try:
        pool, loop = e.runner.token_to_kv_pool, e._loop
        _need_populate(pool.k_buffers[0].data_ptr())
        held, release, seen = threading.Event(), threading.Event(), []

        def chunk():  # 64 KiB chunks; the first one waits for the request
            if not release.is_set():
                held.set()
                release.wait(30)
            seen.append(pool.high_water)
            return pool.prefault_step(max_bytes=64 << 10)

        def restart():  # on the loop thread: prefault from the start again (populate is idempotent)
            pool.prefault_end, loop.idle_work = 1, chunk
        loop.call(restart)
        assert held.wait(30)
        out = {}
        t = threading.Thread(target=lambda: out.update(e.generate(input_ids=prompt, sampling_params=sp)))
        t.start()
        deadline = time.monotonic() + 30
        while loop._inbox.empty() and time.monotonic() < deadline:  # the request is queued
            time.sleep(0.01)
        release.set()
        t.join(60)
        assert out["output_ids"] == base
        target = pool.high_water + 1 + pool._prefault_ahead
        while loop.call(lambda: pool.prefault_end) < min(target, pool.num_pages + 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen[0] == 0 and seen[-1] == pool.high_water >= len(prompt)  # served between chunks
        assert pool.prefault_end == min(target, pool.num_pages + 1)
        e.check_invariants()
    finally:
        e.shutdown()
