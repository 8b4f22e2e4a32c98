"""Loaders of ``EngineConfig.quantization`` = ``gptq`` | ``awq`` | ``fp8`` | ``w8a8_int8`` (registered in
:data:`sglite.runtime.quant_loader.LOADERS`): HF-named weight dicts whose matmul entries are
quantized weights the model runs through ``kernels.linear``.

* ``gptq`` / ``awq``: an AutoGPTQ / AutoAWQ checkpoint (``quantization_config.quant_method``),
  ``<prefix>.qweight/.qzeros/.scales[/.g_idx]`` unpacked (:mod:`.hf_formats`) into
  :class:`sglite.kernels.QuantLinearWeight`. Every quantized tensor is checked before any is
  built: bits (gptq 4|8, awq 4), group size (32|64|128|-1, dividing the tensor's input width, a
  multiple of 32), shapes agreeing with each other and with the config; errors name the tensor and
  the ``quantization_config`` option.
* ``w8a8_int8``: a checkpoint written by ``sglite quantize --method smoothquant`` (``<prefix>.weight``
  int8 + ``<prefix>.weight_scale`` [N, 1]) -> :class:`sglite.kernels.Int8LinearWeight`; on a float
  checkpoint, the float matmul weights are quantized at load (per-channel, without smoothing).
* ``fp8``: the float matmul weights quantized at load to E4M3 with per-output-channel scales
  (:class:`sglite.kernels.Fp8LinearWeight`); or a ``quant_method: fp8`` checkpoint (written by
  ``sglite quantize --format fp8``, or DeepSeek-V3 / SGLang block-wise ones): ``<prefix>.weight``
  float8_e4m3fn with ``<prefix>.weight_scale`` (one per output channel, [N] or [N, 1]) or, with
  ``quantization_config.weight_block_size`` [bn, bk], ``<prefix>.weight_scale_inv``
  [ceil(N/bn), ceil(K/bk)] (:class:`sglite.kernels.Fp8BlockLinearWeight`).
Embeddings, norms and the LM head stay in the activation dtype.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from ..errors import InvalidRequestError
from .hf_formats import AWQ_BITS, GPTQ_BITS, to_quant_linear, unpack_awq, unpack_gptq

LINEAR_RE = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")
GROUP_SIZES = (32, 64, 128, -1)


def quant_config(hf_config) -> Optional[dict]:
    """The config's ``quantization_config`` as a dict (None when absent)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def checkpoint_method(hf_config) -> Optional[str]:
    """``quantization_config.quant_method`` lower-cased, or None for a float checkpoint."""
    qc = quant_config(hf_config)
    return None if qc is None else str(qc.get("quant_method", "")).lower() or None


def _bad(msg: str) -> InvalidRequestError:
    return InvalidRequestError(msg, field="quantization")


def _read_tensors(checkpoint) -> dict:
    from safetensors.torch import load_file

    sd: dict = {}
    for f in sorted(checkpoint.model_dir.glob("*.safetensors")):
        sd.update(load_file(str(f), device="cpu"))
    return sd


def _finish(sd: dict, checkpoint, dtype, device) -> dict:
    """Floats to ``dtype`` / ``device``; tied LM head."""
    for k, v in list(sd.items()):
        if isinstance(v, torch.Tensor):
            sd[k] = (v.to(dtype) if v.is_floating_point() else v).to(device)
    if "lm_head.weight" not in sd:
        if not getattr(checkpoint.hf_config, "tie_word_embeddings", False):
            raise InvalidRequestError(f"model_path: {checkpoint.source!r} has no lm_head.weight and does "
                                      "not tie word embeddings", field="model_path")
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def load_gptq_awq(checkpoint, dtype, device="cpu") -> dict:
    """A GPTQ or AWQ checkpoint -> weights with :class:`QuantLinearWeight` matmuls (module docstring).

    Raises:
        InvalidRequestError (field ``quantization``): unsupported bits / group size, a group size
            not dividing a tensor's input width, tensors disagreeing in shape, a linear neither
            quantized nor float."""
    qc = quant_config(checkpoint.hf_config) or {}
    method = checkpoint_method(checkpoint.hf_config)
    if method not in ("gptq", "awq"):
        raise _bad(f"quantization: {checkpoint.source!r} is not a GPTQ/AWQ checkpoint "
                   f"(quantization_config.quant_method = {method!r})")
    bits = qc.get("bits", qc.get("w_bit"))
    gs = qc.get("group_size", qc.get("q_group_size"))
    allowed = GPTQ_BITS if method == "gptq" else AWQ_BITS
    if bits not in allowed:
        raise _bad(f"quantization_config.bits: {method} checkpoints with {bits}-bit weights are not "
                   f"supported (supported: {allowed})")
    if gs not in GROUP_SIZES:
        raise _bad(f"quantization_config.group_size: {gs} not supported (supported: {GROUP_SIZES})")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise _bad(f"quantization_config.version: only AutoAWQ's gemm packing is supported, got {qc.get('version')!r}")
    sd = _read_tensors(checkpoint)
    prefixes = sorted({k[:-len(".qweight")] for k in sd if k.endswith(".qweight")})
    if not prefixes:
        raise _bad(f"quantization: {checkpoint.source!r} declares {method} but holds no *.qweight tensors")
    unpack = unpack_gptq if method == "gptq" else unpack_awq
    hc = checkpoint.hf_config
    expect_k = {"q_proj": hc.hidden_size, "k_proj": hc.hidden_size, "v_proj": hc.hidden_size,
                "gate_proj": hc.hidden_size, "up_proj": hc.hidden_size, "down_proj": hc.intermediate_size}
    pf = 32 // bits if method == "gptq" else 1  # GPTQ packs K, AWQ packs N
    for p in prefixes:  # the group size against every input width first: the clearest error
        k_in = sd[p + ".qweight"].shape[0] * pf
        if gs != -1 and k_in % gs:
            raise _bad(f"{p}: group_size={gs} does not divide in_features={k_in} "
                       "(quantization_config.group_size)")
    unpacked = {}
    for p in prefixes:  # check every tensor before building any weight
        t = {k: sd.pop(f"{p}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx") if f"{p}.{k}" in sd}
        try:
            q = unpack(t, bits, gs, p)
        except ValueError as exc:
            raise _bad(f"quantization: {exc}") from exc
        want = expect_k.get(p.rsplit(".", 1)[-1])
        if want is not None and q.codes.shape[1] != want:
            raise _bad(f"{p}.qweight: {q.codes.shape[1]} input features, but the config says {want}")
        if gs != -1 and q.codes.shape[1] % 32:
            raise _bad(f"{p}: in_features={q.codes.shape[1]} is not a multiple of 32")
        unpacked[p] = q
    for p, q in unpacked.items():
        try:
            sd[p + ".weight"] = to_quant_linear(q, fmt=method, name=p)
        except ValueError as exc:
            raise _bad(f"quantization: {exc}") from exc
    return _finish(sd, checkpoint, dtype, device)


def _online(checkpoint, dtype, device, make) -> dict:
    """A float checkpoint's weights (float32 on the CPU) with every decoder matmul replaced by
    ``make(weight)``, then cast and moved as :func:`_finish` does."""
    sd = {k: v.float() if v.is_floating_point() else v for k, v in _read_tensors(checkpoint).items()}
    for k in list(sd):
        if k.endswith(".weight") and LINEAR_RE.match(k[:-len(".weight")]):
            sd[k] = make(sd[k])
    return _finish(sd, checkpoint, dtype, device)


def load_fp8(checkpoint, dtype, device="cpu") -> dict:
    """Float checkpoint -> FP8 E4M3 per-channel matmul weights (quantized at load); a ``fp8``
    checkpoint -> its weights as stored (module docstring).

    Raises:
        InvalidRequestError: the checkpoint is quantized with another quant_method; in a fp8
            checkpoint: a bad ``weight_block_size``, a scale whose shape disagrees with its weight,
            a float8 weight without its scale or a scale without a float8 weight (names the tensor)."""
    from sglite.kernels import Fp8LinearWeight

    m = checkpoint_method(checkpoint.hf_config)
    if m is None:
        return _online(checkpoint, dtype, device, Fp8LinearWeight.quantize)
    if m != "fp8":
        raise _bad(f"quantization: fp8 quantizes a float checkpoint at load; {checkpoint.source!r} is "
                   f"{m}-quantized (quantization_config.quant_method)")
    return _finish(_fp8_tensors(checkpoint), checkpoint, dtype, device)


def _fp8_tensors(checkpoint) -> dict:
    from sglite.kernels import Fp8BlockLinearWeight, Fp8LinearWeight

    qc = quant_config(checkpoint.hf_config) or {}
    block = qc.get("weight_block_size")
    if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2
                              or not all(isinstance(b, int) and b >= 1 for b in block)):
        raise _bad(f"quantization_config.weight_block_size: two positive integers [bn, bk], got {block!r}")
    scale_suffix = ".weight_scale" if block is None else ".weight_scale_inv"
    sd = _read_tensors(checkpoint)
    for k in [k for k in sd if k.endswith((".weight_scale", ".weight_scale_inv"))]:
        p = k[:k.rindex(".weight_scale")]
        if not k.endswith(scale_suffix):
            raise _bad(f"{k}: a {'block-wise' if block is None else 'per-channel'} scale, but "
                       f"quantization_config.weight_block_size is {block!r} (expected {p}{scale_suffix})")
        w, s = sd.get(p + ".weight"), sd.pop(k)
        if w is None or w.dtype != torch.float8_e4m3fn or w.dim() != 2:
            raise _bad(f"{p}.weight: must be a float8_e4m3fn [N, K] tensor next to {k}, got "
                       f"{None if w is None else (w.dtype, tuple(w.shape))}")
        try:
            if block is None:
                if s.numel() != w.shape[0]:
                    raise ValueError(f"{k}: {tuple(s.shape)} disagrees with {p}.weight {tuple(w.shape)} "
                                     "(one scale per output channel)")
                sd[p + ".weight"] = Fp8LinearWeight(w, s.reshape(-1).float().contiguous())
            else:
                sd[p + ".weight"] = Fp8BlockLinearWeight.from_tiles(w, s, block)
        except ValueError as exc:
            raise _bad(f"{p}: {exc}") from exc
    for k, v in sd.items():
        if isinstance(v, torch.Tensor) and v.dtype == torch.float8_e4m3fn:
            raise _bad(f"{k}: float8 weight without its {scale_suffix[1:]}")
    return sd


def load_w8a8(checkpoint, dtype, device="cpu") -> dict:
    """W8A8 int8: a ``w8a8_int8`` checkpoint (int8 ``weight`` + ``weight_scale``), or a float
    checkpoint quantized per channel at load (module docstring).

    Raises:
        InvalidRequestError: another quant_method; a ``weight_scale`` whose shape disagrees with
            its weight (names the tensor); a quantized linear without its scale."""
    from sglite.kernels import Int8LinearWeight

    m = checkpoint_method(checkpoint.hf_config)
    if m is None:
        return _online(checkpoint, dtype, device, Int8LinearWeight.quantize)
    if m != "w8a8_int8":
        raise _bad(f"quantization: w8a8_int8 cannot run a {m}-quantized checkpoint "
                   "(quantization_config.quant_method)")
    sd = _read_tensors(checkpoint)
    for k in [k for k in sd if k.endswith(".weight_scale")]:
        p = k[:-len(".weight_scale")]
        w, s = sd.get(p + ".weight"), sd.pop(k)
        if w is None or w.dtype != torch.int8:
            raise _bad(f"{p}.weight: must be int8 next to {k}")
        if s.numel() != w.shape[0]:
            raise _bad(f"{k}: {tuple(s.shape)} disagrees with {p}.weight {tuple(w.shape)} "
                       f"(one scale per output channel)")
        sd[p + ".weight"] = Int8LinearWeight(w, s.reshape(-1).float())
    for k, v in sd.items():
        if isinstance(v, torch.Tensor) and v.dtype == torch.int8:
            raise _bad(f"{k}: int8 weight without a weight_scale")
    return _finish(sd, checkpoint, dtype, device)
