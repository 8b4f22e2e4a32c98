"""End to end on the real default model (SmolLM2-135M-Instruct), one shared engine per session."""
import re

import pytest
import torch


@pytest.fixture(scope="module")
def hf_model(real_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(real_checkpoint.model_dir), dtype=torch.float32)


@pytest.mark.slow
def test_greedy_parity_with_hf_on_four_prompts(real_engine, hf_model):
    tok = real_engine.tokenizer
    texts = ["Hello there, friend", "The history of the Roman empire " * 4,
             real_engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
             "Numbers: " + ", ".join(str(i) for i in range(70))]
    prompts = [tok.encode(t) for t in texts]
    assert min(map(len, prompts)) <= 5 and 250 <= max(map(len, prompts)) <= 300
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    outs = real_engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0)
    for ids, out in zip(prompts, outs):
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
            logp = torch.log_softmax(hf_model(x).logits[0].float(), -1)
        assert out["output_ids"] == ref
        ours = torch.tensor([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]])
        theirs = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(ours, theirs, atol=1e-3), float((ours - theirs).abs().max())


@pytest.mark.slow  # the real default model (real_engine)
def test_regex_constrained_flight_code(real_engine):
    pat = r"[A-Z]{3}-[0-9]{2,4}"
    prompt = real_engine.apply_chat_template([{"role": "user", "content": "Invent a product code."}])
    out = real_engine.generate(prompt, {"regex": pat, "max_new_tokens": 20, "temperature": 0})
    assert re.fullmatch(pat, out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.slow  # the real default model (real_engine)
def test_same_long_prompt_twice_is_cached(real_engine):
    prompt = "Tell me about caching. " * 40
    n = len(real_engine.tokenizer.encode(prompt))
    assert n >= 200
    p = {"max_new_tokens": 8, "temperature": 0}
    a = real_engine.generate(prompt, p)
    b = real_engine.generate(prompt, p)
    assert b["meta_info"]["cached_tokens"] == b["meta_info"]["prompt_tokens"] - 1 == n - 1
    assert a["output_ids"] == b["output_ids"]
