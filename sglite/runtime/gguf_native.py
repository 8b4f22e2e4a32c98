"""GGUF blocks kept quantized: a ``.gguf`` file's matmul weights of the :data:`NATIVE_TYPES`
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K: every type of llama.cpp's Q4_K_M / Q5_K_M mixes)
read with the ``gguf`` package's ``GGUFReader`` straight into
:class:`sglite.kernels.QuantLinearWeight` (the byte layouts and their exact mapping are in
:mod:`sglite.runtime.gguf_blocks`), everything else (norms, any other tensor type) from the
dequantized float32 cache folder of :func:`sglite.runtime.model_loader.load_checkpoint` (which also
supplies config and tokenizer).

Q/K row order: llama.cpp's converter reorders the rows of ``attn_q`` / ``attn_k`` of Llama-arch
models within each head (``reshape(heads, 2, D/2, K).swapaxes(1, 2)``: from HF's rotate-half RoPE
layout to GGML's interleaved one); transformers' GGUF loader reverses it, and so do we
(:func:`unpermute_rows`), by permuting whole quantized rows (exact). The first layer's Q and K are
checked against the cached float32 weights at load, so a file whose rows are laid out otherwise
fails loudly instead of producing garbage.

Start-up: the weights read from the blocks are saved once into the converted folder
(:mod:`sglite.runtime.native_cache`) and memory-mapped from there on later starts, which skips
``GGUFReader`` (its metadata parsing is most of a start's time).
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch

from sglite.kernels.quant_linear import QuantLinearWeight

from ..errors import InvalidRequestError
from . import gguf_moe, native_cache
from .gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, NATIVE_TYPES, QK_K, blocks_to_weight, k_scale_min  # noqa: F401
from .model_loader import Checkpoint

log = logging.getLogger("sglite.gguf_native")

#: GGUF tensor name suffix -> HF name suffix of a Llama-like layer's seven matmul weights
LLAMA_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAMES = {**LLAMA_LAYER_NAMES, **gguf_moe.SHARED_NAMES}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
#: GGUF ``general.architecture`` values that llama.cpp's Llama converter writes: Q / K rows reordered
#: per head (:func:`unpermute_rows` undoes it)
PERMUTED_ARCHS = ("llama", "granite", "smollm3")


def hf_name(gguf_name: str) -> Optional[str]:
    """HF parameter name of a GGUF matmul tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None for tensors that are not matmul weights."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row index ``idx`` such that ``hf = gguf[idx]`` for an ``attn_q`` / ``attn_k`` of ``n_rows``
    rows in ``n_head`` heads (inverse of the converter's per-head reorder)."""
    hd = n_rows // n_head
    fwd = torch.arange(n_rows).view(n_head, 2, hd // 2).transpose(1, 2).reshape(-1)  # gguf[i] = hf[fwd[i]]
    return torch.argsort(fwd)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types and f.types[0].name == "STRING" else v.tolist()[0]


def load_state_dict(checkpoint: Checkpoint, dtype: torch.dtype, device: str = "cpu") -> dict:
    """HF-named weights of a ``.gguf`` checkpoint with its :data:`NATIVE_TYPES` matmul weights (and a
    quantized token embedding) as :class:`QuantLinearWeight` on ``device``, other tensors from the
    float32 cache cast to ``dtype``. Without ``output.weight`` the LM head is tied (no
    ``lm_head.weight`` entry; the model reuses the embedding).

    Raises:
        InvalidRequestError: the checkpoint is not a GGUF file, or the first layer's dequantized
            Q / K rows disagree with the cached float32 weights (an unknown row layout).
    """
    import gguf
    from safetensors import safe_open

    if not checkpoint.source.lower().endswith(".gguf"):
        raise InvalidRequestError(f"quantization: gguf needs a .gguf model_path, got {checkpoint.source!r}",
                                  field="quantization")
    cfg = checkpoint.hf_config
    cache = native_cache.cache_path(checkpoint.model_dir)
    state = native_cache.load(cache, device)  # the blocks as a previous start read them
    if state is None:
        state = _read_blocks(gguf.GGUFReader(checkpoint.source), cfg, device)
        native_cache.save(cache, state)
    files = sorted(checkpoint.model_dir.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name not in state and not gguf_moe.superseded(name, state):
                    ten = f.get_tensor(name)
                    state[name] = (ten.to(dtype) if ten.is_floating_point() else ten).to(device)
    _check_against_cache(state, files)
    from .models import phi3

    if (getattr(cfg, "architectures", None) or [""])[0] == phi3.ARCH:  # fused qkv / gate_up -> Llama names
        phi3.split_fused_weights(state, cfg)
    if "lm_head.weight" not in state and not getattr(cfg, "tie_word_embeddings", False):
        log.info("GGUF file has no output.weight: the LM head is tied to the token embedding")
    n_q = sum(isinstance(v, QuantLinearWeight) for v in state.values())
    log.info("GGUF %s: %d tensors kept quantized (%s)", checkpoint.source, n_q,
             ", ".join(sorted({v.fmt for v in state.values() if isinstance(v, QuantLinearWeight)})))
    return state


def _read_blocks(reader, cfg, device: str) -> dict:
    """The :data:`NATIVE_TYPES` tensors of an open ``GGUFReader`` as HF-named QuantLinearWeights."""
    arch = _field(reader, "general.architecture", "llama")
    heads = {"attn_q": cfg.num_attention_heads,
             "attn_k": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads}
    state: dict = {}
    other: dict = {}  # matmul tensors of types the kernels do not read: dequantized (the float cache)
    for t in reader.tensors:
        if gguf_moe.expert_kind(t.name) and t.tensor_type.name in NATIVE_TYPES:  # stacked MoE experts
            experts = gguf_moe.split_experts(t.name, t.data, int(t.shape[0]),
                                             lambda rows, k: blocks_to_weight(t.tensor_type.name, rows, k))
            state.update({n: w.to(device) for n, w in experts.items()})
            continue
        name = hf_name(t.name)
        if name is not None and t.tensor_type.name not in NATIVE_TYPES and t.tensor_type.name not in ("F32", "F16", "BF16"):
            other[t.tensor_type.name] = other.get(t.tensor_type.name, 0) + 1
        if name is None or t.tensor_type.name not in NATIVE_TYPES:
            continue
        w = blocks_to_weight(t.tensor_type.name, t.data, int(t.shape[0]))
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if arch == "phi3" and kind == "ffn_up":  # Phi-3's is the fused gate+up: float, from the cache
            continue
        if kind in heads and arch in PERMUTED_ARCHS:
            w = w.permute_rows(unpermute_rows(w.shape[0], heads[kind]))
        state[name] = w.to(device)
    if other:
        log.warning("GGUF matmul tensors of types sglite does not keep quantized are dequantized to float: %s "
                    "(kept quantized: %s)", ", ".join(f"{n} x {k}" for k, n in sorted(other.items())), ", ".join(NATIVE_TYPES))
    return state


def _check_against_cache(state: dict, files) -> None:
    from safetensors import safe_open

    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        w = state.get(name)
        if not isinstance(w, QuantLinearWeight):
            continue
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                if name in f.keys():
                    ref = f.get_tensor(name).float()
                    if not torch.equal(w.dequantize(torch.float32).cpu(), ref):
                        raise InvalidRequestError(
                            f"model_path: GGUF tensor for {name} does not match its dequantized copy "
                            "(unknown Q/K row layout); use quantization=none", field="quantization")
