"""Llama 3.1 / 3.2 GGUF files: llama.cpp stores their ``llama3`` RoPE scaling as a
``rope_freqs.weight`` tensor (per-frequency divisors; transformers' GGUF reader drops it), which
sglite reads from the file and applies through its RoPE tables (sglite/runtime/models/rope.py).

Fast: the divisors llama.cpp's converter writes (:func:`sglite.testing_gguf.llama3_rope_freqs`)
reproduce transformers' ``llama3`` inverse frequencies, and sglite's tables built from them equal
its ``llama3`` tables; the tensor is read from the file exactly (F32 and F16) and a malformed one
is refused naming the field. Slow (transformers' GGUF conversion parses the 49 152-piece
vocabulary, about a minute here): a tiny random Llama 3 checkpoint written as GGUF the converter's
way gives transformers' float32 greedy tokens and prompt logprobs on the source checkpoint (untied
LM head, as 3.1 8B), and a tied-embedding (3.2 1B) file whose tensor disagrees with the
checkpoint's ``llama3`` config follows the tensor (llama.cpp's behaviour), checked against
transformers with its inverse frequencies set from the tensor."""
import math

import pytest
import torch

from sglite.errors import InvalidRequestError
from sglite.runtime.models import rope
from sglite.testing_gguf import llama3_rope_freqs

LO = 64
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": LO}
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("params, head_dim", [
    (LLAMA3, 16),
    ({**LLAMA3, "rope_theta": 500000.0, "original_max_position_embeddings": 8192}, 128),  # Llama 3.1 8B's
    ({**LLAMA3, "rope_theta": 500000.0, "factor": 32.0, "original_max_position_embeddings": 8192}, 64),  # 3.2 1B's
])
def test_rope_freqs_reproduce_transformers_llama3(params, head_dim):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      intermediate_size=64, num_hidden_layers=1, vocab_size=32, max_position_embeddings=256,
                      rope_parameters=dict(params))
    ref, att = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    factors = llama3_rope_freqs(params, head_dim)
    assert att == 1.0 and min(factors) == 1.0 and max(factors) == params["factor"]  # both ends present
    base = 1.0 / params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    assert torch.allclose(base / torch.tensor(factors, dtype=torch.float64), ref.double(), rtol=1e-5)
    want = rope.rope_cache(rope.spec_from_hf_config(cfg, head_dim), 256)  # sglite's llama3 tables
    plain = rope.RopeSpec(theta=params["rope_theta"], dim=head_dim, max_position_embeddings=256,
                          freq_factors=tuple(factors))  # what a GGUF file's tensor gives
    assert all(torch.allclose(g, w, atol=2e-5) for g, w in zip(rope.rope_cache(plain, 256), want))
    cfg.gguf_rope_freqs = factors  # the converted folder's config carries the tensor
    assert rope.spec_from_hf_config(cfg, head_dim).freq_factors == tuple(factors)


def _gguf_with(path, values, ggml_type="F32", arch="llama"):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32("test.n", 1)
    w.add_tensor("t", np.zeros((3, 5), dtype=np.float32))  # data before it: its offset is not 0
    if ggml_type == "Q8_0":
        arr = gguf.quants.quantize(np.asarray(values, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor("rope_freqs.weight", arr, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        w.add_tensor("rope_freqs.weight", np.asarray(values, dtype=np.float32 if ggml_type == "F32" else np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("ggml_type", ["F32", "F16"])
def test_rope_freqs_tensor_read_exactly(tmp_path, ggml_type):
    from sglite.runtime.gguf_header import read_rope_freqs

    values = llama3_rope_freqs(LLAMA3, 16)
    got = read_rope_freqs(_gguf_with(tmp_path / "m.gguf", values, ggml_type))
    dt = torch.float32 if ggml_type == "F32" else torch.float16
    assert got == torch.tensor(values, dtype=dt).tolist()
    assert read_rope_freqs(_gguf_with(tmp_path / "none.gguf", [1.0] * 4)) is not None


def test_malformed_rope_freqs_refused_naming_the_field(tmp_path):
    from transformers import LlamaConfig

    from sglite.runtime.gguf_header import read_rope_freqs

    with pytest.raises(InvalidRequestError, match="rope_freqs.weight tensor of type Q8_0.*F32 or F16") as e:
        read_rope_freqs(_gguf_with(tmp_path / "q.gguf", [1.0] * 32, "Q8_0"))
    assert e.value.field == "model_path"
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=1, vocab_size=32)
    for bad in ([1.0] * 7, [1.0] * 7 + [0.0], [1.0] * 7 + [math.inf]):
        cfg.gguf_rope_freqs = bad
        with pytest.raises(InvalidRequestError, match="rotary_dim/2=8 positive finite") as e:
            rope.spec_from_hf_config(cfg, 16)
        assert e.value.field == "rope_freqs"


# ------------------------------------------------------------------------------------------------
# end to end (slow: transformers' GGUF conversion)


def _hf_reference(hf, prompts):
    outs, logps = [], []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            g = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=GREEDY["max_new_tokens"],
                            do_sample=False, eos_token_id=None, pad_token_id=0)
            logps.append(torch.log_softmax(hf(x).logits[0].float(), -1))
        outs.append(g[0, len(ids):].tolist())
    return outs, logps


def _sglite(path, prompts, quantization="none"):
    from sglite import Engine

    with Engine(model_path=str(path), dtype="float32", quantization=quantization, max_total_tokens=4096) as e:
        spec = e.runner.model.arch.rope
        res = e.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    return spec, [r["output_ids"] for r in res], [[x[0] for x in r["meta_info"]["input_token_logprobs"][1:]]
                                                   for r in res]


def _check(prompts, got_lp, ref_lp, atol):
    for ids, ours, ref in zip(prompts, got_lp, ref_lp):
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(torch.tensor(ours), want, atol=atol), (torch.tensor(ours) - want).abs().max()


@pytest.fixture(scope="module")
def prompts(real_tokenizer):
    from sglite.testing import word_prompts

    out = word_prompts(real_tokenizer, 3, 5, 90, seed=7)  # up to 90 tokens: beyond LO = 64 as well
    out[0] = out[0][:5]
    return out


@pytest.mark.slow
def test_llama31_gguf_untied_matches_transformers(tmp_path, monkeypatch, real_checkpoint, prompts):
    from transformers import AutoModelForCausalLM

    from sglite.testing import make_tiny_llama
    from sglite.testing_gguf import write_llama_gguf

    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))
    d = make_tiny_llama(tmp_path / "hf", seed=5, vocab_from=real_checkpoint.model_dir, tie_word_embeddings=False,
                        rope_parameters=dict(LLAMA3))
    path = write_llama_gguf(tmp_path / "llama31.gguf", d)
    outs, logps = _hf_reference(AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                                     attn_implementation="eager"), prompts)
    for q in ("none", "gguf"):  # dequantized float path, and the native GGUF loader (F32 file: same math)
        spec, got, lp = _sglite(path, prompts, q)
        assert spec.freq_factors == pytest.approx(llama3_rope_freqs(LLAMA3, 16), rel=1e-6)
        assert got == outs, q
        _check(prompts, lp, logps, 1e-4)


@pytest.mark.slow
def test_rope_freqs_tensor_wins_over_the_config_tied_q8(tmp_path, monkeypatch, real_checkpoint, prompts):
    """A tied-embedding (Llama 3.2 1B-like) Q8_0 file whose ``rope_freqs`` (factor 4, Lo 32) disagrees
    with its source's ``llama3`` config (factor 8, Lo 64): sglite follows the tensor, as llama.cpp
    does -- transformers on the converted float32 weights with the tensor's inverse frequencies."""
    from transformers import AutoModelForCausalLM

    from sglite.runtime.model_loader import load_checkpoint
    from sglite.testing import make_tiny_llama
    from sglite.testing_gguf import write_llama_gguf

    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))
    d = make_tiny_llama(tmp_path / "hf", seed=6, vocab_from=real_checkpoint.model_dir, rope_parameters=dict(LLAMA3))
    factors = llama3_rope_freqs({**LLAMA3, "factor": 4.0, "original_max_position_embeddings": 32}, 16)
    assert factors != llama3_rope_freqs(LLAMA3, 16)
    path = write_llama_gguf(tmp_path / "llama32.gguf", d, rope_freqs=factors, tensor_type="Q8_0")
    ck = load_checkpoint(path)
    assert ck.hf_config.tie_word_embeddings and ck.hf_config.gguf_rope_freqs == pytest.approx(factors, rel=1e-6)
    hf = AutoModelForCausalLM.from_pretrained(str(ck.model_dir), dtype=torch.float32, attn_implementation="eager")
    rot = hf.model.rotary_emb
    base = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    rot.inv_freq = rot.original_inv_freq = base / torch.tensor(factors, dtype=torch.float32)
    outs, logps = _hf_reference(hf, prompts)
    spec, got, lp = _sglite(path, prompts)
    assert got == outs
    _check(prompts, lp, logps, 1e-4)
    _, native, native_lp = _sglite(path, prompts, "gguf")  # Q8_0 kept quantized: the same text
    assert native == got
    assert max(abs(a - b) for x, y in zip(native_lp, lp) for a, b in zip(x, y)) < 1e-2
    config_rope = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager")
    assert _hf_reference(config_rope, prompts[1:])[0] != outs[1:]  # the two scalings do give other text
