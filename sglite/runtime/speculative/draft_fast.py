"""The EAGLE draft layer and the draft LM head as a few small bf16 GEMVs through ``sglite.kernels``.

:class:`FastEagle` computes what :class:`.heads.EagleHead` computes (same inputs, same outputs:
``(out [B, T, H] float32, (k, v) [B, T, Hkv, D] float32)``) with the weights prepared once:

* bf16 copies of every matrix, with the q/k/v projections fused into one [(Hq+2Hkv)*D, H] matrix and
  gate/up into one [2I, H] matrix (:func:`sglite.kernels.make_linear`), each run by
  :func:`sglite.kernels.linear` on the C++ few-row GEMV (``cpp``: :mod:`sglite.kernels.cpu_gemv`,
  1 to 8 rows, AVX-512-BF16) where the CPU has it, else oneDNN / ``F.linear`` in bf16;
* RMSNorm and the SwiGLU activation through the kernel dispatcher (:func:`sglite.kernels.rms_norm`,
  :func:`sglite.kernels.silu_mul`); RoPE from a cos/sin table (q and k heads rotated in one
  op) and the few-row attention in float32 torch ops, reading the cached K / V chunks in place
  (scores per chunk, one softmax) instead of concatenating them every pass.

:class:`FastLMHead` is the draft vocabulary's rows of the target's LM head ([Vd, H], bf16, the
same GEMV), log-softmax in float32.

Why: a draft is 4 passes of one layer over 1 to 4 rows plus the draft LM head; in float32 every
pass streams ~11.6 MB of weights (SmolLM2-135M heads with a 768-wide MLP) and runs ~15 separate
torch ops. Halving the bytes and fusing the projections is what cuts a draft's milliseconds
(measured: docs/speculative.md). Drafts are point masses that the target verifies, so a draft
computed in bf16 changes which tokens are proposed (rarely), never the output.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.nn import functional as F

from ... import kernels
from ...kernels import cpu_gemv
from .heads import EagleHead


def _impl() -> str:
    """The few-row matmul path: the C++ bf16 GEMV where available, else torch's bf16 ``F.linear``."""
    return "cpp" if cpu_gemv.available() else "torch"


def _weight(parts: list, bias: Optional[torch.Tensor] = None):
    w = kernels.make_linear([p.detach() for p in parts], None if bias is None else bias.detach(),
                            torch.bfloat16, "cpu")
    return w.use(_impl())


class FastLMHead:
    """``feat [..., H] -> [..., Vd]`` float32 log-probabilities over the draft vocabulary's rows
    ``w`` ([Vd, H], any float dtype; kept as a bf16 :class:`sglite.kernels.LinearWeight`)."""

    def __init__(self, w: torch.Tensor):
        self.w = _weight([w])

    def __call__(self, feat: torch.Tensor) -> torch.Tensor:
        x = feat.reshape(-1, feat.shape[-1]).to(torch.bfloat16)
        y = kernels.linear(x, self.w).float()
        return torch.log_softmax(y, dim=-1).view(*feat.shape[:-1], -1)


class FastEagle:
    """:class:`.heads.EagleHead`'s forward (module docstring) from bf16 fused weights."""

    def __init__(self, head: EagleHead):
        self.nh, self.nkv, self.hd = head.nh, head.nkv, head.hd
        self.eps, self.theta = head.eps, head.theta
        self.fc = _weight([head.fc.weight], head.fc.bias)
        self.qkv = _weight([head.q.weight, head.k.weight, head.v.weight])
        self.o = _weight([head.o.weight])
        self.gate_up = _weight([head.gate.weight, head.up.weight])
        self.down = _weight([head.down.weight])
        self.inter = head.gate.weight.shape[0]
        self.post_norm = head.post_norm.detach().to(torch.bfloat16)
        self.in_norm = None if head.in_norm is None else head.in_norm.detach().to(torch.bfloat16)
        self._table = (torch.empty(0, self.hd // 2), torch.empty(0, self.hd // 2))  # RoPE cos / sin by position

    def _cos_sin(self, pos: torch.Tensor) -> tuple:
        """cos, sin [T, 1, D/2] float32 of positions ``pos`` [T] (a table grown on demand)."""
        need = int(pos.max()) + 1
        if need > self._table[0].shape[0]:
            n = max(need, 2 * self._table[0].shape[0])
            d = self.hd
            inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            ang = torch.arange(n, dtype=torch.float32)[:, None] * inv
            self._table = (ang.cos(), ang.sin())
        return self._table[0][pos][:, None], self._table[1][pos][:, None]

    def __call__(self, emb: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor,
                 past: Optional[tuple] = None, mask: Optional[torch.Tensor] = None) -> tuple:
        """As :meth:`.heads.EagleHead.forward` for B = 1 (shapes there; any float input dtype);
        ``past`` may also hold lists of K / V chunks ([1, P_i, Hkv, D] each, in position order),
        which are read in place (no concatenation)."""
        B, T, H = emb.shape
        if B != 1:
            raise ValueError(f"FastEagle: batch of 1 request only, got {B}")
        rows = torch.cat((emb.reshape(T, H), feat.reshape(T, H)), dim=-1).to(torch.bfloat16)
        x = kernels.linear(rows, self.fc)  # [T, H] bf16
        h = kernels.rms_norm(x, self.in_norm, self.eps) if self.in_norm is not None else x
        nq, nk, d = self.nh * self.hd, self.nkv * self.hd, self.hd
        qkv = kernels.linear(h, self.qkv).float()
        qk = qkv[:, :nq + nk].view(T, self.nh + self.nkv, d)  # q and k heads rotated together
        cos, sin = self._cos_sin(pos.reshape(T))
        x1, x2 = qk[..., :d // 2], qk[..., d // 2:]
        qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        q, k = qk[:, :self.nh], qk[:, self.nh:]  # [T, nh, D], [T, nkv, D]
        v = qkv[:, nq + nk:].view(T, self.nkv, d)
        ks = [] if past is None else (list(past[0]) if isinstance(past[0], (list, tuple)) else [past[0]])
        vs = [] if past is None else (list(past[1]) if isinstance(past[1], (list, tuple)) else [past[1]])
        ks, vs = [c[0] for c in ks] + [k], [c[0] for c in vs] + [v]  # [P_i, nkv, D] each
        att = self._attend(q, ks, vs, mask)  # [T, nh * D]
        x = x + kernels.linear(att.to(torch.bfloat16), self.o)
        h = kernels.rms_norm(x, self.post_norm, self.eps)
        gu = kernels.linear(h, self.gate_up)
        x = x + kernels.linear(kernels.silu_mul(gu[:, :self.inter], gu[:, self.inter:]), self.down)
        return x.float().view(1, T, H), (k[None], v[None])

    def _attend(self, q: torch.Tensor, ks: list, vs: list, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Softmax attention of ``q`` [T, nh, D] over K / V chunks [P_i, nkv, D] (grouped heads:
        query head ``h`` reads K/V head ``h // (nh / nkv)``); ``mask`` [T, sum P_i] (True: may
        attend) or None (causal: the last T keys are the queries' own). Returns [T, nh * D]."""
        T, rep, d = q.shape[0], self.nh // self.nkv, self.hd
        qg = q.view(T, self.nkv, rep, d).permute(1, 2, 0, 3).reshape(self.nkv, rep * T, d) * (1.0 / math.sqrt(d))
        s = torch.cat([qg @ c.permute(1, 2, 0) for c in ks], dim=-1)  # [nkv, rep*T, P]
        P = s.shape[-1]
        if mask is None:
            mask = torch.ones(T, P, dtype=torch.bool).tril(P - T)
        s = s.view(self.nkv, rep, T, P).masked_fill(~mask, float("-inf")).view(self.nkv, rep * T, P)
        p = torch.softmax(s, dim=-1)
        out, a = None, 0
        for c in vs:
            part = p[..., a:a + c.shape[0]] @ c.transpose(0, 1)  # [nkv, rep*T, D]
            out, a = part if out is None else out + part, a + c.shape[0]
        return out.view(self.nkv, rep, T, d).permute(2, 0, 1, 3).reshape(T, self.nh * d)


class FastMedusa:
    """:class:`.heads.MedusaHeads`' forward (``h [..., H] -> [..., K, H]``) with the K residual
    blocks fused into one bf16 [K*H, H] matrix (one GEMV); float32 out."""

    def __init__(self, heads):
        self.k = len(heads.blocks)
        self.w = _weight([b.weight for b in heads.blocks], torch.cat([b.bias.detach() for b in heads.blocks]))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])
        y = kernels.linear(x.to(torch.bfloat16), self.w).float().view(x.shape[0], self.k, -1)
        return (x[:, None] + F.silu(y)).view(*h.shape[:-1], self.k, h.shape[-1])
