"""AWQ: activation-aware per-input-channel scaling before group quantization (Lin et al. 2023,
"AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration", §3.2).

Weights that meet large activations matter most. For the linears ``W_i`` [N_i, K] that read the
same input ``X`` [T, K], AWQ scales input channel ``k`` of the weights up by ``s_k`` and the
input down by ``1 / s_k`` (folded into the op that produces ``X``: an RMSNorm weight, or the rows of
``up_proj`` for ``down_proj``), which is exact in real arithmetic but shrinks the relative rounding
error of the salient channels. The scale is ``s = s_X ** alpha`` with ``s_X`` the mean magnitude
of each input channel over the calibration tokens, normalized by ``sqrt(max(s) * min(s))``, and
``alpha`` picked from the grid ``{0, 1/n_grid, ..., (n_grid-1)/n_grid}`` to minimize
``|| Q(W diag(s)) (diag(s)^-1 X) - W X ||^2`` over the calibration tokens (``alpha = 0`` is plain
RTN, so the search never does worse than RTN on the calibration set). Quantization ``Q`` is the
asymmetric RTN grid of :mod:`.rtn` (AutoAWQ's ``zero_point: true``).
"""
from __future__ import annotations

import torch

from .rtn import fake_quant


def search_scales(weights: list[torch.Tensor], x: torch.Tensor, bits: int, group_size: int,
                  n_grid: int = 20, sym: bool = False) -> tuple[torch.Tensor, float, dict]:
    """The AWQ input-channel scales for ``weights`` (each [N_i, K]) reading ``x`` [T, K].

    Returns:
        ``(s [K] float32, alpha, {"loss": best, "loss_rtn": loss at alpha 0})``; the losses are
        mean squared output errors over ``x``.
    Raises:
        ValueError: weights with different K, or K != x's last dimension.
    """
    k = x.shape[-1]
    if any(w.shape[1] != k for w in weights):
        raise ValueError(f"awq: every weight must have in_features={k}, got {[tuple(w.shape) for w in weights]}")
    x = x.reshape(-1, k).float()
    w = torch.cat([w.float() for w in weights])  # [N, K]
    ref = x @ w.T
    s_x = x.abs().mean(0).clamp(min=1e-8)
    best, best_alpha, best_s, loss_rtn = float("inf"), 0.0, torch.ones(k), None
    for i in range(n_grid):
        alpha = i / n_grid
        s = s_x.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = fake_quant(w * s[None, :], bits, group_size, sym) / s[None, :]
        loss = float(((x @ wq.T - ref) ** 2).mean())
        if i == 0:
            loss_rtn = loss
        if loss < best:
            best, best_alpha, best_s = loss, alpha, s
    return best_s, best_alpha, {"loss": best, "loss_rtn": loss_rtn}
