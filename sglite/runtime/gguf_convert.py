"""GGUF files of the architectures transformers' GGUF reader does not map (``granite``, ``olmo2``,
``smollm3``),
read into the same float32 HF folder parts as :func:`sglite.runtime.model_loader.load_checkpoint`'s
conversion of the others: a ``transformers`` config, HF-named float32 tensors, the tokenizer.

The layout is llama.cpp's (``convert_hf_to_gguf.py``, ``conversion/granite.py``,
``conversion/olmo.py`` and ``conversion/llama.py``'s ``SmolLM3Model`` of the llama.cpp vendored in
llama-cpp-python 0.3.36):

- tensor names: ``token_embd`` / ``output_norm`` / ``output`` and per block ``attn_q`` / ``attn_k`` /
  ``attn_v`` / ``attn_output`` / ``ffn_gate`` / ``ffn_up`` / ``ffn_down``; Granite's pre-norms
  ``attn_norm`` / ``ffn_norm``; OLMo 2's ``attn_q_norm`` / ``attn_k_norm`` (over all heads) and its
  post-norms ``post_attention_norm`` / ``post_ffw_norm``. No ``output`` tensor: a tied LM head.
- Granite's and SmolLM3's converters are Llama's, which reorders the rows of ``attn_q`` / ``attn_k``
  within each head (rotate-half to GGML's interleaved RoPE); undone here as for Llama
  (:func:`sglite.runtime.gguf_native.unpermute_rows`). OLMo 2's converter keeps HF's rows.
- SmolLM3's NoPE layers are not in the file: llama.cpp's graph skips RoPE on every 4th layer, which
  is the config's default (``no_rope_layer_interval`` 4) that the converted config gets.
- hyper-parameters under ``<arch>.*``: ``embedding_length``, ``feed_forward_length``,
  ``block_count``, ``context_length``, ``attention.head_count`` / ``head_count_kv`` /
  ``layer_norm_rms_epsilon`` / ``key_length``, ``rope.freq_base``; Granite's multipliers as
  ``attention.scale``, ``embedding_scale``, ``residual_scale``, ``logit_scale``.
- checked as llama.cpp's loader checks them (:func:`read_config`, :func:`read`): required keys
  required, llama.cpp's defaults for the optional ones, every tensor by name and shape.

The tokenizer (``tokenizer.*`` keys, chat template included) is converted by transformers from a
tensor-less copy of those keys under ``general.architecture = llama``: its GGUF tokenizer
conversion depends on ``tokenizer.ggml.model`` (``gpt2`` BPE or ``llama`` SentencePiece), not on
the model's architecture, and the architecture check would refuse the original file. Checked in
``tests/runtime/test_gguf_families.py`` against transformers on the source checkpoint (logits and
greedy tokens), on files written in llama.cpp's layout (float32 and Q8_0).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from ..errors import InvalidRequestError
from .gguf_native import LLAMA_LAYER_NAMES, PERMUTED_ARCHS, unpermute_rows

OWN_ARCHS = ("granite", "olmo2", "smollm3")  # GGUF general.architecture values converted here
_HF_ARCH = {"granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
_PRE_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_LAYER = {
    "granite": {**LLAMA_LAYER_NAMES, **_PRE_NORMS}, "smollm3": {**LLAMA_LAYER_NAMES, **_PRE_NORMS},
    "olmo2": {**LLAMA_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
              "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_GRANITE_SCALES = {"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                   "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}


def hf_tensor_name(arch: str, gguf_name: str) -> str | None:
    """The HF parameter name of GGUF tensor ``gguf_name`` in an ``arch`` file, or None when the
    tensor is not one the model has (``blk.0.attn_q_norm.weight`` -> ``model.layers.0.self_attn.q_norm.weight``)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER[arch]:
        return f"model.layers.{parts[1]}.{_LAYER[arch][parts[2]]}.weight"
    return None


def _number(meta: dict, key: str, where: str, default=None, kind=int):
    """``meta[key]`` as ``kind`` (``default`` when absent; a required key when ``default`` is None)."""
    v = meta.get(key)
    if v is None and default is None:
        raise InvalidRequestError(f"model_path: {where} lacks GGUF key {key}", field="model_path")
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
        raise InvalidRequestError(f"model_path: {where} has {key}={v!r}, not a{'n integer' if kind is int else ' number'}",
                                  field="model_path")
    return kind(v)


def read_config(arch: str, meta: dict, has_output: bool, vocab: int, where: str):
    """The transformers config of an ``arch`` file from its metadata ``meta`` (``has_output``: the
    file has an ``output.weight``, else the LM head is tied; ``vocab``: rows of its ``token_embd``).
    Keys llama.cpp requires are required (``embedding_length``, ``feed_forward_length``,
    ``block_count``, ``context_length``, ``attention.head_count``,
    ``attention.layer_norm_rms_epsilon``; Granite's ``logit_scale``); absent optional ones take
    llama.cpp's defaults (Granite: ``attention.scale`` absent or 0 is 1/sqrt(head_dim), as
    llama.cpp's graph, not GraniteConfig's 1.0; ``embedding_scale`` / ``residual_scale`` absent or 0
    are 1).

    Raises:
        InvalidRequestError (field ``model_path``): a required key is missing or not a number, head
            counts that do not divide (embedding length by heads, heads by KV heads), a head size
            other than the embedding length / heads where the model has none of its own (Granite's
            ``attention.key_length`` / ``value_length``), partial RoPE (``rope.dimension_count``),
            a RoPE scaling factor other than 1, Granite without RoPE (``rope.scaling.finetuned``
            false), or the file uses sliding-window attention (OLMo 3), which the OLMo 2 model does
            not run.
    """
    from transformers import AutoConfig

    def num(key: str, default=None, kind=int):
        return _number(meta, f"{arch}.{key}", where, default, kind)

    def refuse(what: str):
        raise InvalidRequestError(f"model_path: {where} {what}", field="model_path")

    if meta.get(f"{arch}.attention.sliding_window"):  # 0: none, as llama.cpp reads it
        refuse(f"uses sliding-window attention ({arch}.attention.sliding_window, an OLMo 3 file), which "
               "sglite's OLMo 2 model does not run")
    heads, hidden = num("attention.head_count"), num("embedding_length")
    kv = num("attention.head_count_kv", heads)
    layers, ff = num("block_count"), num("feed_forward_length")
    if min(heads, kv, hidden, layers, ff) <= 0 or heads % kv or hidden % heads:
        refuse(f"has {arch}.attention.head_count={heads}, head_count_kv={kv}, embedding_length={hidden}, "
               f"block_count={layers}, feed_forward_length={ff}: each must be positive, the heads a multiple "
               "of the KV heads and the embedding length a multiple of the heads")
    # OLMo 2's config has a head size of its own (attention.key_length); Granite's is hidden / heads
    hd = num("attention.key_length", hidden // heads) if arch == "olmo2" else hidden // heads
    source = f"{arch}.attention.key_length" if arch == "olmo2" else "embedding_length / head_count"
    for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        if num(key, hd) != hd:
            refuse(f"has {arch}.{key}={num(key)}, but its head size is {hd} ({source})")
    if num("rope.scaling.factor", 1.0, float) not in (0.0, 1.0):  # llama.cpp: linear scaling by default
        refuse(f"has {arch}.rope.scaling.factor={num('rope.scaling.factor', kind=float)} (RoPE scaling), "
               "which the conversion does not keep")
    if arch == "granite" and meta.get(f"{arch}.rope.scaling.finetuned") is False:  # llama.cpp: no RoPE
        refuse(f"has {arch}.rope.scaling.finetuned=false (no RoPE), which sglite's Granite model does not run")
    fields = dict(
        hidden_size=hidden, intermediate_size=ff, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, max_position_embeddings=num("context_length"),
        rms_norm_eps=num("attention.layer_norm_rms_epsilon", kind=float),
        rope_parameters={"rope_type": "default", "rope_theta": num("rope.freq_base", 10000.0, float)},
        vocab_size=vocab,
        tie_word_embeddings=not has_output, dtype="float32",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
    if arch == "olmo2":
        fields["head_dim"] = hd
    if arch == "granite":
        if num("logit_scale", kind=float) == 0.0:
            refuse(f"has {arch}.logit_scale=0 (llama.cpp divides the logits by it)")
        defaults = {"attention.scale": hd ** -0.5, "embedding_scale": 1.0, "residual_scale": 1.0, "logit_scale": 1.0}
        fields.update({attr: num(key, 0.0, float) or defaults[key] for key, attr in _GRANITE_SCALES.items()})
    config = AutoConfig.for_model(arch, **fields)
    config.architectures = [_HF_ARCH[arch]]
    return config


def expected_shapes(arch: str, config) -> dict[str, tuple[int, ...]]:
    """``{HF name: shape}`` of every tensor an ``arch`` model of ``config`` has (``lm_head.weight``
    only when the head is untied)."""
    h, ff, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
             "self_attn.o_proj": (h, q), "mlp.gate_proj": (ff, h), "mlp.up_proj": (ff, h), "mlp.down_proj": (h, ff),
             "self_attn.q_norm": (q,), "self_attn.k_norm": (kv,)}
    for i in range(config.num_hidden_layers):
        for p in _LAYER[arch].values():
            out[f"model.layers.{i}.{p}.weight"] = layer.get(p, (h,))
    return out


def read_tensors(reader, arch: str, config) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors of an open ``gguf.GGUFReader`` (every ggml type gguf-py dequantizes),
    each in HF's shape ([out, in] for a matmul), the Q / K rows of a Llama-converted file
    (``gguf_native.PERMUTED_ARCHS``) back in HF's order. Tensors the model has no parameter for are skipped."""
    from gguf.quants import dequantize

    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_tensor_name(arch, t.name)
        if name is None:
            continue
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32", copy=True))
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF ne is innermost-first
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if arch in PERMUTED_ARCHS and kind in heads:
            w = w[unpermute_rows(w.shape[0], heads[kind])]
        out[name] = w.contiguous()
    return out


def read_tokenizer(reader, where: str):
    """The tokenizer of an open ``GGUFReader``, converted by transformers from a tensor-less GGUF
    holding the file's ``tokenizer.*`` keys under ``general.architecture = llama``.

    Raises:
        InvalidRequestError (field ``model_path``): the file has no tokenizer, or transformers cannot
            convert it.
    """
    import gguf
    from transformers import AutoTokenizer

    keys = [f for f in reader.fields.values() if f.name.startswith("tokenizer.")]
    if not any(f.name == "tokenizer.ggml.tokens" for f in keys):
        raise InvalidRequestError(f"model_path: {where} holds no tokenizer (tokenizer.ggml.tokens)", field="model_path")
    with tempfile.TemporaryDirectory(prefix="sglite-gguf-tok-") as tmp:
        path = os.path.join(tmp, "tokenizer.gguf")
        w = gguf.GGUFWriter(path, "llama")
        for f in keys:
            vt = gguf.GGUFValueType(f.types[0])
            sub = gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(f.name, f.contents(), vt, sub_type=sub)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        try:
            return AutoTokenizer.from_pretrained(tmp, gguf_file="tokenizer.gguf")
        except (ValueError, OSError, KeyError, TypeError) as exc:
            raise InvalidRequestError(f"model_path: cannot convert the tokenizer of {where}: "
                                      f"{type(exc).__name__}: {exc}", field="model_path") from exc


def read(path: Path, meta: dict):
    """``(config, float32 HF state dict, tokenizer)`` of GGUF file ``path`` (``meta``: its metadata,
    :func:`sglite.runtime.gguf_header.read_gguf_header`); ``general.architecture`` in :data:`OWN_ARCHS`.
    Every tensor is checked by name and shape against the config before any is read, as llama.cpp's
    loader checks them.

    Raises:
        InvalidRequestError (field ``model_path``): see :func:`read_config` / :func:`read_tokenizer`;
            the file lacks a tensor the model needs, has one it does not (named), a tensor of
            another shape than the config's (named, with both shapes), or a vocabulary
            (``tokenizer.ggml.tokens``) of another size than ``token_embd``'s rows.
    """
    import gguf

    arch, where = meta["general.architecture"], repr(str(path))
    reader = gguf.GGUFReader(str(path))
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}  # HF order, outermost first
    embd = shapes.get("token_embd.weight")
    if embd is None or len(embd) != 2:
        raise InvalidRequestError(f"model_path: {where} lacks token_embd.weight (or it is not a matrix)",
                                  field="model_path")
    tokens = meta.get("tokenizer.ggml.tokens#len")
    if tokens is not None and tokens != embd[0]:
        raise InvalidRequestError(f"model_path: {where} has {tokens} tokens in tokenizer.ggml.tokens but "
                                  f"{embd[0]} rows in token_embd.weight", field="model_path")
    config = read_config(arch, meta, "output.weight" in shapes, embd[0], where)
    want = expected_shapes(arch, config)
    names = {g: hf_tensor_name(arch, g) for g in shapes}
    extra = sorted(g for g, n in names.items() if n not in want)
    if extra:
        raise InvalidRequestError(f"model_path: {where} has tensors a {arch} model of "
                                  f"{config.num_hidden_layers} blocks does not have: {extra[:3]} ({len(extra)} in all)",
                                  field="model_path")
    missing = sorted(want.keys() - names.values())
    if missing:
        raise InvalidRequestError(f"model_path: {where} lacks tensors for {missing[:3]} "
                                  f"({len(missing)} in all)", field="model_path")
    bad = [f"{g} {list(s)} (expected {list(want[names[g]])})" for g, s in shapes.items() if s != want[names[g]]]
    if bad:
        raise InvalidRequestError(f"model_path: {where} has tensors of the wrong shape for its metadata: "
                                  f"{'; '.join(bad[:3])} ({len(bad)} in all)", field="model_path")
    return config, read_tensors(reader, arch, config), read_tokenizer(reader, where)
