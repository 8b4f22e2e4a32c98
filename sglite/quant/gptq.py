"""GPTQ: one linear layer quantized column by column with optimal-brain-surgeon updates (Frantar,
Ashkboos, Hoefler, Alistarh 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", Algorithm 1).

Minimizes ``||W X - Q X||^2`` over the calibration inputs ``X`` of the layer through the Hessian
``H = 2 X X^T / n`` [K, K]:

* dead inputs (``H[k, k] == 0``) get ``H[k, k] = 1`` and zero weights;
* optional act-order (``desc_act``, §"Additional details"): columns are processed in order of
  decreasing ``H[k, k]``; groups are formed in that order and ``g_idx`` maps every input channel to
  its group;
* dampening ``lambda = damp_percent * mean(diag H)`` is added to the diagonal (§4, "Cholesky
  reformulation"), then ``Hinv = chol(H^-1)^T`` (upper Cholesky factor of the inverse);
* columns are quantized one at a time with the group's RTN grid (:mod:`.rtn`; the grid is fitted
  on the group's CURRENT, already-updated weights when the group starts); the error
  ``(w - q) / Hinv[i, i]`` is spread over the not-yet-quantized columns of the block with row ``i``
  of ``Hinv``, and each finished block of ``block_size`` columns updates all later columns at
  once (the "lazy batch" updates, §4 Step 2).
"""
from __future__ import annotations

import math

import torch

from .hf_formats import GroupQuant
from .rtn import group_params, quantize_codes


class HessianAccumulator:
    """Running ``H = 2 / n * sum_t x_t x_t^T`` over input rows (float64 accumulation).

    Attributes:
        h: float64 [K, K].  n: rows seen."""

    def __init__(self, k: int):
        self.h = torch.zeros(k, k, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        """Add inputs ``x`` [..., K] (any float dtype)."""
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        self.h += x.T @ x
        self.n += x.shape[0]

    def hessian(self) -> torch.Tensor:
        """float32 [K, K]; zeros before any input."""
        return (self.h * (2.0 / max(self.n, 1))).float()


def prepare(w: torch.Tensor, h: torch.Tensor, act_order: bool, damp_percent: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first steps of Algorithm 1 for ``w`` [N, K] and Hessian ``h`` [K, K]: dead inputs, the
    act-order permutation, dampening and ``Hinv = chol(H^-1)^T``.

    Returns:
        ``(W float32 [N, K] (a copy, columns in processing order), Hinv float32 [K, K] upper,
        perm int64 [K])`` -- processing position ``j`` is logical input channel ``perm[j]``.
    Raises:
        ValueError: ``h`` not [K, K]; the damped Hessian is not positive definite.
    """
    k = w.shape[1]
    if tuple(h.shape) != (k, k):
        raise ValueError(f"gptq: Hessian must be [{k}, {k}], got {tuple(h.shape)}")
    W = w.detach().float().clone()
    H = h.detach().float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp_percent * torch.mean(torch.diag(H)) * torch.eye(k)
    try:
        L = torch.linalg.cholesky(H)
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    except RuntimeError as exc:  # torch.linalg.LinAlgError subclasses RuntimeError
        raise ValueError(f"gptq: the damped Hessian is not positive definite ({exc}); raise damp_percent") from exc
    return W, Hinv, perm


def obs_columns(W: torch.Tensor, Hinv: torch.Tensor, quant_col, block_size: int) -> None:
    """The column loop of Algorithm 1 on ``W`` [N, K] (modified in place), any quantizer.

    ``quant_col(col, W1, i)`` returns the quantized (dequantized-value) column ``col`` [N] from the
    current block ``W1`` [N, block] whose column ``i`` is ``col`` (it may look at later columns of
    the block, e.g. to fit a group's grid); the error ``(w - q) / Hinv[i, i]`` goes to the block's
    later columns, and each finished block updates every later column (the lazy batch, §4 Step 2).
    """
    k = W.shape[1]
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            wc = W1[:, i].clone()
            err = (wc - quant_col(i1 + i, W1, i)) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            E1[:, i] = err
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int, sym: bool = True,
                  act_order: bool = False, damp_percent: float = 0.01, block_size: int = 128,
                  min_zero: int = 1) -> GroupQuant:
    """GPTQ of ``w`` [N, K] given the Hessian ``h`` [K, K] (module docstring).

    Args:
        bits: 4 or 8.  group_size: channels per group (-1 = K).  sym: symmetric grid.
        act_order: process columns by decreasing ``diag(h)`` (AutoGPTQ's ``desc_act``).
        damp_percent: dampening as a fraction of ``mean(diag h)``.
        block_size: lazy-batch width (rounded up to a multiple of the group size).
        min_zero: smallest asymmetric zero point (1 for AutoGPTQ's v1 "zeros minus one" storage).
    Returns:
        :class:`GroupQuant` in the logical channel order (codes [N, K], g_idx [K]).
    Raises:
        ValueError: ``group_size`` does not divide K; ``h`` not [K, K]; the damped Hessian is not
            positive definite (raise ``damp_percent``).
    """
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    if gs <= 0 or k % gs:
        raise ValueError(f"group_size: {group_size} does not divide in_features={k}")
    if tuple(h.shape) != (k, k):
        raise ValueError(f"gptq: Hessian must be [{k}, {k}], got {tuple(h.shape)}")
    W, Hinv, perm = prepare(w, h, act_order, damp_percent)
    G = k // gs
    codes = torch.zeros(n, k)
    scales = torch.zeros(n, G)
    zeros = torch.zeros(n, G)

    def quant_col(col: int, W1: torch.Tensor, i: int) -> torch.Tensor:
        if col % gs == 0:  # fit the group's grid on its current (updated) weights
            s, z = group_params(W1[:, i:i + gs], bits, sym, min_zero)
            scales[:, col // gs], zeros[:, col // gs] = s, z
        s, z = scales[:, col // gs], zeros[:, col // gs]
        qc = quantize_codes(W1[:, i:i + 1], s, z, bits)[:, 0]
        codes[:, col] = qc
        return s * (qc - z)

    bs = gs * math.ceil(block_size / gs) if gs < block_size else gs  # groups never straddle blocks
    obs_columns(W, Hinv, quant_col, bs)

    inv = torch.argsort(perm)
    g_idx = (torch.arange(k) // gs)[inv]  # group of logical channel c = (position of c in perm) // gs
    return GroupQuant(codes[:, inv].to(torch.uint8).contiguous(), zeros.to(torch.int32), scales,
                      g_idx.to(torch.int32), bits, gs)
