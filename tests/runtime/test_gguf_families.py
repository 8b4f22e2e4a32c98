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

from tests.runtime.family_parity import check_greedy_and_prompt_logprobs, prompts_of

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
    prompts = prompts_of(real_tokenizer, 3, 5, 60, seed=11)
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
    prompts = prompts_of(real_tokenizer, 3, 5, 60, seed=11)
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


def _rewrite(src, dst, keys=None, drop=(), tensors=None):
    """``src`` rewritten as ``dst`` with metadata ``keys`` ({name: (value, GGUFValueType)}) set,
    keys / tensors named in ``drop`` left out and ``tensors`` ({name: float32 array}) added or replaced."""
    import gguf
    import numpy as np

    r, keys, tensors = gguf.GGUFReader(str(src)), dict(keys or {}), dict(tensors or {})
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if not (f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in drop or f.name in keys):
            vt = gguf.GGUFValueType(f.types[0])
            w.add_key_value(f.name, f.contents(), vt, sub_type=gguf.GGUFValueType(f.types[-1]) if f.types[1:] else None)
    for k, (v, vt) in keys.items():
        w.add_key_value(k, v, vt)
    for t in r.tensors:
        if t.name not in drop and t.name not in tensors:
            w.add_tensor(t.name, np.array(t.data).reshape([int(d) for d in reversed(t.shape)]))
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_granite_multipliers_absent_take_llama_cpps_defaults(tmp_path, family):
    """llama.cpp's Granite graph scales attention by 1/sqrt(head_dim) when ``attention.scale`` is
    absent or 0 (not GraniteConfig's 1.0), skips an absent or 0 embedding / residual scale, and
    requires ``logit_scale``."""
    from sglite.errors import InvalidRequestError
    from sglite.runtime import gguf_convert
    from sglite.runtime.gguf_header import read_gguf_header

    arch, _ = family
    if arch != "granite":
        pytest.skip("Granite's multipliers")
    meta = read_gguf_header(_gguf(family, tmp_path, tokenizer=False)).metadata
    for absent in ({}, {"granite.attention.scale": 0.0, "granite.embedding_scale": 0.0, "granite.residual_scale": 0.0}):
        m = {k: v for k, v in meta.items() if k not in ("granite.attention.scale", "granite.embedding_scale",
                                                        "granite.residual_scale")} | absent
        cfg = gguf_convert.read_config(arch, m, False, 8, "f")
        assert (cfg.attention_multiplier, cfg.embedding_multiplier, cfg.residual_multiplier) == (0.25, 1.0, 1.0)
        assert cfg.logits_scaling == 2.0
    for m, key in (({k: v for k, v in meta.items() if k != "granite.logit_scale"}, "granite.logit_scale"),
                   ({**meta, "granite.logit_scale": 0.0}, "granite.logit_scale=0")):
        with pytest.raises(InvalidRequestError, match=key) as e:
            gguf_convert.read_config(arch, m, False, 8, "f")
        assert e.value.field == "model_path"


BAD_KEYS = [  # (metadata change, the key the refusal names); "-" drops the key
    ({"attention.head_count": 3}, "head_count=3"), ({"attention.head_count_kv": 3}, "head_count_kv=3"),
    ({"attention.head_count": 0}, "head_count=0"), ({"attention.head_count": "4"}, "head_count='4', not an integer"),
    ({"block_count": 2.5}, "block_count=2.5"), ({"attention.layer_norm_rms_epsilon": "-"}, "layer_norm_rms_epsilon"),
    ({"context_length": "-"}, "context_length"), ({"attention.value_length": 32}, "value_length=32"),
    ({"rope.dimension_count": 8}, "dimension_count=8"), ({"rope.scaling.factor": 4.0}, "scaling.factor=4.0"),
    ({"attention.sliding_window": 4096}, "sliding")]


@pytest.mark.parametrize("change,match", BAD_KEYS, ids=[m for _, m in BAD_KEYS])
def test_malformed_metadata_is_refused_naming_the_key(family, tmp_path, change, match):
    from sglite.errors import InvalidRequestError
    from sglite.runtime import gguf_convert
    from sglite.runtime.gguf_header import read_gguf_header

    arch, _ = family
    meta = read_gguf_header(_gguf(family, tmp_path, tokenizer=False)).metadata
    for k, v in change.items():
        meta.pop(f"{arch}.{k}") if v == "-" else meta.__setitem__(f"{arch}.{k}", v)
    with pytest.raises(InvalidRequestError, match=match) as e:
        gguf_convert.read_config(arch, meta, True, 8, "f")
    assert e.value.field == "model_path"
    meta = read_gguf_header(_gguf(family, tmp_path, tokenizer=False)).metadata
    if arch == "granite":  # Granite has no head size of its own (llama.cpp's graph asserts it), nor runs without RoPE
        for k, v in (("attention.key_length", 32), ("rope.scaling.finetuned", False)):
            with pytest.raises(InvalidRequestError, match=k):
                gguf_convert.read_config(arch, {**meta, f"{arch}.{k}": v}, True, 8, "f")
    assert gguf_convert.read_config(arch, {**meta, f"{arch}.attention.sliding_window": 0}, True, 8, "f")


def test_malformed_tensors_are_refused_before_any_cache(family, tmp_path, monkeypatch):
    """Tensors checked by name and shape as llama.cpp's loader checks them: an unknown tensor (a
    bias the model would silently drop, a block past block_count), a wrong shape, a vocabulary
    of another size than token_embd's rows; a refused file leaves nothing in the cache."""
    import numpy as np

    from sglite.errors import InvalidRequestError
    from sglite.runtime import gguf_convert
    from sglite.runtime.gguf_header import read_gguf_header
    from sglite.runtime.model_loader import load_checkpoint

    arch, _ = family
    src = _gguf(family, tmp_path, tokenizer=False)
    n = int(read_gguf_header(src).metadata[f"{arch}.block_count"])  # a block past the last one
    cases = [({"blk.0.attn_q.bias": np.ones(64)}, "blk.0.attn_q.bias"),
             ({f"blk.{n}.attn_q.weight": np.ones((64, 64))}, f"blk.{n}"),
             ({"blk.1.attn_v.weight": np.ones((16, 64))}, r"blk.1.attn_v.weight \[16, 64\] \(expected \[32, 64\]\)"),
             ({"output.weight": np.ones((100, 64))}, r"output.weight \[100, 64\]")]
    for i, (tensors, match) in enumerate(cases):
        path = _rewrite(src, tmp_path / f"bad{i}.gguf", tensors=tensors)
        with pytest.raises(InvalidRequestError, match=match) as e:
            gguf_convert.read(path, read_gguf_header(path).metadata)
        assert e.value.field == "model_path"
    meta = {**read_gguf_header(src).metadata, "tokenizer.ggml.tokens#len": 49153}
    with pytest.raises(InvalidRequestError, match="49153 tokens in tokenizer.ggml.tokens but 49152 rows"):
        gguf_convert.read(src, meta)
    import gguf

    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))
    path = _rewrite(src, tmp_path / "heads.gguf", keys={f"{arch}.attention.head_count": (3, gguf.GGUFValueType.UINT32)})
    with pytest.raises(InvalidRequestError, match="head_count=3"):
        load_checkpoint(path)
    assert not [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()]
