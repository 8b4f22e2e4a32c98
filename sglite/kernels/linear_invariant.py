"""The batch-invariant matmul on raw tensors (deterministic inference): row ``i`` of
``x @ w.T + bias`` depends only on ``x[i]``, ``w`` and ``bias``, never on the row count or the
other rows. The ``invariant`` implementation of :data:`sglite.kernels.matmul.IMPLS` and the float
product inside the batch-invariant 8-bit implementations (:mod:`.w8_linear`) both call it; it knows
no weight type, so neither imports the other.

On CUDA tensors when triton imports: :func:`.triton_matmul.linear_invariant` (fixed tiles, no
split-K); otherwise (CPU): :func:`.cpu_gemv.linear_invariant` (the C++ kernel for bf16 / fp32 on
AVX-512-BF16 CPUs, one ``F.linear`` per row without it).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import cpu_gemv
from .device import triton_available


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Batch-invariant ``F.linear(x, weight, bias)``.

    Args:
        x: [M, K] activations (M >= 0), weight's dtype and device.
        weight: [N, K] float weight (out x in features).
        bias: [N] or None.
    Returns:
        [M, N] in x's dtype.
    """
    if x.is_cuda and triton_available():
        from . import triton_matmul  # imports triton: only on the CUDA path

        return triton_matmul.linear_invariant(x, weight, bias)
    return cpu_gemv.linear_invariant(x, weight, bias)
