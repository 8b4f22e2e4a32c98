"""Quantized KV pools (issue 16): the KIVI int8 / int4 layout and fp8 against independent dense
oracles, the C++ decode kernel against the torch reference, extend attention equal to token-by-token
decoding, and engines on quantized pools unchanged by the radix cache, chunking, page size and
retraction."""
import pytest
import torch

from sglite.errors import InvalidRequestError
from sglite.kernels import kv_quant as kq
from sglite.kernels import kv_quant_cpu
from sglite.config import EngineConfig
from sglite.runtime.kv_pool import kv_bytes_per_token
from sglite.runtime.kv_quant import QuantTokenToKVPool


def oracle_fake_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Dequantized asymmetric RTN of x over its first dim (one scale and min per column, both
    rounded to float16), written column by column."""
    out = torch.empty(x.shape, dtype=torch.float32)
    qmax = 2 ** bits - 1
    flat, of = x.float().reshape(x.shape[0], -1), out.view(x.shape[0], -1)
    for c in range(flat.shape[1]):
        col = flat[:, c]
        lo = float(torch.tensor(float(col.min())).half())
        sc = float(torch.tensor((float(col.max()) - lo) / qmax).half())
        q = torch.zeros_like(col) if sc == 0 else torch.clamp(torch.round((col - lo) / sc), 0, qmax)
        of[:, c] = q * sc + lo
    return out


class Seq:
    """Rows of a pool written step by step, with the dense full-precision K/V kept beside."""

    def __init__(self, kind, G=16, page=32, Hkv=2, D=16, rows=3, dtype=torch.float32, seed=0):
        self.pool = QuantTokenToKVPool(page * 24, page, 1, Hkv, D, dtype, kind=kind, group=G, max_reqs=rows)
        self.layer, self.G, self.page, self.dtype = self.pool.k_buffers[0], G, page, dtype
        self.table = torch.zeros(rows, 512, dtype=torch.int32)
        self.k = [torch.empty(0, Hkv, D) for _ in range(rows)]
        self.v = [torch.empty(0, Hkv, D) for _ in range(rows)]
        gen = torch.Generator().manual_seed(seed)
        self.src_k = torch.randn(rows, 256, Hkv, D, generator=gen).to(dtype).float()  # what each row will store
        self.src_k[..., 0] += 4.0  # an outlier channel, as keys have (KIVI §3.1)
        self.src_v = torch.randn(rows, 256, Hkv, D, generator=gen).to(dtype).float()
        self.Hkv, self.D = Hkv, D

    def step(self, news: dict):
        """Store ``news[row]`` new tokens per row in one step (extend-like: rows concatenated)."""
        rows, pos, locs, ks, vs = [], [], [], [], []
        for r, n in news.items():
            L = len(self.k[r])
            last = int(self.table[r, L - 1]) if L else None
            slots = self.pool.alloc_extend(last, L, n)
            self.table[r, L:L + n] = slots.int()
            k, v = self.src_k[r, L:L + n], self.src_v[r, L:L + n]
            self.k[r], self.v[r] = torch.cat((self.k[r], k)), torch.cat((self.v[r], v))
            rows += [r] * n; pos += list(range(L, L + n)); locs.append(slots); ks.append(k); vs.append(v)
        st = self.pool.step
        st.tok_rows, st.positions = torch.tensor(rows), torch.tensor(pos)
        st.row_len = torch.zeros(self.table.shape[0], dtype=torch.int64)
        for r in news:
            st.row_len[r] = len(self.k[r])
        kq.store_kv(self.layer, torch.cat(locs), torch.cat(ks).to(self.dtype), torch.cat(vs).to(self.dtype))

    def seen(self, r: int, L: int, bits: int):
        """Oracle K/V a decode query of row r at length L attends to: quantized complete groups
        (keys per channel over the group, values per token), the rest as written."""
        n = len(self.k[r])
        sealed = n // self.G * self.G
        k, v = self.k[r][:L].clone(), self.v[r][:L].clone()
        for g0 in range(0, min(sealed, L), self.G):
            k[g0:g0 + self.G] = oracle_fake_quant(self.k[r][g0:g0 + self.G], bits)
        for t in range(min(sealed, L)):
            v[t] = oracle_fake_quant(self.v[r][t].T.contiguous(), bits).T
        return k, v


def dense_attention(q, k, v, scale):
    """q [Hq, D], k/v [L, Hkv, D] → [Hq, D] (float64)."""
    G = q.shape[0] // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)  # [L, Hq, D]
    p = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), kk) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", p, vv)


def test_int4_packing_and_quantize_roundtrip():
    q = torch.randint(0, 16, (5, 3, 24), dtype=torch.uint8)
    assert torch.equal(kq.unpack_int4(kq.pack_int4(q)), q)
    with pytest.raises(ValueError, match="even head dim"):
        kq.pack_int4(q[..., :3])
    x = torch.randn(40, 7) * 3
    for bits in (8, 4):
        c, sc, mn = kq.quantize(x, 0, bits)
        deq = kq.dequant_codes(c, sc, mn)
        assert (deq - x).abs().le(sc.float() / 2 + 1e-3 * x.abs().max()).all()
        assert torch.allclose(deq, oracle_fake_quant(x, bits), atol=1e-5)


@pytest.mark.parametrize("kind,bits", [("int8", 8), ("int4", 4)])
def test_store_then_decode_matches_dense_oracle(kind, bits):
    s = Seq(kind)
    s.step({0: 5, 1: 40})       # a prefill that completes two groups of row 1
    for _ in range(13):          # decode steps: row 0 completes its first group at length 16
        s.step({0: 1, 1: 1})
    s.step({2: 33, 0: 3})        # another extend beside short appends
    q = torch.randn(3, 4, s.D)
    rows = torch.tensor([0, 1, 2])
    lens = torch.tensor([len(s.k[r]) for r in range(3)])
    for r in range(3):
        s.pool.step.row_len[r] = lens[r]
    ref = kq.decode_attention(q, s.layer, s.table, rows, lens, 0.25)
    for r in range(3):
        k, v = s.seen(r, int(lens[r]), bits)
        want = dense_attention(q[r], k, v, 0.25)
        assert torch.allclose(ref[r].double(), want, atol=2e-5), (kind, r)
    # quantization does change what is seen (the oracle is not the identity)
    raw = dense_attention(q[1], s.k[1], s.v[1], 0.25)
    assert (ref[1].double() - raw).abs().max() > 1e-4


def test_fp8_store_and_attention():
    pool = QuantTokenToKVPool(256, 1, 1, 2, 16, torch.float32, kind="fp8_e4m3", group=16, max_reqs=2)
    layer = pool.k_buffers[0]
    layer.k_scale.fill_(0.5)  # per-head scales
    table = torch.zeros(2, 64, dtype=torch.int32)
    slots = pool.alloc_extend(None, 0, 20)
    table[0, :20] = slots.int()
    k, v = torch.randn(20, 2, 16) * 3, torch.randn(20, 2, 16)
    kq.store_kv(layer, slots, k, v)
    kf = (k / 0.5).to(torch.float8_e4m3fn).float() * 0.5
    vf = v.to(torch.float8_e4m3fn).float()
    q = torch.randn(1, 4, 16)
    out = kq.decode_attention(q, layer, table, torch.tensor([0]), torch.tensor([20]), 0.25)
    assert torch.allclose(out[0].double(), dense_attention(q[0], kf, vf, 0.25), atol=1e-5)
    layer.v_scale.fill_(2.0)
    kq.store_kv(layer, slots, k, v)
    vf = (v / 2).to(torch.float8_e4m3fn).float() * 2
    table[1, :7] = slots[:7].int()  # a second, shorter row: the batched path pads and masks
    q2 = torch.randn(2, 4, 16)
    out = kq.decode_attention(q2, layer, table, torch.tensor([0, 1]), torch.tensor([20, 7]), 0.25)
    assert torch.allclose(out[0].double(), dense_attention(q2[0], kf, vf, 0.25), atol=1e-5)
    assert torch.allclose(out[1].double(), dense_attention(q2[1], kf[:7], vf[:7], 0.25), atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_extend_attention_equals_token_by_token_decode(kind):
    """A prompt prefilled in chunks sees, at every position, what decoding it token by token sees."""
    G, n = 16, 45
    a, b = Seq(kind, G=G, rows=1, seed=3), Seq(kind, G=G, rows=1, seed=3)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(n, 4, a.D, generator=gen)
    dec = []
    for t in range(n):
        a.step({0: 1})
        dec.append(kq.decode_attention(q[t:t + 1], a.layer, a.table, torch.tensor([0]), torch.tensor([t + 1]), 0.3))
    dec = torch.cat(dec)
    outs = []
    for lo, hi in ((0, 7), (7, 40), (40, 45)):  # chunks crossing group boundaries
        b.step({0: hi - lo})
        outs.append(kq.extend_attention(q[lo:hi], b.layer, b.table, torch.tensor([0]), torch.tensor([lo]),
                                        torch.tensor([hi - lo]), 0.3))
    assert torch.allclose(torch.cat(outs), dec, atol=1e-5)


@pytest.mark.skipif(not kv_quant_cpu.available(), reason="the C++ kernel did not build here")
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (16, 4, 2), (128, 8, 1), (24, 4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_decode_matches_reference(kind, D, Hq, Hkv, dtype):
    s = Seq(kind, G=16, page=16, Hkv=Hkv, D=D, rows=4, dtype=dtype, seed=D)
    s.step({0: 37, 1: 16, 2: 5, 3: 50})
    s.step({0: 1, 1: 1, 3: 1})
    rows = torch.tensor([0, 1, 2, 3])
    lens = torch.tensor([len(x) for x in s.k])
    q = torch.randn(4, Hq, D).to(dtype)
    ref = kq.decode_attention(q, s.layer, s.table, rows, lens, 0.125)
    out = kv_quant_cpu.decode_attention(q, s.layer, s.table, rows, lens, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and torch.allclose(out.float(), ref.float(), atol=tol)


def test_pool_sizes_and_page_rules():
    assert EngineConfig(kv_cache_dtype="int8", kv_cache_quant_group_size=64).page_size == 64
    assert EngineConfig(kv_cache_dtype="auto", kv_cache_quant_group_size=64).page_size == 1
    assert EngineConfig(kv_cache_dtype="int4", kv_cache_quant_group_size=64, page_size=128).page_size == 128
    with pytest.raises(InvalidRequestError, match="page_size"):
        EngineConfig(kv_cache_dtype="int4", kv_cache_quant_group_size=32, page_size=48)
    for kind in ("int8", "int4", "fp8_e4m3"):
        pool = QuantTokenToKVPool(1024, 128, 3, 2, 32, torch.float32, kind=kind, group=128, max_reqs=4)
        nbytes = sum(t.untyped_storage().nbytes() for L in pool.k_buffers
                     for t in (L.k_data, L.v_data, L.k_scale, L.v_scale))
        slots = (pool.num_pages + 1) * pool.page_size
        assert nbytes == pytest.approx(pool.bytes_per_token * slots, rel=1e-3), kind
    bf16 = kv_bytes_per_token("bfloat16", 30, 3, 64)
    assert bf16 / kv_bytes_per_token("int8", 30, 3, 64) >= 1.9
    assert bf16 / kv_bytes_per_token("int4", 30, 3, 64) >= 3.5


def test_bad_options_name_the_field(tiny_model_dir, tmp_path):
    from sglite import Engine
    from sglite.config import EngineConfig
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(InvalidRequestError, match="page_size"):
        EngineConfig(kv_cache_dtype="int8", page_size=24, kv_cache_quant_group_size=16)
    with pytest.raises(InvalidRequestError, match="kv_cache_quant_group_size"):
        EngineConfig(kv_cache_dtype="int8", kv_cache_quant_group_size=48)
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4", enable_deterministic_inference=True)
    # speculation keeps its drafts inside a key group (speculative/decoder.py): accepted, pages of a group
    assert EngineConfig(kv_cache_dtype="int8", speculative_algorithm="NGRAM").page_size == 128
    assert EngineConfig(kv_cache_dtype="fp8_e4m3", speculative_algorithm="NGRAM").page_size == 1
    from types import SimpleNamespace

    from sglite.runtime.kv_quant import check_kv_cache_dtype

    odd = SimpleNamespace(num_attention_heads=2, hidden_size=30)  # head dim 15
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype.*even head dim"):
        check_kv_cache_dtype("int4", odd, "cpu")
    check_kv_cache_dtype("int8", odd, "cpu")
    check_kv_cache_dtype("fp8_e4m3", odd, "cpu")
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):  # refused before any model loads
        Engine(str(tiny_model_dir), kv_cache_dtype="int2")


PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 6 + "Then",
           "The quick brown fox jumps over the lazy dog. " * 6 + "After that",
           "Once upon a time", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]


def _run(model_dir, prompts, **kw):
    from sglite import Engine

    with Engine(str(model_dir), dtype="float32", check_invariants=True, log_level="warning", **kw) as e:
        outs = e.generate(prompts, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
                          return_logprob=True)
        return [o["meta_info"]["output_token_logprobs"] for o in outs]


# int4 here is slow-tier: the fast tier keeps int4's packing against the dense oracle (store/decode,
# extend = token-by-token decode) and an int4 engine run (test_engine_quantized_pool_stays_close...)
@pytest.mark.parametrize("kind", ["int8", pytest.param("int4", marks=pytest.mark.slow)])
def test_engine_unchanged_by_cache_chunking_pages_and_retraction(tiny_model_dir, kind):
    """The same greedy tokens (and logprobs to float tolerance) whether prefixes come from the radix
    cache, prompts are chunked, pages hold one or two key groups, or requests are retracted."""
    base = _run(tiny_model_dir, PROMPTS, kv_cache_dtype=kind, kv_cache_quant_group_size=16,
                disable_radix_cache=True, chunked_prefill_size=-1, max_total_tokens=4096)
    variants = [dict(chunked_prefill_size=7),                       # chunks crossing groups, tree reuse
                dict(page_size=32, chunked_prefill_size=20),         # two groups per page
                dict(max_total_tokens=224, max_running_requests=4)]  # retraction under pressure
    for kw in variants:
        got = _run(tiny_model_dir, PROMPTS + PROMPTS[:2], kv_cache_dtype=kind, kv_cache_quant_group_size=16,
                   **{"max_total_tokens": 4096, **kw})
        for want, have in zip(base + base[:2], got):
            assert [t for _, t, _ in have] == [t for _, t, _ in want], kw
            assert max(abs(a[0] - b[0]) for a, b in zip(have, want)) < 1e-3, kw


def test_engine_quantized_pool_stays_close_to_float_pool(tiny_model_dir):
    """int8 changes little, fp8 / int4 more, on the same prompts (teacher-forced logprobs)."""
    from sglite import Engine

    prompt = PROMPTS[0] * 2
    lps = {}
    for kind in ("auto", "int8", "int4", "fp8_e4m3"):
        with Engine(str(tiny_model_dir), dtype="float32", kv_cache_dtype=kind, kv_cache_quant_group_size=16,
                    log_level="warning", max_total_tokens=4096) as e:
            o = e.generate(prompt, {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0)
            lps[kind] = torch.tensor([x[0] for x in o["meta_info"]["input_token_logprobs"][1:]])
    err = {k: (lps[k] - lps["auto"]).abs().mean().item() for k in ("int8", "int4", "fp8_e4m3")}
    assert 0 < err["int8"] < 0.01, err
    assert err["int8"] < err["int4"] < 0.3, err


@pytest.mark.slow
def test_default_model_accuracy_against_bf16_pool(real_checkpoint):
    """Default model, float32 activations, one 1,024-token window of CPython's pydoc topics text:
    teacher-forced top-1 agreement with the bfloat16-KV run and the perplexity change (the issue's
    targets: int8 >= 95 % and <= 0.5 %, int4 >= 85 % and <= 3 %)."""
    import math

    from sglite import Engine
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    res = {}
    for kind in ("bfloat16", "int8", "int4"):
        with Engine(dtype="float32", kv_cache_dtype=kind, max_total_tokens=4096, log_level="warning") as e:
            ids = e.tokenizer.encode(text[:12000], add_special_tokens=False)[:1024]
            o = e.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                           return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
            m = o["meta_info"]
            nll = -sum(x[0] for x in m["input_token_logprobs"][1:]) / (len(ids) - 1)
            top = [x[0][1] for x in m["input_top_logprobs"][1:]]
            res[kind] = (nll, top)
    for kind, agree_min, ppl_max in (("int8", 0.95, 0.005), ("int4", 0.85, 0.03)):
        nll, top = res[kind]
        agree = sum(a == b for a, b in zip(top, res["bfloat16"][1])) / len(top)
        assert agree >= agree_min, (kind, agree)
        assert math.exp(nll - res["bfloat16"][0]) - 1 <= ppl_max, (kind, nll, res["bfloat16"][0])
