"""Fused C++ CPU decode attention over a quantized KV pool (int8 / int4, KIVI layout; fp8_e4m3 through
:mod:`.cpu_attention`'s kernel, :func:`decode_attention_fp8`), the pools' C++ dequantization
(:func:`dequant_groups`, :func:`dequant_fp8`), sealing (:func:`seal_groups`) and store
(:func:`store`).

Same contract as :func:`.kv_quant.decode_attention` (the torch reference):
    q            [B, Hq, D] float32 | bfloat16 (unit stride along D)
    layer        :class:`.kv_quant.QuantKVLayer` of kind int8 / int4 on CPU: codes [S, Hkv, Dq]
                 uint8 and value scales [S, Hkv, 2] float16 (any strides with a unit last stride:
                 the pool's head-major storage), key scales [S/G, Hkv, 2, D] float16 contiguous,
                 residual windows [R, G, Hkv, D] float32 | bfloat16
    req_to_token [R, Lmax] int32; req_pool_indices / seq_lens [B] int64
    returns      [B, Hq, D] in q's dtype; Hq % Hkv == 0, D <= 256 (int4: D even).

One task per (request, KV head) (``at::parallel_for``), reading the pool in place. Keys of a
sealed group (G contiguous slots sharing per-channel scale ``s`` and minimum ``z``) are scored as
``(q*s) . codes + q . z``: the scaled query and the constant are formed once per group, so a key
row costs one widen + FMA per channel, as a bf16 row does. Values (per-token scale ``sv``, minimum
``zv``) accumulate ``(p*sv) * codes`` and ``sum p*zv`` is added once at the end. Positions from the
row's quantized boundary (``row_len // G * G``) on come from its residual window; the rare rows of a
short extend whose own group the step sealed (:func:`.kv_quant.needs_stash`) are redone by the
reference, which reads the step's stash. Float32
arithmetic, two-pass softmax as :mod:`.cpu_attention`; a request's result depends only on its own
inputs (batch-invariant). AVX-512 when the compiler targets it (D a multiple of 16, int4 of 32),
portable loops otherwise. Build and fallback as :mod:`.cpu_attention`: the torch reference runs
when the extension is unavailable or the inputs are not covered (fp8 pools, other devices).
"""
from __future__ import annotations

import functools

import torch

from . import kv_quant
from .cpu_build import load_cpp, read_source
from .device import serial_torch

_LIB = "sglite_kv_quant"
MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=None)
def load():
    """The compiled ops namespace, or None after one logged warning (see :func:`.cpu_build.load_cpp`)."""
    return load_cpp("sglite_kv_quant", read_source("kv_quant_attention.cpp"), ("-O3", "-march=native"),
                    ops_namespace=_LIB)


def available() -> bool:
    """True when the extension compiled (or was already built) and loaded."""
    return load() is not None


def supported(q: torch.Tensor, layer: kv_quant.QuantKVLayer) -> bool:
    """Whether the kernel covers these inputs (CPU int8/int4 layer, float32/bfloat16 q and residual)."""
    return (layer.kind in kv_quant.INT_KINDS and q.device.type == "cpu" and layer.k_data.device.type == "cpu"
            and q.dtype in (torch.float32, torch.bfloat16) and q.dim() == 3 and q.stride(-1) == 1
            and layer.res_k.dtype in (torch.float32, torch.bfloat16) and layer.head_dim <= MAX_HEAD_DIM
            and layer.k_data.stride(-1) == 1 and layer.v_data.stride(-1) == 1 and layer.k_scale.is_contiguous()
            and layer.v_scale.stride(-1) == 1 and layer.res_k.is_contiguous() and layer.res_v.is_contiguous())


def decode_attention(q: torch.Tensor, layer: kv_quant.QuantKVLayer, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Fused decode attention over a quantized pool; see the module docstring.

    Raises:
        ValueError: mismatched shapes, a seq_len outside [1, Lmax].
        IndexError: a request row or a slot outside the table / pool.
    """
    if layer.kind == "fp8_e4m3":
        return decode_attention_fp8(q, layer, req_to_token, req_pool_indices, seq_lens, sm_scale)
    ops = load()
    if ops is None or not supported(q, layer):
        return kv_quant.decode_attention(q, layer, req_to_token, req_pool_indices, seq_lens, sm_scale)
    if req_to_token.dtype != torch.int32 or req_to_token.stride(-1) != 1:
        req_to_token = req_to_token.to(torch.int32).contiguous()
    rows = req_pool_indices.to(torch.int64).contiguous()
    stash = kv_quant.needs_stash(layer, rows, seq_lens)
    out = ops.decode_attention(q, layer.k_data, layer.v_data, layer.k_scale, layer.v_scale, layer.res_k,
                                layer.res_v, req_to_token, rows, seq_lens.to(torch.int64).contiguous(),
                                layer.sealed_lens(rows).contiguous(), float(sm_scale), layer.bits, layer.group)
    if bool(stash.any()):  # rows of a short extend whose group the step sealed: the reference
        i = stash.nonzero().squeeze(1)
        out[i] = kv_quant.decode_attention(q[i], layer, req_to_token, rows[i], seq_lens[i], sm_scale)
    return out


def fp8_scales(q: torch.Tensor, layer: kv_quant.QuantKVLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 pool's per-KV-head key and value scales ([Hkv] float32) as factors of q's heads:
    [Hq, 1] float32 each (query head h belongs to KV head h // (Hq / Hkv))."""
    g = q.shape[1] // layer.k_scale.shape[0]
    return (layer.k_scale.float().repeat_interleave(g)[:, None], layer.v_scale.float().repeat_interleave(g)[:, None])


def decode_attention_fp8(q: torch.Tensor, layer: kv_quant.QuantKVLayer, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Decode attention over an fp8_e4m3 pool through :mod:`.cpu_attention`'s kernel, which reads the
    float8 codes in place (``load16`` of ``csrc/cpu_attention.cpp``): the scores of ``q * k_scale``
    against the codes equal those of ``q`` against ``codes * k_scale`` (the reference's dequantized
    keys) up to float32 rounding, and the output is scaled by ``v_scale``; the torch reference when
    the kernel is unavailable. q [B, Hq, D] -> [B, Hq, D] in q's dtype."""
    from . import cpu_attention

    if (not cpu_attention.available() or q.device.type != "cpu" or layer.k_data.stride(-1) != 1
            or layer.head_dim > cpu_attention.MAX_HEAD_DIM):
        return kv_quant.decode_attention(q, layer, req_to_token, req_pool_indices, seq_lens, sm_scale)
    with serial_torch():  # the scaling is torch glue between C++ kernels (device.serial_torch)
        ks, vs = fp8_scales(q, layer)
        qs = (q.float() * ks).contiguous()
    out = cpu_attention.decode_attention(qs, layer.k_data, layer.v_data, req_to_token, req_pool_indices, seq_lens,
                                         sm_scale, cascade_min=0)
    with serial_torch():
        return (out * vs).to(q.dtype)


def dequant_groups(layer: kv_quant.QuantKVLayer, gids: torch.Tensor, dtype: torch.dtype):
    """K and V [n * G, Hkv, D] in ``dtype`` (float32 / bfloat16) of whole key groups ``gids`` ([n]
    int64) of an int8 / int4 CPU layer, as :func:`.kv_quant.dequant_slots` computes them (bf16: that
    float32 result rounded once); None when the C++ build is unavailable or the inputs are not covered
    (``csrc/kv_dequant.h``)."""
    ops = load()
    if (ops is None or layer.kind not in kv_quant.INT_KINDS or layer.k_data.device.type != "cpu"
            or dtype not in (torch.float32, torch.bfloat16) or not layer.k_scale.is_contiguous()):
        return None
    return ops.dequant_groups(layer.k_data, layer.v_data, layer.k_scale, layer.v_scale,
                              gids.to(torch.int64).contiguous(), layer.bits, layer.group, dtype == torch.bfloat16)


def store(layer: kv_quant.QuantKVLayer, out_cache_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """:func:`.kv_quant.store_kv` of a CPU layer in one C++ call: the step's K / V ([N, Hkv, D], slots
    ``out_cache_loc`` [N] int64, tokens in the order of ``layer.step``). int8 / int4
    (``csrc/kv_seal.h`` store_groups): into the residual windows, and every key group the step
    completes sealed with :func:`.kv_quant.quantize`'s arithmetic bit for bit; returns the stash
    ``(groups [NB] int64 ascending, K, V [NB, G, Hkv, D])`` as the torch store builds it. fp8_e4m3
    (``csrc/kv_dequant.h`` store_fp8): ``x / scale`` clamped and rounded as torch converts to float8;
    returns ``()``. None (nothing written) when the build is unavailable or the inputs are not
    covered.

    Raises:
        IndexError: a token's row, position or slot outside the pool, or a position not at its
        offset in its page."""
    ops = load()
    if ops is None or layer.k_data.device.type != "cpu" or k.dtype not in (torch.float32, torch.bfloat16):
        return None
    loc = out_cache_loc.to(torch.int64).contiguous()
    if layer.kind == "fp8_e4m3":
        if k.stride(-1) != 1 or v.stride(-1) != 1 or v.dtype != k.dtype:
            return None
        ops.store_fp8(layer.k_data, layer.v_data, layer.k_scale, layer.v_scale, k, v, loc)
        return ()
    rk, st = layer.res_k, layer.step
    if (rk.dtype not in (torch.float32, torch.bfloat16) or not layer.k_scale.is_contiguous()
            or not rk.is_contiguous() or not layer.res_v.is_contiguous() or st.row_len is None):
        return None
    return ops.store_groups(layer.k_data, layer.v_data, layer.k_scale, layer.v_scale, rk, layer.res_v,
                            k.to(rk.dtype).contiguous(), v.to(rk.dtype).contiguous(), st.tok_rows.contiguous(),
                            st.positions.contiguous(), st.row_len.contiguous(), loc, layer.bits)


def dequant_fp8(layer: kv_quant.QuantKVLayer, slots: torch.Tensor, dtype: torch.dtype):
    """K and V [T, Hkv, D] in ``dtype`` (float32 / bfloat16) of ``slots`` ([T] int64) of an fp8_e4m3 CPU
    layer, as :func:`.kv_quant.dequant_slots` computes them (bf16: that float32 product rounded
    once); None when the C++ build is unavailable or the inputs are not covered
    (``csrc/kv_dequant.h``).

    Raises:
        IndexError: a slot outside the pool."""
    ops = load()
    if (ops is None or layer.kind != "fp8_e4m3" or layer.k_data.device.type != "cpu"
            or dtype not in (torch.float32, torch.bfloat16)):
        return None
    return ops.dequant_fp8(layer.k_data, layer.v_data, layer.k_scale, layer.v_scale,
                           slots.to(torch.int64).contiguous(), dtype == torch.bfloat16)


def seal_groups(layer: kv_quant.QuantKVLayer, groups: torch.Tensor, bk: torch.Tensor, bv: torch.Tensor) -> bool:
    """Quantize full-precision key groups ``bk`` / ``bv`` ([NB, G, Hkv, D] float32 / bfloat16) into
    pool groups ``groups`` ([NB] int64) of an int8 / int4 CPU layer with :func:`.kv_quant.quantize`'s
    arithmetic bit for bit (``csrc/kv_seal.h``, shared with the fused decode); False (nothing
    written) when the C++ build is unavailable or the inputs are not covered."""
    ops = load()
    if (ops is None or layer.kind not in kv_quant.INT_KINDS or layer.k_data.device.type != "cpu"
            or bk.dtype not in (torch.float32, torch.bfloat16) or not layer.k_scale.is_contiguous()):
        return False
    ops.seal_groups(layer.k_data, layer.v_data, layer.k_scale, layer.v_scale, bk.contiguous(), bv.contiguous(),
                    groups.to(torch.int64).contiguous(), layer.bits)
    return True
