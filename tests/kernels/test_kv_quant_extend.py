"""Extend attention over a quantized KV pool through the float pool's C++ extend kernel
(sglite.kernels.kv_quant_extend, what ``kernels.extend_attention`` runs on CPU): equal to the torch
reference (``kv_quant.extend_attention``) on steps that mix cached prefixes, chunks crossing key
groups, groups sealed in the step and rows at a group's last position; and a prompt prefilled in
chunks sees what token-by-token decoding sees."""
from types import SimpleNamespace

import pytest
import torch

from sglite.kernels import cpu_attention, dispatch, kv_quant as kq, kv_quant_cpu, kv_quant_extend, reference
from tests.kernels.builds import built
from tests.kernels.test_kv_quant import Seq

@pytest.fixture(autouse=True, scope="module")
def _kernels():
    """The C++ builds these tests run (a skip without a compiler or ninja; with them, a failed build fails)."""
    for load in (kv_quant_cpu.load, cpu_attention.load, cpu_attention.load_extend):
        built(load)


def fast(q, s, rows, prefix, extend, scale):
    return dispatch.extend_attention(q, s.layer, s.layer, s.table, rows, prefix, extend, scale, impl="cpp")


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_extend_matches_the_reference(kind, dtype, tol):
    s = Seq(kind, G=16, page=16, Hkv=2, D=16, rows=4, dtype=dtype, seed=5)
    s.step({0: 20, 1: 16, 2: 3})  # cached prefixes: 20 (a sealed group + 4), 16 (exactly one group), 3
    news = {0: 29, 1: 1, 2: 45, 3: 16}  # 20 -> 49 (groups 16 and 32 sealed here, 48 the last position of
    # a group), 16 -> 17, 3 -> 48 (ends on a group's last position), 0 -> 16 (one whole group)
    prefix = {r: len(s.k[r]) for r in news}
    s.step(news)
    rows = torch.tensor(list(news))
    p, e = torch.tensor([prefix[r] for r in news]), torch.tensor(list(news.values()))
    q = torch.randn(int(e.sum()), 4, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref = kq.extend_attention(q, s.layer, s.table, rows, p, e, 0.25)
    out = fast(q, s, rows, p, e, 0.25)
    assert out.dtype == dtype and torch.allclose(out.float(), ref.float(), atol=tol), (out.float() - ref.float()).abs().max()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_chunked_prefill_equals_token_by_token_decode(kind):
    G, n = 16, 45
    a, b = Seq(kind, G=G, rows=1, seed=3), Seq(kind, G=G, rows=1, seed=3)
    q = torch.randn(n, 4, a.D, generator=torch.Generator().manual_seed(1))
    dec = []
    for t in range(n):
        a.step({0: 1})
        dec.append(kq.decode_attention(q[t:t + 1], a.layer, a.table, torch.tensor([0]), torch.tensor([t + 1]), 0.3))
    outs = []
    for lo, hi in ((0, 7), (7, 40), (40, 45)):  # chunks crossing group boundaries
        b.step({0: hi - lo})
        outs.append(fast(q[lo:hi], b, torch.tensor([0]), torch.tensor([lo]), torch.tensor([hi - lo]), 0.3))
    assert torch.allclose(torch.cat(outs), torch.cat(dec), atol=1e-5)


def test_reference_attend_gives_the_same():
    """The module is a rearrangement, not a kernel: with the float reference as ``attend`` it equals the
    quantized reference too (so a CPU without the C++ extend could use it)."""
    s = Seq("int8", G=16, page=16, rows=2, seed=9)
    s.step({0: 5})
    s.step({0: 30, 1: 33})
    rows, p, e = torch.tensor([0, 1]), torch.tensor([5, 0]), torch.tensor([30, 33])
    q = torch.randn(63, 4, 16, generator=torch.Generator().manual_seed(4))
    out = kv_quant_extend.extend_attention(q, s.layer, s.table, rows, p, e, 0.2, reference.extend_attention)
    assert torch.allclose(out, kq.extend_attention(q, s.layer, s.table, rows, p, e, 0.2), atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_dequant_groups_equals_dequant_slots(kind, monkeypatch):
    s = Seq(kind, G=16, page=32, rows=3, seed=7)
    s.step({0: 48, 1: 64, 2: 17})
    slots = torch.cat((s.table[0, :48], s.table[1, :64], s.table[2, :16])).long()
    rk, rv = kq.dequant_slots(s.layer, slots)
    for dtype in (torch.float32, torch.bfloat16):  # the C++ build, then the torch fallback
        k, v = kv_quant_extend.dequant_groups(s.layer, slots[::16] // 16, dtype)
        assert k.dtype == dtype and torch.equal(k, rk.to(dtype)) and torch.equal(v, rv.to(dtype))
        k, v = kv_quant_cpu.dequant_groups(s.layer, slots[::16] // 16, dtype)  # C++ only
        assert torch.equal(k, rk.to(dtype)) and torch.equal(v, rv.to(dtype))
    with monkeypatch.context() as m:
        m.setattr(kv_quant_cpu, "load", lambda: None)
        k, v = kv_quant_extend.dequant_groups(s.layer, slots[::16] // 16, torch.bfloat16)
        assert torch.equal(k, rk.bfloat16()) and torch.equal(v, rv.bfloat16())


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_sealing_equals_the_torch_quantizer(kind, dtype, monkeypatch):
    """The store's groups sealed by the C++ (kv_quant_cpu.seal_groups, what kernels.store_kv runs on
    CPU) are the torch quantizer's codes and scales, bit for bit, on steps that seal several groups of
    several rows (one of them twice in one step)."""
    sealed = []

    def cpp_seal(layer, groups, bk, bv):
        sealed.append(groups.numel())
        return kv_quant_cpu.seal_groups(layer, groups, bk, bv)

    def run(seal):
        s = Seq(kind, G=16, page=16, rows=3, dtype=dtype, seed=11)
        if seal:
            monkeypatch.setattr(kq, "store_kv", lambda layer, loc, k, v: orig(layer, loc, k, v, cpp_seal))
        s.step({0: 5, 1: 20})
        s.step({0: 40, 1: 12, 2: 16})
        monkeypatch.setattr(kq, "store_kv", orig)
        return s.layer

    orig = kq.store_kv
    a, b = run(False), run(True)
    assert sealed == [1, 4]  # row 1's first group, then 0's two (from 5 to 45 tokens), 1's second and 2's first
    for name in ("k_data", "v_data", "k_scale", "v_scale", "res_k", "res_v"):
        assert torch.equal(getattr(a, name).view(torch.uint8), getattr(b, name).view(torch.uint8)), name


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_store_equals_the_torch_store(kind, dtype, monkeypatch):
    """kv_quant_cpu.store (the whole store in C++, what kernels.store_kv runs on CPU) writes the
    torch store's codes, scales and residual windows bit for bit and leaves the same stash (sealed
    groups ascending, their full-precision blocks), on steps that seal groups of several rows out of
    pool order, cross several groups at once, and decode single tokens at a group's last position."""
    orig = kq.store_kv
    steps = ({0: 5, 1: 20}, {0: 40, 1: 12, 2: 16}, {0: 1, 1: 1, 2: 1}, {0: 2, 1: 3, 2: 15})

    def run(store):
        s = Seq(kind, G=16, page=16, rows=3, dtype=dtype, seed=13)
        monkeypatch.setattr(kq, "store_kv", lambda layer, loc, k, v: orig(layer, loc, k, v, None, store))
        stashes = []
        for news in steps:
            s.step(news)
            stashes.append(s.layer.step.stash.get(id(s.layer)))
            s.layer.step.stash.pop(id(s.layer), None)
        monkeypatch.setattr(kq, "store_kv", orig)
        return s.layer, stashes

    (a, sa), (b, sb) = run(None), run(kv_quant_cpu.store)
    for name in ("k_data", "v_data", "k_scale", "v_scale", "res_k", "res_v"):
        assert torch.equal(getattr(a, name).view(torch.uint8), getattr(b, name).view(torch.uint8)), name
    assert [x is None for x in sa] == [x is None for x in sb] == [False, False, True, False]
    for x, y in zip(sa, sb):
        if x is not None:
            assert all(torch.equal(u, w) for u, w in zip(x, y)), (x[0], y[0])
    assert sb[1][0].tolist() == sorted(sb[1][0].tolist()) and sb[1][0].numel() == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_fp8_store_and_dequant_equal_torch(dtype, monkeypatch):
    """fp8_e4m3: the C++ store (kv_quant_cpu.store) writes torch's float8 codes bit for bit, values past
    the clamp and subnormal ones included, and dequant_fp8 equals dequant_slots rounded once."""
    orig = kq.store_kv

    def run(store):
        s = Seq("fp8_e4m3", G=16, page=16, rows=2, dtype=dtype, seed=17)
        s.layer.k_scale.copy_(torch.tensor([0.01, 3.0])), s.layer.v_scale.copy_(torch.tensor([0.5, 1e-3]))
        s.src_k[0, :3] *= 1e4  # past 448 * scale: clamped
        s.src_v[1, :4] *= 1e-6  # subnormal codes
        monkeypatch.setattr(kq, "store_kv", lambda layer, loc, k, v: orig(layer, loc, k, v, None, store))
        s.step({0: 7, 1: 20})
        s.step({0: 1, 1: 30})
        monkeypatch.setattr(kq, "store_kv", orig)
        return s

    a, b = run(None), run(kv_quant_cpu.store)
    for name in ("k_data", "v_data"):
        assert torch.equal(getattr(a.layer, name).view(torch.uint8), getattr(b.layer, name).view(torch.uint8)), name
    slots = b.table[1, :50].long()
    k, v = kv_quant_cpu.dequant_fp8(b.layer, slots, dtype)
    rk, rv = kq.dequant_slots(b.layer, slots)
    assert torch.equal(k, rk.to(dtype)) and torch.equal(v, rv.to(dtype))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fp8_decode_reads_the_codes_in_place(dtype, tol):
    """fp8 pools: the C++ decode (cpu_attention's kernel on the float8 codes, q scaled by the key
    scales, the output by the value scales) against the torch reference, with non-unit scales and
    subnormal codes; what kernels.decode_attention runs for an fp8 layer on CPU."""
    s = Seq("fp8_e4m3", rows=4, D=16, Hkv=2, dtype=dtype, seed=13)
    s.layer.k_scale.copy_(torch.tensor([0.5, 2.0]))
    s.layer.v_scale.copy_(torch.tensor([1.5, 0.25]))
    s.step({0: 37, 1: 16, 2: 5, 3: 50})
    s.layer.k_data[s.table[2, :5].long(), 0, :4] = torch.tensor([0.001, -0.003, 0.0, -0.0]).to(torch.float8_e4m3fn)
    rows, lens = torch.tensor([0, 1, 2, 3]), torch.tensor([37, 16, 5, 50])
    q = torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    ref = kq.decode_attention(q, s.layer, s.table, rows, lens, 0.25)
    out = dispatch.decode_attention(q, s.layer, s.layer, s.table, rows, lens, 0.25, impl="cpp")
    assert out.dtype == dtype and torch.allclose(out.float(), ref.float(), atol=tol), (out.float() - ref.float()).abs().max()


@pytest.mark.slow  # builds a small C++ module of its own (~20 s)
def test_fp8_scalar_widening_is_exact():
    """scalar_math.h's widen(uint8_t) (the non-AVX-512 path of the fp8 decode) against torch's float8
    conversion, every one of the 256 codes (NaN codes compared as NaN)."""
    from sglite.kernels.cpu_build import load_cpp, read_source

    src = read_source("scalar_math.h").replace("#pragma once", "") + """
at::Tensor widen_all() {
  at::Tensor out = at::empty({256}, at::kFloat);
  for (int i = 0; i < 256; ++i) out.data_ptr<float>()[i] = sglite_scalar::widen((uint8_t)i);
  return out;
}"""
    mod = load_cpp("sglite_test_widen_fp8", "#include <cstdint>\n#include <cstring>\n" + src, functions=["widen_all"])
    got = mod.widen_all()
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32))


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_the_stash_holds_one_layers_rows_not_the_forwards(kind):
    """A layer's store keeps only its own step rows (and sealed groups) in the stash: before, every
    layer's entry stayed until the next step, and the C++ RoPE path's V was a view of the layer's qkv
    output, so a prefill held all layers' qkv projections (7x one layer's step K+V on a 2-layer tiny
    Llama; ~1.2 GB for a 32-layer 8B-shaped bf16 model at 2,048-token chunks). The extend attention
    read after it is unchanged (it reads the layer just stored)."""
    from sglite.kernels import cpu_elementwise
    from sglite.runtime.kv_quant import QuantTokenToKVPool

    built(cpu_elementwise.load)
    Hq, Hkv, D, N = 4, 2, 16, 40
    pool = QuantTokenToKVPool(256, 16, 3, Hkv, D, torch.float32, kind=kind, group=16, max_reqs=2)
    st = pool.step
    st.tok_rows, st.positions = torch.zeros(N, dtype=torch.int64), torch.arange(N)
    st.row_len = torch.tensor([N, 0])
    loc, table = torch.arange(N) + 16, torch.zeros(2, 64, dtype=torch.int32)
    table[0, :N] = loc.int()
    gen = torch.Generator().manual_seed(4)
    ang = torch.arange(N)[:, None] * torch.rand(D // 2, generator=gen)
    cos, sin = ang.cos(), ang.sin()
    for L in pool.k_buffers:
        qkv = torch.randn(N, (Hq + 2 * Hkv) * D, generator=gen)
        qk, v = qkv.split([(Hq + Hkv) * D, Hkv * D], dim=-1)
        q = dispatch.rope_store_kv(qk.view(N, Hq + Hkv, D), v.view(N, Hkv, D), cos, sin, L, L, loc, Hq)
        assert {k if isinstance(k, int) else k[0] for k in st.stash} == {id(L)}
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for e in st.stash.values() for t in e}
        assert qkv.untyped_storage().data_ptr() not in held and sum(held.values()) <= 2 * 2 * N * Hkv * D * 4
        ref = kq.extend_attention(q, L, table, torch.tensor([0]), torch.tensor([0]), torch.tensor([N]), 0.25)
        assert torch.allclose(fast(q, SimpleNamespace(layer=L, table=table), torch.tensor([0]), torch.tensor([0]),
                                   torch.tensor([N]), 0.25), ref, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_float32_rows_into_a_bf16_pool_are_seen_rounded(kind):
    """K/V handed to the store wider than the pool's residual windows (float32 rows, bf16 windows):
    the reference attends to the group's own rows as the store keeps them (rounded to bf16), and so
    does the fast path (it read the step's float32 rows unrounded: 8e-3 int8, 1.1e-2 int4 off the
    reference; the models store in their own dtype, so the engine did not reach it)."""
    s = Seq(kind, G=16, page=16, Hkv=2, D=16, rows=2, dtype=torch.bfloat16, seed=5)
    gen = torch.Generator().manual_seed(8)
    s.src_k, s.src_v = torch.randn(s.src_k.shape, generator=gen) * 3, torch.randn(s.src_v.shape, generator=gen)
    s.dtype = torch.float32  # Seq hands its rows to the store in s.dtype: float32 values bf16 does not hold
    s.step({0: 20, 1: 5})
    news = {0: 29, 1: 7}  # row 0 seals group 32 from 20 (stash), row 1 stays in group 0 (residual)
    prefix = {r: len(s.k[r]) for r in news}
    s.step(news)
    rows = torch.tensor(list(news))
    p, e = torch.tensor([prefix[r] for r in news]), torch.tensor(list(news.values()))
    q = torch.randn(int(e.sum()), 4, 16, generator=gen)
    ref = kq.extend_attention(q, s.layer, s.table, rows, p, e, 0.25)
    assert torch.allclose(fast(q, s, rows, p, e, 0.25), ref, atol=1e-5)
