"""Deterministic inference (``enable_deterministic_inference``): batch-invariant kernels and the
engine-level guarantee that a request's greedy tokens and logprobs are bitwise those of its solo run,
whatever else is in the batch, whatever the chunk size, with or without radix-cache hits.

Kernel level: row i of every batch-sensitive op (linear, SwiGLU activation, decode attention,
RMSNorm, log-softmax) computed alone equals, bit for bit, row i computed inside batches of other
sizes. Engine level: a tiny random bf16 Llama (no real model), then a ``slow`` stress on the default
model. In this mode the scheduler lays every prompt token out as a decode row of its own causal
length (``StepPlan.layout(None)``); the engine-level tests go through it.
"""
import random

import pytest
import torch
import torch.nn.functional as F

from sglite import kernels
from sglite.kernels import cpu_attention, cpu_gemv, reference

SIZES = (1, 2, 3, 7, 8, 9, 16, 33, 70)


def _rows_invariant(fn, x: torch.Tensor, sizes=SIZES) -> None:
    """fn(x[:n])[i] is bitwise fn(x[i:i+1])[0] for every n in sizes, i < n (and from the far end)."""
    alone = [fn(x[i:i + 1]) for i in range(x.shape[0])]
    for n in sizes:
        for part in (x[:n], x[-n:]):
            out = fn(part)
            off = 0 if part.data_ptr() == x.data_ptr() else x.shape[0] - n
            for i in range(n):
                assert torch.equal(out[i:i + 1], alone[off + i]), (n, off + i)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [1, 7, 37, 64, 100, 576])
def test_linear_invariant_rows_and_accuracy(dtype, K):
    g = torch.Generator().manual_seed(K)
    w = torch.randn(301, K, generator=g).to(dtype)
    b = torch.randn(301, generator=g).to(dtype)
    x = torch.randn(70, K, generator=g).to(dtype)
    for lw in (kernels.LinearWeight(w, b).use("invariant"), kernels.LinearWeight(w).use("invariant")):
        _rows_invariant(lambda t: kernels.linear(t, lw), x)
    y = kernels.linear(x, kernels.LinearWeight(w, b).use("invariant"))
    ref = F.linear(x.double(), w.double(), b.double())  # [70, 301]
    order = K * 2.0 ** -23 * (x.double().abs() @ w.double().abs().T + b.double().abs())
    half_ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    assert bool(((y.double() - ref).abs() <= ref.abs() * half_ulp + 1.01 * order + 1e-30).all())
    assert kernels.linear(x[:0], kernels.LinearWeight(w).use("invariant")).shape == (0, 301)


def test_few_row_gemv_matches_invariant_kernel():
    """The fast path's C++ GEMV (1..8 rows) runs the invariant kernel's per-row order."""
    if not cpu_gemv.available():
        pytest.skip("the C++ GEMV is unavailable here")
    g = torch.Generator().manual_seed(3)
    for K in (37, 100, 576):  # K % 64 > 32, < 32, == 0: every tail shape
        w = torch.randn(65, K, generator=g).bfloat16()
        x = torch.randn(8, K, generator=g).bfloat16()
        inv = cpu_gemv.linear_invariant(x, w)
        for m in range(1, 9):
            assert torch.equal(cpu_gemv.gemv(x[:m], w), inv[:m]), (K, m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H", [37, 128, 1536])
def test_silu_mul_invariant_and_accurate(dtype, H):
    g = torch.Generator().manual_seed(H)
    a = (torch.randn(70, H, generator=g) * 4).to(dtype)
    u = torch.randn(70, H, generator=g).to(dtype)
    _rows_invariant(lambda t: kernels.silu_mul(t, _match(u, a, t), batch_invariant=True), a)
    out = kernels.silu_mul(a, u, batch_invariant=True)
    ref = F.silu(a.double()) * u.double()
    tol = 2 ** -7 if dtype == torch.bfloat16 else 2e-6
    assert float(((out.double() - ref).abs() / (ref.abs() + 1e-3)).max()) < tol * 2
    assert torch.equal(kernels.silu_mul(a, u), F.silu(a) * u)  # default: torch


def _match(u, a, t):
    """Rows of u aligned with the view t of a."""
    start = (t.data_ptr() - a.data_ptr()) // (a.element_size() * a.shape[1])
    return u[start:start + t.shape[0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H", [16, 37, 64, 576])
def test_torch_row_reductions_are_row_invariant(dtype, H):
    """RMSNorm and the sampler's log-softmax reduce each row with the same code at every row count
    (why neither has a separate batch-invariant variant)."""
    g = torch.Generator().manual_seed(H)
    x = (torch.randn(70, H, generator=g) * 3).to(dtype)
    w = torch.randn(H, generator=g).to(dtype)
    _rows_invariant(lambda t: kernels.rms_norm(t, w, 1e-5), x)
    _rows_invariant(lambda t: torch.log_softmax(t.float(), dim=-1), x)
    v = torch.randn(9, 49152, generator=g)  # the vocabulary's width
    _rows_invariant(lambda t: torch.log_softmax(t, dim=-1), v, sizes=(1, 2, 5, 9))


def _pool(lens, hkv, d, dtype, g):
    S = sum(lens) + 9
    kb, vb = torch.randn(S, hkv, d, generator=g).to(dtype), torch.randn(S, hkv, d, generator=g).to(dtype)
    r2t = torch.randint(1, S, (len(lens) + 2, max(lens) + 3), generator=g, dtype=torch.int32)
    perm, o = torch.randperm(S - 1, generator=g) + 1, 0
    for i, n in enumerate(lens):
        r2t[i, :n] = perm[o:o + n].int()
        o += n
    return kb, vb, r2t


@pytest.mark.parametrize("impl", ["cpp", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_batch_invariant(impl, dtype):
    if impl == "cpp" and not cpu_attention.available():
        pytest.skip("the C++ decode-attention kernel is unavailable here")
    g = torch.Generator().manual_seed(5)
    lens = [1, 3, 17, 64, 130, 5, 33, 2, 300]
    kb, vb, r2t = _pool(lens, 3, 64, dtype, g)
    q = torch.randn(len(lens), 9, 64, generator=g).to(dtype)
    rows, sl = torch.arange(len(lens)), torch.tensor(lens)

    def run(idx):
        return kernels.decode_attention(q[idx], kb, vb, r2t, rows[idx], sl[idx], 0.125, impl=impl,
                                        batch_invariant=True)

    alone = [run(torch.tensor([i])) for i in range(len(lens))]
    for idx in (list(range(len(lens))), [8, 0], [3, 4, 5], [2, 8, 1, 7, 6]):
        out = run(torch.tensor(idx))
        for j, i in enumerate(idx):
            assert torch.equal(out[j], alone[i][0]), (impl, idx, i)
    ref = reference.decode_attention(q.double(), kb.double(), vb.double(), r2t, rows, sl, 0.125)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert float((run(rows).double() - ref).abs().max()) < tol


# ------------------------------------------------------------------ engine level (tiny model)
def _workload(n: int, seed: int):
    rng = random.Random(seed)
    shared = [[rng.randrange(100, 5000) for _ in range(rng.randint(20, 40))] for _ in range(3)]
    reqs = []
    for _ in range(n):
        own = [rng.randrange(100, 5000) for _ in range(rng.randint(1, 30))]
        reqs.append(((rng.choice(shared) if rng.random() < 0.6 else []) + own, rng.randint(1, 12)))
    return reqs


def _params(max_new):
    return {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}


def _key(out):
    """Tokens and (bitwise) logprobs of one output."""
    lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    return out["output_ids"], [float(v).hex() for v in lps]


def _solo(model_dir, work, **kw):
    from sglite import Engine

    with Engine(model_path=str(model_dir), dtype="bfloat16", max_total_tokens=8192, disable_radix_cache=True,
                chunked_prefill_size=None, enable_deterministic_inference=True, **kw) as e:
        return [_key(e.generate(input_ids=ids, sampling_params=_params(m), return_logprob=True))
                for ids, m in work]


def _batched(model_dir, work, **kw):
    from sglite import Engine

    with Engine(model_path=str(model_dir), dtype="bfloat16", max_total_tokens=8192,
                enable_deterministic_inference=True, **kw) as e:
        outs = e.generate(input_ids=[ids for ids, _ in work], sampling_params=[_params(m) for _, m in work],
                          return_logprob=True)
        assert e.runner.model.linear_impl == "invariant"
        return [_key(o) for o in outs]


def test_engine_batch_equals_solo_bitwise(tiny_model_dir):
    """48 mixed requests (shared prefixes, lengths 1-70, 1-12 new tokens) batched with small prefill
    chunks, cache on and off, at several batch caps: every request's tokens and logprobs are those
    of its solo run, bit for bit."""
    work = _workload(48, seed=0)
    solo = _solo(tiny_model_dir, work)
    runs = {
        "cache, chunk 16": _batched(tiny_model_dir, work, chunked_prefill_size=16),
        "no cache, chunk 7, 5 running": _batched(tiny_model_dir, work, chunked_prefill_size=7,
                                                 disable_radix_cache=True, max_running_requests=5),
    }
    for name, got in runs.items():
        bad = [i for i, (a, b) in enumerate(zip(got, solo)) if a != b]
        assert not bad, f"{name}: {len(bad)} of {len(work)} requests differ from their solo run, e.g. #{bad[0]}"


@pytest.mark.slow
def test_engine_300_requests_under_retraction_equal_solo(tiny_model_dir):
    """The stress shape (300 requests, a pool 1.3x the longest request, so prefixes are evicted and
    running requests retracted and recomputed) in bf16: tokens and logprobs equal the solo runs."""
    from sglite import Engine

    work = _workload(300, seed=3)
    longest = max(len(ids) + m for ids, m in work)
    solo = _solo(tiny_model_dir, work)
    with Engine(model_path=str(tiny_model_dir), dtype="bfloat16", max_total_tokens=int(1.3 * longest),
                max_running_requests=64, chunked_prefill_size=16, enable_deterministic_inference=True) as e:
        got = [_key(o) for o in e.generate(input_ids=[ids for ids, _ in work],
                                           sampling_params=[_params(m) for _, m in work], return_logprob=True)]
        info = e.get_server_info()
    assert info["retractions"] > 0 and info["evicted_tokens"] > 0, info
    bad = [i for i, (a, b) in enumerate(zip(got, solo)) if a != b]
    assert not bad, f"{len(bad)} of 300 requests differ from their solo run"


def test_engine_batch_equals_solo_qwen_fp32(tiny_qwen_dir):
    """float32 weights with q/k/v biases: the fp32 invariant matmul and the bias path."""
    work = _workload(16, seed=1)
    from sglite import Engine

    with Engine(model_path=str(tiny_qwen_dir), dtype="float32", max_total_tokens=8192,
                enable_deterministic_inference=True, chunked_prefill_size=9) as e:
        got = [_key(o) for o in e.generate(input_ids=[ids for ids, _ in work],
                                           sampling_params=[_params(m) for _, m in work], return_logprob=True)]
        solo = [_key(e.generate(input_ids=ids, sampling_params=_params(m), return_logprob=True)) for ids, m in work]
    assert got == solo


@pytest.mark.slow
def test_real_model_300_requests_bf16_equal_solo(real_checkpoint):
    """The done-when: 300 requests on the default model in bf16 with deterministic inference (radix
    cache on, 64-token chunks, up to 64 running) equal each request's solo run, tokens and logprobs
    bitwise."""
    from sglite import Engine

    rng = random.Random(7)
    shared = [[rng.randrange(100, 40000) for _ in range(48)] for _ in range(4)]
    work = [((rng.choice(shared) if rng.random() < 0.6 else []) + [rng.randrange(100, 40000)
             for _ in range(rng.randint(1, 40))], rng.randint(1, 16)) for _ in range(300)]
    with Engine(dtype="bfloat16", max_total_tokens=65536, enable_deterministic_inference=True,
                chunked_prefill_size=64) as e:
        got = [_key(o) for o in e.generate(input_ids=[ids for ids, _ in work],
                                           sampling_params=[_params(m) for _, m in work], return_logprob=True)]
    with Engine(dtype="bfloat16", max_total_tokens=65536, enable_deterministic_inference=True,
                disable_radix_cache=True, chunked_prefill_size=None) as e:
        solo = [_key(e.generate(input_ids=ids, sampling_params=_params(m), return_logprob=True)) for ids, m in work]
    bad = [i for i, (a, b) in enumerate(zip(got, solo)) if a != b]
    assert not bad, f"{len(bad)} of 300 requests differ from their solo run"
