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

OWN_ARCHS = ("granite", "olmo2", "smollm3")  # GGUF general.architecture values converted here
_HF_ARCH = {"granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
_LLAMA_ROWS = ("granite", "smollm3")  # converted by llama.cpp's Llama converter: Q / K rows reordered
_COMMON = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}
_PRE_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_LAYER = {
    "granite": {**_COMMON, **_PRE_NORMS}, "smollm3": {**_COMMON, **_PRE_NORMS},
    "olmo2": {**_COMMON, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
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


def read_config(arch: str, meta: dict, has_output: bool, vocab: int, where: str):
    """The transformers config of an ``arch`` file from its metadata ``meta`` (``has_output``: the
    file has an ``output.weight``, else the LM head is tied; ``vocab``: rows of its ``token_embd``).

    Raises:
        InvalidRequestError (field ``model_path``): a required key is missing, or the file uses
            sliding-window attention (OLMo 3), which the OLMo 2 model does not run.
    """
    from transformers import AutoConfig

    def need(key: str):
        v = meta.get(f"{arch}.{key}")
        if v is None:
            raise InvalidRequestError(f"model_path: {where} lacks GGUF key {arch}.{key}", field="model_path")
        return v

    if meta.get(f"{arch}.attention.sliding_window") is not None:
        raise InvalidRequestError(f"model_path: {where} uses sliding-window attention ({arch}.attention."
                                  "sliding_window, an OLMo 3 file), which sglite's OLMo 2 model does not run",
                                  field="model_path")
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    fields = dict(
        hidden_size=hidden, intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        max_position_embeddings=int(meta.get(f"{arch}.context_length") or 4096),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base") or 10000.0)},
        vocab_size=vocab,
        tie_word_embeddings=not has_output, dtype="float32",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
    if arch == "olmo2" and meta.get(f"{arch}.attention.key_length"):
        fields["head_dim"] = int(meta[f"{arch}.attention.key_length"])
    if arch == "granite":
        fields.update({attr: float(meta[f"{arch}.{key}"]) for key, attr in _GRANITE_SCALES.items()
                       if meta.get(f"{arch}.{key}") is not None})
    config = AutoConfig.for_model(arch, **fields)
    config.architectures = [_HF_ARCH[arch]]
    return config


def read_tensors(reader, arch: str, config) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors of an open ``gguf.GGUFReader`` (every ggml type gguf-py dequantizes),
    Granite's Q / K rows back in HF's order. Tensors the model has no parameter for are skipped."""
    from gguf.quants import dequantize

    from .gguf_native import unpermute_rows

    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_tensor_name(arch, t.name)
        if name is None:
            continue
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32", copy=True))
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF ne is innermost-first
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if arch in _LLAMA_ROWS and kind in heads:
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

    Raises:
        InvalidRequestError (field ``model_path``): see :func:`read_config` / :func:`read_tokenizer`,
            or the file lacks a tensor the model needs.
    """
    import gguf

    arch, where = meta["general.architecture"], repr(str(path))
    reader = gguf.GGUFReader(str(path))
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}  # ne: innermost first
    if "token_embd.weight" not in shapes:
        raise InvalidRequestError(f"model_path: {where} lacks token_embd.weight", field="model_path")
    config = read_config(arch, meta, "output.weight" in shapes, shapes["token_embd.weight"][-1], where)
    state = read_tensors(reader, arch, config)
    wanted = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{p}.weight" for i in range(config.num_hidden_layers) for p in _LAYER[arch].values()}
    missing = sorted(wanted - state.keys())
    if missing:
        raise InvalidRequestError(f"model_path: {where} lacks tensors for {missing[:3]} "
                                  f"({len(missing)} in all)", field="model_path")
    return config, state, read_tokenizer(reader, where)
