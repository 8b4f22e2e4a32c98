"""C++ few-row bf16 GEMV (sglite.kernels.cpu_gemv) against an fp32 reference of the same bf16
inputs, the huge-page packing (sglite.kernels.host_memory), and the build helper's fallback
(sglite.kernels.cpu_build)."""
import logging

import pytest
import torch
import torch.nn.functional as F

from sglite.kernels import cpu_build, cpu_gemv, host_memory


def _kernel():
    missing = [f for f in cpu_gemv.REQUIRED_FLAGS if f not in cpu_build.cpu_flags()]
    if missing:
        pytest.skip(f"CPU lacks {', '.join(missing)}")
    mod = cpu_gemv.load()
    if mod is None:
        pytest.skip("the C++ GEMV did not build here (no compiler or ninja; see the logged warning)")
    return mod


def _check(y, x, w, b=None):
    """y equals the fp32 product of the bf16 inputs rounded to bf16, up to summation order."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())  # [M, N] fp32
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    # summation-order error of fp32 dots (K terms) plus one bf16 rounding (half an ulp = 2^-8 rel.)
    order = x.shape[1] * 2.0 ** -23 * (x.float().abs() @ w.float().abs().T)
    tol = ref.abs() * 2.0 ** -8 + 1.01 * order + 1e-30
    err = (y.float() - ref).abs()
    assert bool((err <= tol).all()), float((err / tol).max())
    # and nearly always exactly the rounded reference (a truncating rounding would miss half)
    assert int((y != ref.bfloat16()).sum()) <= max(1, ref.numel() // 30)


@pytest.mark.parametrize("N", [1, 7, 64, 576, 1000])
@pytest.mark.parametrize("K", [1, 7, 64, 576, 1000])
def test_gemv_matches_fp32_reference(N, K):
    _kernel()
    g = torch.Generator().manual_seed(N * 1009 + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    for M in (1, 2, 5, cpu_gemv.MAX_ROWS):
        x = torch.randn(M, K, generator=g).bfloat16()
        assert cpu_gemv.supports(x, w)
        _check(cpu_gemv.gemv(x, w), x, w)


def test_gemv_bias_threads_and_layouts():
    mod = _kernel()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 1000, generator=g).bfloat16()[1:2, ::2]  # [1, 500] non-contiguous row
    w = torch.randn(333, 500, generator=g).bfloat16()
    b = torch.randn(333, generator=g).bfloat16()
    _check(mod.gemv_bf16(x, w, b), x, w, b)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        big = torch.randn(4099, 96, generator=g).bfloat16()
        xb = torch.randn(1, 96, generator=g).bfloat16()
        _check(cpu_gemv.gemv(xb, big), xb, big)
    finally:
        torch.set_num_threads(old)
    # uncovered inputs run F.linear (float32, several rows)
    xf, wf = torch.randn(2, 5), torch.randn(3, 5)
    assert torch.equal(cpu_gemv.gemv(xf, wf), F.linear(xf, wf))
    with pytest.raises(RuntimeError, match="K"):
        mod.gemv_bf16(x[:, :-1], w, None)
    x9 = torch.randn(cpu_gemv.MAX_ROWS + 1, 500).bfloat16()
    assert not cpu_gemv.supports(x9, w)
    with pytest.raises(RuntimeError, match="M <= 8"):
        mod.gemv_bf16(x9, w, None)
    assert torch.equal(cpu_gemv.gemv(x9, w), F.linear(x9, w))
    x4 = torch.randn(4, 500, generator=g).bfloat16()
    _check(mod.gemv_bf16(x4, w, b), x4, w, b)


@pytest.mark.parametrize("big", [False, True])
def test_hugepage_copies_are_equal_aligned_and_shared(big):
    ts = [torch.randn(5, 7).bfloat16(), torch.randn(3).bfloat16(), torch.randn(64, 64).bfloat16()]
    if big:  # past MIN_BYTES: the huge-page path (2 MiB aligned)
        ts.append(torch.randn(1100, 1000).float())
    cp = host_memory.hugepage_copies(ts)
    assert all(torch.equal(a, b) and a.shape == b.shape and a.dtype == b.dtype for a, b in zip(ts, cp))
    assert all(c.data_ptr() % 64 == 0 and c.is_contiguous() for c in cp)
    assert cp[0].untyped_storage().data_ptr() == cp[2].untyped_storage().data_ptr()
    if big:
        assert cp[0].data_ptr() % host_memory.HUGE_PAGE == 0
    with pytest.raises(ValueError, match="nbytes"):
        host_memory.empty_hugepage(-1)


def test_failed_build_returns_none_and_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="sglite.kernels.cpu_build"):
        assert cpu_build.load_cpp("sglite_forced_failure", "#error forced failure\n", ("-O0",),
                                  ops_namespace="sglite_forced_failure") is None
    assert any("sglite_forced_failure" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="exactly one"):
        cpu_build.load_cpp("x", "", functions=["f"], ops_namespace="x")


def test_gemv_falls_back_without_kernel(monkeypatch):
    monkeypatch.setattr(cpu_gemv, "load", lambda: None)
    x, w = torch.randn(1, 33).bfloat16(), torch.randn(9, 33).bfloat16()
    assert not cpu_gemv.available()
    assert torch.equal(cpu_gemv.gemv(x, w), F.linear(x, w))
    xs = torch.randn(5, 33).bfloat16()  # the invariant fallback: one F.linear per row
    assert torch.equal(cpu_gemv.linear_invariant(xs, w), torch.cat([F.linear(xs[i:i + 1], w) for i in range(5)]))
    g, u = torch.randn(3, 37), torch.randn(3, 37)
    assert torch.equal(cpu_gemv.silu_mul(g, u), torch.stack([F.silu(g[i]) * u[i] for i in range(3)]))


def test_cpp_sources_are_package_data_files():
    """The C++ sources live in sglite/kernels/csrc/*.cpp (shipped as package data), not in Python strings."""
    from pathlib import Path

    names = sorted(p.name for p in cpu_build.CSRC.glob("*.cpp"))
    assert {"cpu_attention.cpp", "cpu_gemv.cpp", "quant_gemv.cpp"} <= set(names), names
    assert all("#include" in cpu_build.read_source(n) for n in names)
    kernels_dir = cpu_build.CSRC.parent
    assert not [p.name for p in kernels_dir.glob("*.py") if "#include <" in p.read_text()]
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    text = pyproject.read_text()
    assert '"sglite.kernels.csrc" = ["*.cpp", "*.h"]' in text and '"sglite.kernels.csrc",' in text
    # csrc headers are spliced in, once, so the build tag covers every compiled line
    for n in names:
        src = cpu_build.read_source(n)
        assert '#include "' not in src
        uses_math = '#include "avx512_math.h"' in (cpu_build.CSRC / n).read_text()
        assert src.count("inline __m512 exp_nonpos(") == int(uses_math), n
        uses_scalar = '#include "scalar_math.h"' in (cpu_build.CSRC / n).read_text()
        assert src.count("namespace sglite_scalar {") == int(uses_scalar), n
    # the scalar dot / axpy fallbacks are written once, in the shared header
    users = [n for n in names if '#include "scalar_math.h"' in (cpu_build.CSRC / n).read_text()]
    assert {"cpu_attention.cpp", "kv_quant_attention.cpp"} <= set(users), users
    for n in users:
        raw = (cpu_build.CSRC / n).read_text()
        assert "float s[8]" not in raw and "float part[8]" not in raw and "inline float widen(" not in raw, n
    with pytest.raises(FileNotFoundError):
        cpu_build.read_source("missing.cpp")


def test_stale_build_lock_is_removed_and_a_live_one_waited_for(tmp_path):
    """A lock left by a killed build (old mtime) is removed; a fresh one is waited for until its
    holder deletes it (torch's own wait would hang forever on a stale one)."""
    import os
    import threading
    import time

    lock = tmp_path / "lock"
    assert cpu_build.clear_stale_lock(lock) is False  # no lock: nothing to do
    lock.touch()
    old = time.time() - 2 * cpu_build.STALE_LOCK_S
    os.utime(lock, (old, old))
    assert cpu_build.clear_stale_lock(lock) is True and not lock.exists()
    lock.touch()  # a live build: released by its holder after 0.3 s
    threading.Timer(0.3, lock.unlink).start()
    t = time.monotonic()
    assert cpu_build.clear_stale_lock(lock, poll_s=0.05) is False
    assert time.monotonic() - t >= 0.25 and not lock.exists()


def _hold_build(build_dir, seconds):
    """A process that builds in ``build_dir``: takes the owner lock, writes torch's ``lock``,
    prints ``ready``, sleeps ``seconds`` and removes it (unless killed first)."""
    import subprocess
    import sys

    code = ("import sys, time; from pathlib import Path; from sglite.kernels import cpu_build\n"
            "d = Path(sys.argv[1])\n"
            "with cpu_build.build_owner(d):\n"
            "    (d / 'lock').touch(); print('ready', flush=True); time.sleep(float(sys.argv[2]))\n"
            "    (d / 'lock').unlink()\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(build_dir), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_killed_builders_lock_is_cleared_at_once_and_a_live_one_waited_for(tmp_path):
    """torch's build lock left by a SIGKILLed build is removed by the next process at once (the
    dead holder's flock is gone), not after STALE_LOCK_S; a live builder is waited for."""
    import time

    p = _hold_build(tmp_path, 60)
    p.kill()
    p.wait()
    assert (tmp_path / "lock").exists()
    t = time.monotonic()
    with cpu_build.build_owner(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - t < 5
    p = _hold_build(tmp_path, 0.5)
    t = time.monotonic()
    with cpu_build.build_owner(tmp_path):
        waited = time.monotonic() - t
        assert not (tmp_path / "lock").exists()
    p.wait()
    assert waited >= 0.3 and p.returncode == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_reads_row_strided_halves_in_place(dtype):
    """The two halves of a fused gate_up product ([M, 2I] chunked: row stride 2I, unit stride along I)
    give the bits of the contiguous inputs, for random shapes (I not a multiple of 16 included),
    and a 3-D or column-strided input still goes through the contiguous path."""
    if not cpu_gemv.available():
        pytest.skip("C++ GEMV extension unavailable")
    gen = torch.Generator().manual_seed(7)
    for M, I in ((1, 5), (3, 37), (17, 64), (40, 1536), (0, 16)):
        gu = torch.randn(M, 2 * I, generator=gen).to(dtype)
        g, u = gu.chunk(2, dim=-1)
        got = cpu_gemv.silu_mul(g, u)
        assert got.is_contiguous() and got.shape == (M, I), (M, I)
        assert torch.equal(got, cpu_gemv.silu_mul(g.contiguous(), u.contiguous())), (M, I)
        torch.testing.assert_close(got.float(), (F.silu(g.float()) * u.float()).to(dtype).float(),
                                   rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    g3, u3 = torch.randn(2, 3, 40, generator=gen).to(dtype), torch.randn(2, 3, 40, generator=gen).to(dtype)
    flat = cpu_gemv.silu_mul(g3.reshape(6, 40), u3.reshape(6, 40))
    assert torch.equal(cpu_gemv.silu_mul(g3, u3), flat.view(2, 3, 40))
    gt, ut = g3[0].t(), u3[0].t()  # unit stride along rows, not columns
    assert torch.equal(cpu_gemv.silu_mul(gt, ut), cpu_gemv.silu_mul(gt.contiguous(), ut.contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_against_torch(dtype):
    """GeGLU's activation against torch's ``F.gelu(g, approximate="tanh") * u`` on random shapes
    (row-strided halves of a fused gate_up, I not a multiple of 16, values out to |g| = 12): float32
    within 1e-5 (the tanh from the kernel's exp); bf16 each element equal to torch's or one rounding
    step of the activation away (plus the tanh's 1e-7 in the far tails), and almost all equal; halves read in place give the contiguous bits."""
    if not cpu_gemv.available():
        pytest.skip("C++ GEMV extension unavailable")
    gen = torch.Generator().manual_seed(11)
    same = total = 0
    for M, I in ((1, 5), (3, 37), (17, 64), (40, 2048), (0, 16)):
        gu = (torch.randn(M, 2 * I, generator=gen) * 3).to(dtype)
        gu[:, :3] = torch.tensor([-12.0, 0.0, 12.0], dtype=dtype)  # the tails of tanh and zero
        g, u = gu.chunk(2, dim=-1)
        got = cpu_gemv.gelu_tanh_mul(g, u)
        assert got.is_contiguous() and got.shape == (M, I) and got.dtype == dtype, (M, I)
        assert torch.equal(got, cpu_gemv.gelu_tanh_mul(g.contiguous(), u.contiguous())), (M, I)
        want = F.gelu(g, approximate="tanh") * u
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # tanh abs. error ~1e-7, times u
            continue
        act = F.gelu(g.float(), approximate="tanh")  # float32 activation: the bf16 roundings bracket it
        err = act.abs() * 2 ** -7 + 1e-7 * g.float().abs()  # a rounding step, plus the tanh's abs. error x |g| / 2 x 2
        assert ((got.float() - want.float()).abs() <= err * u.float().abs() * 1.01).all(), (M, I)
        same += int((got == want).sum())
        total += got.numel()
    if dtype == torch.bfloat16:
        assert same >= 0.95 * total, (same, total)  # measured 97.9 %: the others in the negative tail, where 1 + tanh cancels
    from sglite import kernels

    g = torch.randn(4, 24, generator=gen).to(dtype)
    assert torch.equal(kernels.gelu_tanh_mul(g, g), cpu_gemv.gelu_tanh_mul(g, g) if dtype == torch.bfloat16
                       else F.gelu(g, approximate="tanh") * g)  # the dispatcher: C++ for bf16, torch for float32
