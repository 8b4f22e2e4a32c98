"""Kernel dispatcher: Triton for CUDA tensors when Triton imports, the torch reference otherwise.

``SGLITE_KERNEL=torch|triton`` (environment) and the ``impl=`` argument of each op override the
choice. Unknown names raise ``ValueError`` listing the known ones. Only ``triton_*.py`` modules
import triton, lazily, so ``import sglite`` works where triton is absent.
"""
from __future__ import annotations

import importlib
import os
from typing import Optional

import torch

from . import reference

IMPLS = ("torch", "triton")
OPS = ("store_kv", "decode_attention", "extend_attention", "apply_token_bitmask", "sample")


def _triton_available() -> bool:
    try:
        importlib.import_module("triton")
        return True
    except Exception:
        return False


def resolve_impl(impl: Optional[str], example: Optional[torch.Tensor]) -> str:
    """Which implementation runs: ``impl`` argument > ``SGLITE_KERNEL`` > device-based default.

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
    return "torch"


def _op(name: str, impl: str):
    if impl == "torch":
        return getattr(reference, name)
    mod = importlib.import_module(".triton_ops", __package__)
    return getattr(mod, name)


def store_kv(k_buffer, v_buffer, out_cache_loc, k, v, *, impl: Optional[str] = None):
    """See :func:`sglite.kernels.reference.store_kv`."""
    return _op("store_kv", resolve_impl(impl, k))(k_buffer, v_buffer, out_cache_loc, k, v)


def decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale,
                     *, impl: Optional[str] = None):
    """See :func:`sglite.kernels.reference.decode_attention`."""
    return _op("decode_attention", resolve_impl(impl, q))(
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
