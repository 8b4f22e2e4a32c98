"""Kernel dispatcher: Triton for CUDA tensors when Triton imports; on CPU the fused C++ kernels
(``cpu_attention``) for ``decode_attention`` and ``extend_attention``, and the fused elementwise
kernels (``cpu_elementwise``) for ``rms_norm``, ``add_rms_norm`` and ``rope_store_kv``, when they
compile; the torch reference otherwise.

``SGLITE_KERNEL=torch|triton|cpp`` (environment) and the ``impl=`` argument of each op override the
choice. Unknown names raise ``ValueError`` listing the known ones. ``cpp`` serves only the ops its
module defines (``CPP_OPS``); the others, and every op when the build failed, run the reference.
Only ``triton_*.py`` modules import triton, lazily, so ``import sglite`` works where triton is absent
(:func:`.device.triton_available` probes it once per process).

Quantized KV pools (:class:`.kv_quant.QuantKVLayer`, passed as ``k_buffer`` and ``v_buffer``)
route ``store_kv``, ``decode_attention`` and ``extend_attention`` to :mod:`.kv_quant` (the torch
reference) or, for ``decode_attention``, to the fused C++ kernel of :mod:`.kv_quant_cpu` (CPU) or
the Triton kernel of :mod:`.kv_quant_triton` (CUDA), and for ``extend_attention`` on CPU to
:mod:`.kv_quant_extend` (the float pool's C++ extend over a scratch buffer).

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
from .device import serial_torch, triton_available
from .matmul import LinearWeight, linear  # noqa: F401  (re-exported: the op of every matmul)

IMPLS = ("torch", "triton", "cpp")
OPS = ("store_kv", "decode_attention", "extend_attention", "apply_token_bitmask", "sample")
CPP_OPS = ("decode_attention", "extend_attention")  # ops with a C++ CPU kernel (sglite/kernels/cpu_attention.py)
ELEMENTWISE_OPS = ("rms_norm", "add_rms_norm", "rope_store_kv")  # C++ on CPU: sglite/kernels/cpu_elementwise.py


def _cpp_available(op: Optional[str] = None) -> bool:
    from . import cpu_attention, cpu_elementwise  # compile on first call (cached on disk), then memoised

    if op in ELEMENTWISE_OPS:
        return cpu_elementwise.available()
    return cpu_attention.extend_available() if op == "extend_attention" else cpu_attention.available()


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
    if (op in CPP_OPS + ELEMENTWISE_OPS and example is not None and example.device.type == "cpu"
            and _cpp_available(op)):
        if isinstance(example, kv_quant.QuantKVLayer):  # build the quantized-pool kernel too
            from . import kv_quant_cpu

            kv_quant_cpu.available()
        return "cpp"
    return "torch"


def prepare_cpu(pool_example: torch.Tensor, dtype: torch.dtype) -> None:
    """Build (or load from the disk cache) the C++ kernels a CPU step calls, so that a fresh machine
    compiles them at engine start (before the engine is ready), not inside its first request.

    Args:
        pool_example: one layer's K buffer of the KV pool ([S, Hkv, D], or a quantized pool's
            ``kv_quant.QuantKVLayer``): picks the paged-attention kernels (:data:`CPP_OPS`).
        dtype: the model's activation dtype: the elementwise ops' kernel, and for bfloat16
            :mod:`.cpu_gemv` (SiLU * up, few-row GEMVs).

    Each kernel is built at most once per process; one that does not build leaves its op on the
    torch path (:func:`resolve_impl`, one logged warning).

    Raises:
        ValueError: ``SGLITE_KERNEL`` names an unknown implementation (as :func:`resolve_impl`)."""
    for op in CPP_OPS:
        resolve_impl(None, pool_example, op)
    resolve_impl(None, torch.empty(0, dtype=dtype), "rms_norm")
    if dtype == torch.bfloat16:
        cpu_gemv.available()


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
    if isinstance(k_buffer, kv_quant.QuantKVLayer):  # groups the step completes sealed in C++ on CPU
        if resolve_impl(impl, k, "decode_attention") != "cpp":  # as the quantized decode chooses C++
            return kv_quant.store_kv(k_buffer, out_cache_loc, k, v)
        from . import kv_quant_cpu

        with serial_torch():  # torch glue between C++ kernels: see device.serial_torch (the sealing too)
            return kv_quant.store_kv(k_buffer, out_cache_loc, k, v, kv_quant_cpu.seal_groups, kv_quant_cpu.store)
    return _op("store_kv", resolve_impl(impl, k))(k_buffer, v_buffer, out_cache_loc, k, v)


def decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale,
                     *, impl: Optional[str] = None, batch_invariant: bool = False, window: int = 0,
                     softcap: float = 0.0):
    """See :func:`sglite.kernels.reference.decode_attention`.

    ``window`` (sliding-window layers: the last ``window`` tokens only; slots before them are
    never read) and ``softcap`` (attention logit soft-capping) run in every implementation (C++,
    Triton, torch); a quantized pool refuses them (ValueError).

    ``batch_invariant``: row i's output depends only on row i (its query, its KV, its length):
    ``cpp`` is so by construction; ``torch`` then runs :func:`.reference.decode_attention_rowwise`;
    ``triton`` a fixed number of KV splits (:data:`.triton_attention.INVARIANT_SPLITS`).
    """
    name = resolve_impl(impl, q, "decode_attention")
    if isinstance(k_buffer, kv_quant.QuantKVLayer):  # row-independent in every implementation
        if window > 0 or softcap > 0:
            raise ValueError("a quantized KV pool supports neither sliding windows nor soft-capping")
        return _quant_decode(name)(q, k_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale)
    args = (q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale)
    if window > 0 or softcap > 0:
        args += (int(window), float(softcap))
    if not batch_invariant:
        return _op("decode_attention", name)(*args)
    if name == "triton":
        return _op("decode_attention", name)(*args, batch_invariant=True)
    if name == "cpp" and _cpp_available():
        from . import cpu_attention

        if cpu_attention.supported(q, k_buffer, v_buffer):
            return cpu_attention.decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                                                  sm_scale, window, softcap, cascade_min=0)  # per-row: no shared-prefix pass
    return reference.decode_attention_rowwise(*args)


def extend_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens,
                     extend_lens, sm_scale, *, impl: Optional[str] = None, window: int = 0,
                     softcap: float = 0.0):
    """See :func:`sglite.kernels.reference.extend_attention` (:func:`.kv_quant.extend_attention`
    for a quantized pool layer). ``window`` / ``softcap``: as in :func:`decode_attention`."""
    if isinstance(k_buffer, kv_quant.QuantKVLayer):
        if window > 0 or softcap > 0:
            raise ValueError("a quantized KV pool supports neither sliding windows nor soft-capping")
        name = resolve_impl(impl, q, "extend_attention")
        if name == "cpp":  # the float pool's C++ extend over a scratch buffer (kv_quant_extend)
            from . import kv_quant_extend

            return kv_quant_extend.extend_attention(q, k_buffer, req_to_token, req_pool_indices, prefix_lens,
                                                    extend_lens, sm_scale, _op("extend_attention", name))
        return kv_quant.extend_attention(q, k_buffer, req_to_token, req_pool_indices, prefix_lens,
                                         extend_lens, sm_scale)
    args = (q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, sm_scale)
    if window > 0 or softcap > 0:
        args += (int(window), float(softcap))
    return _op("extend_attention", resolve_impl(impl, q, "extend_attention"))(*args)


def _cpu_elementwise(x: torch.Tensor, op: str):
    """:mod:`.cpu_elementwise` when ``op`` runs the C++ kernel for CPU tensor ``x``, else None."""
    if x.device.type != "cpu" or resolve_impl(None, x, op) != "cpp":
        return None
    from . import cpu_elementwise

    return cpu_elementwise


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, batch_invariant: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``.

    x: [..., H]; weight: [H] of x's dtype, or float32 with a bf16 x (then the float32 norm of x,
    rounded once to bf16: ``rms_norm(x.float(), weight).to(bf16)``); returns x's shape and dtype.
    On CPU (float32/bf16, rows with unit stride): the C++ kernel :func:`.cpu_elementwise.add_rms_norm` (one pass
    per row, torch's rounding, a fixed float32 reduction order: row-invariant); elsewhere
    ``F.rms_norm`` (on CPU also row-invariant: torch reduces each row with the same code whatever
    the row count; checked in tests/runtime/test_deterministic.py). ``batch_invariant`` on CUDA
    runs :func:`.triton_norm.rms_norm` (one program per row), since torch's CUDA reductions choose
    their launch configuration from the number of rows too.
    """
    if batch_invariant and x.is_cuda and triton_available():
        from . import triton_norm

        return triton_norm.rms_norm(x, weight, eps)
    ce = _cpu_elementwise(x, "rms_norm")
    if ce is not None:
        if weight.dtype != x.dtype and x.dim() != 2 and not x.is_contiguous():
            x = x.contiguous()  # a copy in x's dtype for the kernel (not the float32 one)
        x2 = x if x.dim() == 2 else (x.view(-1, x.shape[-1]) if x.is_contiguous() else None)
        if x2 is not None and ce.norm_supported(x2, None, weight):
            return ce.add_rms_norm(x2, None, weight, eps)[1].view(x.shape)
    if weight.dtype != x.dtype:  # a float32 weight on bf16 x: the float32 norm, one rounding
        return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add and the RMSNorm after it: ``s = x + residual``, returns ``(s, rms_norm(s))``.

    x, residual: [M, H] of one dtype; weight: [H]. On CPU the C++ kernel does both in one pass per
    row (:func:`.cpu_elementwise.add_rms_norm`: ``s`` bit-identical to ``x + residual``, the norm
    as :func:`rms_norm`'s kernel); otherwise ``x + residual`` then :func:`rms_norm` (with
    ``batch_invariant``). Reference: :func:`.reference.add_rms_norm`.
    """
    ce = _cpu_elementwise(x, "add_rms_norm")
    if ce is not None and ce.norm_supported(x, residual, weight):
        return ce.add_rms_norm(x, residual, weight, eps)
    s = x + residual
    return s, rms_norm(s, weight, eps, batch_invariant=batch_invariant)


def rope_store_kv(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_buffer, v_buffer,
                  out_cache_loc: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """Rotate-half RoPE of the fused q/k heads and the K/V store, returning the rotated queries.

    qk: [N, Hq+Hkv, D]; v: [N, Hkv, D]; cos/sin: [N, D/2] in qk's dtype; pools as :func:`store_kv`;
    out_cache_loc: [N] int64; returns [N, Hq, D]. On CPU (one float32/bf16 dtype, a plain pool):
    :func:`.cpu_elementwise.rope_store_kv` in one pass, bit-identical to
    :func:`.reference.rope_store_kv`; a quantized pool on CPU: the same kernel rotating into a
    scratch of the step's rows, then :func:`store_kv`; otherwise :func:`.reference.rope_rotate_half`
    then :func:`store_kv` (other devices or dtypes).
    """
    ce = _cpu_elementwise(qk, "rope_store_kv")
    if (ce is not None and ce.rope_supported(qk, k_buffer, v_buffer) and v.dtype == qk.dtype
            and cos.dtype == qk.dtype and sin.dtype == qk.dtype):
        return ce.rope_store_kv(qk, v, cos, sin, k_buffer, v_buffer, out_cache_loc, num_q_heads)
    if isinstance(k_buffer, kv_quant.QuantKVLayer) and qk.device.type == "cpu":
        with serial_torch():  # torch glue between C++ kernels (device.serial_torch): a quantized pool's step
            kr = torch.empty((qk.shape[0], v.shape[1], v.shape[2]), dtype=qk.dtype)  # [N, Hkv, D]
            if ce is not None and ce.rope_supported(qk, kr, kr) and v.dtype == qk.dtype == cos.dtype == sin.dtype:
                # the C++ rotation (bit-identical to the reference), its keys into a scratch of the step's
                # rows and v stored there too: the quantized store then takes them as it would the reference's
                vr = torch.empty_like(kr)
                q = ce.rope_store_kv(qk, v, cos, sin, kr, vr, torch.arange(qk.shape[0]), num_q_heads)
                store_kv(k_buffer, v_buffer, out_cache_loc, kr, vr)  # vr: v's rows copied (v views the qkv output)
                return q
            rotated = reference.rope_rotate_half(qk, cos, sin)  # [N, Hq+Hkv, D]
    else:
        rotated = reference.rope_rotate_half(qk, cos, sin)
    store_kv(k_buffer, v_buffer, out_cache_loc, rotated[:, num_q_heads:], v)
    return rotated[:, :num_q_heads]


def silu_mul(g: torch.Tensor, u: torch.Tensor, *, batch_invariant: bool = False) -> torch.Tensor:
    """SwiGLU's activation ``silu(g) * u`` (Shazeer 2020), g and u of one shape and dtype.

    ``batch_invariant`` on CPU, and every bf16 product on CPU: :func:`.cpu_gemv.silu_mul` (one pass
    on the C++ thread pool instead of two torch ops; torch's ``F.silu`` rounds an element
    differently in the vectorised body and the scalar tail, so its bits depend on where the batch
    puts it); elsewhere ``F.silu(g) * u`` (float32 on CPU keeps torch's, the reference path; CUDA's
    elementwise kernels apply one formula per element).
    """
    if g.device.type == "cpu" and (batch_invariant or (g.dtype == torch.bfloat16 and cpu_gemv.available())):
        return cpu_gemv.silu_mul(g, u)  # bf16: one pooled pass, torch's two roundings (silu, then the product)
    if g.device.type == "cpu":  # torch's ops on this thread only (device.serial_torch: OpenMP stalls)
        with serial_torch():
            return torch.nn.functional.silu(g) * u
    return torch.nn.functional.silu(g) * u


def gelu_tanh_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """GeGLU's activation with the tanh GELU (Shazeer 2020; Hendrycks & Gimpel 2016, eq. for the
    tanh approximation): ``gelu_tanh(g) * u``, as HF's ``gelu_pytorch_tanh`` (Gemma 2/3 MLPs).
    g, u: [..., I] of one dtype; returns the same shape and dtype. bf16 on CPU:
    :func:`.cpu_gemv.gelu_tanh_mul` (one pass, halves read in place; the tanh from the kernel's exp,
    so a bf16 element may differ from torch's by one rounding step); float32 and elsewhere: torch's
    ops (the reference, transformers' own)."""
    if g.device.type == "cpu" and g.dtype == torch.bfloat16 and cpu_gemv.available():
        return cpu_gemv.gelu_tanh_mul(g, u)
    return torch.nn.functional.gelu(g, approximate="tanh") * u


def moe_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """Top-k expert routing: see :func:`sglite.kernels.reference.moe_topk` (torch ops on any device,
    so the tie-breaking is ``torch.topk``'s, as transformers' routers)."""
    return reference.moe_topk(router_logits, top_k, renormalize)


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up, down,
                *, batch_invariant: bool = False) -> torch.Tensor:
    """Routed SwiGLU experts of a mixture-of-experts layer, grouped by expert (one gate/up and one
    down matmul per active expert over the rows routed to it, no per-token loop): the grouping of
    :func:`sglite.kernels.reference.moe_experts`, each matmul through :func:`linear` (so an
    expert's weight may be a :class:`LinearWeight` or a quantized weight, run by its own
    implementation) and the activation through :func:`silu_mul`.

    x: [N, H]; topk_ids / topk_weights: [N, k] (from :func:`moe_topk`); gate_up, down: sequences
    of E weights [2I, H] and [H, I]. Returns [N, H] in x's dtype. ``batch_invariant``: the
    activation's row-invariant kernel (with the ``invariant`` matmuls a row's result then does not
    depend on the other rows: each token's experts are summed in ascending expert order).
    """
    return reference.moe_experts(x, topk_ids, topk_weights, gate_up, down, linear=linear,
                                 act=lambda g, u: silu_mul(g, u, batch_invariant=batch_invariant))


def lora_add(y, x, a, b, seg_lens, seg_slots, *, spans=None, impl: Optional[str] = None):
    """Segmented LoRA: ``y[i] += (x[i] · A_sᵀ) · b_s`` (``b_s = B_sᵀ``) for every row of a segment of adapter slot
    ``s`` (rows of slot -1 untouched), in place; see :func:`.reference.lora_add`. CUDA: the Triton
    kernel (:mod:`.triton_lora`); CPU: the C++ kernel (:mod:`.cpu_lora`) when it builds; the torch
    reference otherwise (or with ``impl="torch"``). ``spans``: which rank rows and output columns of
    ``a`` / ``b`` are non-zero (:func:`.cpu_lora.lora_add`; a hint the C++ kernel uses to skip zeros,
    the other implementations ignore it: the result is the same)."""
    name = impl or os.environ.get("SGLITE_KERNEL") or ""
    if name and name not in IMPLS:
        raise ValueError(f"unknown kernel implementation {name!r}; known: {list(IMPLS)}")
    if name == "triton" or (not name and x.is_cuda and triton_available()):
        return importlib.import_module(".triton_lora", __package__).lora_add(y, x, a, b, seg_lens, seg_slots)
    if name != "torch" and x.device.type == "cpu":
        from . import cpu_lora

        return cpu_lora.lora_add(y, x, a, b, seg_lens, seg_slots, spans)  # the reference when the build failed
    return reference.lora_add(y, x, a, b, seg_lens, seg_slots)


def apply_token_bitmask(logits, bitmask, indices=None, *, impl: Optional[str] = None):
    """See :func:`sglite.kernels.reference.apply_token_bitmask`."""
    return _op("apply_token_bitmask", resolve_impl(impl, logits))(logits, bitmask, indices)


def greedy(logits, bitmask=None, *, impl: Optional[str] = None):
    """See :func:`sglite.kernels.reference.greedy` (torch ops on any device; a greedy batch needs
    no per-row parameter tensors). CPU float32 logits: the unmasked argmax is the C++ one of
    :func:`.cpu_elementwise.argmax_rows` on the decode thread pool (the same tokens, bit for bit;
    with a grammar mask the reference then re-picks only the rows whose winner it forbids), unless
    ``impl`` / ``SGLITE_KERNEL`` is ``torch``."""
    name = impl or os.environ.get("SGLITE_KERNEL") or ""
    if name != "torch" and logits.device.type == "cpu":
        from . import cpu_elementwise

        if cpu_elementwise.argmax_supported(logits):
            first = cpu_elementwise.argmax_rows(logits)  # the reference when the build failed
            return first if bitmask is None else reference.greedy(logits, bitmask, first)
    return reference.greedy(logits, bitmask)


def sample(logits, temperatures, top_ps, top_ks, min_ps, seeds, positions, bitmask=None,
           *, impl: Optional[str] = None):
    """See :func:`sglite.kernels.reference.sample`. CPU logits: :func:`.cpu_sampling.sample` (the
    reference's tokens from each ranked row's most likely candidates instead of a sort of its whole
    vocabulary), its torch ops on the calling thread (``device.serial_torch``), unless ``impl`` /
    ``SGLITE_KERNEL`` names ``torch`` or ``triton``."""
    name = impl or os.environ.get("SGLITE_KERNEL") or ""
    if name in ("", "cpp") and logits.device.type == "cpu":
        from . import cpu_sampling

        with serial_torch():
            return cpu_sampling.sample(logits, temperatures, top_ps, top_ks, min_ps, seeds, positions, bitmask)
    return _op("sample", resolve_impl(impl, logits))(
        logits, temperatures, top_ps, top_ks, min_ps, seeds, positions, bitmask)
