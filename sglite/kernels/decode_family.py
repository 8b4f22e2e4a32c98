"""Fused CPU decode of the Llama-like families: Gemma 2 / Gemma 3, OLMo 2, Granite (the layer of
``sglite.runtime.models.family.FamilyModel``) and Qwen3-style per-head QK-norm on the Llama layer,
in one C++ call per step (``decode_family_forward``, source ``csrc/decode_family.h``, spliced into
``csrc/decode_layer.cpp``), with the GEMVs, thread pool, paged attention and LM head of
:mod:`.decode_fused` (whose docstring gives the arithmetic, threads and preconditions).

The family's differences from the Llama layer run as data, read from the model's ``arch`` (a
``FamilyArch``; a plain ``LlamaArch`` gives Llama's values):

* the layer's norms among ``in_norm``, ``attn_out_norm``, ``ffn_in_norm``, ``ffn_out_norm`` (those
  the layer holds; their weights as the per-op path applies them: Gemma's ``(1 + w)`` is folded in
  at load), RMSNorm (Zhang & Sennrich 2019) in float32;
* QK-norm over each head (Gemma 3, Qwen3) or over the whole q / k width (OLMo 2), before RoPE;
* the embedding scale (rounded to the model dtype first where the family does, as the per-op
  path), the residual scale and the softmax scale (Granite; Gemma's ``query_pre_attn_scalar``);
* the MLP activation: SwiGLU or GELU-tanh GeGLU (Gemma);
* sliding-window (local) layers: their own RoPE tables (``model.local_cos`` / ``local_sin``), their
  K/V slots in the hybrid pool's local slot space (``fb.swa``, :mod:`sglite.runtime.swa_pool`),
  attention over the last ``sliding_window`` positions (the C++ attention op's window); NoPE layers
  (SmolLM3) are passed as local layers with identity tables and no window (the full slots);
* attention logit soft-capping (Gemma 2) in the attention op; the LM head's divisor (Granite's
  ``logits_scaling``) and final soft-capping (Gemma 2) on the [M, V] logits after the head.

Quantized KV pools (int8 / int4 KIVI, fp8_e4m3; issue 33): as in :mod:`.decode_fused`
(:meth:`.decode_fused.FusedDecode.quant_pool_args`: the step's K/V into the residual windows,
completed key groups sealed in C++, the pool's attention; fp8 codes stored as ``x / scale``,
``q * key scale``, output times the value scale), with the family's options around them, for models
without local layers and attention soft-capping (Qwen3, OLMo 2, Granite; quantized pools support
neither): :attr:`FamilyFusedDecode.quant_kv`. Gemma's quantized steps are declined (the per-op
path, which refuses them; the model registry refuses such a pool at load), and SmolLM3's (its NoPE
layers ride on the local flags, which the quantized pools refuse) run the per-op path.

LoRA adapters (``csrc/lora_fused.h``, as in :mod:`.decode_fused`): each projection's delta is added
to its output before the family's norms; steps of up to :data:`.decode_fused.MAX_ROWS_AMX` rows
where the tiled GEMMs run on AMX (:meth:`.decode_fused.FusedDecode.amx_min`).

float32 models: logits equal the per-op path's (``FamilyModel._forward``, the reference) up to
float32 summation order, greedy tokens identical (tests/kernels/test_decode_family.py; over
quantized pools tests/kernels/test_decode_family_kv_quant.py).
"""
from __future__ import annotations

import torch

from typing import Optional

from . import decode_fused
from .decode_fused import _NO_ROWS, _PLAIN_POOL, LINEAR_KEYS, FusedDecode, load
from .device import serial_torch

NORM_KEYS = ("in_norm", "attn_out_norm", "ffn_in_norm", "ffn_out_norm")
QK_KINDS = {"": 0, "head": 1, "full": 2}
ACTS = {"silu": 0, "gelu_tanh": 1}


def layer_norms(layer: dict) -> dict:
    """``{key: weight}`` of a layer's norms under :data:`NORM_KEYS` (a Llama layer's ``in_norm`` /
    ``post_norm`` read as ``in_norm`` / ``ffn_in_norm``)."""
    if "post_norm" in layer:
        return {"in_norm": layer["in_norm"], "ffn_in_norm": layer["post_norm"]}
    return {k: layer[k] for k in NORM_KEYS if k in layer}


def supported(model) -> bool:
    """Whether the family options of ``model`` fit :func:`decode_family_forward` (same norm keys
    in every layer, a known QK-norm kind and activation, local RoPE tables over the whole head)."""
    a = model.arch
    keys = {tuple(layer_norms(L)) for L in model.layers}
    kind = getattr(a, "qk_norm_kind", "") or ("head" if a.qk_norm else "")
    local_cos = getattr(model, "local_cos", model.cos)
    return (len(keys) == 1 and kind in QK_KINDS and getattr(a, "mlp_act", "silu") in ACTS
            and tuple(local_cos.shape[1:]) == (a.head_dim // 2,) and not (kind and "q_norm" not in model.layers[0]))


class FamilyFusedDecode(FusedDecode):
    """:class:`.decode_fused.FusedDecode` with the family options of the module docstring.

    Attributes:
        quant_kv: steps over a quantized KV pool run here (:meth:`.FusedDecode.quant_pool_args`)
            when the model has no local (sliding-window) layer and no attention soft-capping, which
            quantized pools do not support; else False (the per-op path, which refuses them).
    """

    def _norms(self, model) -> torch.Tensor:
        a, H = model.arch, model.arch.hidden_size
        present = layer_norms(model.layers[0])
        self.norm_mask = sum(1 << i for i, k in enumerate(NORM_KEYS) if k in present)
        one = torch.ones(H)
        self.qk_kind = QK_KINDS[getattr(a, "qk_norm_kind", "") or ("head" if a.qk_norm else "")]
        self.qk_norms = [L[k].float().contiguous() for L in model.layers for k in ("q_norm", "k_norm")] if self.qk_kind else []
        # the layers on the local tables: sliding-window ones (Gemma), NoPE ones (SmolLM3; no window)
        self.local = [int(x) for x in getattr(model, "rope_local", ())] or [0] * len(model.layers)
        self.window = int(getattr(a, "sliding_window", 0) or 0) if any(self.local) else 0
        self.act = ACTS[getattr(a, "mlp_act", "silu")]
        self.quant_kv = not any(self.local) and not float(getattr(a, "attn_softcap", 0.0))
        return torch.stack([torch.stack([layer_norms(L).get(k, one).float() for k in NORM_KEYS])
                            for L in model.layers]).contiguous()  # [L, 4, H] float32

    def hidden(self, fb, k_buffers, v_buffers, quant: Optional[tuple] = None) -> torch.Tensor:
        """[N, H] float32 final-normed hidden states of the step's decode rows (KV written), with
        the rows' LoRA deltas when the step has adapters (``fb.lora``). ``quant``:
        :meth:`.FusedDecode.quant_pool_args` of a step over a quantized pool (its buffers and slots
        replace the pool's; no local layers), None for a float pool."""
        m, a = self.model, self.model.arch
        kvq_args, loc = _PLAIN_POOL, fb.out_cache_loc
        if quant is not None:
            k_buffers, v_buffers, loc, kvq_args = quant
        with serial_torch():  # the torch glue on this thread (device.serial_torch: OpenMP stalls under load)
            x = m.embed_rows(fb.input_ids)  # [N, H] model dtype
            es = float(getattr(a, "embed_scale", 1.0))
            if es != 1.0:  # as FamilyModel._forward: in the model dtype
                x = x * (torch.tensor(es, dtype=x.dtype) if getattr(a, "embed_scale_in_dtype", False) else es)
            pos = fb.positions
            cos, sin = m.cos[pos].contiguous(), m.sin[pos].contiguous()  # [N, D/2] float32
            lc, ls = getattr(m, "local_cos", m.cos), getattr(m, "local_sin", m.sin)
            lcos, lsin = (cos, sin) if lc is m.cos else (lc[pos].contiguous(), ls[pos].contiguous())
            rt = fb.req_to_token if fb.req_to_token.dtype == torch.int32 else fb.req_to_token.to(torch.int32)
            rows, loc = fb.dec_req_pool_indices.contiguous(), loc.contiguous()
            swa = fb.swa
            if swa is not None and quant is None:  # local layers: the hybrid pool's local slots
                lrt = swa.req_to_token if swa.req_to_token.dtype == torch.int32 else swa.req_to_token.to(torch.int32)
                lloc, lrows = swa.out_cache_loc.contiguous(), swa.dec_rows.contiguous()
            else:
                lrt, lloc, lrows = rt, loc, rows
            x = x.float().contiguous()
        Hq, Hkv, D, eps, sm = self.dims
        lora = getattr(fb, "lora", None)
        ab, lrows_, spans = ([], _NO_ROWS, []) if lora is None else lora.fused_args(LINEAR_KEYS, x.shape[0])
        return load(self.portable).decode_family_forward(
            x, self.norms, self.norm_mask, self.qk_norms, self.qk_kind, self.lin, self.bits,
            self.final_norm, cos, sin, lcos, lsin, self.local, self.window, float(getattr(a, "attn_softcap", 0.0)),
            float(getattr(a, "residual_scale", 1.0)), self.act, list(k_buffers), list(v_buffers), loc, rt, rows,
            lloc, lrt, lrows, fb.dec_seq_lens.contiguous(), Hq, Hkv, D, eps, sm, self.q8, self.tiled,
            self.num_threads(), self.attn_split_min, ab, lrows_, spans, self.lora_split_min, self.amx_min(), self.packed,
            0 if kvq_args[0] else self.cascade_min(), *kvq_args)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """:meth:`FusedDecode.head`, then the logits divisor and the final soft-capping."""
        a = self.model.arch
        logits = super().head(h)
        div, cap = float(getattr(a, "logits_divisor", 1.0)), float(getattr(a, "final_softcap", 0.0))
        if div != 1.0:
            logits = logits / div
        if cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits


def prepare(model, portable: bool = False) -> Optional[FusedDecode]:
    """The fused decode of ``model`` (:func:`.decode_fused.prepare`): a :class:`FamilyFusedDecode`
    for a family model whose options fit (:func:`supported`), the Llama layer's
    :class:`~.decode_fused.FusedDecode` otherwise; None where neither applies (the per-op path)."""
    if decode_fused.is_family(model):
        return decode_fused.prepare(model, portable, family=FamilyFusedDecode) if supported(model) else None
    return decode_fused.prepare(model, portable)
