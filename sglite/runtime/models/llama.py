"""Llama-family decoder (Llama, Mistral, SmolLM, Qwen2 via ``qkv_bias``, Qwen3 via ``qk_norm``).

RMSNorm, rotary position embedding (RoPE, Su et al. 2021), grouped-query attention (GQA,
Ainslie et al. 2023), SwiGLU MLP (Shazeer 2020), optional tied embeddings. Q/K/V and gate/up
projections are fused into one matmul each. Every compute op (matmuls, norms, the SwiGLU
activation, attention, KV writes) goes through ``sglite.kernels``, over the token-level paged
pool; each matmul weight is a :class:`sglite.kernels.LinearWeight` whose implementation is chosen
once at load (:meth:`LlamaModel.use_linear_impl`).

Deterministic inference (``batch_invariant=True``): matmuls use the ``invariant`` implementation,
attention and the SwiGLU activation their batch-invariant variants, and the scheduler lays extend
(prefill) tokens out as decode rows of their own causal length (``StepPlan.layout``), so a token's result does not depend on what
else is in the step, on the chunk size or on which prefix came from the radix cache.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

from sglite import kernels
from sglite.errors import InvalidRequestError

from ..forward_batch import ForwardBatch
from . import rope as rope_mod

log = logging.getLogger("sglite.models.llama")

LINEAR_KEYS = ("qkv", "o", "gate_up", "down")  # matmul weights of a layer (LinearWeight)
SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                   "Phi3ForCausalLM")  # Phi-3: fused qkv/gate_up split at load (models/phi3.py)


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
    rope: "rope_mod.RopeSpec | None" = None  # RoPE variant (models/rope.py); None: default RoPE

    @classmethod
    def from_hf_config(cls, cfg) -> "LlamaArch":
        """Build from a transformers config; unsupported architectures or RoPE types raise."""
        archs = list(getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])
        if archs[0] not in SUPPORTED_ARCHS:
            raise InvalidRequestError(f"architectures={archs}: only {SUPPORTED_ARCHS} are supported", field="model_path")
        nh = cfg.num_attention_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
        rope = rope_mod.spec_from_hf_config(cfg, hd)  # raises on an unsupported rope_type
        if rope.head_dim and archs[0] == "Qwen3ForCausalLM":  # its per-head QK-norm sees the rotary order
            raise InvalidRequestError(f"partial_rotary_factor: not supported for {archs[0]} (only 1.0)",
                                      field="partial_rotary_factor")
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers, num_heads=nh,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or nh, head_dim=hd,
            rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6), rope_theta=rope.theta,
            max_position_embeddings=rope.table_positions,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=archs[0] == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False)),
            qk_norm=archs[0] == "Qwen3ForCausalLM", rope=rope,
        )


def _rope_cache(arch: LlamaArch, max_pos: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, D/2] float32 cos and sin of every position (the RoPE variant's tables, models/rope.py)."""
    spec = arch.rope or rope_mod.RopeSpec(theta=arch.rope_theta, dim=arch.head_dim)
    return rope_mod.rope_cache(spec, max_pos, device)


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

    emits_hidden = True  # forward(..., hidden=[]) gives the final-normed hidden states (draft heads)

    def __init__(self, arch: LlamaArch, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device="cpu",
                 batch_invariant: bool = False):
        self.arch, self.dtype, self.device = arch, dtype, device
        self.batch_invariant = batch_invariant
        sd = state_dict

        def raw(name):
            if name not in sd:
                raise InvalidRequestError(f"checkpoint is missing weight {name!r}", field="model_path")
            return sd[name]

        def w(name):
            return raw(name).to(device=device, dtype=dtype).contiguous()

        def lin(names, bias=None):  # one (fused) matmul weight; parts may be quantized (QuantLinearWeight)
            return kernels.make_linear([rows(n, raw(n)) for n in names], bias, dtype, device)

        partial = arch.rope is not None and arch.rope.head_dim > arch.rope.dim
        if partial:  # the fused C++ decode would read the same tables, but is not checked on partial rotary
            self.fused_decode_ok = False

        def rows(name, t):  # partial rotary: Q / K rows (and biases) in full-head rotate-half order (rope.py)
            if not partial or not name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
                return t
            idx = rope_mod.rotary_row_order(t.shape[0], arch.head_dim, arch.rope.dim)
            return t.permute_rows(idx) if isinstance(t, kernels.QuantLinearWeight) else t[idx]

        emb = raw("model.embed_tokens.weight")  # [V, H]; a QuantLinearWeight when kept quantized
        self.embed = emb.to(device) if isinstance(emb, kernels.QuantLinearWeight) else w("model.embed_tokens.weight")
        tied = arch.tie_word_embeddings or "lm_head.weight" not in sd
        if tied and isinstance(self.embed, kernels.QuantLinearWeight):
            self.lm_head = self.embed  # [V, H]: one quantized table serves the lookup and the head
        else:
            self.lm_head = kernels.LinearWeight(self.embed) if tied else lin(["lm_head.weight"])  # [V, H]
        self.norm = w("model.norm.weight")  # [H]
        self.layers = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            qkv_bias = (torch.cat([rows(p + f"self_attn.{n}_proj.bias", w(p + f"self_attn.{n}_proj.bias"))
                                   for n in "qkv"]) if arch.qkv_bias else None)
            layer = {
                "in_norm": w(p + "input_layernorm.weight"),  # [H]
                "post_norm": w(p + "post_attention_layernorm.weight"),  # [H]
                "qkv": lin([p + f"self_attn.{n}_proj.weight" for n in "qkv"], qkv_bias),
                # [(Hq+2Hkv)D, H], bias [(Hq+2Hkv)D] (Qwen2)
                "o": lin([p + "self_attn.o_proj.weight"]),  # [H, Hq*D]
                **self._mlp_weights(sd, i, lin),  # gate_up [2I, H], down [H, I] (MoE: models/moe.py)
            }
            if arch.qk_norm:
                layer["q_norm"] = w(p + "self_attn.q_norm.weight")  # [D]
                layer["k_norm"] = w(p + "self_attn.k_norm.weight")  # [D]
            self.layers.append(layer)
        self.cos, self.sin = _rope_cache(arch, arch.max_position_embeddings, device)
        self.sm_scale = 1.0 / math.sqrt(arch.head_dim)
        # tensor parallelism (sglite.runtime.parallel): this model is one rank's shard and ``tp`` (a
        # TPComm) does the vocab-parallel embedding, the all-reduces and the logits all-gather
        self.tp = None
        # fused C++ decode of 1..32 decode rows (sglite.kernels.decode_fused.FusedDecode), set by the
        # model runner when its preconditions hold; None: every step runs the per-op path below
        self.decode_fused = None

    def linear_weights(self) -> list:
        """Every matmul weight (:class:`~sglite.kernels.LinearWeight` or
        :class:`~sglite.kernels.QuantLinearWeight`), layer by layer (qkv, o, gate_up, down), then
        the LM head."""
        return [L[k] for L in self.layers for k in LINEAR_KEYS] + [self.lm_head]

    @property
    def linear_impl(self) -> str:
        """The implementation every matmul uses (see :data:`sglite.kernels.matmul.IMPLS`)."""
        return self.lm_head.impl

    def use_linear_impl(self, impl: str) -> None:
        """Route every matmul through ``impl`` (``torch``, ``fp16``, ``cpp``, ``invariant``); called
        once at load (:class:`~sglite.runtime.model_runner.ModelRunner`), and by the fp16 overflow
        fallback. Raises ValueError for an unknown name."""
        for lw in self.linear_weights():
            lw.use(impl)

    def pack_hugepages(self) -> bool:
        """Move the float matmul weights and the LM head (with the embedding when tied) into one
        buffer advised for huge pages (:func:`sglite.kernels.host_memory.hugepage_copies`), and the
        quantized weights' codes, scales and offsets into a second one: the C++ kernels stream
        them faster; same bytes, the old tensors are released. CPU only: returns False
        (nothing moved) on other devices."""
        if self.device != "cpu":
            return False
        from sglite.kernels.host_memory import hugepage_copies

        lws = [lw for lw in self.linear_weights() if isinstance(lw, kernels.LinearWeight)]  # float ones
        tied = bool(lws) and lws[-1] is self.lm_head and self.lm_head.weight is self.embed
        for lw, t in zip(lws, hugepage_copies([lw.weight for lw in lws])):
            lw.weight = t
            if lw.impl == "fp16":
                lw.use("fp16")
        if tied:
            self.embed = self.lm_head.weight
        qws = list({id(q): q for q in self.linear_weights() if isinstance(q, kernels.QuantLinearWeight)}.values())
        parts = [(q, f) for q in qws for f in ("qweight", "scales", "mins", "amx_packed")
                 if getattr(q, f) is not None]
        for (q, f), t in zip(parts, hugepage_copies([getattr(q, f) for q, f in parts]) if parts else []):
            setattr(q, f, t)  # quantized codes, scales and offsets too (the embedding with them when tied)
        return True

    def weight_bytes(self) -> int:
        """Bytes of weights read per decode step (embedding lookup excluded unless tied to the head):
        matmul weights as resident (quantized ones packed), norms in the model's dtype."""
        n = self.lm_head.nbytes() + self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            n += sum(t.nbytes if isinstance(t, torch.Tensor) else t.nbytes() for t in layer.values())
        return n

    def resident_weight_bytes(self) -> int:
        """Bytes of every weight held (the embedding counted once when tied to the head)."""
        emb = self.embed
        n = 0 if emb is self.lm_head or getattr(self.lm_head, "weight", None) is emb else (
            emb.nbytes if isinstance(emb, torch.Tensor) else emb.nbytes())
        return n + self.weight_bytes()

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                hidden: Optional[list] = None) -> torch.Tensor:
        """Run one mixed extend/decode step, writing new K/V into the pool.

        Args:
            fb: the step's tensors (see :class:`ForwardBatch`), on the model's device.
            k_buffers, v_buffers: per layer [S, Hkv, D] pool buffers (mutated).
            hidden: when a list, the step's final-normed hidden states of *all* its tokens
                ([N, H] float32, token order of ``fb.input_ids``) are appended to it (the features
                EAGLE / Medusa draft heads read, :mod:`sglite.runtime.speculative.heads`).
        Returns:
            [M, V] float32 logits for the rows ``fb.logits_indices``.
        """
        if self.decode_fused is not None:  # the fused C++ decode (LoRA adapters of fb.lora included)
            logits = (self.decode_fused.forward(fb, k_buffers, v_buffers) if hidden is None
                      else self.decode_fused.forward(fb, k_buffers, v_buffers, hidden=hidden))
            if logits is not None:
                return logits
        # (family models' _forward takes no ``hidden``: they never get one, emits_hidden is False)
        args = (fb, k_buffers, v_buffers) if hidden is None else (fb, k_buffers, v_buffers, hidden)
        logits = self._forward(*args)
        if (self.linear_impl == "fp16" and (fb.input_ids.shape[0] == 1 or logits.shape[0] == 1)
                and not bool(logits.isfinite().all())):
            # an activation left fp16's range: redo the step on the bf16 path (it rewrites the
            # same KV slots) and stop using fp16 for this model
            log.warning("fp16 GEMV overflowed; falling back to %s matmuls", self.dtype)
            self.use_linear_impl("torch")
            if hidden is not None:
                hidden.clear()
            logits = self._forward(*args)
        return logits

    def _forward(self, fb: ForwardBatch, k_buffers, v_buffers, hidden: Optional[list] = None) -> torch.Tensor:
        a = self.arch
        Hq, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        inv = self.batch_invariant
        ne, dec_rows, dec_lens = fb.num_extend_tokens, fb.dec_req_pool_indices, fb.dec_seq_lens
        # deterministic mode: the scheduler lays every token out as a decode row of its own causal
        # length (StepPlan.layout(None)), so a token meets one kernel however its prompt was cut
        assert not (inv and ne), "batch-invariant forward given extend rows (see StepPlan.layout)"
        if self.tp is not None:  # vocab-parallel lookup (tensor parallelism)
            x = self.tp.embed(self.embed, fb.input_ids)  # [N, H]
        with kernels.serial_torch():  # torch glue on this thread only (kernels.device.serial_torch)
            if self.tp is None:
                x = self.embed_rows(fb.input_ids)  # [N, H]
            cos = self.cos[fb.positions].to(self.dtype)  # [N, D/2]
            sin = self.sin[fb.positions].to(self.dtype)  # [N, D/2]
        nl = len(self.layers)
        for li, L in enumerate(self.layers):
            if li == 0:  # later layers get h from the previous layer's fused residual add + norm
                h = kernels.rms_norm(x, L["in_norm"], a.rms_norm_eps, batch_invariant=inv)  # [N, H]
            qkv = self._lin(h, L, "qkv", li, fb)  # [N, (Hq+2Hkv)D]
            qk, v = qkv.split([(Hq + Hkv) * D, Hkv * D], dim=-1)
            qk, v = qk.view(-1, Hq + Hkv, D), v.view(-1, Hkv, D)  # [N, Hq+Hkv, D], [N, Hkv, D]
            if a.qk_norm:
                q = kernels.rms_norm(qk[:, :Hq], L["q_norm"], a.rms_norm_eps, batch_invariant=inv)
                k = kernels.rms_norm(qk[:, Hq:], L["k_norm"], a.rms_norm_eps, batch_invariant=inv)
                qk = torch.cat((q, k), dim=1)
            # q and k heads rotated together (as _apply_rope), k and v stored: [N, Hq, D]
            q = kernels.rope_store_kv(qk, v, cos, sin, k_buffers[li], v_buffers[li], fb.out_cache_loc, Hq)
            parts = []
            if ne:
                parts.append(kernels.extend_attention(
                    q[:ne], k_buffers[li], v_buffers[li], fb.req_to_token, fb.ext_req_pool_indices,
                    fb.ext_prefix_lens, fb.ext_extend_lens, self.sm_scale))  # [Ne, Hq, D]
            if q.shape[0] > ne:
                parts.append(kernels.decode_attention(
                    q[ne:], k_buffers[li], v_buffers[li], fb.req_to_token, dec_rows, dec_lens,
                    self.sm_scale, batch_invariant=inv))  # [Nd, Hq, D]
            if len(parts) == 1:
                o = parts[0]  # [N, Hq, D]
            else:
                with kernels.serial_torch():
                    o = torch.cat(parts)  # [N, Hq, D]
            x, h = kernels.add_rms_norm(x, self._reduce(self._lin(o.reshape(-1, Hq * D), L, "o", li, fb)),
                                        L["post_norm"], a.rms_norm_eps, batch_invariant=inv)  # [N, H] each
            d = self._reduce(self._mlp(h, L, li, fb))  # [N, H]
            if li + 1 < nl:  # residual add fused with the next layer's input norm
                x, h = kernels.add_rms_norm(x, d, self.layers[li + 1]["in_norm"], a.rms_norm_eps, batch_invariant=inv)
            else:
                with kernels.serial_torch():
                    x = x + d
        if hidden is not None:  # every token's final-normed state (the logits rows keep their own norm)
            hn = kernels.rms_norm(x, self.norm, a.rms_norm_eps, batch_invariant=inv)
            with kernels.serial_torch():
                hidden.append(hn.float())  # [N, H]
        with kernels.serial_torch():
            x = x[fb.logits_indices]  # [M, H]
        x = kernels.rms_norm(x, self.norm, a.rms_norm_eps, batch_invariant=inv)  # [M, H]
        logits = kernels.linear(x, self.lm_head)  # [M, V] ([M, V/tp] on a tensor-parallel rank)
        with kernels.serial_torch():
            logits = logits.float()
        return logits if self.tp is None else self.tp.gather_logits(logits)

    def _mlp_weights(self, sd: dict, i: int, lin) -> dict:
        """Layer ``i``'s feed-forward weights: SwiGLU ``gate_up`` [2I, H] and ``down`` [H, I];
        ``lin(names)`` builds one (fused) matmul weight. Mixture-of-experts models override it."""
        p = f"model.layers.{i}.mlp."
        return {"gate_up": lin([p + "gate_proj.weight", p + "up_proj.weight"]), "down": lin([p + "down_proj.weight"])}

    def _mlp(self, h: torch.Tensor, L: dict, li: int, fb: ForwardBatch) -> torch.Tensor:
        """The feed-forward block of layer ``li`` (weights ``L``) on normed rows h [N, H] -> [N, H]
        (before the tensor-parallel reduce), with the rows' LoRA deltas when ``fb`` has adapters."""
        return self._lin(self._gated_act(h, L, li, fb), L, "down", li, fb)

    def _gated_act(self, h: torch.Tensor, L: dict, li: int, fb: ForwardBatch, act: str = "silu") -> torch.Tensor:
        """``act(g) * u`` [N, I] of layer ``li``'s fused gate/up projection of h [N, H] (``act``:
        ``silu``, SwiGLU, or ``gelu_tanh``, GeGLU). SwiGLU without LoRA and outside batch-invariant
        mode comes from the gate/up GEMM's output stage where the weight's implementation has one
        (:func:`sglite.kernels.linear_silu`); otherwise the product, then the activation kernel."""
        if act == "silu" and fb.lora is None and not self.batch_invariant:
            out = kernels.linear_silu(h, L["gate_up"])  # None where the weight's implementation has none
            if out is not None:
                return out
        g, u = self._lin(h, L, "gate_up", li, fb).chunk(2, dim=-1)  # [N, I] each
        if act == "gelu_tanh":
            return kernels.gelu_tanh_mul(g, u)
        return kernels.silu_mul(g, u, batch_invariant=self.batch_invariant)

    @staticmethod
    def _lin(x: torch.Tensor, L: dict, key: str, li: int, fb: ForwardBatch) -> torch.Tensor:
        """Matmul ``key`` of layer ``li`` (one of ``LINEAR_KEYS``) on x [N, in] -> [N, out], plus
        the LoRA delta of each row's adapter when the step has adapters (``fb.lora``,
        :class:`sglite.lora.LoraBatch`)."""
        y = kernels.linear(x, L[key])
        return y if fb.lora is None else fb.lora.apply(y, x, li, key)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of token ids ``ids`` [N] int64 -> [N, H] in the model dtype, from the float
        table or a quantized one (:meth:`~sglite.kernels.QuantLinearWeight.rows` dequantizes only
        those rows). Not the tensor-parallel lookup (``self.tp.embed``)."""
        return self.embed[ids] if isinstance(self.embed, torch.Tensor) else self.embed.rows(ids, self.dtype)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel matmul's output: summed over tensor-parallel ranks, else as is."""
        return x if self.tp is None else self.tp.all_reduce(x)
