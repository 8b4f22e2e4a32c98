"""Loading one PEFT LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models") for a base model of sglite's Llama-like families.

Format: a folder with ``adapter_config.json`` (PEFT's ``LoraConfig``: ``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``) and ``adapter_model.safetensors`` holding
``…layers.<i>.<self_attn|mlp>.<module>.lora_A.weight`` [r, in] and ``….lora_B.weight`` [out, r].
A projection's output becomes ``W x + scaling · B (A x)`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA, Kalajievo 2023).

The model fuses q/k/v and gate/up into one matmul each (``LINEAR_KEYS`` of
:mod:`sglite.runtime.models.llama`), so each projection becomes a *part* of its fused matmul: rank
block ``block`` (q, k, v -> 0, 1, 2; gate, up -> 0, 1) and output rows from ``row``. Phi-3's fused
``qkv_proj`` / ``gate_up_proj`` adapters are one part over all the fused rows.

Errors (:class:`~sglite.errors.InvalidRequestError`, the message naming the adapter): a missing
file (``lora_paths``), a rank over the limit (``max_lora_rank``), an unknown or unsupported target
module (``target_modules``, also embedding / LM-head adapters), PEFT options sglite does not apply
(``use_dora``, ``bias``, ``modules_to_save``, ``fan_in_fan_out``, ``rank_pattern``,
``alpha_pattern``), widths that differ from the base model's (``hidden_size``,
``intermediate_size``, ``vocab_size``) and layers past the model's (``num_hidden_layers``).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..errors import InvalidRequestError

#: fused matmul of each projection name, its rank block, and whether it covers all the fused rows
MODULES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "qkv_proj": ("qkv", 0),
           "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
           "gate_up_proj": ("gate_up", 0), "down_proj": ("down", 0)}
#: rank blocks of each fused matmul (its parts)
KEY_BLOCKS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
_WEIGHT = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")
_REFUSED_OPTIONS = (("use_dora", "DoRA adapters"), ("fan_in_fan_out", "fan_in_fan_out weights"))


class ModelShape(Protocol):
    """What an adapter is checked against (a :class:`~sglite.runtime.models.llama.LlamaArch`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class Part:
    """One projection's LoRA inside its fused matmul: ``a`` [r, in], ``b`` [rows, r] (scaling
    folded in), in rank block ``block``, written to output rows ``row:row+rows``."""

    block: int
    row: int
    a: torch.Tensor
    b: torch.Tensor


@dataclass(eq=False)
class LoraAdapter:
    """A loaded adapter. ``parts[(layer, key)]``: its :class:`Part` list of fused matmul ``key``
    (``qkv``, ``o``, ``gate_up``, ``down``) of layer ``layer``. ``uid`` is unique per load (the
    radix cache's namespace of this adapter)."""

    name: str
    path: str
    uid: int
    rank: int
    scaling: float
    parts: dict = field(default_factory=dict)

    @property
    def keys(self) -> set:
        """The fused matmuls this adapter changes."""
        return {k for _, k in self.parts}

    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for ps in self.parts.values() for p in ps)


def read_config(name: str, path: str) -> dict:
    """``adapter_config.json`` of adapter ``name`` at ``path`` (InvalidRequestError naming
    ``lora_paths`` when absent or not JSON)."""
    cfg_path = os.path.join(str(path), "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise InvalidRequestError(f"lora_paths: adapter {name!r}: no adapter_config.json in {path!r}", field="lora_paths")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"lora_paths: adapter {name!r}: unreadable adapter_config.json ({e})",
                                  field="lora_paths") from None


def fused_layout(shape: ModelShape) -> dict:
    """``{key: (in width, out width)}`` of the fused matmuls, and of each projection
    ``{module: (in width, first row, rows)}`` under key ``"modules"``."""
    H, I = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    mods = {"q_proj": (H, 0, q), "k_proj": (H, q, kv), "v_proj": (H, q + kv, kv), "qkv_proj": (H, 0, q + 2 * kv),
            "o_proj": (q, 0, H), "gate_proj": (H, 0, I), "up_proj": (H, I, I), "gate_up_proj": (H, 0, 2 * I),
            "down_proj": (I, 0, H)}
    return {"qkv": (H, q + 2 * kv), "o": (q, H), "gate_up": (H, 2 * I), "down": (I, H), "modules": mods}


def _check_config(name: str, cfg: dict, max_rank: int) -> tuple[int, float]:
    def bad(fld, msg):
        raise InvalidRequestError(f"{fld}: adapter {name!r}: {msg}", field=fld)

    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        bad("r", f"adapter_config.json r={r!r} must be a positive integer")
    if r > max_rank:
        bad("max_lora_rank", f"rank r={r} exceeds max_lora_rank={max_rank} (--max-lora-rank)")
    for opt, what in _REFUSED_OPTIONS:
        if cfg.get(opt):
            bad(opt, f"{what} are not supported ({opt}={cfg[opt]!r})")
    if cfg.get("bias", "none") != "none":
        bad("bias", f"bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        bad("modules_to_save", f"modules_to_save={cfg['modules_to_save']!r} is not supported")
    for opt in ("rank_pattern", "alpha_pattern"):
        if cfg.get(opt):
            bad(opt, f"per-module {opt} is not supported")
    targets = cfg.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    unknown = [t for t in names if t not in MODULES]
    if unknown:
        bad("target_modules", f"unknown target module(s) {unknown}; supported: {sorted(MODULES)}")
    alpha = cfg.get("lora_alpha", r)
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scaling)


def load_adapter(name: str, path: str, shape: ModelShape, max_rank: int, dtype: torch.dtype, uid: int) -> LoraAdapter:
    """Read and check adapter ``name`` from folder ``path`` for a model of ``shape``; weights in
    ``dtype`` on the CPU (the pool copies them to the model's device). Raises InvalidRequestError
    (module docstring)."""
    from safetensors.torch import load_file

    cfg = read_config(name, path)
    r, scaling = _check_config(name, cfg, max_rank)
    st = os.path.join(str(path), "adapter_model.safetensors")
    if not os.path.isfile(st):
        raise InvalidRequestError(f"lora_paths: adapter {name!r}: no adapter_model.safetensors in {path!r}",
                                  field="lora_paths")
    tensors = load_file(st)
    layout = fused_layout(shape)
    found: dict = {}
    for wname, t in tensors.items():
        m = _WEIGHT.search(wname)
        if m is None:
            _refuse_weight(name, wname, t, shape)
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES:
            raise InvalidRequestError(f"target_modules: adapter {name!r}: weight {wname!r} targets {module!r}; "
                                      f"supported: {sorted(MODULES)}", field="target_modules")
        if layer >= shape.num_layers:
            raise InvalidRequestError(f"num_hidden_layers: adapter {name!r}: weight {wname!r} is for layer {layer}, "
                                      f"the base model has {shape.num_layers} layers", field="num_hidden_layers")
        found[(layer, module, ab)] = t
    adapter = LoraAdapter(name, str(path), uid, r, scaling)
    for (layer, module, ab), t in sorted(found.items()):
        if ab == "B":
            continue
        b = found.get((layer, module, "B"))
        if b is None:
            raise InvalidRequestError(f"lora_paths: adapter {name!r}: layer {layer} {module} has lora_A but no lora_B",
                                      field="lora_paths")
        in_w, row, rows = layout["modules"][module]
        width = "intermediate_size" if module == "down_proj" else "hidden_size"
        if t.dim() != 2 or t.shape[1] != in_w or t.shape[0] != r:
            raise InvalidRequestError(f"{width}: adapter {name!r}: layer {layer} {module}.lora_A is {tuple(t.shape)}, "
                                      f"expected [r={r}, {in_w}] for the base model's {width}", field=width)
        if b.dim() != 2 or b.shape[0] != rows or b.shape[1] != r:
            out_w = "intermediate_size" if module in ("gate_proj", "up_proj", "gate_up_proj") else "hidden_size"
            raise InvalidRequestError(f"{out_w}: adapter {name!r}: layer {layer} {module}.lora_B is {tuple(b.shape)}, "
                                      f"expected [{rows}, r={r}] for the base model's {out_w}", field=out_w)
        rope = getattr(shape, "rope", None)  # partial rotary: the model's Q / K rows are reordered at load
        if module in ("q_proj", "k_proj", "qkv_proj") and getattr(rope, "head_dim", 0):
            raise InvalidRequestError(f"target_modules: adapter {name!r}: {module} LoRA on a partial-rotary model "
                                      "(partial_rotary_factor < 1) is not supported; supported there: v_proj, o_proj, "
                                      "and the MLP projections", field="target_modules")
        key, block = MODULES[module]
        parts = adapter.parts.setdefault((layer, key), [])
        if any(p.row < row + rows and row < p.row + p.b.shape[0] for p in parts):
            raise InvalidRequestError(f"target_modules: adapter {name!r}: layer {layer} has both a fused and a split "
                                      f"projection over {module}'s rows", field="target_modules")
        parts.append(Part(block, row, t.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous()))
    if not adapter.parts:
        raise InvalidRequestError(f"lora_paths: adapter {name!r}: adapter_model.safetensors holds no LoRA weights",
                                  field="lora_paths")
    return adapter


def _refuse_weight(name: str, wname: str, t: torch.Tensor, shape: ModelShape) -> None:
    """Raise for a weight that is not a projection's lora_A / lora_B (embedding and LM-head LoRA
    included: a vocabulary that differs from the base model's is named as such)."""
    if any(s in wname for s in ("embed_tokens", "lm_head", "lora_embedding")):
        if shape.vocab_size not in tuple(t.shape):
            raise InvalidRequestError(f"vocab_size: adapter {name!r}: weight {wname!r} {tuple(t.shape)} does not "
                                      f"match the base model's vocab_size={shape.vocab_size}", field="vocab_size")
        raise InvalidRequestError(f"target_modules: adapter {name!r}: weight {wname!r}: embedding / LM-head LoRA is "
                                  "not supported (the attention and MLP projections are)", field="target_modules")
    raise InvalidRequestError(f"target_modules: adapter {name!r}: unexpected weight {wname!r} (LoRA of the "
                              f"projections {sorted(MODULES)} is supported)", field="target_modules")
