"""GGUF blocks kept quantized: a ``.gguf`` file's Q4_0 / Q4_1 / Q8_0 matmul weights read with the
``gguf`` package's ``GGUFReader`` straight into :class:`sglite.kernels.QuantLinearWeight` (the
mapping of each block type is in :mod:`sglite.kernels.quant_linear`), everything else (norms, any
other tensor type) from the dequantized float32 cache folder of
:func:`sglite.runtime.model_loader.load_checkpoint` (which also supplies config and tokenizer).

Block layouts (ggml's ``block_q4_0`` / ``block_q4_1`` / ``block_q8_0``, 32 weights each, little
endian): Q4_0 ``{f16 d; u8 qs[16]}`` (w = d * (q - 8)), Q4_1 ``{f16 d; f16 m; u8 qs[16]}``
(w = d * q + m), Q8_0 ``{f16 d; i8 qs[32]}`` (w = d * q); ``qs[j]`` holds weight ``j`` in its low
nibble and ``j + 16`` in its high nibble (Q4). A ``GGUFReader`` tensor of such a type is a uint8
array [N, K / 32 * block bytes] (ggml's shape ``[K, N]``).

Q/K row order: llama.cpp's converter reorders the rows of ``attn_q`` / ``attn_k`` of Llama-arch
models within each head (``reshape(heads, 2, D/2, K).swapaxes(1, 2)``: from HF's rotate-half RoPE
layout to GGML's interleaved one); transformers' GGUF loader reverses it, and so do we
(:func:`unpermute_rows`), by permuting whole quantized rows (exact). The first layer's Q and K are
checked against the cached float32 weights at load, so a file whose rows are laid out otherwise
fails loudly instead of producing garbage.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch

from sglite.kernels.quant_linear import QuantLinearWeight

from ..errors import InvalidRequestError
from .model_loader import Checkpoint

log = logging.getLogger("sglite.gguf_native")

NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_LAYER_NAMES = {  # GGUF tensor name suffix -> HF name suffix (Llama family)
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
_PERMUTED_ARCHS = ("llama",)  # GGUF general.architecture values whose converter reorders Q/K rows


def hf_name(gguf_name: str) -> Optional[str]:
    """HF parameter name of a GGUF matmul tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None for tensors that are not matmul weights."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def blocks_to_weight(type_name: str, data: np.ndarray, k: int) -> QuantLinearWeight:
    """One GGUF tensor's raw blocks -> :class:`QuantLinearWeight`.

    Args:
        type_name: ``Q4_0`` | ``Q4_1`` | ``Q8_0``.
        data: uint8 [N, K / 32 * block bytes] (``ReaderTensor.data``).
        k: K (input features).
    Raises:
        ValueError: another type, or a byte count that does not match K.
    """
    sizes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
    if type_name not in sizes:
        raise ValueError(f"GGUF type {type_name} is not kept quantized (native: {NATIVE_TYPES})")
    if k % 32 or data.ndim != 2 or data.shape[1] != k // 32 * sizes[type_name]:
        raise ValueError(f"GGUF {type_name} tensor: {data.shape} bytes do not hold rows of K={k}")
    n, g = data.shape[0], k // 32
    b = np.ascontiguousarray(data).reshape(n, g, sizes[type_name])
    d = torch.from_numpy(b[:, :, 0:2].copy().view(np.float16).reshape(n, g)).float()
    if type_name == "Q8_0":
        codes = torch.from_numpy(b[:, :, 2:].copy().reshape(n, k) ^ np.uint8(0x80))  # signed q -> q + 128
        return QuantLinearWeight(codes, d, -128.0 * d, 8, 32, k, fmt="gguf:Q8_0")
    off = 4 if type_name == "Q4_1" else 2
    qs = torch.from_numpy(b[:, :, off:].copy().reshape(n, k // 2))  # already our Q4 packing
    mins = (torch.from_numpy(b[:, :, 2:4].copy().view(np.float16).reshape(n, g)).float()
            if type_name == "Q4_1" else -8.0 * d)
    return QuantLinearWeight(qs, d, mins, 4, 32, k, fmt=f"gguf:{type_name}")


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
    """HF-named weights of a ``.gguf`` checkpoint with its Q4_0 / Q4_1 / Q8_0 matmul weights (and a
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
    reader = gguf.GGUFReader(checkpoint.source)
    arch = _field(reader, "general.architecture", "llama")
    cfg = checkpoint.hf_config
    heads = {"attn_q": cfg.num_attention_heads,
             "attn_k": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads}
    state: dict = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or t.tensor_type.name not in NATIVE_TYPES:
            continue
        w = blocks_to_weight(t.tensor_type.name, t.data, int(t.shape[0]))
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind in heads and arch in _PERMUTED_ARCHS:
            w = w.permute_rows(unpermute_rows(w.shape[0], heads[kind]))
        state[name] = w.to(device)
    files = sorted(checkpoint.model_dir.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name not in state:
                    ten = f.get_tensor(name)
                    state[name] = (ten.to(dtype) if ten.is_floating_point() else ten).to(device)
    _check_against_cache(state, files)
    if "lm_head.weight" not in state and not getattr(cfg, "tie_word_embeddings", False):
        log.info("GGUF file has no output.weight: the LM head is tied to the token embedding")
    n_q = sum(isinstance(v, QuantLinearWeight) for v in state.values())
    log.info("GGUF %s: %d tensors kept quantized (%s)", checkpoint.source, n_q,
             ", ".join(sorted({v.fmt for v in state.values() if isinstance(v, QuantLinearWeight)})))
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
