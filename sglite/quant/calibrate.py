"""Layer-by-layer calibration of an HF transformers Llama-family model: the driver behind
``sglite quantize`` for every scheme (RTN, GPTQ, AWQ, SmoothQuant W8A8).

Sequential, as GPTQ's reference implementation: the calibration tokens go through the embedding
once; then for each decoder layer in turn the layer runs on the current hidden states while hooks
collect what the scheme needs from the inputs of its linears (GPTQ: Hessians; AWQ: input rows;
SmoothQuant: per-channel absolute maxima), the layer's weights are quantized (and, for AWQ /
SmoothQuant, rescaled with the inverse scales folded into the preceding RMSNorm or ``up_proj``),
the module's weights are replaced by their dequantized values, and the layer runs again to produce
the next layer's inputs -- so each layer is calibrated on the outputs of the already-quantized
layers before it. Cost: about two forward passes of the model over the calibration tokens, plus
the per-layer algorithm.

Calibration tokens: the LAST ``n_samples * seq_len`` tokens of a text the caller passes in
(:func:`calibration_ids`); ``sglite quantize`` (:mod:`sglite.quantize`) defaults to CPython's
``pydoc_data`` topics text (:func:`sglite.eval.perplexity.topics_text`), so they are disjoint from
the first tokens that ``sglite eval perplexity`` evaluates on (as long as the two together fit in
the text, ~100k tokens).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from .awq import search_scales
from .fp8 import expand_block_scales, gptq_fp8, rtn_fp8
from .gptq import HessianAccumulator, gptq_quantize
from .hf_formats import GroupQuant
from .rtn import rtn

log = logging.getLogger("sglite.quant")

METHODS = ("rtn", "gptq", "awq", "smoothquant")
# linear groups of one decoder layer: (group name, linears reading the same input)
GROUPS = (("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
          ("o", ("self_attn.o_proj",)),
          ("gate_up", ("mlp.gate_proj", "mlp.up_proj")),
          ("down", ("mlp.down_proj",)))


def calibration_ids(tokenizer, n_samples: int, seq_len: int, text: str) -> torch.Tensor:
    """int64 [n_samples, seq_len] token ids: the last ``n_samples * seq_len`` tokens of ``text``
    (``tokenizer.encode(text, add_special_tokens=False)``, the first token dropped: it may be cut).

    Raises:
        ValueError: the text has fewer tokens than needed."""
    need = n_samples * seq_len
    ids = tokenizer.encode(text[-12 * need:], add_special_tokens=False)[1:]  # first token may be cut
    if len(ids) < need:
        raise ValueError(f"calibration text: {len(ids)} tokens, need n_samples * seq_len = {need}")
    return torch.tensor(ids[-need:], dtype=torch.int64).view(n_samples, seq_len)


@dataclass
class QuantOptions:
    """What ``sglite quantize`` asked for.

    Attributes:
        method: rtn | gptq | awq | smoothquant.  bits: 4 or 8 (smoothquant: 8).
        group_size: channels per group (-1 = per output channel over all of K).
        sym: symmetric grid (default asymmetric for every method: the same grid for all).
        desc_act: GPTQ act-order.  damp_percent: GPTQ dampening.
        awq_grid: AWQ alpha grid size.  awq_tokens: calibration rows kept for AWQ's search.
        smooth_alpha: SmoothQuant migration strength.
        weight_format: ``int`` (the integer grids above) or ``fp8`` (E4M3, :mod:`.fp8`; methods
            rtn | gptq; ``bits`` and ``group_size`` unused).
        weight_block_size: fp8 only: ``(bn, bk)`` tile scales instead of per-channel ones.
    """

    method: str = "gptq"
    bits: int = 4
    group_size: int = 64
    sym: bool = False
    desc_act: bool = False
    damp_percent: float = 0.01
    awq_grid: int = 20
    awq_tokens: int = 512
    smooth_alpha: float = 0.5
    weight_format: str = "int"
    weight_block_size: Optional[tuple[int, int]] = None

    @property
    def format(self) -> str:
        """Checkpoint format written: ``fp8`` for the fp8 weight format, ``awq`` for AWQ,
        ``w8a8_int8`` for SmoothQuant, else ``gptq``."""
        if self.weight_format == "fp8":
            return "fp8"
        return {"awq": "awq", "smoothquant": "w8a8_int8"}.get(self.method, "gptq")

    @property
    def min_zero(self) -> int:
        """Smallest zero point: 1 for GPTQ's v1 storage (zeros minus one must not wrap), else 0."""
        return 1 if self.format == "gptq" else 0


@dataclass
class _Stats:
    hessian: Optional[HessianAccumulator] = None
    rows: list = field(default_factory=list)
    n_rows: int = 0
    absmax: Optional[torch.Tensor] = None


class _Stop(Exception):
    pass


def _layer_inputs(model, ids: torch.Tensor, batch: int) -> tuple[list[torch.Tensor], dict]:
    """Hidden states entering layer 0 per batch chunk, and the keyword arguments the model passes
    its decoder layers (position embeddings, mask) -- the same for every chunk of equal shape."""
    layer0 = model.model.layers[0]
    got: dict = {}

    def pre(_mod, args, kwargs):
        got["h"] = args[0] if args else kwargs["hidden_states"]
        got["kw"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    handle = layer0.register_forward_pre_hook(pre, with_kwargs=True)
    hs = []
    try:
        for chunk in ids.split(batch):
            try:
                model(chunk, use_cache=False)
            except _Stop:
                pass
            hs.append(got["h"].detach())
    finally:
        handle.remove()
    return hs, got["kw"]


def _run_layer(layer, hs: list[torch.Tensor], kw: dict) -> list[torch.Tensor]:
    out = []
    for h in hs:
        kw_h = dict(kw)
        if h.shape[0] != hs[0].shape[0]:  # a shorter last chunk: position embeddings are batch-broadcast
            kw_h["position_embeddings"] = tuple(t[:1].expand(h.shape[0], *t.shape[1:])
                                                for t in kw["position_embeddings"])
        o = layer(h, **kw_h)
        out.append((o[0] if isinstance(o, tuple) else o).detach())
    return out


def _get(layer, name):
    m = layer
    for p in name.split("."):
        m = getattr(m, p)
    return m


@torch.no_grad()
def quantize_model(model, ids: torch.Tensor, opts: QuantOptions, batch: int = 8) -> dict:
    """Quantize ``model`` (HF ``*ForCausalLM``, float32) in place, layer by layer (module docstring).

    Returns:
        ``{linear prefix ("model.layers.3.mlp.up_proj"): GroupQuant}`` for rtn / gptq / awq, or
        ``{prefix: (int8 weight [N, K], float32 scale [N])}`` for smoothquant, ``{prefix: (float8_e4m3fn
        weight [N, K], float32 scale [N] or tile scales)}`` for the fp8 format. The module weights
        hold the dequantized values; AWQ / SmoothQuant also rescaled the RMSNorm weights and
        ``up_proj`` rows (write the model's other tensors as they are now).
    Raises:
        ValueError: an unknown method, or a group size that does not divide a layer's K.
    """
    if opts.method not in METHODS:
        raise ValueError(f"method: must be one of {METHODS}, got {opts.method!r}")
    cfg = model.config
    same_heads = cfg.num_attention_heads == getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    data_free = opts.method == "rtn"  # RTN looks at the weights only: no forward passes
    hs, kw = ([], {}) if data_free else _layer_inputs(model, ids, batch)
    out: dict = {}
    for li, layer in enumerate(model.model.layers):
        t0 = time.perf_counter()
        stats = {g: _Stats() for g, _ in GROUPS}
        handles = []
        for g, names in GROUPS:
            def hook(_m, args, st=stats[g]):
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                if opts.method == "gptq":
                    if st.hessian is None:
                        st.hessian = HessianAccumulator(x.shape[1])
                    st.hessian.add(x)
                elif opts.method == "awq" and st.n_rows < opts.awq_tokens:
                    st.rows.append(x[:opts.awq_tokens - st.n_rows].clone())
                    st.n_rows += st.rows[-1].shape[0]
                elif opts.method == "smoothquant":
                    m = x.abs().amax(0)
                    st.absmax = m if st.absmax is None else torch.maximum(st.absmax, m)
            handles.append(_get(layer, names[0]).register_forward_pre_hook(hook))
        if not data_free:
            _run_layer(layer, hs, kw)
        for h in handles:
            h.remove()
        prefix = f"model.layers.{li}."
        if opts.method == "awq":
            _apply_awq(layer, stats, opts, same_heads)
        elif opts.method == "smoothquant":
            _apply_smoothing(layer, stats, opts.smooth_alpha)
        for g, names in GROUPS:
            for name in names:
                mod = _get(layer, name)
                w = mod.weight.float()
                if opts.format == "fp8":
                    blk = opts.weight_block_size
                    w8, s = (gptq_fp8(w, stats[g].hessian.hessian(), opts.desc_act, opts.damp_percent, block=blk)
                             if opts.method == "gptq" else rtn_fp8(w, blk))
                    out[prefix + name] = (w8, s)
                    full = s[:, None] if blk is None else expand_block_scales(s, tuple(w.shape), blk)
                    mod.weight.copy_((w8.float() * full).to(mod.weight.dtype))
                    continue
                if opts.method == "gptq":
                    q = gptq_quantize(w, stats[g].hessian.hessian(), opts.bits, opts.group_size, opts.sym,
                                      opts.desc_act, opts.damp_percent, min_zero=opts.min_zero)
                elif opts.method == "smoothquant":
                    wq, s = int8_per_channel(w)
                    out[prefix + name] = (wq, s)
                    mod.weight.copy_((wq.float() * s[:, None]).to(mod.weight.dtype))
                    continue
                else:
                    q = rtn(w, opts.bits, opts.group_size, opts.sym, min_zero=opts.min_zero)
                out[prefix + name] = q
                mod.weight.copy_(q.dequantize().to(mod.weight.dtype))
        if not data_free:
            hs = _run_layer(layer, hs, kw)
        log.info("layer %d/%d quantized (%s) in %.1f s", li + 1, len(model.model.layers), opts.method,
                 time.perf_counter() - t0)
    return out


def _scale_in(mods, s):
    for m in mods:
        m.weight.mul_(s[None, :].to(m.weight.dtype))


def _apply_awq(layer, stats: dict, opts: QuantOptions, same_heads: bool) -> None:
    """AWQ scales searched on the float weights of every group, then folded: the weights' input
    channels times s, the producer of their input divided by s. ``o_proj`` is scaled only when
    query and KV heads are as many (its scale folds into ``v_proj`` rows; with grouped-query
    attention one V row feeds several o_proj columns, so no per-column scale can be folded)."""
    plans = []
    for g, names in GROUPS:
        if g == "o" and not same_heads:
            continue
        mods = [_get(layer, n) for n in names]
        x = torch.cat(stats[g].rows)
        s, alpha, info = search_scales([m.weight for m in mods], x, opts.bits, opts.group_size,
                                       opts.awq_grid, opts.sym)
        log.debug("awq %s: alpha %.2f loss %.3g (rtn %.3g)", g, alpha, info["loss"], info["loss_rtn"])
        plans.append((g, mods, s))
    for g, mods, s in plans:
        _scale_in(mods, s)
        _fold(layer, g, s)


def _fold(layer, group: str, s: torch.Tensor) -> None:
    """Divide what produces ``group``'s input by ``s`` (RMSNorm weight, or output rows)."""
    if group == "qkv":
        layer.input_layernorm.weight.div_(s.to(layer.input_layernorm.weight.dtype))
    elif group == "gate_up":
        layer.post_attention_layernorm.weight.div_(s.to(layer.post_attention_layernorm.weight.dtype))
    elif group == "down":
        layer.mlp.up_proj.weight.div_(s[:, None].to(layer.mlp.up_proj.weight.dtype))
    elif group == "o":
        layer.self_attn.v_proj.weight.div_(s[:, None].to(layer.self_attn.v_proj.weight.dtype))
        if getattr(layer.self_attn.v_proj, "bias", None) is not None:
            layer.self_attn.v_proj.bias.div_(s.to(layer.self_attn.v_proj.bias.dtype))


def _apply_smoothing(layer, stats: dict, alpha: float) -> None:
    """SmoothQuant (Xiao et al. 2023, §4): per input channel ``s_j = max|X_j|^alpha /
    max|W_j|^(1 - alpha)`` for the qkv, gate_up and down groups; weights times s, the input's
    producer divided by s (see :func:`_fold`)."""
    for g, names in GROUPS:
        if g == "o":
            continue
        mods = [_get(layer, n) for n in names]
        s = smooth_scales(stats[g].absmax, torch.cat([m.weight.float() for m in mods]), alpha)
        _scale_in(mods, s)
        _fold(layer, g, s)


def smooth_scales(act_absmax: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's migration scales ``s_j = max|X_j|^alpha / max_i |W_ij|^(1-alpha)`` [K]
    (clamped to [1e-5, 1e5]); ``w`` [N, K] the weights reading X."""
    wmax = w.abs().amax(0).clamp(min=1e-5)
    return (act_absmax.clamp(min=1e-5).pow(alpha) / wmax.pow(1 - alpha)).clamp(1e-5, 1e5)


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(q int8 [N, K], scale float32 [N])``,
    ``w ~= q * scale``, ``scale = max|w_n| / 127``."""
    s = (w.float().abs().amax(1) / 127.0).clamp(min=1e-10)
    q = torch.clamp(torch.round(w.float() / s[:, None]), -127, 127).to(torch.int8)
    return q, s
