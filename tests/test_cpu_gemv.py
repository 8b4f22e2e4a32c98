"""Batch-1 decode through float16 weight copies of a bf16 model (cpu_decode_gemv): same greedy
tokens as the bf16 path, close logits, and a fallback when an activation leaves fp16's range."""
import pytest
import torch

from sglite.runtime.models.cpu_gemv import linear, want_fp16_gemv


def _engine(model_dir, mode):
    from sglite import Engine

    return Engine(model_path=str(model_dir), dtype="bfloat16", max_total_tokens=4096, cpu_decode_gemv=mode)


def test_linear_routes_only_single_rows():
    w = torch.randn(8, 4).bfloat16()
    w16 = w.half()
    x1, x3 = torch.randn(1, 4).bfloat16(), torch.randn(3, 4).bfloat16()
    y1 = linear(x1, w, None, w16)
    assert y1.dtype == torch.bfloat16 and torch.allclose(y1.float(), (x1.float() @ w.float().T), rtol=2e-2, atol=1e-2)
    assert torch.equal(linear(x3, w, None, w16), torch.nn.functional.linear(x3, w))


def test_mode_choice():
    w = [torch.randn(16, 16).bfloat16()]
    assert not want_fp16_gemv("off", torch.bfloat16, "cpu", w)
    assert not want_fp16_gemv("fp16", torch.float32, "cpu", w)  # only bf16 models
    assert want_fp16_gemv("fp16", torch.bfloat16, "cpu", w)
    with pytest.raises(ValueError, match="cpu_decode_gemv"):
        want_fp16_gemv("int8", torch.bfloat16, "cpu", w)


def test_fp16_gemv_matches_bf16_path(tiny_model_dir):
    from sglite import Engine

    prompts = [[5, 9, 17, 33, 2, 8], list(range(40, 75))]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    res = {}
    for mode in ("off", "fp16", "float32"):
        if mode == "float32":
            e = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096)
        else:
            e = _engine(tiny_model_dir, mode)
            assert (e.runner.model.gemv16 is not None) == (mode == "fp16")
        try:
            res[mode] = [e.generate(input_ids=p, sampling_params=params, return_logprob=True)
                         for p in prompts]  # one at a time: every decode step is batch 1
        finally:
            e.shutdown()

    def lps(out):
        return [x[0] for x in out["meta_info"]["output_token_logprobs"]]

    err = {"off": [], "fp16": []}
    for i in range(len(prompts)):
        assert res["off"][i]["output_ids"] == res["fp16"][i]["output_ids"]
        if res["float32"][i]["output_ids"] != res["off"][i]["output_ids"]:
            continue  # a bf16 near-tie: no common tokens to compare logprobs on
        for mode in err:
            err[mode] += [abs(a - b) for a, b in zip(lps(res[mode][i]), lps(res["float32"][i]))]
    assert err["fp16"], "no prompt where bf16 and float32 agree"
    # the fp16 path is no less accurate than the bf16 one (both measured against float32)
    mean = {k: sum(v) / len(v) for k, v in err.items()}
    assert mean["fp16"] <= 1.5 * mean["off"] + 0.01, mean


def test_overflow_falls_back_to_bf16(tiny_model_dir):
    e = _engine(tiny_model_dir, "fp16")
    try:
        m = e.runner.model
        m.gemv16[0]["down"].fill_(60000.0)  # the fp16 copy only: its output overflows fp16
        out = e.generate(input_ids=[5, 9, 17], sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                 "ignore_eos": True})
        assert m.gemv16 is None  # fell back for good
        ref = _engine(tiny_model_dir, "off")
        try:
            want = ref.generate(input_ids=[5, 9, 17], sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                        "ignore_eos": True})
        finally:
            ref.shutdown()
        assert out["output_ids"] == want["output_ids"]
    finally:
        e.shutdown()
