"""Kernel dispatcher: Triton for CUDA tensors when Triton imports; on CPU the fused C++ kernel
(``cpu_attention``) for ``decode_attention`` when it compiles; the torch reference otherwise.

``SGLITE_KERNEL=torch|triton|cpp`` (environment) and the ``impl=`` argument of each op override the
choice. Unknown names raise ``ValueError`` listing the known ones. ``cpp`` serves only the ops its
module defines (``CPP_OPS``); the others, and every op when the build failed, run the reference.
Only ``triton_*.py`` modules import triton, lazily, so ``import sglite`` works where triton is absent
(:func:`.device.triton_available` probes it once per process).

Quantized KV pools (:class:`.kv_quant.QuantKVLayer`, passed as ``k_buffer`` and ``v_buffer``)
route ``store_kv``, ``decode_attention`` and ``extend_attention`` to :mod:`.kv_quant` (the torch
reference) or, for ``decode_attention``, to the fused C++ kernel of :mod:`.kv_quant_cpu` (CPU) or
the Triton kernel of :mod:`.kv_quant_triton` (CUDA).

``linear`` dispatches on its weight instead (:class:`.matmul.LinearWeight` carries the
implementation chosen once at load). ``batch_invariant=True`` (deterministic inference) asks
``decode_attention`` and ``silu_mul`` for results whose row ``i`` depends only on row ``i``'s
inputs, never on the other rows or the batch size: the C++ decode kernel is (one task per
(request, KV head), its reduction order fixed by the request's own length; the torch reference is
not: its batched path pads to the longest row), Triton runs a fixed number of KV splits, and
``silu_mul`` runs the C++ elementwise kernel on CPU (see :func:`silu_mul`).
"""
from __future__ import annotations

import importlib
import os
from typing import Optional

import torch

from . import cpu_gemv, kv_quant, reference
from .device import triton_available
from .matmul import LinearWeight, linear  # noqa: F401  (re-exported: the op of every matmul)

IMPLS = ("torch", "triton", "cpp")
OPS = ("store_kv", "decode_attention", "extend_attention", "apply_token_bitmask", "sample")
CPP_OPS = ("decode_attention",)  # ops with a C++ CPU kernel (sglite/kernels/cpu_attention.py)


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
    if example is not None and example.is_cuda and triton_available():
        return "triton"
    if (op in CPP_OPS and example is not None and example.device.type == "cpu"
            and _cpp_available()):
        if isinstance(example, kv_quant.QuantKVLayer):  # build the quantized-pool kernel too
            from . import kv_quant_cpu

            kv_quant_cpu.available()
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


def _quant_decode(name: str):
    """The quantized-pool decode attention of implementation ``name`` (C++ on CPU when it builds)."""
    if name == "cpp":
        from . import kv_quant_cpu

        return kv_quant_cpu.decode_attention
    if name == "triton":
        return importlib.import_module(".kv_quant_triton", __package__).decode_attention
    return kv_quant.decode_attention


def store_kv(k_buffer, v_buffer, out_cache_loc, k, v, *, impl: Optional[str] = None):
    """See :func:`sglite.kernels.reference.store_kv` (:func:`.kv_quant.store_kv` for a quantized
    pool layer)."""
    if isinstance(k_buffer, kv_quant.QuantKVLayer):
        return kv_quant.store_kv(k_buffer, out_cache_loc, k, v)
    return _op("store_kv", resolve_impl(impl, k))(k_buffer, v_buffer, out_cache_loc, k, v)


def decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale,
                     *, impl: Optional[str] = None, batch_invariant: bool = False, window: int = 0,
                     softcap: float = 0.0):
    """See :func:`sglite.kernels.reference.decode_attention`.

    ``window`` (sliding-window layers) and ``softcap`` (attention logit soft-capping), when set,
    run the torch reference (:func:`.reference.decode_attention`, row by row when
    ``batch_invariant``): the C++ and Triton kernels do not implement them; a quantized pool
    refuses them (ValueError).

    ``batch_invariant``: row i's output depends only on row i (its query, its KV, its length):
    ``cpp`` is so by construction; ``torch`` then runs :func:`.reference.decode_attention_rowwise`;
    ``triton`` a fixed number of KV splits (:data:`.triton_attention.INVARIANT_SPLITS`).
    """
    if window > 0 or softcap > 0:
        if isinstance(k_buffer, kv_quant.QuantKVLayer):
            raise ValueError("a quantized KV pool supports neither sliding windows nor soft-capping")
        ref = reference.decode_attention_rowwise if batch_invariant else reference.decode_attention
        return ref(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale, window, softcap)
    name = resolve_impl(impl, q, "decode_attention")
    if isinstance(k_buffer, kv_quant.QuantKVLayer):  # row-independent in every implementation
        return _quant_decode(name)(q, k_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale)
    args = (q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale)
    if not batch_invariant:
        return _op("decode_attention", name)(*args)
    if name == "triton":
        return _op("decode_attention", name)(*args, batch_invariant=True)
    if name == "cpp" and _cpp_available():
        from . import cpu_attention

        if cpu_attention.supported(q, k_buffer, v_buffer):
            return cpu_attention.decode_attention(*args)
    return reference.decode_attention_rowwise(*args)


def extend_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens,
                     extend_lens, sm_scale, *, impl: Optional[str] = None, window: int = 0,
                     softcap: float = 0.0):
    """See :func:`sglite.kernels.reference.extend_attention` (:func:`.kv_quant.extend_attention`
    for a quantized pool layer). ``window`` / ``softcap`` set: the torch reference (see
    :func:`decode_attention`)."""
    if window > 0 or softcap > 0:
        if isinstance(k_buffer, kv_quant.QuantKVLayer):
            raise ValueError("a quantized KV pool supports neither sliding windows nor soft-capping")
        return reference.extend_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens,
                                          extend_lens, sm_scale, window, softcap)
    if isinstance(k_buffer, kv_quant.QuantKVLayer):
        return kv_quant.extend_attention(q, k_buffer, req_to_token, req_pool_indices, prefix_lens,
                                         extend_lens, sm_scale)
    return _op("extend_attention", resolve_impl(impl, q))(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, sm_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, batch_invariant: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``.

    x: [..., H]; weight: [H]; returns x's shape and dtype (``F.rms_norm``). On CPU that is
    row-invariant as is (torch reduces each row with the same code whatever the row count; checked
    in tests/runtime/test_deterministic.py). ``batch_invariant`` on CUDA runs
    :func:`.triton_norm.rms_norm` (one program per row), since torch's CUDA reductions choose their
    launch configuration from the number of rows too.
    """
    if batch_invariant and x.is_cuda and triton_available():
        from . import triton_norm

        return triton_norm.rms_norm(x, weight, eps)
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_mul(g: torch.Tensor, u: torch.Tensor, *, batch_invariant: bool = False) -> torch.Tensor:
    """SwiGLU's activation ``silu(g) * u`` (Shazeer 2020), g and u of one shape and dtype.

    ``batch_invariant`` on CPU: :func:`.cpu_gemv.silu_mul` (torch's ``F.silu`` rounds an element
    differently in the vectorised body and the scalar tail, so its bits depend on where the batch
    puts it); elsewhere ``F.silu(g) * u`` (CUDA's elementwise kernels apply one formula per element).
    """
    if batch_invariant and g.device.type == "cpu":
        return cpu_gemv.silu_mul(g, u)
    return torch.nn.functional.silu(g) * u


def gelu_tanh_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """GeGLU's activation with the tanh GELU (Shazeer 2020; Hendrycks & Gimpel 2016, eq. for the
    tanh approximation): ``gelu_tanh(g) * u``, as HF's ``gelu_pytorch_tanh`` (Gemma 2/3 MLPs).
    g, u: [..., I] of one dtype; returns the same shape and dtype."""
    return torch.nn.functional.gelu(g, approximate="tanh") * u


def apply_token_bitmask(logits, bitmask, indices=None, *, impl: Optional[str] = None):
    """See :func:`sglite.kernels.reference.apply_token_bitmask`."""
    return _op("apply_token_bitmask", resolve_impl(impl, logits))(logits, bitmask, indices)


def greedy(logits, bitmask=None):
    """See :func:`sglite.kernels.reference.greedy` (torch ops on any device; a greedy batch needs
    no per-row parameter tensors)."""
    return reference.greedy(logits, bitmask)


def sample(logits, temperatures, top_ps, top_ks, min_ps, seeds, positions, bitmask=None,
           *, impl: Optional[str] = None):
    """See :func:`sglite.kernels.reference.sample`."""
    return _op("sample", resolve_impl(impl, logits))(
        logits, temperatures, top_ps, top_ks, min_ps, seeds, positions, bitmask)
