"""Decoder layer shared by the Llama-like families that differ from Llama in norms, scalars and
attention options: OLMo 2 (:mod:`.olmo2`), Granite (:mod:`.granite`), Gemma 2 and Gemma 3
(:mod:`.gemma`), SmolLM3 (:mod:`.smollm3`).

A :class:`FamilyArch` is a :class:`~.llama.LlamaArch` (the shape, read by the Llama parser from a
view of the HF config) plus what the family changes, as data:

* norm placement: each layer holds the norms its family has, among ``in_norm`` (pre-attention),
  ``attn_out_norm`` (on the attention output, before the residual add), ``ffn_in_norm``
  (pre-MLP) and ``ffn_out_norm`` (on the MLP output); RMSNorm (Zhang & Sennrich 2019) computed in
  float32 (``norm_fp32``) with ``(1 + w)`` weights for Gemma;
* QK-norm over each head (Gemma 3, ``qk_norm_kind="head"``) or over the whole q / k projection
  width (OLMo 2, ``"full"``);
* scalars: embedding scale, residual scale, attention scale, logit divisor (Granite; Gemma's
  sqrt(hidden) embedding scale), attention and final-logit soft-capping (Gemma 2);
* the MLP activation (SwiGLU or GELU-tanh GeGLU), sliding-window (local) layers with their own
  RoPE base (Gemma 2/3), layers without positional encoding (SmolLM3's NoPE layers: they rotate
  with identity tables, cos 1 and sin 0, and the fused decode takes them as its "local" layers
  with no window).

:class:`FamilyModel` is a :class:`~.llama.LlamaModel` (same weights, KV layout, matmul
implementations, hugepage packing) with this layer's forward (the per-op path, the reference); its
decode steps take the families' fused C++ decode (:mod:`sglite.kernels.decode_family`,
``fused_decode_family = True``) when the weights qualify. Under tensor parallelism (``tp``, as
:class:`~.llama.LlamaModel`) the attention output and MLP projections are all-reduced before their
output norms and residual scale, the logits gathered before the divisor and soft-capping; OLMo 2
(QK-norm across all heads) is refused (:func:`sglite.runtime.models.registry.check_engine_config`).
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from sglite import kernels
from sglite.errors import InvalidRequestError

from ..forward_batch import ForwardBatch
from .llama import LlamaArch, LlamaModel, _rope_cache


@dataclass(frozen=True)
class FamilyArch(LlamaArch):
    """A Llama shape plus the family's differences (module docstring). Defaults are Llama's."""

    family: str = "llama"
    norm_fp32: bool = False  # RMSNorm in float32, cast back (OLMo 2, Gemma)
    norm_plus_one: bool = False  # weights stored as w, applied as (1 + w) (Gemma)
    qk_norm_kind: str = ""  # "", "head" (per head, Gemma 3), "full" (whole projection, OLMo 2)
    embed_scale: float = 1.0
    embed_scale_in_dtype: bool = False  # the scale rounded to the model dtype first (Gemma, as HF)
    residual_scale: float = 1.0
    attn_scale: Optional[float] = None  # None: 1/sqrt(head_dim)
    logits_divisor: float = 1.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    mlp_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    sliding_window: int = 0
    local_layers: tuple = ()  # per layer: True = sliding-window (local) attention
    local_rope: Optional[LlamaArch] = None  # RoPE of the local layers (Gemma 3), None: the global one
    nope_layers: tuple = ()  # per layer: True = no positional encoding (SmolLM3): identity RoPE tables


def base_arch(cfg, rope_parameters=None) -> LlamaArch:
    """The Llama shape of a family config ``cfg`` (the Llama parser on a copy named Llama, with
    ``rope_parameters`` in place of the config's own when given)."""
    view = copy.copy(cfg)
    view.architectures = ["LlamaForCausalLM"]
    if rope_parameters is not None:
        view.rope_parameters = dict(rope_parameters)
    return LlamaArch.from_hf_config(view)


def family_arch(cfg, rope_parameters=None, **fields) -> FamilyArch:
    """A :class:`FamilyArch` from ``cfg``'s Llama shape and the family's ``fields``."""
    base = base_arch(cfg, rope_parameters)
    if base.rope is not None and base.rope.head_dim:  # (Llama / Phi-3 only: QK-norms would see the row order)
        raise InvalidRequestError(f"partial_rotary_factor: not supported for {getattr(cfg, 'architectures', None)} "
                                  "(only 1.0; partial rotary runs on Llama / Phi-3 layers)",
                                  field="partial_rotary_factor")
    return FamilyArch(**{f: getattr(base, f) for f in asdict(base)}, **fields)


def refuse(field: str, value, supported) -> None:
    """Raise the InvalidRequestError of an unsupported config value (names field and choices)."""
    raise InvalidRequestError(f"model_path: config {field}={value!r} is not supported; supported: {supported}",
                              field="model_path")


class FamilyModel(LlamaModel):
    """A Llama-like model with the layer of :class:`FamilyArch` (module docstring). A family
    subclass names its layer norms in :meth:`layer_norm_names`."""

    emits_hidden = False  # its own _forward: no hidden states for draft heads (EAGLE / MEDUSA refused)

    fused_decode_family = True  # sglite.kernels.decode_family: the C++ layer with this family's options

    def layer_norm_names(self, arch: FamilyArch) -> dict:
        """``{layer key: HF module name}`` of a layer's norms (keys ``in_norm``, ``attn_out_norm``,
        ``ffn_in_norm``, ``ffn_out_norm``, ``q_norm``, ``k_norm``); Llama's placement by default."""
        return {"in_norm": "input_layernorm", "ffn_in_norm": "post_attention_layernorm"}

    def __init__(self, arch: FamilyArch, state_dict, dtype, device="cpu", batch_invariant: bool = False):
        sd = dict(state_dict)
        for i in range(arch.num_layers):  # LlamaModel reads these two norms: stand-ins where absent
            for hf in ("input_layernorm", "post_attention_layernorm"):
                sd.setdefault(f"model.layers.{i}.{hf}.weight", torch.ones(arch.hidden_size))
        super().__init__(arch, sd, dtype, device, batch_invariant=batch_invariant)
        names = self.layer_norm_names(arch)
        for i, L in enumerate(self.layers):
            del L["in_norm"], L["post_norm"]  # re-read below under this family's meaning
            for key, hf in names.items():
                name = f"model.layers.{i}.{hf}.weight"
                if name not in state_dict:
                    raise InvalidRequestError(f"checkpoint is missing weight {name!r}", field="model_path")
                L[key] = self._norm_weight(state_dict[name])
        self.norm = self._norm_weight(sd["model.norm.weight"])
        if arch.attn_scale is not None:
            self.sm_scale = float(arch.attn_scale)
        self.local_cos, self.local_sin = self.cos, self.sin
        if arch.local_rope is not None:
            self.local_cos, self.local_sin = _rope_cache(arch.local_rope, arch.max_position_embeddings, device)
        if any(arch.nope_layers):  # NoPE layers: the identity rotation (no local layers with them)
            if any(arch.local_layers):
                raise InvalidRequestError("model_path: NoPE and sliding-window layers in one model are not supported",
                                          field="model_path")
            self.local_cos, self.local_sin = torch.ones_like(self.cos), torch.zeros_like(self.sin)
        # per layer: rotates with (local_cos, local_sin): a sliding-window layer, or a NoPE one
        self.rope_local = tuple(bool(x) for x in (arch.local_layers or arch.nope_layers)) or (False,) * arch.num_layers

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        """A norm weight as applied: float32 ``(1 + w)`` (Gemma), float32 ``w`` (``norm_fp32``), or
        ``w`` in the model dtype."""
        a = self.arch
        if a.norm_plus_one:
            return (1.0 + w.to(device=self.device, dtype=torch.float32)).contiguous()
        dt = torch.float32 if a.norm_fp32 else self.dtype
        return w.to(device=self.device, dtype=dt).contiguous()

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x [..., K] with weight w [K] (float32 math when ``norm_fp32``), x's dtype."""
        a = self.arch
        if a.norm_fp32:
            if x.device.type == "cpu" and x.dtype == torch.bfloat16:  # the float32 norm, one rounding, no copies
                return kernels.rms_norm(x, w, a.rms_norm_eps, batch_invariant=self.batch_invariant)
            return kernels.rms_norm(x.float(), w, a.rms_norm_eps, batch_invariant=self.batch_invariant).to(x.dtype)
        return kernels.rms_norm(x, w, a.rms_norm_eps, batch_invariant=self.batch_invariant)

    def _forward(self, fb: ForwardBatch, k_buffers, v_buffers) -> torch.Tensor:
        a = self.arch
        Hq, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        inv, rs = self.batch_invariant, a.residual_scale
        ne, dec_rows, dec_lens = fb.num_extend_tokens, fb.dec_req_pool_indices, fb.dec_seq_lens
        assert not (inv and ne), "batch-invariant forward given extend rows (see StepPlan.layout)"
        x = self.embed_rows(fb.input_ids) if self.tp is None else self.tp.embed(self.embed, fb.input_ids)  # [N, H]
        if a.embed_scale != 1.0:
            x = x * (torch.tensor(a.embed_scale, dtype=x.dtype) if a.embed_scale_in_dtype else a.embed_scale)
        rope = {False: (self.cos[fb.positions].to(self.dtype), self.sin[fb.positions].to(self.dtype))}  # [N, D/2]
        if self.local_cos is not self.cos:
            rope[True] = (self.local_cos[fb.positions].to(self.dtype), self.local_sin[fb.positions].to(self.dtype))
        swa = fb.swa
        full = (fb.out_cache_loc, fb.req_to_token, fb.ext_req_pool_indices, dec_rows)
        for li, L in enumerate(self.layers):
            local = bool(a.local_layers[li]) if a.local_layers else False
            window = a.sliding_window if local else 0
            h = self._rms(x, L["in_norm"]) if "in_norm" in L else x  # [N, H]
            q, k, v = self._lin(h, L, "qkv", li, fb).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            if a.qk_norm_kind == "full":  # OLMo 2: over the whole projection width, before the head split
                q, k = self._rms(q, L["q_norm"]), self._rms(k, L["k_norm"])
            q, k, v = q.reshape(-1, Hq, D), k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D)
            if a.qk_norm_kind == "head":  # Gemma 3: each head over D
                q, k = self._rms(q, L["q_norm"]), self._rms(k, L["k_norm"])
            cos, sin = rope.get(self.rope_local[li], rope[False])
            # RoPE on q and k (as _apply_rope), k and v stored: [N, Hq, D]
            # local layers of a hybrid pool (sglite.runtime.swa_pool): their own slot space
            loc, table, ext_rows, drows = ((swa.out_cache_loc, swa.req_to_token, swa.ext_rows, swa.dec_rows)
                                           if local and swa is not None else full)
            q = kernels.rope_store_kv(torch.cat((q, k), dim=1), v, cos, sin, k_buffers[li], v_buffers[li],
                                      loc, Hq)
            parts = []
            if ne:
                parts.append(kernels.extend_attention(
                    q[:ne], k_buffers[li], v_buffers[li], table, ext_rows,
                    fb.ext_prefix_lens, fb.ext_extend_lens, self.sm_scale, window=window,
                    softcap=a.attn_softcap))  # [Ne, Hq, D]
            if q.shape[0] > ne:
                parts.append(kernels.decode_attention(
                    q[ne:], k_buffers[li], v_buffers[li], table, drows, dec_lens,
                    self.sm_scale, batch_invariant=inv, window=window, softcap=a.attn_softcap))  # [Nd, Hq, D]
            o = parts[0] if len(parts) == 1 else torch.cat(parts)  # [N, Hq, D]
            o = self._reduce(self._lin(o.reshape(-1, Hq * D), L, "o", li, fb))  # [N, H]
            if "attn_out_norm" in L:
                o = self._rms(o, L["attn_out_norm"])
            x = x + (o * rs if rs != 1.0 else o)
            h = self._rms(x, L["ffn_in_norm"]) if "ffn_in_norm" in L else x
            act = self._gated_act(h, L, li, fb, a.mlp_act)  # [N, I]
            d = self._reduce(self._lin(act, L, "down", li, fb))  # [N, H]
            if "ffn_out_norm" in L:
                d = self._rms(d, L["ffn_out_norm"])
            x = x + (d * rs if rs != 1.0 else d)
        x = self._rms(x[fb.logits_indices], self.norm)  # [M, H]
        logits = kernels.linear(x, self.lm_head)  # [M, V] in the model dtype ([M, V/tp] on a rank)
        if self.tp is not None:
            logits = self.tp.gather_logits(logits)  # [M, V]
        if a.logits_divisor != 1.0:
            logits = logits / a.logits_divisor
        if a.final_softcap > 0:
            logits = torch.tanh(logits / a.final_softcap) * a.final_softcap
        return logits.float()
