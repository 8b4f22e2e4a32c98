"""Fused C++ elementwise kernels (sglite/kernels/cpu_elementwise.py): residual add + RMSNorm and
RoPE + KV store against their torch references on random shapes, row invariance, input errors,
dispatcher routing and fallbacks."""

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.builds import built
from sglite import kernels
from sglite.kernels import cpu_elementwise, kv_quant, reference


@pytest.fixture(scope="module")
def ops():
    return built(cpu_elementwise.load)



@pytest.mark.parametrize("M,H", [(1, 640), (5, 37), (200, 640), (33, 256), (0, 16)])
def test_float32_weight_on_bf16_rows_is_the_float32_norm(ops, M, H):
    """A float32 weight on bf16 x (Gemma's float32 norms): the bits of the float32 norm of x.float()
    rounded once to bf16, on strided rows, with and without the residual; through kernels.rms_norm
    too (3-D input; a non-contiguous one, as the per-head QK-norm's split, through a bf16 copy)."""
    g = torch.Generator().manual_seed(M * 7 + H)
    x = (torch.randn(M, H + 5, generator=g) * 3).bfloat16()[:, :H]
    r = torch.randn(M, H, generator=g).bfloat16()
    w = 1.0 + torch.randn(H, generator=g)  # float32, as (1 + w)
    assert cpu_elementwise.norm_supported(x, r, w) and not cpu_elementwise.norm_supported(x.float(), None, w.bfloat16())
    _, want = cpu_elementwise.add_rms_norm(x.float(), None, w, 1e-6)
    _, got = cpu_elementwise.add_rms_norm(x, None, w, 1e-6)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
    s, got_r = cpu_elementwise.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, x + r) and torch.equal(got_r, cpu_elementwise.add_rms_norm(s.float(), None, w, 1e-6)[1].bfloat16())
    x3 = x.contiguous().view(M, 1, H).expand(M, 2, H).contiguous()
    old = kernels.rms_norm(x3.float(), w, 1e-6).to(torch.bfloat16)  # the float32 path it replaces
    assert torch.equal(kernels.rms_norm(x3, w, 1e-6), old)
    xt = x3.transpose(0, 1)  # not contiguous: the kernel on a bf16 copy, the same bits
    assert torch.equal(kernels.rms_norm(xt, w, 1e-6), kernels.rms_norm(xt.float(), w, 1e-6).to(torch.bfloat16))
    qkv = torch.randn(M, 3 * H, generator=g).bfloat16()  # per-head norms on a split of a fused projection
    q = qkv[:, :2 * H].reshape(M, 2, H)
    assert (M < 2 or not q.is_contiguous()) and torch.equal(kernels.rms_norm(q, w, 1e-6),
                                                 kernels.rms_norm(q.float(), w, 1e-6).to(torch.bfloat16))

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,H", [(1, 576), (5, 37), (48, 576), (33, 2048), (3, 16)])
def test_add_rms_norm_matches_reference(ops, M, H, dtype):
    g = torch.Generator().manual_seed(M * 1000 + H)
    x = (torch.randn(M, H + 7, generator=g) * 3).to(dtype)[:, :H]  # strided rows
    r = torch.randn(M, H, generator=g).to(dtype)
    w = torch.randn(H, generator=g).to(dtype)
    s, out = cpu_elementwise.add_rms_norm(x, r, w, 1e-6)
    s_ref, out_ref = reference.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, s_ref)  # the add rounds exactly as torch's
    assert out.dtype == dtype and out.shape == (M, H)
    want = (s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double())
    if dtype == torch.float32:
        torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    else:  # torch's single rounding; only the float32 reduction order differs: almost every bit equal
        assert (out != out_ref).float().mean() < 0.01
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=1e-2)
    plain_s, plain = cpu_elementwise.add_rms_norm(x, None, w, 1e-6)
    assert plain_s is x
    torch.testing.assert_close(plain.float(), F.rms_norm(x, (H,), w, 1e-6).float(), atol=2e-2, rtol=1e-2)


def test_add_rms_norm_rows_do_not_depend_on_the_batch(ops):
    g = torch.Generator().manual_seed(7)
    x, r = torch.randn(257, 576, generator=g), torch.randn(257, 576, generator=g)
    w = torch.randn(576, generator=g)
    _, full = cpu_elementwise.add_rms_norm(x, r, w, 1e-5)
    for i in (0, 100, 256):
        assert torch.equal(full[i:i + 1], cpu_elementwise.add_rms_norm(x[i:i + 1], r[i:i + 1], w, 1e-5)[1])
    assert torch.equal(kernels.rms_norm(x, w, 1e-5)[37], kernels.rms_norm(x[37:38], w, 1e-5)[0])


def _rope_case(N, Hq, Hkv, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qk = torch.randn(N, Hq + 2 * Hkv, D, generator=g).to(dtype)[:, :Hq + Hkv]  # a view of the fused projection
    v = torch.randn(N, 2 * Hkv, D, generator=g).to(dtype)[:, Hkv:]
    ang = torch.rand(N, D // 2, generator=g) * 6.3
    S = N + 17
    kb = torch.zeros(Hkv, S, D, dtype=dtype).transpose(0, 1)  # head-major pool
    vb = torch.zeros(Hkv, S, D, dtype=dtype).transpose(0, 1)
    loc = torch.randperm(S - 1, generator=g)[:N] + 1
    return qk, v, ang.cos().to(dtype), ang.sin().to(dtype), kb, vb, loc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,Hq,Hkv,D", [(1, 9, 3, 64), (37, 9, 3, 64), (5, 16, 2, 128), (4, 4, 1, 256), (3, 2, 2, 6),
                                        (7, 5, 1, 80), (2, 3, 3, 34)])  # D/2 = 40, 17: a full vector, then a masked tail
def test_rope_store_kv_is_bit_identical_to_reference(ops, N, Hq, Hkv, D, dtype):
    qk, v, cos, sin, kb, vb, loc = _rope_case(N, Hq, Hkv, D, dtype, seed=N + D)
    kb2, vb2 = kb.clone(), vb.clone()
    q = cpu_elementwise.rope_store_kv(qk, v, cos, sin, kb, vb, loc, Hq)
    q_ref = reference.rope_store_kv(qk, v, cos, sin, kb2, vb2, loc, Hq)
    assert q.shape == (N, Hq, D) and torch.equal(q, q_ref)
    assert torch.equal(kb, kb2) and torch.equal(vb, vb2)
    assert torch.count_nonzero(kb[loc]) > 0 and torch.equal(vb[loc], v)
    # rotation preserves each pair's norm (float64 check of the formula, not only of the reference)
    x1, x2 = qk[:, :Hq, :D // 2].double(), qk[:, :Hq, D // 2:].double()
    c, s = cos.double()[:, None], sin.double()[:, None]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    tol = 1e-5 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(q.double(), want, atol=tol, rtol=tol)


def test_bad_inputs_raise_clear_errors(ops):
    qk, v, cos, sin, kb, vb, loc = _rope_case(4, 4, 2, 16, torch.float32, seed=1)
    bad = loc.clone()
    bad[2] = kb.shape[0]
    with pytest.raises(IndexError, match="slot outside the pool"):
        cpu_elementwise.rope_store_kv(qk, v, cos, sin, kb, vb, bad, 4)
    with pytest.raises(ValueError, match="cos/sin"):
        cpu_elementwise.rope_store_kv(qk, v, cos[:, :3], sin[:, :3], kb, vb, loc, 4)
    with pytest.raises(ValueError, match="v must be"):
        cpu_elementwise.rope_store_kv(qk, v[:, :1], cos, sin, kb, vb, loc, 4)
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight must be"):
        cpu_elementwise.load().add_rms_norm(x, None, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        cpu_elementwise.load().add_rms_norm(x, torch.randn(2, 8), torch.ones(8), 1e-6)


def test_dispatcher_routes_and_falls_back(ops, monkeypatch):
    monkeypatch.delenv("SGLITE_KERNEL", raising=False)
    qk, v, cos, sin, kb, vb, loc = _rope_case(6, 4, 2, 32, torch.bfloat16, seed=3)
    assert kernels.resolve_impl(None, qk, "rope_store_kv") == "cpp"
    q = kernels.rope_store_kv(qk, v, cos, sin, kb, vb, loc, 4)
    assert torch.equal(q, reference.rope_rotate_half(qk, cos, sin)[:, :4])
    # a quantized pool: rotate in torch, store through kv_quant
    S = kb.shape[0]
    layer = kv_quant.QuantKVLayer("fp8_e4m3", 1, torch.zeros(S, 2, 32, dtype=torch.float8_e4m3fn),
                                  torch.zeros(S, 2, 32, dtype=torch.float8_e4m3fn), torch.ones(2), torch.ones(2),
                                  None, None, kv_quant.QuantStep(), 32)
    q2 = kernels.rope_store_kv(qk, v, cos, sin, layer, layer, loc, 4)
    assert torch.equal(q2, q)
    torch.testing.assert_close(layer.v_data[loc].float(), v.float(), atol=0.07, rtol=0.07)  # fp8 codes of v
    x, r, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    s, h = kernels.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, x + r)
    monkeypatch.setenv("SGLITE_KERNEL", "torch")  # forced reference
    s2, h2 = kernels.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h2, F.rms_norm(x + r, (64,), w, 1e-6))
    torch.testing.assert_close(h, h2)
    x3 = torch.randn(4, 3, 64)  # 3-D input through rms_norm: the kernel on a contiguous view
    monkeypatch.delenv("SGLITE_KERNEL")
    torch.testing.assert_close(kernels.rms_norm(x3, w, 1e-6), F.rms_norm(x3, (64,), w, 1e-6))
    half = x.half()
    assert torch.equal(kernels.rms_norm(half, w.half(), 1e-6), F.rms_norm(half, (64,), w.half(), 1e-6))


def test_bf16_rounding_of_denormals_and_nans_is_c10s(ops):
    """The bf16 rounding (VCVTNEPS2BF16 unless a lane is a NaN or a float32 denormal, which the
    instruction would flush or keep the payload of): sums x + r holding denormals, NaNs of either
    sign, infinities and ordinary values, with the neighbours of each in the same 16 lanes, give
    torch's bits (x + r rounded as c10::BFloat16: denormals kept, NaN as 0x7FC0); the RoPE of
    denormal and NaN inputs as the reference's."""
    vals = torch.tensor([1e-39, -1e-39, 1.5e-38, -3e-39, 1.0, -2.5, float("nan"), -float("nan"),
                         float("inf"), -float("inf"), 3e38, 0.0, -0.0, 7.0, 1e-3, -1e-3] * 3)
    x = vals.view(3, 16).bfloat16()
    r = torch.roll(vals, 5).view(3, 16).bfloat16() * 0.0  # zeros: the sum is x itself, denormals included
    r[2] = torch.randn(16).bfloat16()
    s, _ = cpu_elementwise.add_rms_norm(x, r, torch.ones(16).bfloat16(), 1e-6)
    want = x + r
    same = (s.view(torch.int16) == want.view(torch.int16)) | (torch.isnan(s) & torch.isnan(want) & (s.view(torch.int16) == 0x7FC0))
    assert bool(same.all())
    # the same vector with no special lane takes VCVTNEPS2BF16: bits equal too
    y = (torch.randn(4, 64) * 3).bfloat16()
    s2, _ = cpu_elementwise.add_rms_norm(y, y.flip(0), torch.ones(64).bfloat16(), 1e-6)
    assert torch.equal(s2, y + y.flip(0))
    qk = torch.tensor([1e-39, float("nan"), 2.0, -1e-39] * 48).view(1, 3, 64).bfloat16()
    v = torch.ones(1, 1, 64).bfloat16()
    cos, sin = torch.full((1, 32), 0.5).bfloat16(), torch.full((1, 32), 0.25).bfloat16()
    kb, vb = torch.zeros(4, 1, 64).bfloat16(), torch.zeros(4, 1, 64).bfloat16()
    kb2, vb2 = kb.clone(), vb.clone()
    loc = torch.tensor([2])
    q = cpu_elementwise.rope_store_kv(qk, v, cos, sin, kb, vb, loc, 2)
    q2 = reference.rope_store_kv(qk, v, cos, sin, kb2, vb2, loc, 2)
    eq = lambda a, b: bool(((a.view(torch.int16) == b.view(torch.int16)) | (torch.isnan(a) & torch.isnan(b))).all())  # noqa: E731
    assert eq(q, q2) and eq(kb, kb2) and torch.equal(vb, vb2)


# ---------------------------------------------------------------------------------------------
# argmax_rows: the greedy pick (numpy's / torch's argmax, bit for bit, whatever the thread count)

def _numpy_argmax(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.contiguous().numpy().argmax(axis=-1))


@pytest.mark.parametrize("B,V", [(1, 1), (3, 15), (2, 64), (5, 65), (7, 1000), (48, 49152), (64, 4099), (0, 8)])
@pytest.mark.parametrize("kind", ["randn", "ties", "nan", "neg_inf", "strided"])
def test_argmax_rows_is_numpys_argmax(ops, B, V, kind):
    """Random rows, rows of few distinct values (ties: the first maximum), rows with NaNs (the
    first NaN), rows of -inf with one finite value or none, and rows with a stride > V: the
    C++ argmax equals numpy's on 1, 2 and 3 threads (shares of the vocabulary combined in order)."""
    g = torch.Generator().manual_seed(B * 131 + V)
    x = torch.randn(B, V + 9, generator=g)[:, 4:V + 4] if kind == "strided" else torch.randn(B, V, generator=g)
    if kind == "ties":
        x = torch.randint(-2, 3, (B, V), generator=g).float()
    elif kind == "nan" and B * V:
        x[torch.rand(B, V, generator=g) < 0.002] = float("nan")
        x[0, V // 2] = float("nan")
    elif kind == "neg_inf" and B * V:
        x.fill_(float("-inf"))
        x[0, V - 1] = 0.0
    for threads in (1, 2, 3):
        got = cpu_elementwise.argmax_rows(x, threads)
        assert got.dtype == torch.int64 and torch.equal(got, _numpy_argmax(x)), (threads, kind)
    if not x.isnan().any():
        assert torch.equal(cpu_elementwise.argmax_rows(x), x.argmax(dim=-1))


def test_greedy_dispatch_runs_the_cpp_argmax(ops, monkeypatch):
    """kernels.greedy on CPU float32 logits is the C++ argmax (the reference's tokens); with a
    grammar mask the reference re-picks the rows whose winner is forbidden (the same tokens as the
    reference's own argmax); SGLITE_KERNEL=torch or bf16 logits keep the reference; bad input
    raises a ValueError naming the argument."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5000, generator=g)
    calls = []
    real = cpu_elementwise.argmax_rows
    monkeypatch.setattr(cpu_elementwise, "argmax_rows", lambda t, threads=None: calls.append(1) or real(t, threads))
    assert torch.equal(kernels.greedy(x), reference.greedy(x)) and calls == [1]
    words = torch.full((6, (5000 + 31) // 32), -1, dtype=torch.int32)
    assert torch.equal(kernels.greedy(x, words), reference.greedy(x)) and calls == [1, 1]
    win = x.argmax(dim=-1)
    words[torch.arange(6), win // 32] &= ~(1 << (win % 32)).to(torch.int32)  # forbid every row's winner
    words[0] = 0  # nothing allowed in row 0
    got = kernels.greedy(x, words)
    assert torch.equal(got, reference.greedy(x, words)) and calls == [1, 1, 1]
    assert got[0] == 0 and not torch.equal(got[1:], win[1:])
    assert torch.equal(kernels.greedy(x.bfloat16()), reference.greedy(x.bfloat16())) and calls == [1, 1, 1]
    monkeypatch.setenv("SGLITE_KERNEL", "torch")
    assert torch.equal(kernels.greedy(x), reference.greedy(x)) and calls == [1, 1, 1]
    with pytest.raises(ValueError, match="argmax_rows: x must be float32"):
        ops.argmax_rows(x.t(), 2)
    with pytest.raises(ValueError, match="threads"):
        ops.argmax_rows(x, 0)


# ---------------------------------------------------------------------------------------------
# dequant_rows: quantized embedding rows, the reference's bits

@pytest.mark.parametrize("bits,gs,mins,half,tiled", [(4, 32, True, False, False), (4, 64, False, True, False),
                                                     (8, 32, True, True, True), (8, 16, False, False, False),
                                                     (8, 16, True, True, True), (4, 32, True, True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_rows_is_the_reference(ops, bits, gs, mins, half, tiled, dtype):
    """Random codes / scales / mins (float32 or float16), row or tiled layout, 4/8-bit codes, group
    16 / 32 / 64: the C++ gather equals QuantLinearWeight.rows_reference bit for bit (repeated and
    unordered ids); rows() routes to it; an id outside the table raises IndexError."""
    from sglite.kernels.quant_layout import compact_scales, tile_rows
    from sglite.kernels.quant_linear import QuantLinearWeight

    n, k = 48, 192
    g = torch.Generator().manual_seed(bits * 100 + gs + mins)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    s = (torch.randn(n, k // gs, generator=g) * 0.1).half().float()
    m = (torch.randn(n, k // gs, generator=g) * 0.05).half().float() if mins else None
    w = QuantLinearWeight.from_codes(codes, s, m, bits, gs)
    if half:
        assert compact_scales(w)
    if tiled:
        assert tile_rows(w) and w.tiled
    ids = torch.tensor([47, 0, 16, 5, 31, 5, 17])
    got = cpu_elementwise.dequant_rows(w, ids, dtype)
    want = w.rows_reference(ids, dtype)
    assert got is not None and got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(w.rows(ids, dtype), want)
    assert cpu_elementwise.dequant_rows(w, ids[:0], dtype).shape == (0, k)
    with pytest.raises(IndexError, match="dequant_rows: id 48 outside"):
        cpu_elementwise.dequant_rows(w, torch.tensor([3, 48]), dtype)
    assert cpu_elementwise.dequant_rows(w, ids, torch.float16) is None  # another dtype: the reference
