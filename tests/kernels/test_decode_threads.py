"""Threads of the fused CPU decode (csrc/thread_pool.h through sglite.kernels.decode_fused): the
result does not depend on the thread count, bit for bit. The single-thread kernel is the oracle:
the LM-head GEMV (head_q8) on random shapes, 4/8-bit codes, row and 16-row tile layouts, with and
without offsets, 1..13 rows, against threads 1..4 and against quant_cpu.gemv_q8 (the same
arithmetic in its own module); the whole fused step (every layer's GEMVs and the attention split
over (row, KV head) tasks) on a tiny quantized Llama, float32 (float-exact GEMV) and bf16 (int8
activations), 4 and 8 bits, 1 and 3 decode rows, threads 1..4."""
import json

import pytest
import torch

from tests.kernels.test_decode_fused import PROMPTS, quantized_tiny  # noqa: F401  (the shared fixture)
from sglite.kernels import decode_fused, quant_cpu
from sglite.kernels.quant_layout import tile_rows
from sglite.kernels.quant_linear import QuantLinearWeight

pytestmark = pytest.mark.skipif(not quant_cpu.available() or decode_fused.load() is None,
                                reason="the C++ kernels did not build here")
THREADS = (1, 2, 3, 4)


def make(n, k, bits, seed, mins):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    m = (torch.randn(n, k // 32, generator=g) * 0.05).half().float() if mins else None
    return QuantLinearWeight.from_codes(codes, s, m, bits, 32)


def head(x, w, threads):
    mins = w.mins if w.mins is not None else torch.empty(0, dtype=w.scales.dtype)
    return decode_fused.load().head_q8(x, w.qweight, w.scales, mins, w.bits, w.tiled, threads, 0,
                                      torch.empty(0, dtype=torch.int16))


@pytest.mark.parametrize("bits,n,k,mins,tiled", [(4, 37, 96, True, False), (4, 64, 576, True, True),
                                                 (8, 19, 160, True, False), (8, 48, 64, False, True),
                                                 (4, 1000, 224, False, False), (8, 2048, 96, True, True)])
def test_head_gemv_is_thread_invariant(bits, n, k, mins, tiled):
    w = make(n, k, bits, seed=n + k, mins=mins)
    if tiled:
        assert tile_rows(w) and w.tiled
    for rows in (1, 2, 5, 8, 13):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
        one = head(x, w, 1)
        assert one.shape == (rows, n) and one.dtype == torch.float32
        assert torch.equal(one, quant_cpu.gemv_q8(x, w))  # the same arithmetic as the per-op kernel
        for t in THREADS[1:]:
            assert torch.equal(head(x, w, t), one), (rows, t)


def test_head_gemv_rejects_bad_threads():
    w = make(16, 64, 4, seed=3, mins=True)
    with pytest.raises(RuntimeError, match="threads"):
        head(torch.randn(1, 64), w, 0)




@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_fused_step_is_thread_invariant(quantized_tiny, bits, dtype):
    """Every fused step of a generation recomputed at 1..4 threads: the logits equal bit for bit
    (the step rewrites the same KV slots with the same values each time)."""
    from sglite import Engine

    e = Engine(model_path=str(quantized_tiny[bits]), dtype=dtype, max_total_tokens=2048)
    try:
        model = e.runner.model
        fused = model.decode_fused
        assert fused is not None
        rows_seen = []

        class Checked:
            def forward(self, fb, kb, vb):
                fused.threads = 1
                one = fused.forward(fb, kb, vb)
                if one is not None:
                    rows_seen.append(fb.input_ids.shape[0])
                    for t in THREADS[1:]:
                        fused.threads = t
                        for split_min in (0, decode_fused.ATTN_SPLIT_MIN):  # attention split / on one thread
                            fused.attn_split_min = split_min
                            assert torch.equal(fused.forward(fb, kb, vb), one), (t, split_min)
                fused.threads, fused.attn_split_min = None, decode_fused.ATTN_SPLIT_MIN
                return one

        model.decode_fused = Checked()
        sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
        e.generate(input_ids=PROMPTS, sampling_params=sp)  # 3 rows: fewer than 4 threads x 2 KV heads
        e.generate(input_ids=PROMPTS[0], sampling_params=sp)  # 1 row: the attention split by KV head
        assert 3 in rows_seen and 1 in rows_seen
    finally:
        e.shutdown()


def test_thread_probe_pick_candidates_and_cache(quantized_tiny, monkeypatch, tmp_path):
    from sglite import Engine
    from sglite.kernels import decode_threads as dt

    assert dt.candidates(2) == [1, 2] and dt.candidates(64) == [1, 2, 4, 8, 16, 32, 63, 64]
    assert dt.pick({1: 10.0, 2: 5.0}) == 2
    assert dt.pick({1: 10.0, 2: 9.9}) == 1  # within MIN_GAIN: the smaller count
    assert dt.pick({1: 10.0, 2: 6.0, 4: 5.9}) == 2
    monkeypatch.setattr(dt, "cache_root", lambda: tmp_path)
    monkeypatch.setenv("SGLITE_THREAD_PROBE", "off")
    with Engine(model_path=str(quantized_tiny[4]), dtype="bfloat16", max_total_tokens=2048) as e:
        assert torch.get_num_threads() == dt.fallback_threads()
        fused = e.runner.model.decode_fused
        monkeypatch.delenv("SGLITE_THREAD_PROBE")
        times = dt.measure(fused)
        assert set(times) == set(dt.candidates(dt.usable_cpus())) and all(v > 0 for v in times.values())
        t = dt.default_threads(fused)  # probes and caches
        assert 1 <= t <= dt.usable_cpus()
        cached = json.loads((tmp_path / "thread_probe.json").read_text())
        assert cached[dt.cache_key(fused)]["threads"] == t
        monkeypatch.setattr(dt, "measure", lambda *a, **k: pytest.fail("the cached count was not used"))
        assert dt.default_threads(fused) == t
        key = dt.cache_key(fused)  # a probe taken on a busy machine: reused while busy, measured again when quiet
        dt._write_cache(key, {"threads": 1, "ms": {"1": 1.0}, "when": "then", "load": 0.9})
        monkeypatch.setattr(dt, "load_per_cpu", lambda: 0.9)
        assert dt.default_threads(fused) == 1
        monkeypatch.setattr(dt, "load_per_cpu", lambda: 0.1)
        monkeypatch.setattr(dt, "measure", lambda *a, **k: {1: 2.0e-3, 2: 1.0e-3})
        assert dt.default_threads(fused) == 2
        assert json.loads((tmp_path / "thread_probe.json").read_text())[key]["load"] == 0.1
    assert dt.default_threads(None) == dt.fallback_threads()


def test_serial_torch_runs_one_thread_and_restores_the_count():
    """Inside ``serial_torch`` torch runs on one thread; the caller's count comes back on exit, after
    an exception too, and a count of 1 stays 1."""
    from sglite.kernels import serial_torch

    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with serial_torch():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"):
            with serial_torch():
                raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        with serial_torch():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(old)
