"""GGUF blocks kept quantized: a ``.gguf`` file's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K matmul weights read with the
``gguf`` package's ``GGUFReader`` straight into :class:`sglite.kernels.QuantLinearWeight` (the
mapping of each block type is in :mod:`sglite.kernels.quant_linear`), everything else (norms, any
other tensor type) from the dequantized float32 cache folder of
:func:`sglite.runtime.model_loader.load_checkpoint` (which also supplies config and tokenizer).

Block layouts (ggml's ``block_q4_0`` / ``block_q4_1`` / ``block_q8_0``, 32 weights each, little
endian): Q4_0 ``{f16 d; u8 qs[16]}`` (w = d * (q - 8)), Q4_1 ``{f16 d; f16 m; u8 qs[16]}``
(w = d * q + m), Q8_0 ``{f16 d; i8 qs[32]}`` (w = d * q); ``qs[j]`` holds weight ``j`` in its low
nibble and ``j + 16`` in its high nibble (Q4). A ``GGUFReader`` tensor of such a type is a uint8
array [N, K / 32 * block bytes] (ggml's shape ``[K, N]``).

K-quants (ggml's ``block_q4_K`` / ``block_q6_K``, super-blocks of 256 weights, so K % 256 == 0):
Q4_K (144 bytes) ``{f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}``: eight sub-blocks of 32 with
6-bit scale ``sc_j`` and 6-bit min ``m_j`` packed in ``scales`` (j < 4: low 6 bits of bytes j and
j + 4; j >= 4: the low / high nibble of byte j + 4 plus the top 2 bits of bytes j - 4 / j), weight
``w = (d * sc_j) * q - (dmin * m_j)``; ``qs`` byte ``32 c + i`` holds weight ``64 c + i`` (low
nibble) and ``64 c + 32 + i`` (high). -> bits 4, group 32, s = d * sc_j, m = -(dmin * m_j): the C++ /
Triton kernels run it. Q6_K (210 bytes) ``{u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}``: 6-bit
``q = ql | qh << 4`` (weight ``128 h + 64 s + i`` takes nibble ``s`` of ``ql[64 h + i]``, weight
``128 h + 32 s + i`` the 2 bits ``2 s`` of ``qh[32 h + i]``), ``w = (d * scales_j) * (q - 32)`` over
sixteen sub-blocks of 16. -> bits 8 (codes q, one per byte), group 16, s = d * scales_j,
m = -32 s: runs on ``quant_ref`` (dequantize, float32 ``F.linear``; the kernels read one scale per
32 channels). Both are bit-exact against ``gguf.quants.dequantize`` (the products of a float16 by
6/8-bit integers are exact in float32, and the sums are the oracle's own float32 operations).

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
from .model_loader import Checkpoint

log = logging.getLogger("sglite.gguf_native")

NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
QK_K = 256  # weights per K-quant super-block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": QK_K, "Q6_K": QK_K}
_LAYER_NAMES = {  # GGUF tensor name suffix -> HF name suffix (Llama family)
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", **gguf_moe.SHARED_NAMES,
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
        type_name: one of :data:`NATIVE_TYPES`.
        data: uint8 [N, K / block weights * block bytes] (``ReaderTensor.data``).
        k: K (input features).
    Raises:
        ValueError: another type, or a byte count that does not match K (K must be a multiple of
            the block's weights: 32, or 256 for K-quants).
    """
    if type_name not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {type_name} is not kept quantized (native: {NATIVE_TYPES})")
    qk, nb = BLOCK_WEIGHTS[type_name], BLOCK_BYTES[type_name]
    if k % qk or data.ndim != 2 or data.shape[1] != k // qk * nb:
        raise ValueError(f"GGUF {type_name} tensor: {data.shape} bytes do not hold rows of K={k} "
                         f"({nb}-byte blocks of {qk} weights)")
    n, g = data.shape[0], k // qk
    b = np.ascontiguousarray(data).reshape(n, g, nb)
    if type_name == "Q4_K":
        return _q4_k(b, n, k)
    if type_name == "Q6_K":
        return _q6_k(b, n, k)
    d = torch.from_numpy(b[:, :, 0:2].copy().view(np.float16).reshape(n, g)).float()
    if type_name == "Q8_0":
        codes = torch.from_numpy(b[:, :, 2:].copy().reshape(n, k) ^ np.uint8(0x80))  # signed q -> q + 128
        return QuantLinearWeight(codes, d, -128.0 * d, 8, 32, k, fmt="gguf:Q8_0")
    off = 4 if type_name == "Q4_1" else 2
    qs = torch.from_numpy(b[:, :, off:].copy().reshape(n, k // 2))  # already our Q4 packing
    mins = (torch.from_numpy(b[:, :, 2:4].copy().view(np.float16).reshape(n, g)).float()
            if type_name == "Q4_1" else -8.0 * d)
    return QuantLinearWeight(qs, d, mins, 4, 32, k, fmt=f"gguf:{type_name}")


def _f16(b: np.ndarray) -> torch.Tensor:
    """Little-endian float16 bytes [..., 2] -> float32 [...]."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 packed bytes [..., 12] -> 6-bit ``(scales, mins)`` uint8 [..., 8] (module docstring)."""
    a, m, hi = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = np.concatenate([a & 0x3F, (hi & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (hi >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, mins


def _q4_k(b: np.ndarray, n: int, k: int) -> QuantLinearWeight:
    g = k // QK_K
    d, dmin = _f16(b[:, :, 0:2]), _f16(b[:, :, 2:4])  # [N, G]
    sc, mn = k_scale_min(b[:, :, 4:16])  # [N, G, 8]
    scales = (d[:, :, None] * torch.from_numpy(sc.astype(np.float32))).reshape(n, k // 32)
    mins = -(dmin[:, :, None] * torch.from_numpy(mn.astype(np.float32))).reshape(n, k // 32)
    qs = b[:, :, 16:].reshape(n, g, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    codes = torch.from_numpy((qs & 0x0F).reshape(n, k))
    return QuantLinearWeight.from_codes(codes, scales, mins, 4, 32, fmt="gguf:Q4_K")


def _q6_k(b: np.ndarray, n: int, k: int) -> QuantLinearWeight:
    g = k // QK_K
    ql = b[:, :, 0:128].reshape(n, g, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    qh = b[:, :, 128:192].reshape(n, g, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    q = (ql & 0x0F).reshape(n, g, 2, 128) | ((qh & 0x03).reshape(n, g, 2, 128) << 4)
    sc = torch.from_numpy(b[:, :, 192:208].copy().view(np.int8).astype(np.float32))  # [N, G, 16]
    scales = (_f16(b[:, :, 208:210])[:, :, None] * sc).reshape(n, k // 16)
    return QuantLinearWeight.from_codes(torch.from_numpy(q.reshape(n, k)), scales, -32.0 * scales, 8, 16,
                                        fmt="gguf:Q6_K")


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
    for t in reader.tensors:
        if gguf_moe.expert_kind(t.name) and t.tensor_type.name in NATIVE_TYPES:  # stacked MoE experts
            experts = gguf_moe.split_experts(t.name, t.data, int(t.shape[0]),
                                             lambda rows, k: blocks_to_weight(t.tensor_type.name, rows, k))
            state.update({n: w.to(device) for n, w in experts.items()})
            continue
        name = hf_name(t.name)
        if name is None or t.tensor_type.name not in NATIVE_TYPES:
            continue
        w = blocks_to_weight(t.tensor_type.name, t.data, int(t.shape[0]))
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if arch == "phi3" and kind == "ffn_up":  # Phi-3's is the fused gate+up: float, from the cache
            continue
        if kind in heads and arch in _PERMUTED_ARCHS:
            w = w.permute_rows(unpermute_rows(w.shape[0], heads[kind]))
        state[name] = w.to(device)
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
