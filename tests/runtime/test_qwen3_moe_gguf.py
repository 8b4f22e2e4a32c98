"""Qwen3-MoE from a GGUF file end to end: a tiny random Qwen3-MoE (4 experts, top-2,
``norm_topk_prob``, QK-norm, every layer sparse as llama.cpp's ``qwen3moe`` graph runs) written in
llama.cpp's layout (:func:`sglite.testing_gguf.write_qwen3_moe_gguf`: ``ffn_*_exps`` stacked
experts, ``expert_feed_forward_length``), whose expert size (32) is not transformers' config
default (768): the conversion reads it from the metadata (transformers' GGUF reader does not).

Fast: the converted config's expert size comes from the metadata; the stacked expert blocks split
into one quantized weight per expert. Slow (the conversion parses the 49 152-piece vocabulary,
about a minute here): F32 file -> transformers' float32 greedy tokens and prompt logprobs on the
source checkpoint; Q8_0 experts kept quantized natively -> transformers on the dequantized weights."""
import pytest
import torch

from tests.runtime.family_parity import check_greedy_and_prompt_logprobs, prompts_of

FIELDS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
              mlp_only_layers=[], attention_bias=False)
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hf_qwen3_moe(tmp_path_factory, real_checkpoint):
    from sglite.testing import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("qwen3moe"), "qwen3_moe", "Qwen3MoeForCausalLM", seed=3,
                            vocab_from=real_checkpoint.model_dir, **FIELDS)


def test_expert_size_read_from_metadata_and_blocks_split(hf_qwen3_moe, tmp_path):
    import gguf
    from transformers import AutoConfig

    from sglite.kernels import QuantLinearWeight
    from sglite.runtime import gguf_native, model_loader
    from sglite.testing_gguf import write_qwen3_moe_gguf

    path = write_qwen3_moe_gguf(tmp_path / "m.gguf", hf_qwen3_moe, expert_type="Q8_0", tokenizer=False)
    cfg = model_loader._moe_config(path, str(tmp_path), path.name)["config"]
    got = (cfg.model_type, cfg.moe_intermediate_size, cfg.num_experts, cfg.norm_topk_prob)
    assert got == ("qwen3_moe", 32, 4, True)
    assert AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).moe_intermediate_size != 32  # the gap
    state = gguf_native._read_blocks(gguf.GGUFReader(str(path)), AutoConfig.from_pretrained(str(hf_qwen3_moe)), "cpu")
    ws = [state[f"model.layers.{i}.mlp.experts.{e}.{p}.weight"] for i in range(2) for e in range(4)
          for p in ("gate_proj", "up_proj", "down_proj")]
    assert all(isinstance(w, QuantLinearWeight) and w.fmt == "gguf:Q8_0" for w in ws)


def _run(path, prompts, quantization):
    from sglite import Engine

    with Engine(model_path=str(path), dtype="float32", quantization=quantization, max_total_tokens=4096) as e:
        moe = [L["moe"] for L in e.runner.model.layers]
        fmts = {getattr(w, "fmt", "float") for m in moe for w in m.gate_up + m.down}
        res = e.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    return fmts, res


@pytest.mark.slow
def test_f32_qwen3_moe_gguf_matches_transformers_on_the_source(hf_qwen3_moe, tmp_path, monkeypatch, real_tokenizer):
    from sglite.testing import hf_greedy
    from sglite.testing_gguf import write_qwen3_moe_gguf

    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_qwen3_moe_gguf(tmp_path / "qwen3moe-f32.gguf", hf_qwen3_moe)
    prompts = prompts_of(real_tokenizer, 3, 5, 60, seed=7)
    outs, logps = hf_greedy(hf_qwen3_moe, prompts, GREEDY["max_new_tokens"])
    assert len({tuple(o) for o in outs}) > 1
    fmts, res = _run(path, prompts, "none")
    assert fmts == {"float"}
    check_greedy_and_prompt_logprobs(res, prompts, outs, logps)


@pytest.mark.slow
def test_q8_experts_kept_quantized_match_transformers_on_the_dequantized(hf_qwen3_moe, tmp_path, monkeypatch,
                                                                        real_tokenizer):
    from sglite.runtime.model_loader import load_checkpoint
    from sglite.testing import hf_greedy
    from sglite.testing_gguf import write_qwen3_moe_gguf

    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_qwen3_moe_gguf(tmp_path / "qwen3moe-q8.gguf", hf_qwen3_moe, expert_type="Q8_0")
    prompts = prompts_of(real_tokenizer, 3, 5, 60, seed=7)
    outs, logps = hf_greedy(load_checkpoint(path).model_dir, prompts, GREEDY["max_new_tokens"])
    for q, want in (("gguf", {"gguf:Q8_0"}), ("none", {"float"})):
        fmts, res = _run(path, prompts, q)
        assert fmts == want
        check_greedy_and_prompt_logprobs(res, prompts, outs, logps)
