"""Which weights to load for ``EngineConfig.quantization``: the quantized loaders by scheme
(:data:`LOADERS`) and the plain float path (:func:`sglite.runtime.model_loader.load_state_dict`).

A loader takes ``(checkpoint, dtype, device)`` and returns HF-named weights whose matmul entries may
be :class:`sglite.kernels.QuantLinearWeight` (``LlamaModel`` fuses and runs either kind).
"""
from __future__ import annotations

from typing import Callable, Optional

from ..errors import InvalidRequestError
from ..quant import hf_loader
from . import gguf_native
from .model_loader import Checkpoint, load_state_dict

LOADERS: dict[str, Callable] = {"gguf": gguf_native.load_state_dict,
                                "gptq": hf_loader.load_gptq_awq, "awq": hf_loader.load_gptq_awq,
                                "fp8": hf_loader.load_fp8, "w8a8_int8": hf_loader.load_w8a8}
CHECKPOINT_METHODS = ("gptq", "awq", "w8a8_int8", "fp8")  # quant_method values of quantized HF checkpoints


def resolve_quantization(quantization: Optional[str], checkpoint: Checkpoint) -> Optional[str]:
    """The scheme actually used: ``auto`` -> ``gguf`` for a ``.gguf`` model, else None; an explicit
    scheme is checked against the checkpoint.

    Raises:
        InvalidRequestError: ``gguf`` for a model that is not a ``.gguf`` file (field ``quantization``)."""
    is_gguf = checkpoint.source.lower().endswith(".gguf")
    method = hf_loader.checkpoint_method(checkpoint.hf_config)  # quantized HF checkpoint (GPTQ/AWQ/W8A8)
    if method is not None and method not in CHECKPOINT_METHODS:
        raise InvalidRequestError(f"quantization: {checkpoint.source!r} is {method}-quantized "
                                  f"(quantization_config.quant_method); supported: {CHECKPOINT_METHODS}",
                                  field="quantization")
    if method is not None and quantization not in ("auto", method):
        raise InvalidRequestError(f"quantization: {checkpoint.source!r} is a {method} checkpoint "
                                  f"(quantization_config.quant_method); use quantization auto or {method}, "
                                  f"got {quantization!r}", field="quantization")
    if quantization in ("gptq", "awq") and method is None:
        raise InvalidRequestError(f"quantization: {quantization} needs a {quantization} checkpoint "
                                  "(config.json quantization_config); write one with `sglite quantize`",
                                  field="quantization")
    if quantization == "auto":
        return method or ("gguf" if is_gguf else None)
    if quantization == "gguf" and not is_gguf:
        raise InvalidRequestError(f"quantization: gguf needs a .gguf model_path, got {checkpoint.source!r}",
                                  field="quantization")
    return quantization


def load_weights(checkpoint: Checkpoint, quantization: Optional[str], dtype, device: str = "cpu") -> dict:
    """HF-named weights for the model: float tensors in ``dtype`` (``quantization`` None / resolved
    to None) or a quantized loader's output (see :data:`LOADERS`)."""
    q = resolve_quantization(quantization, checkpoint)
    if q is None:
        return load_state_dict(checkpoint, dtype, device)
    sd = LOADERS[q](checkpoint, dtype, device)
    check_linear_shapes(sd, checkpoint.hf_config)
    return sd


def expected_linear_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """[N, K] of every decoder-layer matmul by HF name suffix (``self_attn.q_proj``...), from the
    config (hidden_size, intermediate_size, heads x head_dim, KV heads x head_dim)."""
    h, inter = hf_config.hidden_size, hf_config.intermediate_size
    nh = hf_config.num_attention_heads
    hd = getattr(hf_config, "head_dim", None) or h // nh
    kv = (getattr(hf_config, "num_key_value_heads", None) or nh) * hd
    return {"self_attn.q_proj": (nh * hd, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, nh * hd), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter)}


def check_linear_shapes(sd: dict, hf_config) -> None:
    """Every quantized loader's decoder matmuls against the config, before the model is built.

    Raises:
        InvalidRequestError (field ``model_path``): a weight whose [N, K] is not what the config
            says (names the tensor, its shape and the config's)."""
    want = expected_linear_shapes(hf_config)
    for name, w in sd.items():
        parts = name.split(".")
        if len(parts) != 6 or parts[:2] != ["model", "layers"] or parts[-1] != "weight":
            continue
        exp = want.get(".".join(parts[3:5]))
        if exp is not None and tuple(w.shape) != exp:
            raise InvalidRequestError(
                f"{name}: shape {tuple(w.shape)} disagrees with the checkpoint's config (expected {exp} from "
                f"hidden_size={hf_config.hidden_size}, intermediate_size={hf_config.intermediate_size}, "
                f"heads x head_dim)", field="model_path")
