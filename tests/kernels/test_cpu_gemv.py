"""Batch-1 decode matmuls of a bf16 model (cpu_decode_gemv): the C++ GEMV and float16 weight copies
give the same greedy tokens as the bf16 path and close logits; fp16 falls back when an activation
leaves its range; ``auto`` picks from a probe; ``cpp`` degrades to ``off`` without the kernel;
every matmul of the model goes through ``sglite.kernels.linear``, its implementation chosen once."""
import pytest
import torch

from sglite import kernels
from sglite.kernels import cpu_gemv as cpp_kernel
from sglite.kernels import matmul as cpu_gemv
from sglite.kernels.matmul import LinearWeight, choose_gemv, choose_impl, linear


def cpp_gemv_fn():
    return cpp_kernel.load()


def _engine(model_dir, mode):
    from sglite import Engine

    return Engine(model_path=str(model_dir), dtype="bfloat16", max_total_tokens=4096, cpu_decode_gemv=mode)


def test_linear_routes_only_single_rows():
    w = torch.randn(8, 4).bfloat16()
    lw = LinearWeight(w).use("fp16")
    assert lw.w16 is not None and lw.w16.dtype == torch.float16
    x1, x3 = torch.randn(1, 4).bfloat16(), torch.randn(3, 4).bfloat16()
    y1 = linear(x1, lw)
    assert y1.dtype == torch.bfloat16 and torch.allclose(y1.float(), (x1.float() @ w.float().T), rtol=2e-2, atol=1e-2)
    assert torch.equal(linear(x3, lw), torch.nn.functional.linear(x3, w))
    assert lw.use("torch").w16 is None  # the copy goes with the implementation
    with pytest.raises(ValueError, match="unknown implementation"):
        lw.use("int4")
    with pytest.raises(ValueError, match="bias"):
        linear(x1, lw, torch.zeros(8).bfloat16())


def test_linear_routes_cpp_only_few_rows(monkeypatch):
    calls = []

    def fake(x, w, b):
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, w, b)

    monkeypatch.setattr(cpp_kernel, "gemv", fake)
    lw = LinearWeight(torch.randn(8, 4).bfloat16()).use("cpp")
    for m in (0, 1, 3, cpu_gemv.CPP_MAX_ROWS, cpu_gemv.CPP_MAX_ROWS + 1):
        assert linear(torch.randn(m, 4).bfloat16(), lw).shape == (m, 8)
    assert calls == [1, 3, cpu_gemv.CPP_MAX_ROWS]  # none or many rows: F.linear


def test_mode_choice(monkeypatch):
    w = [torch.randn(16, 16).bfloat16()]
    assert choose_gemv("off", torch.bfloat16, "cpu", w) == "off"
    assert choose_gemv("fp16", torch.float32, "cpu", w) == "off"  # only bf16 models
    assert choose_gemv("cpp", torch.bfloat16, "cuda", w) == "off"  # only CPU
    assert choose_gemv("fp16", torch.bfloat16, "cpu", w) == "fp16"
    with pytest.raises(ValueError, match="cpu_decode_gemv"):
        choose_gemv("int8", torch.bfloat16, "cpu", w)
    # auto keeps the fastest probed path; fp16 only when >= MIN_SPEEDUP x faster than off
    for times, want in [({"off": 1.0, "fp16": 0.5, "cpp": 0.3}, "cpp"),
                        ({"off": 1.0, "fp16": 0.5, "cpp": 0.6}, "fp16"),
                        ({"off": 1.0, "fp16": 0.9, "cpp": 1.2}, "off"),
                        ({"off": 1.0, "fp16": 0.9}, "off"),  # fp16 not enough faster, no kernel
                        ({"off": 1.0, "fp16": 0.7}, "fp16")]:
        monkeypatch.setattr(cpu_gemv, "probe_times", lambda ws, t=times: dict(t))
        assert choose_gemv("auto", torch.bfloat16, "cpu", w) == want, times
    monkeypatch.setattr(cpp_kernel, "load", lambda: None)  # the kernel did not build
    assert choose_gemv("cpp", torch.bfloat16, "cpu", w) == "off"
    assert choose_impl("cpp", torch.bfloat16, "cpu", w) == "torch"  # "off" is the torch impl
    assert choose_impl("auto", torch.float32, "cpu", w, deterministic=True) == "invariant"
    with pytest.raises(ValueError, match="cpu_decode_gemv"):
        choose_impl("int8", torch.bfloat16, "cpu", w, deterministic=True)


def test_probe_times_streams_each_candidate():
    w = [torch.randn(32, 64).bfloat16() for _ in range(3)]
    t = cpu_gemv.probe_times(w, reps=1)
    assert {"off", "fp16"} <= set(t) and all(v > 0 for v in t.values())
    assert ("cpp" in t) == (cpp_gemv_fn() is not None)


def test_gemv_paths_match_bf16_path(tiny_model_dir):
    from sglite import Engine

    prompts = [[5, 9, 17, 33, 2, 8], list(range(40, 75))]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    res = {}
    modes = ("off", "fp16", "cpp") if cpp_gemv_fn() is not None else ("off", "fp16")
    for mode in modes + ("float32",):
        if mode == "float32":
            e = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096)
        else:
            e = _engine(tiny_model_dir, mode)
            m = e.runner.model
            assert m.linear_impl == {"off": "torch"}.get(mode, mode)
            assert all(lw.impl == m.linear_impl for lw in m.linear_weights())
            assert (m.lm_head.w16 is not None) == (mode == "fp16")
            if mode == "cpp":  # weights moved into one huge-page buffer, the tied embedding with them
                qkv = m.layers[0]["qkv"].weight
                assert qkv.untyped_storage().data_ptr() == m.lm_head.weight.untyped_storage().data_ptr()
                assert m.embed is m.lm_head.weight
        try:
            res[mode] = [e.generate(input_ids=p, sampling_params=params, return_logprob=True)
                         for p in prompts]  # one at a time: every decode step is batch 1
        finally:
            e.shutdown()

    def lps(out):
        return [x[0] for x in out["meta_info"]["output_token_logprobs"]]

    err = {m: [] for m in modes}
    for i in range(len(prompts)):
        for m in modes:
            assert res["off"][i]["output_ids"] == res[m][i]["output_ids"], m
        if res["float32"][i]["output_ids"] != res["off"][i]["output_ids"]:
            continue  # a bf16 near-tie: no common tokens to compare logprobs on
        for mode in err:
            err[mode] += [abs(a - b) for a, b in zip(lps(res[mode][i]), lps(res["float32"][i]))]
    assert err["fp16"], "no prompt where bf16 and float32 agree"
    # the fp16 and cpp paths are no less accurate than the bf16 one (all measured against float32)
    mean = {k: sum(v) / len(v) for k, v in err.items()}
    for m in modes:
        assert mean[m] <= 1.5 * mean["off"] + 0.01, mean


def test_overflow_falls_back_to_bf16(tiny_model_dir):
    e = _engine(tiny_model_dir, "fp16")
    try:
        m = e.runner.model
        m.layers[0]["down"].w16.fill_(60000.0)  # the fp16 copy only: its output overflows fp16
        out = e.generate(input_ids=[5, 9, 17], sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                 "ignore_eos": True})
        assert m.linear_impl == "torch" and m.layers[0]["down"].w16 is None  # fell back for good
        ref = _engine(tiny_model_dir, "off")
        try:
            want = ref.generate(input_ids=[5, 9, 17], sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                        "ignore_eos": True})
        finally:
            ref.shutdown()
        assert out["output_ids"] == want["output_ids"]
    finally:
        e.shutdown()


def test_chunked_prefill_step_without_logits_rows(tiny_model_dir):
    """A prefill chunk that samples nothing has zero LM-head rows: it must not reach the kernel."""
    from sglite import Engine

    prompt = list(range(30, 75))  # 45 tokens, chunks of 16: two steps without a sampled token
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs = {}
    for mode in ("off", "cpp"):
        e = Engine(model_path=str(tiny_model_dir), dtype="bfloat16", max_total_tokens=4096, cpu_decode_gemv=mode,
                   chunked_prefill_size=16)
        try:
            outs[mode] = e.generate(input_ids=prompt, sampling_params=params)
        finally:
            e.shutdown()
    assert outs["cpp"]["meta_info"]["finish_reason"]["type"] == "length"
    assert outs["cpp"]["output_ids"] == outs["off"]["output_ids"]


def test_every_matmul_goes_through_kernels_linear_and_impl_is_chosen_once(tiny_qwen_dir, monkeypatch):
    """Each forward calls ``kernels.linear`` 4 x layers + 1 times (qkv, o, gate_up, down, LM head),
    no ``F.linear`` / ``matmul`` runs outside it, and the implementation is chosen once, at load."""
    from sglite import Engine

    chosen, calls, outside = [], [], []
    real_choose, real_linear = kernels.choose_impl, kernels.linear
    inside = [False]

    def choose(*a, **kw):
        chosen.append(a[0])
        return real_choose(*a, **kw)

    def counted(x, w, bias=None):
        calls.append(tuple(w.shape))
        inside[0] = True
        try:
            return real_linear(x, w, bias)
        finally:
            inside[0] = False

    def guard(name, fn):
        def wrapped(*a, **kw):
            if not inside[0]:
                outside.append(name)
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(kernels, "choose_impl", choose)
    monkeypatch.setattr(kernels, "linear", counted)
    e = Engine(model_path=str(tiny_qwen_dir), dtype="bfloat16", max_total_tokens=4096, cpu_decode_gemv="auto")
    try:
        m = e.runner.model
        assert chosen == ["auto"] and m.linear_impl == e.runner.linear_impl
        steps = []
        real_forward = m.forward
        monkeypatch.setattr(m, "forward", lambda *a: (steps.append(1), real_forward(*a))[1])
        monkeypatch.setattr(torch.nn.functional, "linear", guard("F.linear", torch.nn.functional.linear))
        monkeypatch.setattr(torch, "matmul", guard("torch.matmul", torch.matmul))
        e.generate(input_ids=[[5, 9, 17, 33], list(range(40, 60))],
                   sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        per_step = 4 * m.arch.num_layers + 1
        assert len(calls) == per_step * len(steps) and steps
        assert calls[:per_step] == [tuple(m.layers[0][k].shape) for k in ("qkv", "o", "gate_up", "down")] * \
            m.arch.num_layers + [tuple(m.lm_head.shape)]
        assert not outside
        assert chosen == ["auto"]  # never re-chosen while serving
    finally:
        e.shutdown()
