"""Draft heads on the target's own features: Medusa heads and the EAGLE draft layer.

Both read the target's *final-normed* last hidden states (``ModelRunner.keep_hidden``; HF's
``last_hidden_state``) and reuse the target's LM head (Medusa heads may bring their own).

* :class:`MedusaHeads` (Cai et al. 2024, "Medusa", §2.1.1): head ``k`` (1-based) maps the feature
  ``h_t`` of position ``t`` to ``h_t + SiLU(W_k h_t + b_k)`` and then the LM head: logits of the
  token at ``t + 1 + k`` (the target's own head gives ``t + 1``).
* :class:`EagleHead` (Li et al. 2024, "EAGLE", §3; the draft network EAGLE-2 reuses): ``fc`` maps
  ``concat(embed(x_{t+1}), f_t)`` ([2H] -> [H]) and one Llama decoder layer (no input norm, as
  the published layer 0) predicts ``f_{t+1}``, whose LM-head logits give ``x_{t+2}``.

Files (:func:`load_heads` / :func:`save_heads`): a folder with ``config.json`` and
``model.safetensors`` (or ``pytorch_model.bin``) in the published layouts: EAGLE ``fc.weight``
[H, 2H] (``fc.bias``), ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``
(``layers.0.input_layernorm.weight`` when present); Medusa ``medusa_head.{k}.0.linear.weight`` /
``.bias`` (its own LM head ``medusa_head.{k}.1.weight`` when present). Optional
``draft_vocab`` [Vd] int64: the token ids the heads may propose (their LM head is cut to these
rows: a cheaper draft; other tokens are never drafted, which changes speed, not output).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from ...errors import InvalidRequestError

FIELD = "speculative_draft_model_path"


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x [..., T, Hh, D] at positions pos [..., T] (int64)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))  # [D/2]
    ang = pos.to(torch.float32)[..., None] * inv  # [..., T, D/2]
    c, s = ang.cos()[..., None, :], ang.sin()[..., None, :]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class EagleHead(nn.Module):
    """The EAGLE draft network (module docstring). ``cfg``: ``hidden_size``, ``intermediate_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``rms_norm_eps``, ``rope_theta``,
    ``vocab_size`` (the target's), optional ``head_dim``, ``input_norm``, ``fc_bias``."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = dict(cfg)
        H, I = cfg["hidden_size"], cfg["intermediate_size"]
        self.nh, self.nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        self.hd = cfg.get("head_dim") or H // self.nh
        self.eps, self.theta = float(cfg.get("rms_norm_eps", 1e-6)), float(cfg.get("rope_theta", 10000.0))
        self.fc = nn.Linear(2 * H, H, bias=bool(cfg.get("fc_bias", True)))
        self.q = nn.Linear(H, self.nh * self.hd, bias=False)
        self.k = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.v = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.o = nn.Linear(self.nh * self.hd, H, bias=False)
        self.gate, self.up, self.down = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False), nn.Linear(I, H, bias=False)
        self.post_norm = nn.Parameter(torch.ones(H))
        self.in_norm = nn.Parameter(torch.ones(H)) if cfg.get("input_norm") else None

    NAMES = {"fc.weight": "fc.weight", "fc.bias": "fc.bias",
             **{f"layers.0.self_attn.{n}_proj.weight": f"{n}.weight" for n in "qkvo"},
             **{f"layers.0.mlp.{n}_proj.weight": f"{n}.weight" for n in ("gate", "up", "down")},
             "layers.0.post_attention_layernorm.weight": "post_norm",
             "layers.0.input_layernorm.weight": "in_norm"}

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor,
                past: Optional[tuple] = None, mask: Optional[torch.Tensor] = None) -> tuple:
        """One pass of the draft layer.

        Args:
            emb, feat: [B, T, H] token embeddings of ``x_{t+1}`` and target features ``f_t``.
            pos: [B, T] int64 positions ``t``.
            past: (K, V) [B, P, Hkv, D] of earlier positions, or None.
            mask: [T, P + T] bool (True: may attend), or None for causal over ``past`` + these.
        Returns:
            (out [B, T, H] predicted features ``f_{t+1}``, (k, v) [B, T, Hkv, D] of these rows).
        """
        B, T, _ = emb.shape
        x = self.fc(torch.cat((emb, feat), dim=-1))
        h = _rms(x, self.in_norm, self.eps) if self.in_norm is not None else x
        q = _rope(self.q(h).view(B, T, self.nh, self.hd), pos, self.theta)
        k = _rope(self.k(h).view(B, T, self.nkv, self.hd), pos, self.theta)
        v = self.v(h).view(B, T, self.nkv, self.hd)
        kk, vv = (k, v) if past is None else (torch.cat((past[0], k), 1), torch.cat((past[1], v), 1))
        P = kk.shape[1] - T
        if mask is None:
            mask = torch.ones(T, P + T, dtype=torch.bool, device=x.device).tril(P)
        rep = self.nh // self.nkv
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), kk.repeat_interleave(rep, 2).transpose(1, 2), vv.repeat_interleave(rep, 2).transpose(1, 2),
            attn_mask=mask, scale=1.0 / math.sqrt(self.hd))  # [B, nh, T, D]
        x = x + self.o(att.transpose(1, 2).reshape(B, T, self.nh * self.hd))
        h = _rms(x, self.post_norm, self.eps)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x, (k, v)


class MedusaHeads(nn.Module):
    """``num_heads`` residual blocks (module docstring); ``own_head``: each with its own LM head
    [V, H] (the published Medusa-1 layout), else the target's."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = dict(cfg)
        H, n = cfg["hidden_size"], cfg["medusa_num_heads"]
        self.blocks = nn.ModuleList(nn.Linear(H, H) for _ in range(n))
        self.heads = nn.ModuleList(nn.Linear(H, cfg["vocab_size"], bias=False) for _ in range(n)) if cfg.get("own_head") else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> [..., K, H]: every head's feature (before the LM head)."""
        return torch.stack([h + F.silu(b(h)) for b in self.blocks], dim=-2)

    def names(self) -> dict:
        out = {}
        for i in range(len(self.blocks)):
            out[f"medusa_head.{i}.0.linear.weight"] = f"blocks.{i}.weight"
            out[f"medusa_head.{i}.0.linear.bias"] = f"blocks.{i}.bias"
            if self.heads is not None:
                out[f"medusa_head.{i}.1.weight"] = f"heads.{i}.weight"
        return out


def head_names(module: nn.Module) -> dict:
    """``{file name: parameter name}`` of a head module (the published layouts)."""
    if isinstance(module, MedusaHeads):
        return module.names()
    return {f: p for f, p in EagleHead.NAMES.items() if p != "in_norm" or module.in_norm is not None
            if p != "fc.bias" or module.fc.bias is not None}


def method_of(cfg: dict) -> str:
    """``"medusa"`` when the config names Medusa heads, else ``"eagle"``."""
    return "medusa" if "medusa_num_heads" in cfg else "eagle"


def save_heads(module: nn.Module, folder, draft_vocab: Optional[torch.Tensor] = None,
               dtype: torch.dtype = torch.float32, extra: Optional[dict] = None) -> None:
    """Write ``module`` to ``folder`` (``config.json`` + ``model.safetensors``, ``dtype`` weights)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    params = dict(module.named_parameters())
    sd = {f: params[p].detach().to(dtype).contiguous() for f, p in head_names(module).items()}
    if draft_vocab is not None:
        sd["draft_vocab"] = draft_vocab.to(torch.int64).contiguous()
    cfg = dict(module.cfg, architectures=["MedusaModel" if isinstance(module, MedusaHeads) else "EagleModel"],
               **(extra or {}))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(sd, str(folder / "model.safetensors"))


def _read_state(folder: Path) -> dict:
    st = folder / "model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    pt = folder / "pytorch_model.bin"
    if pt.is_file():
        return torch.load(str(pt), map_location="cpu", weights_only=True)
    raise InvalidRequestError(f"{folder}: no model.safetensors or pytorch_model.bin", field=FIELD)


def load_heads(folder, hidden_size: int, vocab_size: int, method: Optional[str] = None):
    """Load draft heads from ``folder`` and check them against the target.

    Args:
        folder: a head folder (module docstring).
        hidden_size, vocab_size: the target's.
        method: ``"eagle"`` / ``"medusa"`` expected, or None (from the config).
    Returns:
        (module in float32, eval mode; draft_vocab [Vd] int64 or None).
    Raises:
        InvalidRequestError (field ``speculative_draft_model_path``): no config, a method other
        than asked, or a hidden size / vocabulary that differs from the target's (both named).
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise InvalidRequestError(f"{folder}: no config.json (a draft-head folder)", field=FIELD)
    cfg = json.loads((folder / "config.json").read_text())
    got = method_of(cfg)
    if method is not None and got != method:
        raise InvalidRequestError(f"{folder} holds {got} heads, not {method}", field=FIELD)
    for name, want in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if cfg.get(name) != want:
            raise InvalidRequestError(
                f"draft heads' {name} ({cfg.get(name)}) differs from the target model's ({want})", field=FIELD)
    sd = _read_state(folder)
    if got == "medusa":
        cfg.setdefault("medusa_num_heads", sum(1 for k in sd if k.endswith(".0.linear.weight")))
        cfg["own_head"] = any(k.endswith(".1.weight") for k in sd)
        module = MedusaHeads(cfg)
    else:
        cfg["input_norm"] = "layers.0.input_layernorm.weight" in sd
        cfg["fc_bias"] = "fc.bias" in sd
        module = EagleHead(cfg)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for f, p in head_names(module).items():
            if f not in sd:
                raise InvalidRequestError(f"{folder}: weight {f!r} missing", field=FIELD)
            if tuple(sd[f].shape) != tuple(params[p].shape):
                raise InvalidRequestError(f"{folder}: weight {f!r} has shape {tuple(sd[f].shape)}, "
                                          f"expected {tuple(params[p].shape)}", field=FIELD)
            params[p].copy_(sd[f].float())
    vocab = sd.get("draft_vocab")
    return module.eval(), (vocab.to(torch.int64) if vocab is not None else None)


def default_heads_dir(method: str) -> Path:
    """The heads shipped for the default model: ``sglite/runtime/speculative/trained/<method>``."""
    return Path(__file__).resolve().parent / "trained" / method
