"""Kernel dispatcher: Triton for CUDA tensors when Triton imports; on CPU the fused C++ kernel
(``cpu_attention``) for ``decode_attention`` when it compiles; the torch reference otherwise.

``SGLITE_KERNEL=torch|triton|cpp`` (environment) and the ``impl=`` argument of each op override the
choice. Unknown names raise ``ValueError`` listing the known ones. ``cpp`` serves only the ops its
module defines (``CPP_OPS``); the others, and every op when the build failed, run the reference.
Only ``triton_*.py`` modules import triton, lazily, so ``import sglite`` works where triton is absent.
"""
from __future__ import annotations

import importlib
import os
from typing import Optional

import torch

from . import reference

IMPLS = ("torch", "triton", "cpp")
OPS = ("store_kv", "decode_attention", "extend_attention", "apply_token_bitmask", "sample")
CPP_OPS = ("decode_attention",)  # ops with a C++ CPU kernel (kernels/cpu_attention.py)


def _triton_available() -> bool:
    try:
        importlib.import_module("triton")
        return True
    except Exception:
        return False


def _cpp_available() -> bool:
    from . import cpu_attention  # compiles on first call (cached on disk), then memoised

    return cpu_attention.available()


def resolve_impl(impl: Optional[str], example: Optional[torch.Tensor], op: Optional[str] = None) -> str:
    """Which implementation runs: ``impl`` argument > ``SGLITE_KERNEL`` > device-based default.

    The default is ``triton`` for CUDA tensors when triton imports; ``cpp`` for CPU tensors of an
    op in ``CPP_OPS`` when the C++ extension builds (``op`` names the op); ``torch`` otherwise.

    Raises:
        ValueError: an unknown implementation name (lists the known ones).
    """
    name = impl or os.environ.get("SGLITE_KERNEL") or ""
    if name:
        if name not in IMPLS:
            raise ValueError(f"unknown kernel implementation {name!r}; known: {list(IMPLS)}")
        return name
    if example is not None and example.is_cuda and _triton_available():
        return "triton"
    if (op in CPP_OPS and example is not None and example.device.type == "cpu"
            and _cpp_available()):
        return "cpp"
    return "torch"


def _op(name: str, impl: str):
    if impl == "torch":
        return getattr(reference, name)
    if impl == "cpp":  # cpu_attention falls back itself when its build failed
        if name not in CPP_OPS:
            return getattr(reference, name)
        return getattr(importlib.import_module(".cpu_attention", __package__), name)
    mod = importlib.import_module(".triton_ops", __package__)
    return getattr(mod, name)


def store_kv(k_buffer, v_buffer, out_cache_loc, k, v, *, impl: Optional[str] = None):
    """See :func:`sglite.kernels.reference.store_kv`."""
    return _op("store_kv", resolve_impl(impl, k))(k_buffer, v_buffer, out_cache_loc, k, v)


def decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale,
                     *, impl: Optional[str] = None):
    """See :func:`sglite.kernels.reference.decode_attention`."""
    return _op("decode_attention", resolve_impl(impl, q, "decode_attention"))(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale)


def extend_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens,
                     extend_lens, sm_scale, *, impl: Optional[str] = None):
    """See :func:`sglite.kernels.reference.extend_attention`."""
    return _op("extend_attention", resolve_impl(impl, q))(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, sm_scale)


def apply_token_bitmask(logits, bitmask, indices=None, *, impl: Optional[str] = None):
    """See :func:`sglite.kernels.reference.apply_token_bitmask`."""
    return _op("apply_token_bitmask", resolve_impl(impl, logits))(logits, bitmask, indices)


def sample(logits, temperatures, top_ps, top_ks, min_ps, seeds, positions, bitmask=None,
           *, impl: Optional[str] = None):
    """See :func:`sglite.kernels.reference.sample`."""
    return _op("sample", resolve_impl(impl, logits))(
        logits, temperatures, top_ps, top_ks, min_ps, seeds, positions, bitmask)
