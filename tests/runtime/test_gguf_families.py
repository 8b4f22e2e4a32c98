"""Granite, OLMo 2 and SmolLM3 from GGUF files, which transformers' GGUF reader does not map
(:mod:`sglite.runtime.gguf_convert`). Tiny random checkpoints (Granite tied, with non-default
multipliers, as Granite 3.x 2B ties its head; OLMo 2 untied, as llama.cpp's OLMo 2 graph needs;
SmolLM3 with 4 layers, its last a NoPE layer as llama.cpp's fixed every-4th)
written in llama.cpp's layout (:func:`sglite.testing_gguf.write_family_gguf`, whose tensors are bit
for bit those of llama.cpp's own converter).

Fast: the config read from the metadata is the source's, the tensors read back are the source's
bit for bit (Granite's and SmolLM3's Q / K rows back in HF's order), the kernels' Q8_0 blocks dequantize to the
float conversion's rows, refusals name the field. Slow (the conversion parses the 49 152-piece
vocabulary): the F32 file served by the engine gives transformers' greedy tokens and prompt
logprobs on the source checkpoint; the Q8_0 file, its matmul weights kept quantized, gives
transformers' on the dequantized folder; and on both files the prompt tokenizes as llama.cpp's
and every next token, teacher-forced on llama.cpp's greedy output, is llama.cpp's wherever
llama.cpp's own top-1 / top-2 margin is clear (``tests/data/gguf_families_llamacpp.json``,
recorded by ``scripts/record_llamacpp_families.py``)."""
import json
from pathlib import Path

import pytest
import torch

from tests.runtime.family_parity import check_greedy_and_prompt_logprobs

DATA = Path(__file__).resolve().parents[1] / "data" / "gguf_families_llamacpp.json"
RECORD = json.loads(DATA.read_text())
ARCHS = {k: (v["hf_architecture"], v["seed"], v["fields"]) for k, v in RECORD["families"].items()}
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
# |our top-1 - top-2 logit margin - llama.cpp's| at most (F32: llama.cpp keeps an f16 KV cache;
# Q8_0: llama.cpp also quantizes the activations to 8 bits, sglite multiplies bf16 / f32 ones)
MARGIN_TOL = {"F32": 0.15, "Q8_0": 1.5}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def family(request, tmp_path_factory, real_checkpoint):
    from sglite.testing import make_tiny_family

    arch = request.param
    hf_arch, seed, fields = ARCHS[arch]
    out = make_tiny_family(tmp_path_factory.mktemp(arch), arch, hf_arch, seed=seed, vocab_from=real_checkpoint.model_dir,
                           **fields)
    return arch, out


def _gguf(family, tmp_path, tensor_type="F32", tokenizer=True):
    from sglite.testing_gguf import write_family_gguf

    arch, hf = family
    return write_family_gguf(tmp_path / f"{arch}-{tensor_type}.gguf", hf, arch, tensor_type=tensor_type,
                             tokenizer=tokenizer)


def test_config_and_tensors_read_back_as_the_source(family, tmp_path):
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from sglite.runtime import gguf_convert
    from sglite.runtime.gguf_header import read_gguf_header

    arch, hf = family
    path = _gguf(family, tmp_path, tokenizer=False)
    src = AutoConfig.from_pretrained(str(hf))
    meta = read_gguf_header(path).metadata
    reader = gguf.GGUFReader(str(path))
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    cfg = gguf_convert.read_config(arch, meta, "output.weight" in shapes, shapes["token_embd.weight"][-1], "f")
    keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "vocab_size", "tie_word_embeddings", "model_type"]
    keys += ["head_dim"] if arch == "olmo2" else []  # Granite has none (llama.cpp drops it too)
    keys += ["embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"] if arch == "granite" else []
    assert {k: getattr(cfg, k, None) for k in keys} == pytest.approx({k: getattr(src, k, None) for k in keys})
    assert cfg.rms_norm_eps == pytest.approx(src.rms_norm_eps)
    assert cfg.rope_parameters["rope_theta"] == src.rope_parameters["rope_theta"]
    state = gguf_convert.read_tensors(reader, arch, cfg)
    want = load_file(str(hf / "model.safetensors"))
    assert sorted(state) == sorted(want)
    for name, w in want.items():
        assert torch.equal(state[name], w.float()), name


def test_q8_rows_match_the_dequantized_rows_and_refusals(family, tmp_path):
    import gguf

    from sglite.errors import InvalidRequestError
    from sglite.kernels import QuantLinearWeight
    from sglite.runtime import gguf_convert, gguf_native
    from sglite.runtime.gguf_header import read_gguf_header

    arch, hf = family
    path = _gguf(family, tmp_path, "Q8_0", tokenizer=False)
    reader = gguf.GGUFReader(str(path))
    meta = read_gguf_header(path).metadata
    cfg = gguf_convert.read_config(arch, meta, arch == "olmo2", 49152, "f")
    floats = gguf_convert.read_tensors(reader, arch, cfg)
    native = gguf_native._read_blocks(reader, cfg, "cpu")  # the kernels' blocks, same row order
    qk = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in ("q", "k", "v", "o")]
    for name in qk:
        assert isinstance(native[name], QuantLinearWeight) and native[name].fmt == "gguf:Q8_0"
        assert torch.equal(native[name].dequantize(torch.float32), floats[name]), name
    with pytest.raises(InvalidRequestError, match=f"{arch}.block_count") as e:
        gguf_convert.read_config(arch, {k: v for k, v in meta.items() if not k.endswith("block_count")}, True, 8, "f")
    assert e.value.field == "model_path"
    with pytest.raises(InvalidRequestError, match="sliding") as e:
        gguf_convert.read_config(arch, {**meta, f"{arch}.attention.sliding_window": 4096}, True, 8, "f")
    assert e.value.field == "model_path"
    assert gguf_convert.hf_tensor_name(arch, "blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_convert.hf_tensor_name(arch, "rope_freqs.weight") is None


def _prompts(real_tokenizer):
    from sglite.testing import word_prompts

    out = word_prompts(real_tokenizer, 3, 5, 60, seed=11)
    out[0] = out[0][:5]
    return out


def _serve(path, prompts, quantization):
    from sglite import Engine

    with Engine(model_path=str(path), dtype="float32", quantization=quantization, max_total_tokens=4096) as e:
        fmts = {getattr(L["qkv"], "fmt", "float") for L in e.runner.model.layers}
        res = e.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    return res, fmts


@pytest.mark.slow
def test_f32_gguf_matches_transformers_on_the_source(family, tmp_path, monkeypatch, real_tokenizer):
    from sglite.runtime.model_loader import load_checkpoint
    from sglite.testing import hf_greedy

    arch, hf = family
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf(family, tmp_path)
    ck = load_checkpoint(path)
    assert ck.architecture == ARCHS[arch][0]
    prompts = _prompts(real_tokenizer)
    outs, logps = hf_greedy(hf, prompts, GREEDY["max_new_tokens"])
    assert len({tuple(o) for o in outs}) > 1
    res, fmts = _serve(path, prompts, "none")
    assert fmts == {"float"}
    check_greedy_and_prompt_logprobs(res, prompts, outs, logps)


@pytest.mark.slow
def test_q8_gguf_kept_quantized_matches_transformers_on_the_dequantized(family, tmp_path, monkeypatch, real_tokenizer):
    from sglite.runtime.model_loader import load_checkpoint
    from sglite.testing import hf_greedy

    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf(family, tmp_path, "Q8_0")
    prompts = _prompts(real_tokenizer)
    outs, logps = hf_greedy(load_checkpoint(path).model_dir, prompts, GREEDY["max_new_tokens"])
    for q, want in (("gguf", {"gguf:Q8_0"}), ("none", {"float"})):
        res, fmts = _serve(path, prompts, q)
        assert fmts == want
        check_greedy_and_prompt_logprobs(res, prompts, outs, logps)


@pytest.mark.slow
@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0"])
def test_next_tokens_are_llama_cpps_on_the_same_file(family, tensor_type, tmp_path, monkeypatch):
    from sglite import Engine

    arch, _ = family
    rec = RECORD["records"][f"{arch}/{tensor_type}"]
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf(family, tmp_path, tensor_type)
    P, R = rec["prompt_ids"], rec["output_ids"]
    with Engine(model_path=str(path), dtype="float32", max_total_tokens=4096) as e:
        assert e.tokenizer.encode(RECORD["prompt"]) == P
        out = e.generate(input_ids=P + R[:-1], sampling_params={"max_new_tokens": 1, "temperature": 0},
                         return_logprob=True, logprob_start_len=len(P) - 1, top_logprobs_num=2)
    meta = out["meta_info"]
    tops = meta["input_top_logprobs"][1:] + [meta["output_top_logprobs"][0]]
    assert len(tops) == len(R)
    tol = MARGIN_TOL[tensor_type]
    for i, (t, want) in enumerate(zip(tops, R)):
        ours, theirs = t[0][0] - t[1][0], rec["top1_logits"][i] - rec["top2_logits"][i]
        assert abs(ours - theirs) <= tol, (i, ours, theirs)
        if theirs > tol:  # a clear choice for llama.cpp: ours too
            assert t[0][1] == want, (i, t, want)
