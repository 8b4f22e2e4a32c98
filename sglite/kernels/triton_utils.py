"""Small helpers shared by the Triton kernel modules (device checks, tile-size arithmetic)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _probe():
    pass


#: True when this process decorated both triton's own library functions and ours for the CPU
#: interpreter (``TRITON_INTERPRET=1`` was set before triton was first imported); immutable.
INTERPRETED: bool = (type(_probe).__name__ == "InterpretedFunction"
                     and type(tl.max).__name__ == "InterpretedFunction")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def prev_pow2(n: int) -> int:
    """Largest power of two <= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n).bit_length() - 1)


def is_interpreted(t: torch.Tensor) -> bool:
    """Whether a launch on ``t`` runs in the interpreter (CPU tensors can only run there)."""
    return not t.is_cuda


def check_device(*tensors: torch.Tensor) -> None:
    """Check that all tensors share one device that Triton can run on.

    Raises:
        ValueError: tensors on different devices.
        RuntimeError: CPU tensors while kernels were compiled for the GPU (``TRITON_INTERPRET=1``
            must be set before triton is first imported to run them on CPU).
    """
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device; got {dev} and {t.device}")
    if dev.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"Triton kernels got {dev} tensors: they need CUDA tensors, or TRITON_INTERPRET=1 set "
            "before triton is first imported (CPU interpreter); use impl='torch' otherwise")
