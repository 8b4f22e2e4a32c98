"""``--lora-dtype`` (vLLM's flag): the adapters' A / B storage. ``auto`` follows the model's
activation dtype (so the float32 PEFT oracles of tests/runtime/test_lora.py run float32 adapters);
bf16 adapters on a float32 model stay close to the float32 ones: teacher-forced greedy tokens agree
on most positions and prompt logprobs within a stated tolerance (a statistical check)."""
import json

import pytest
import torch

from sglite.config import EngineConfig
from sglite.errors import InvalidRequestError
from sglite.lora import resolve_lora_dtype
from tests.kernels.test_decode_fused_lora import write_adapter

SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = ["The sea is calm and", "Once upon a time there was", "A list of colours: red,", "In 1999 the city",
           "Numbers: one two", "She opened the door and saw"]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
MIN_AGREE = 0.9  # fraction of teacher-forced positions whose top-1 token agrees
# |logprob difference| in nats, per adapted prompt: max and mean over positions. The adapters are
# deliberately strong (A, B ~ N(0, 0.3), scaling 2: deltas as large as the base weights on hidden 64),
# so bf16's 2^-9 relative rounding of A / B, compounded over the layers, shows (measured 2026-12-06:
# max 0.16, means 0.017-0.035, prompt logprobs ~ -6); real adapters' deltas are far smaller.
LOGP_MAX, LOGP_MEAN = 0.3, 0.06


def test_resolve_and_config():
    assert resolve_lora_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_lora_dtype("auto", torch.float32) == torch.float32
    assert resolve_lora_dtype("auto", torch.float16) == torch.float32
    assert resolve_lora_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert resolve_lora_dtype("float32", torch.bfloat16) == torch.float32
    with pytest.raises(InvalidRequestError, match="lora_dtype") as e:
        EngineConfig(lora_dtype="float16")
    assert e.value.field == "lora_dtype"


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    from sglite import Engine

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    root = tmp_path_factory.mktemp("lora_dtype")
    paths = {n: str(write_adapter(root / n, cfg, 8, SEVEN, seed=s)) for n, s in (("a", 3), ("b", 4))}
    kw = dict(dtype="float32", max_total_tokens=4096, lora_paths=paths)
    with Engine(str(tiny_model_dir), lora_dtype="float32", **kw) as f32, \
            Engine(str(tiny_model_dir), lora_dtype="bfloat16", **kw) as bf16:
        yield f32, bf16


def test_bf16_adapters_close_to_float32(pair):
    f32, bf16 = pair
    assert f32.lora.pool.dtype == torch.float32 and bf16.lora.pool.dtype == torch.bfloat16
    names = ["a", "b", None] * 2
    ref = f32.generate(prompt=PROMPTS, sampling_params=GREEDY, lora_path=names)
    seqs = [f32.tokenizer.encode(p) + r["output_ids"] for p, r in zip(PROMPTS, ref)]
    sp = {"max_new_tokens": 1, "temperature": 0}
    kw = dict(input_ids=seqs, sampling_params=sp, lora_path=names, return_logprob=True, top_logprobs_num=1,
              logprob_start_len=0)
    outs = {k: e.generate(**kw) for k, e in (("f32", f32), ("bf16", bf16))}
    agree = total = 0
    worst, means = 0.0, []
    for i, name in enumerate(names):
        lp = [torch.tensor([x[0] for x in outs[k][i]["meta_info"]["input_token_logprobs"][1:]]) for k in outs]
        top = [[t[0][1] for t in outs[k][i]["meta_info"]["input_top_logprobs"][1:]] for k in outs]
        if name is None:  # the base model's rows do not read the adapters at all
            assert torch.equal(lp[0], lp[1]) and top[0] == top[1]
            continue
        assert not torch.equal(lp[0], lp[1])  # the adapters' weights really were rounded
        worst = max(worst, float((lp[0] - lp[1]).abs().max()))
        means.append(float((lp[0] - lp[1]).abs().mean()))
        agree += sum(x == y for x, y in zip(*top))
        total += len(top[0])
    assert agree >= MIN_AGREE * total, (agree, total)
    assert worst < LOGP_MAX and max(means) < LOGP_MEAN, (worst, means)
