"""Fused CPU decode (sglite.kernels.decode_fused) and the int8-activation GEMV
(quant_cpu.gemv_q8): the C++ activation quantization bit for bit against its torch reference, the
GEMV against the reference on random shapes (odd block counts, 4/8 bits, with and without
offsets, 1..8 rows, both builds), the fused step against the per-op path (the reference) on a tiny
random Llama quantized to 32-groups (float32: logits close and greedy tokens identical; bf16: the
int8 path close), and the fallbacks (SGLITE_KERNEL=torch, a failed build, steps it does not take)."""
import os

import pytest
import torch

from sglite.kernels import decode_fused, gemm_paths, quant_cpu
from sglite.kernels.quant_linear import QuantLinearWeight, compact_scales

pytestmark = pytest.mark.skipif(not quant_cpu.available(), reason="the C++ quant kernel did not build here")
# portable=False: VNNI where the CPU has it. The portable build (a second compile of the extension)
# runs in the slow tier; the fast tier checks the native build
BUILDS = [False, pytest.param(True, marks=pytest.mark.slow)]


def make(n, k, bits, seed, mins=True):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    m = (torch.randn(n, k // 32, generator=g) * 0.05).half().float() if mins else None
    return QuantLinearWeight.from_codes(codes, s, m, bits, 32)


@pytest.mark.parametrize("k", [32, 96, 160, 576])
def test_activation_quantization_is_bit_exact(k):
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(k)) * 3
    x[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    x[1, 5] = 1e4  # one outlier sets its block's step
    xq, d, sx = quant_cpu._mod(False).quant_q8_act(x)
    rq, rd, rsx = quant_cpu.quantize_act_q8_reference(x)
    assert torch.equal(xq, rq) and torch.equal(d, rd) and torch.equal(sx, rsx)
    assert int(xq.abs().max()) <= 127 and int(xq[0, :32].abs().max()) == 0


@pytest.mark.parametrize("portable", BUILDS)
@pytest.mark.parametrize("bits,n,k,mins", [(4, 37, 96, True), (4, 64, 576, True), (8, 19, 160, True),
                                           (8, 33, 64, False), (4, 5, 32, False)])
def test_gemv_q8_matches_reference(portable, bits, n, k, mins):
    w = make(n, k, bits, seed=n + k, mins=mins)
    for rows in (1, 2, 3, 5, 8, 13):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        y, r = quant_cpu.gemv_q8(x, w, portable=portable), quant_cpu.gemv_q8_reference(x, w)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        assert (y - r).abs().max().item() <= 1e-5 * k ** 0.5 * (r.abs().max().item() + 1e-6)
        # and it is a quantized product: close to the float one, not equal
        exact = x @ w.dequantize().T
        assert (y - exact).abs().max().item() <= 0.05 * exact.abs().max().item()
    # float16 scales / mins (compact_scales): the same values, so the same result bit for bit
    ref = [quant_cpu.gemv_q8(torch.randn(r, k, generator=torch.Generator().manual_seed(r)), w, portable=portable)
           for r in (1, 4)]
    assert compact_scales(w) and w.scales.dtype == torch.float16
    for r, y in zip((1, 4), ref):
        x = torch.randn(r, k, generator=torch.Generator().manual_seed(r))
        assert torch.equal(quant_cpu.gemv_q8(x, w, portable=portable), y)
        assert torch.allclose(quant_cpu.linear(x, w, portable=portable), x @ w.dequantize().T, rtol=1e-4, atol=1e-4)


def test_compact_scales_only_when_exact():
    w = make(8, 64, 4, seed=1)
    w.scales[0, 0] = 0.1 + 1e-9  # not a float16 value
    before = w.dequantize()
    assert not compact_scales(w) and w.scales.dtype == torch.float32
    w.scales[0, 0] = 0.25
    assert compact_scales(w) and w.mins.dtype == torch.float16
    assert torch.equal(w.dequantize()[1:], before[1:])
    with pytest.raises(ValueError, match="mins dtype"):
        QuantLinearWeight(w.qweight, w.scales.float(), w.mins, 4, 32, 64)


def test_gemv_q8_rejects_other_group_sizes():
    w = QuantLinearWeight.from_codes(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 1), None, 4, 64)
    with pytest.raises(RuntimeError, match="group_size must be 32"):
        quant_cpu.gemv_q8(torch.randn(1, 64), w)


@pytest.fixture(scope="module")
def quantized_tiny(tiny_model_dir, tmp_path_factory):
    from sglite.quant.calibrate import QuantOptions
    from sglite.quantize import quantize

    root = tmp_path_factory.mktemp("fused")
    return {bits: quantize(str(tiny_model_dir), root / f"rtn{bits}", QuantOptions(method="rtn", bits=bits, group_size=32),
                           n_samples=1, seq_len=16) for bits in (4, 8)}


PROMPTS = [[504, 3458, 3502, 314, 253, 5426], [1314, 28, 5248, 11633, 28, 690, 9095, 30, 378], [357, 12, 99]]
MANY = [[100 + 37 * i, 7 + i, 2000 + i] for i in range(11)]  # 11 decode rows: GEMVs in blocks of 8


def _checked_engine(model_dir, dtype, atol_rel, seen):
    """An engine whose fused steps are checked against the per-op path on the same batch."""
    from sglite import Engine

    e = Engine(model_path=str(model_dir), dtype=dtype, max_total_tokens=2048)
    fused = e.runner.model.decode_fused
    assert fused is not None and fused.q8 == (dtype == "bfloat16")
    check_fused_steps(e.runner.model, atol_rel, seen)
    return e, fused


def spy_hidden(fused, steps: list) -> None:
    """Wrap ``fused.hidden`` so that every fused step appends ``(input ids, final hidden states)``
    (clones) to ``steps``."""
    hidden0 = fused.hidden

    def spy(fb, kb, vb):
        h = hidden0(fb, kb, vb)
        steps.append((fb.input_ids.clone(), h.clone()))
        return h

    fused.hidden = spy


def check_fused_steps(model, atol_rel, seen):
    """Replace ``model.decode_fused`` by a wrapper that checks every fused step's logits against the
    per-op path on the same batch (relative max error <= ``atol_rel``) and appends the step's row
    count to ``seen``; returns the wrapped fused decode."""
    fused = model.decode_fused

    class Checked:
        def forward(self, fb, kb, vb):
            got = fused.forward(fb, kb, vb)
            if got is not None:
                ref = model._forward(fb, kb, vb)  # rewrites the same KV slots
                err = (got - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
                assert err <= atol_rel, err
                seen.append(fb.input_ids.shape[0])
            return got

    model.decode_fused = Checked()
    return fused


@pytest.mark.parametrize("bits", [4, 8])
def test_fused_float32_matches_per_op(quantized_tiny, bits):
    seen = []
    e, fused = _checked_engine(quantized_tiny[bits], "float32", 1e-5, seen)
    try:
        sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        got = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=sp)]
        got_many = [o["output_ids"] for o in e.generate(input_ids=MANY, sampling_params=sp)]
        assert 3 in seen and 11 in seen  # multi-row steps went through the fused path
        e.runner.model.decode_fused = None  # the per-op path alone
        ref = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=sp)]
        assert got == ref
        assert got_many == [o["output_ids"] for o in e.generate(input_ids=MANY, sampling_params=sp)]
    finally:
        e.shutdown()


def test_fused_rows_do_not_depend_on_their_place_in_the_batch(quantized_tiny):
    """19 decode rows (the RMSNorm's 16-row vector group plus a masked tail of 3) and the same
    requests in reverse order: every row's final hidden state is bit for bit the same wherever the
    row sits (the vectorized sum of squares keeps one lane per row)."""
    from sglite import Engine

    e = Engine(model_path=str(quantized_tiny[4]), dtype="float32", max_total_tokens=2048)
    fused = e.runner.model.decode_fused
    steps: list = []
    spy_hidden(fused, steps)
    prompts = [[100 + 37 * i, 7 + i, 2000 + 3 * i] for i in range(19)]
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    try:
        first = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]
        n = len(steps)
        e.flush_cache()
        second = [o["output_ids"] for o in e.generate(input_ids=prompts[::-1], sampling_params=sp)]
    finally:
        e.shutdown()
    assert second == first[::-1]
    a, b = steps[:n], steps[n:]
    assert len(a) == len(b) >= 2 and all(ids.shape[0] == 19 for ids, _ in a)
    for (ids1, h1), (ids2, h2) in zip(a, b):
        assert torch.equal(ids2, ids1.flip(0)) and torch.equal(h2, h1.flip(0))


@pytest.mark.slow  # the real default model (real_engine)
def test_prefill_only_short_prompt(real_engine):
    """Regression (fresh-user report): ``max_new_tokens=0`` on a prompt of <= 8 new tokens runs
    them as decode rows through the fused path with no logits row wanted; the bf16 model's int8
    LM head got 0 rows and the step aborted ("quant_gemv_q8: x must be float32 [M <= 32, K]")."""
    import torch

    from sglite.kernels.decode_fused import FusedDecode

    model = real_engine.runner.model
    for q8 in (True, False):  # the bf16 models' int8 head and the float32 models' float-exact one
        f = FusedDecode(model, q8=q8)
        assert f.head_kind == ("q8" if q8 else "quant")
        assert f.head(torch.zeros(0, model.arch.hidden_size)).shape == (0, model.lm_head.shape[0])
    e = real_engine
    for text in ("Hello", "Hello there, how", "Hello there, how are you"):  # 1 new token; 4 new after 1 cached; ...
        o = e.generate(text, {"max_new_tokens": 0})
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 0} and o["output_ids"] == []
    e.check_invariants()


def test_fused_bf16_int8_path_is_close(quantized_tiny):
    seen = []
    e, _ = _checked_engine(quantized_tiny[4], "bfloat16", 0.1, seen)
    try:
        e.generate(input_ids=PROMPTS[:2], sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert seen
    finally:
        e.shutdown()


@pytest.mark.skipif(not __import__("sglite.kernels.quant_amx", fromlist=["x"]).available(), reason="no AMX-BF16 here")
def test_fused_many_rows_take_amx_and_stay_close(quantized_tiny):
    """40 decode rows (past MAX_ROWS): with AMX the fused call takes them, its tiled GEMMs and head
    on the tile GEMM (bf16 activations), close to the per-op path on the same batch."""
    seen = []
    e, fused = _checked_engine(quantized_tiny[4], "bfloat16", 0.1, seen)
    try:
        if not fused.tiled:
            pytest.skip("the tiny model's weights are not in 16-row tiles")
        assert fused.amx_min() == gemm_paths.AMX_MIN_ROWS  # 4-bit layers of a small model: the general threshold
        assert fused.max_rows() == decode_fused.MAX_ROWS_AMX
        many = [[100 + 37 * i, 7 + i, 2000 + i] for i in range(40)]
        e.generate(input_ids=many, sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert 40 in seen
    finally:
        e.shutdown()


def test_fused_many_rows_take_the_vnni_gemm_and_stay_close(quantized_tiny):
    """40 decode rows on a CPU with VNNI and no AMX: the fused call takes them (up to MAX_ROWS_AMX),
    its tiled GEMMs and head on the int8 VNNI GEMM from FUSED_VNNI_MIN_ROWS rows, close to the
    per-op path on the same batch; SGLITE_GEMM other than auto keeps the fused step at MAX_ROWS."""
    seen = []
    e, fused = _checked_engine(quantized_tiny[4], "bfloat16", 0.1, seen)
    try:
        if not fused._vnni_on():
            pytest.skip("the fused decode's VNNI GEMM runs on VNNI CPUs without AMX (tiled weights)")
        assert fused.amx_min() == gemm_paths.FUSED_VNNI_MIN_ROWS
        head = fused.model.lm_head
        assert fused.head_amx_min() == (gemm_paths.FUSED_VNNI_MIN_ROWS if fused.head_kind == "q8" and head.tiled else 0)
        assert fused.max_rows() == decode_fused.MAX_ROWS_AMX
        many = [[100 + 37 * i, 7 + i, 2000 + i] for i in range(40)]
        e.generate(input_ids=many, sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert 40 in seen
        os.environ[gemm_paths.ENV] = "torch"
        try:
            assert (fused.amx_min(), fused.max_rows()) == (0, decode_fused.MAX_ROWS)
        finally:
            del os.environ[gemm_paths.ENV]
    finally:
        e.shutdown()


@pytest.mark.parametrize("bits", [4, 8])
def test_head_q8_vnni_rows_equal_the_vnni_gemm(bits):
    """On a VNNI build without AMX the fused products from their threshold run the per-op VNNI
    GEMM's kernel (quant_gemm_kernel.h) on the GEMV's int8 activations: the same float32 outputs
    bit for bit as quant_gemm_q8; below the threshold the GEMV in 8-row blocks, close to it."""
    from sglite.kernels import quant_amx, quant_gemm
    from sglite.kernels.device import cpu_flags
    from sglite.kernels.quant_layout import tile_rows

    if quant_gemm.load() is None or all(f in cpu_flags() for f in quant_amx.REQUIRED_FLAGS):
        pytest.skip("the fused decode takes the VNNI GEMM on VNNI CPUs without AMX")
    w = make(64, 576, bits, seed=2)
    compact_scales(w)
    assert tile_rows(w)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(1))
    mins = w.mins if w.mins is not None else torch.empty(0, dtype=w.scales.dtype)
    none = torch.empty(0, dtype=torch.int16)
    for m in (9, 13, 40):
        xm = x[:m].contiguous()
        got = decode_fused.load().head_q8(xm, w.qweight, w.scales, mins, w.bits, w.tiled, 2, 9, none)
        want = quant_gemm.load().quant_gemm_q8(xm, w.qweight, w.scales, mins, w.bits, w.group_size, False)
        assert torch.equal(got, want)
        gemv = decode_fused.load().head_q8(xm, w.qweight, w.scales, mins, w.bits, w.tiled, 2, 0, none)
        torch.testing.assert_close(gemv, want, rtol=1e-4, atol=1e-4)  # the GEMV: same int dots, other float order


@pytest.mark.skipif(not __import__("sglite.kernels.quant_amx", fromlist=["x"]).available(), reason="no AMX-BF16 here")
def test_fused_thresholds_per_weight_and_few_row_amx_head(quantized_tiny, monkeypatch):
    """The fused step's AMX thresholds come from the dispatcher per weight (8-bit layers: 12 rows; a
    quantized head counted as large: 9 rows), and a 10-row step with its head on the tiles stays
    close to the per-op path on the same head; SGLITE_GEMM=vnni turns both off."""
    from sglite.kernels.quant_layout import tile_rows

    seen = []
    monkeypatch.setattr(gemm_paths, "FUSED_LARGE_BYTES", 1 << 20)  # the tiny 3 MB head counts as large
    e, fused = _checked_engine(quantized_tiny[8], "bfloat16", 0.1, seen)
    try:
        model = e.runner.model
        if not fused.tiled:
            pytest.skip("the tiny model's weights are not in 16-row tiles")
        assert fused.head_amx_min() == 0  # a float head: not the q8 head
        head = make(*model.lm_head.shape, 8, seed=5)  # a quantized, tiled head for both paths
        compact_scales(head)
        assert tile_rows(head)
        model.lm_head = head
        fused = decode_fused.FusedDecode(model, q8=True)
        model.decode_fused = fused
        check_fused_steps(model, 0.1, seen)
        assert (fused.amx_min(), fused.head_amx_min()) == (gemm_paths.FUSED_AMX_MIN_ROWS_8BIT,
                                                           gemm_paths.FUSED_AMX_MIN_ROWS_LARGE)
        rows = [[100 + 37 * i, 7 + i, 2000 + i] for i in range(10)]
        e.generate(input_ids=rows, sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert 10 in seen
        monkeypatch.setenv(gemm_paths.ENV, "vnni")
        assert (fused.amx_min(), fused.head_amx_min()) == (0, 0)
    finally:
        e.shutdown()


@pytest.mark.skipif(not (__import__("sglite.kernels.cpu_attention", fromlist=["x"]).amx_ready()
                          or __import__("sglite.kernels.cpu_attention", fromlist=["x"]).dot_cascade_built()),
                    reason="neither AMX nor AVX512-BF16 here")
def test_fused_shared_prefix_rows_cascade_and_stay_close(quantized_tiny, monkeypatch):
    """Decode rows continuing one cached 80-token prefix: the fused step attends it once per group
    on the tiles (decode_cascade.h on AMX, else decode_dot_cascade.h), close to the per-op path run
    row by row on the same batch."""
    from sglite.kernels import cpu_attention

    seen = []
    e, fused = _checked_engine(quantized_tiny[4], "bfloat16", 0.1, seen)
    try:
        fused.cascade_min = lambda: 16
        monkeypatch.setattr(cpu_attention, "default_cascade_min", lambda: 0)  # the per-op reference: per row
        groups, hidden = [], fused.hidden

        def spy(fb, kb, vb):
            groups.append(cpu_attention.shared_prefix_groups(fb.req_to_token, fb.dec_req_pool_indices, fb.dec_seq_lens, 16))
            return hidden(fb, kb, vb)

        fused.hidden = spy
        prefix = [100 + (7 * i) % 900 for i in range(80)]
        sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        e.generate(input_ids=[prefix], sampling_params=sp)  # cache the prefix
        e.generate(input_ids=[prefix + [5 + i, 9 + i] for i in range(6)] + [prefix[:40] + [3]], sampling_params=sp)
        assert 7 in seen and any(g and max(len(r) for _, r in g) >= 6 for g in groups), groups
    finally:
        e.shutdown()


def test_head_q8_amx_rows_equal_the_tile_gemm():
    from sglite.kernels import quant_amx
    from sglite.kernels.quant_layout import tile_rows

    if not quant_amx.available():
        pytest.skip("no AMX-BF16 here")
    w = make(64, 576, 8, seed=2)
    compact_scales(w)
    assert tile_rows(w)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(1))
    mins = w.mins if w.mins is not None else torch.empty(0, dtype=w.scales.dtype)
    none = torch.empty(0, dtype=torch.int16)
    got = decode_fused.load().head_q8(x, w.qweight, w.scales, mins, w.bits, w.tiled, 2, 32, none)
    want = quant_amx.load().quant_gemm_amx(x.bfloat16(), w.qweight, w.scales, mins, w.bits, w.group_size, False, none)
    assert torch.equal(got, want)  # same tiles, same sums; x rounded to bf16 the same way
    for m in (9, 13):  # few rows from the head's own threshold (gemm_paths.fused_amx_min)
        got = decode_fused.load().head_q8(x[:m].contiguous(), w.qweight, w.scales, mins, w.bits, w.tiled, 2, 9, none)
        assert torch.equal(got, quant_amx.load().quant_gemm_amx(x[:m].bfloat16(), w.qweight, w.scales, mins, w.bits,
                                                                 w.group_size, False, none))
    packed = decode_fused.load().head_q8(x, w.qweight, w.scales, mins, w.bits, w.tiled, 2, 32, quant_amx.pack(w))
    assert torch.equal(packed, want)  # the repacked copy: the same bf16 tiles


def _decode_batch(e):
    """A one-row decode ForwardBatch captured from a real step of ``e``."""
    got = []
    runner, orig = e.runner, e.runner.forward

    def spy(fb):
        if fb.num_extend_tokens == 0:
            got.append(fb)
        return orig(fb)

    runner.forward = spy
    try:
        e.generate(input_ids=PROMPTS[2], sampling_params={"max_new_tokens": 2, "temperature": 0})
    finally:
        runner.forward = orig
    return got[-1]


def test_fallbacks(quantized_tiny, monkeypatch):
    from sglite import Engine

    with Engine(model_path=str(quantized_tiny[4]), dtype="float32", max_total_tokens=2048) as e:
        model = e.runner.model
        assert decode_fused.prepare(model) is not None
        monkeypatch.setenv("SGLITE_KERNEL", "torch")
        assert decode_fused.prepare(model) is None
        monkeypatch.delenv("SGLITE_KERNEL")
        monkeypatch.setattr(decode_fused, "load", lambda portable=False: None)  # a failed build
        assert decode_fused.prepare(model) is None
        fused = model.decode_fused
        model.tp = object()  # made a tensor-parallel shard after load: the fused step declines
        try:
            assert fused.forward(_decode_batch(e), list(e.runner.token_to_kv_pool.k_buffers),
                                 list(e.runner.token_to_kv_pool.v_buffers)) is None
        finally:
            model.tp = None
        model.decode_fused = None
        out = e.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 3, "temperature": 0})
        assert len(out["output_ids"]) == 3


def test_float_model_is_not_fused(tiny_model_dir):
    from sglite import Engine

    with Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=2048) as e:
        assert e.runner.model.decode_fused is None  # float weights: the per-op path


@pytest.mark.slow  # builds the portable extension (the fast tier: the native build)
def test_portable_build_matches(quantized_tiny):
    from sglite import Engine

    if decode_fused.load(portable=True) is None:
        pytest.skip("portable build failed")
    with Engine(model_path=str(quantized_tiny[4]), dtype="float32", max_total_tokens=2048) as e:
        model = e.runner.model
        sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        ref = e.generate(input_ids=PROMPTS[1], sampling_params=sp)["output_ids"]
        model.decode_fused = decode_fused.prepare(model, portable=True)
        assert e.generate(input_ids=PROMPTS[1], sampling_params=sp)["output_ids"] == ref


@pytest.mark.slow
def test_real_model_fused_float32_tokens_equal_per_op(real_engine):
    model = real_engine.runner.model
    fused = model.decode_fused
    assert fused is not None and not fused.q8
    msgs = [real_engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])
            for p in ("Explain the water cycle.", "Write a haiku about bees.", "Name three chess openings.")]
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    try:
        got = [o["output_ids"] for o in real_engine.generate(msgs, sp)]
        model.decode_fused = None
        ref = [o["output_ids"] for o in real_engine.generate(msgs, sp)]
    finally:
        model.decode_fused = fused
    assert got == ref


@pytest.mark.parametrize("dtype,rows", [("float32", 19), ("bfloat16", 40)])
def test_fused_hidden_is_the_same_on_one_thread_and_two(quantized_tiny, dtype, rows):
    """The per-row work between the GEMMs (norms and residual adds, RoPE and the K/V stores, SiLU *
    up, the tile GEMMs' bf16 rows) splits the step's rows over the pool: every decode step's final
    hidden states are bit for bit those of the same steps on one thread (bf16: the AMX tile GEMM
    where this CPU has it; 40 rows there, the fused path's most elsewhere)."""
    from sglite import Engine

    e = Engine(model_path=str(quantized_tiny[4]), dtype=dtype, max_total_tokens=4096)
    fused = e.runner.model.decode_fused
    rows = min(rows, fused.max_rows())  # without the AMX tiles a fused step holds at most MAX_ROWS rows
    steps: list = []
    spy_hidden(fused, steps)
    prompts = [[100 + 37 * i, 7 + i, 2000 + 3 * i] for i in range(rows)]
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    runs = []
    try:
        for threads in (1, 2):
            fused.threads = threads
            steps.clear()
            runs.append(([o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)], list(steps)))
            e.flush_cache()
    finally:
        e.shutdown()
    (ids1, h1), (ids2, h2) = runs
    assert ids1 == ids2
    assert len(h1) == len(h2) >= 2 and any(h.shape[0] == rows for _, h in h1)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(h1, h2))


@pytest.mark.slow
def test_workers_that_sleep_after_every_job_give_the_same_tokens(quantized_tiny):
    """``SGLITE_POOL_SPIN_US=0``: the pool's workers sleep after every job, so each of a step's
    fork/joins wakes them (the condition-variable path, rare at the default spin): the tokens of a
    two-thread batched decode are those of the default spin (a fresh process: the pool reads the
    variable once)."""
    import json
    import subprocess
    import sys

    script = (
        "import json, sys\n"
        "from sglite import Engine\n"
        "e = Engine(model_path=sys.argv[1], dtype='bfloat16', max_total_tokens=4096, num_threads=2)\n"
        "ps = [[100 + 37 * i, 7 + i, 2000 + 3 * i] for i in range(24)]\n"
        "sp = {'max_new_tokens': 6, 'temperature': 0, 'ignore_eos': True}\n"
        "print(json.dumps([o['output_ids'] for o in e.generate(input_ids=ps, sampling_params=sp)]))\n"
        "e.shutdown()\n")
    outs = []
    for spin in ("0", ""):
        env = {**os.environ, "SGLITE_POOL_SPIN_US": spin}
        r = subprocess.run([sys.executable, "-c", script, str(quantized_tiny[4])], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert outs[0] == outs[1] and len(outs[0]) == 24
