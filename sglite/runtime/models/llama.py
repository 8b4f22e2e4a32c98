"""Llama-family decoder (Llama, Mistral, SmolLM, Qwen2 via ``qkv_bias``, Qwen3 via ``qk_norm``).

RMSNorm, rotary position embedding (RoPE, Su et al. 2021), grouped-query attention (GQA,
Ainslie et al. 2023), SwiGLU MLP (Shazeer 2020), optional tied embeddings. Q/K/V and gate/up
projections are fused into one matmul each. Attention and KV writes go through
``sglite.kernels`` only, over the token-level paged pool.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from sglite import kernels
from sglite.errors import InvalidRequestError

from ..forward_batch import ForwardBatch
from .cpu_gemv import cpp_gemv_fn, linear

log = logging.getLogger("sglite.models.llama")

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class LlamaArch:
    """Shape of a Llama-family model (read from a HF config)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf_config(cls, cfg) -> "LlamaArch":
        """Build from a transformers config; unsupported architectures or RoPE types raise."""
        archs = list(getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])
        if archs[0] not in SUPPORTED_ARCHS:
            raise InvalidRequestError(f"architectures={archs}: only {SUPPORTED_ARCHS} are supported", field="model_path")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rtype = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rtype not in ("default", None):
            raise InvalidRequestError(f"rope_type={rtype!r} is not supported (only default RoPE)", field="model_path")
        theta = getattr(cfg, "rope_theta", None) or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0
        nh = cfg.num_attention_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers, num_heads=nh,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or nh, head_dim=hd,
            rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=archs[0] == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False)),
            qk_norm=archs[0] == "Qwen3ForCausalLM",
        )


def _rope_cache(arch: LlamaArch, max_pos: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float64) / arch.head_dim))
    t = torch.arange(max_pos, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)  # [P, D/2]
    return freqs.cos().float().to(device), freqs.sin().float().to(device)  # [P, D/2] each


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in x's dtype (HF's order of operations, so bf16 rounds as HF's does).

    x: [N, H, D]; cos/sin: [N, D/2] in x's dtype. Returns [N, H, D].
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [N, H, D/2]
    c, s = cos[:, None, :], sin[:, None, :]  # [N, 1, D/2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)  # [N, H, D]


class LlamaModel:
    """Weights and forward of a Llama-family causal LM (no nn.Module: plain tensors, inference only)."""

    def __init__(self, arch: LlamaArch, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device="cpu"):
        self.arch, self.dtype, self.device = arch, dtype, device
        sd = state_dict

        def w(name):
            if name not in sd:
                raise InvalidRequestError(f"checkpoint is missing weight {name!r}", field="model_path")
            return sd[name].to(device=device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")  # [V, H]
        self.lm_head = self.embed if (arch.tie_word_embeddings or "lm_head.weight" not in sd) else w("lm_head.weight")
        self.norm = w("model.norm.weight")  # [H]
        self.layers = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "in_norm": w(p + "input_layernorm.weight"),  # [H]
                "post_norm": w(p + "post_attention_layernorm.weight"),  # [H]
                "qkv": torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).contiguous(),  # [(Hq+2Hkv)D, H]
                "o": w(p + "self_attn.o_proj.weight"),  # [H, Hq*D]
                "gate_up": torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]).contiguous(),  # [2I, H]
                "down": w(p + "mlp.down_proj.weight"),  # [H, I]
            }
            if arch.qkv_bias:
                layer["qkv_bias"] = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])  # [(Hq+2Hkv)D]
            if arch.qk_norm:
                layer["q_norm"] = w(p + "self_attn.q_norm.weight")  # [D]
                layer["k_norm"] = w(p + "self_attn.k_norm.weight")  # [D]
            self.layers.append(layer)
        self.gemv16: Optional[list] = None  # per layer float16 weights for one-row matmuls (CPU bf16)
        self.lm_head16: Optional[torch.Tensor] = None
        self.gemv_cpp = None  # C++ one-row bf16 matmul (CPU), see .cpu_gemv
        self.cos, self.sin = _rope_cache(arch, arch.max_position_embeddings, device)
        self.sm_scale = 1.0 / math.sqrt(arch.head_dim)

    def enable_fp16_gemv(self) -> None:
        """Keep float16 copies of the matmul weights for one-row products (see :mod:`.cpu_gemv`)."""
        half = lambda t: t.to(torch.float16)  # noqa: E731
        self.gemv16 = [{k: half(L[k]) for k in ("qkv", "o", "gate_up", "down")} for L in self.layers]
        self.lm_head16 = half(self.lm_head)

    def pack_hugepages(self) -> bool:
        """Move the matmul weights and the LM head (with the embedding when tied) into one buffer
        advised for huge pages, which the C++ GEMV streams faster (see :mod:`.cpu_gemv`); same bytes,
        the old tensors are released. Returns False (nothing moved) when the kernel is unavailable."""
        from sglite.kernels.cpu_gemv import hugepage_copies

        keys, tied = ("qkv", "o", "gate_up", "down"), self.lm_head is self.embed
        packed = hugepage_copies([L[k] for L in self.layers for k in keys] + [self.lm_head])
        if packed is None:
            return False
        *mats, self.lm_head = packed
        for i, L in enumerate(self.layers):
            L.update(zip(keys, mats[4 * i:4 * i + 4]))
        if tied:
            self.embed = self.lm_head
        return True

    def enable_cpp_gemv(self) -> bool:
        """Route one-row products through the C++ bf16 GEMV (see :mod:`.cpu_gemv`). Returns False
        when the kernel is unavailable."""
        self.gemv_cpp = cpp_gemv_fn()
        return self.gemv_cpp is not None

    def weight_bytes(self) -> int:
        """Bytes of weights read per decode step (embedding lookup excluded unless tied to the head)."""
        n = self.lm_head.numel() + self.norm.numel()
        for layer in self.layers:
            n += sum(t.numel() for t in layer.values())
        return n * self.embed.element_size()

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor]) -> torch.Tensor:
        """Run one mixed extend/decode step, writing new K/V into the pool.

        Args:
            fb: the step's tensors (see :class:`ForwardBatch`), on the model's device.
            k_buffers, v_buffers: per layer [S, Hkv, D] pool buffers (mutated).
        Returns:
            [M, V] float32 logits for the rows ``fb.logits_indices``.
        """
        fp16 = self.gemv16 is not None
        logits = self._forward(fb, k_buffers, v_buffers, fp16)
        if fp16 and (fb.input_ids.shape[0] == 1 or logits.shape[0] == 1) and not bool(logits.isfinite().all()):
            # an activation left fp16's range: redo the step on the bf16 path (it rewrites the
            # same KV slots) and stop using fp16 for this model
            log.warning("fp16 GEMV overflowed; falling back to %s matmuls", self.dtype)
            self.gemv16 = self.lm_head16 = None
            logits = self._forward(fb, k_buffers, v_buffers, False)
        return logits

    def _forward(self, fb: ForwardBatch, k_buffers, v_buffers, fp16: bool) -> torch.Tensor:
        a = self.arch
        Hq, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        ne = fb.num_extend_tokens
        x = self.embed[fb.input_ids]  # [N, H]
        cos = self.cos[fb.positions].to(self.dtype)  # [N, D/2]
        sin = self.sin[fb.positions].to(self.dtype)  # [N, D/2]
        cpp = self.gemv_cpp
        for li, L in enumerate(self.layers):
            W16 = self.gemv16[li] if fp16 else {}
            h = F.rms_norm(x, (a.hidden_size,), L["in_norm"], a.rms_norm_eps)  # [N, H]
            qkv = linear(h, L["qkv"], L.get("qkv_bias"), W16.get("qkv"), cpp)  # [N, (Hq+2Hkv)D]
            qk, v = qkv.split([(Hq + Hkv) * D, Hkv * D], dim=-1)
            qk, v = qk.view(-1, Hq + Hkv, D), v.view(-1, Hkv, D)  # [N, Hq+Hkv, D], [N, Hkv, D]
            if a.qk_norm:
                q = F.rms_norm(qk[:, :Hq], (D,), L["q_norm"], a.rms_norm_eps)
                k = F.rms_norm(qk[:, Hq:], (D,), L["k_norm"], a.rms_norm_eps)
                qk = torch.cat((q, k), dim=1)
            qk = _apply_rope(qk, cos, sin)  # [N, Hq+Hkv, D] (q and k heads rotated together)
            q, k = qk[:, :Hq], qk[:, Hq:]  # [N, Hq, D], [N, Hkv, D]
            kernels.store_kv(k_buffers[li], v_buffers[li], fb.out_cache_loc, k, v)
            parts = []
            if ne:
                parts.append(kernels.extend_attention(
                    q[:ne], k_buffers[li], v_buffers[li], fb.req_to_token, fb.ext_req_pool_indices,
                    fb.ext_prefix_lens, fb.ext_extend_lens, self.sm_scale))  # [Ne, Hq, D]
            if q.shape[0] > ne:
                parts.append(kernels.decode_attention(
                    q[ne:], k_buffers[li], v_buffers[li], fb.req_to_token, fb.dec_req_pool_indices,
                    fb.dec_seq_lens, self.sm_scale))  # [Nd, Hq, D]
            o = parts[0] if len(parts) == 1 else torch.cat(parts)  # [N, Hq, D]
            x = x + linear(o.reshape(-1, Hq * D), L["o"], None, W16.get("o"), cpp)  # [N, H]
            h = F.rms_norm(x, (a.hidden_size,), L["post_norm"], a.rms_norm_eps)  # [N, H]
            gu = linear(h, L["gate_up"], None, W16.get("gate_up"), cpp)  # [N, 2I]
            g, u = gu.chunk(2, dim=-1)
            x = x + linear(F.silu(g) * u, L["down"], None, W16.get("down"), cpp)  # [N, H]
        x = x[fb.logits_indices]  # [M, H]
        x = F.rms_norm(x, (a.hidden_size,), self.norm, a.rms_norm_eps)  # [M, H]
        return linear(x, self.lm_head, None, self.lm_head16 if fp16 else None, cpp).float()  # [M, V]
