"""The ``linear`` op (:func:`linear`, re-exported as ``sglite.kernels.linear``): every matmul of the
model, through one op whose implementation is chosen once at load and carried by the weight
(:class:`LinearWeight`).

Implementations (``LinearWeight.impl``):
    ``torch``      ``F.linear`` on the weight as loaded (oneDNN / cuBLAS).
    ``fp16``       rows == 1: ``F.linear`` on a float16 copy of a bf16 weight (oneDNN's fp16 GEMV),
                   the output rounded back to bf16; other row counts: ``torch``.
    ``cpp``        1 <= rows <= 8: the C++ AVX-512-BF16 GEMV (:mod:`.cpu_gemv`); more rows: oneDNN's
                   matmul on a copy of the weight reordered ONCE into oneDNN's blocked layout
                   (``packed``; ``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``),
                   where ``F.linear`` would reorder the plain [N, K] tensor on every call. The path per
                   row count is :func:`.gemm_paths.float_path`'s (``SGLITE_GEMM`` forces it).
    ``onednn``     every row count on the packed copy (no C++ GEMV: CPUs without AVX-512-BF16).
    ``invariant``  batch-invariant (deterministic inference): row i of the result depends only on
                   ``x[i]`` and the weight, whatever the row count (:mod:`.linear_invariant`): on
                   CPU the C++ kernel :func:`.cpu_gemv.linear_invariant` (bf16 and fp32), on CUDA
                   the Triton kernel :func:`.triton_matmul.linear_invariant` (fixed tiles, no
                   split-K); without either, one ``F.linear`` per row.
Quantized weights plug in as more implementations: a :class:`.quant_linear.QuantLinearWeight`
(group-quantized integer codes: GGUF Q4_0/Q4_1/Q8_0, GPTQ, AWQ) carries one of the ``quant_*``
names of :data:`IMPLS` (see :mod:`.quant_linear`), an 8-bit weight of :mod:`.w8_linear` one of the
``fp8*`` / ``w8a8*`` names; :func:`make_linear` builds any kind from a model's (possibly fused)
parts. :data:`IMPLS` is the one registry: the implementation modules know no registry and import
weight types only for typing, so the kernels' imports run one way (registry -> implementations).

Why the choice exists (CPU bf16 models, one-row products of batch-1 decoding): on AVX-512-BF16 CPUs
without AVX-512-FP16 (e.g. AMD Zen 4), oneDNN's one-row bf16 GEMV reads weights at about a quarter
of one core's bandwidth. Measured here (one thread, the 120 SmolLM2-135M layer matrices + the LM
head, 269 MB): oneDNN bf16 33 ms (8 GB/s), oneDNN fp16 on float16 copies 16 ms (17 GB/s), the C++
kernel 13 ms on the weights as loaded (20 GB/s) and 9 ms once they sit in huge pages (30 GB/s).
fp16 copies serve rows ``M == 1`` only (they lose at two rows and more: 23 vs 26 ms at M=2, 178 vs
40 ms at M=16); the kernel serves up to 8 rows (batch <= 8 decode), still streaming the weights
once (M=2 9-11 ms, M=4 11, M=8 20 vs oneDNN bf16 33-41 ms); larger steps use ``F.linear``.

Choice (:func:`choose_impl`, ``EngineConfig.cpu_decode_gemv``): ``cpp`` (the kernel; no weight
copies, the matrices move into one huge-page buffer), ``fp16`` (float16 copies: twice the weight
memory), ``off`` (``torch``), and ``auto``, which times the candidates over the model's own
matrices (:func:`probe_times`: they stream from memory as in decoding; one matrix repeated would
stay in cache) and keeps the fastest, fp16 only when at least :data:`MIN_SPEEDUP` faster than
``off``. ``EngineConfig.enable_deterministic_inference`` overrides all of it with ``invariant``.

Numerics: ``cpp`` sums exact bf16 products in float32 and rounds once to bf16, as oneDNN does (only
the summation order differs). ``fp16``: a bf16 value converts to fp16 exactly when
``6.1e-5 <= |w| <= 65504`` (smaller weights become fp16 subnormals, absolute error <= 3e-8); the
output is rounded to fp16 then bf16 (differs from one rounding only at exact bf16 midpoints). An
activation or output past fp16's range becomes inf: the model checks the step's logits and redoes
the step on ``torch`` (:meth:`LlamaModel.forward`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F

from . import cpu_gemv, gemm_paths, quant_amx, quant_cpu, quant_gemm, quant_linear, w8_linear
from .linear_invariant import linear_invariant
from .quant_linear import QuantLinearWeight, reference_linear

log = logging.getLogger("sglite.kernels.matmul")

MODES = ("auto", "cpp", "fp16", "off")  # EngineConfig.cpu_decode_gemv
MIN_SPEEDUP = 1.3  # adopt the fp16 copies only when the load-time probe finds them this much faster
CPP_MAX_ROWS = cpu_gemv.MAX_ROWS
PACK_ROWS_HINT = 64  # the row count oneDNN's reorder is told to expect (decode batches; any M runs)


@dataclass(eq=False)
class LinearWeight:
    """A matmul weight prepared once at load: the tensor as loaded plus what its implementation needs.

    Attributes:
        weight: [N, K] (out x in features), the model's dtype, contiguous.
        bias: [N] or None.
        impl: a name of :data:`IMPLS`; set through :meth:`use`.
        w16: [N, K] float16 copy (``fp16`` only), else None.
        packed: the weight reordered once for oneDNN (``cpp`` / ``onednn`` on CPU bf16, when
            oneDNN supports bf16 here), else None. Same values; costs a second copy of the weight.
    """

    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    impl: str = "torch"
    w16: Optional[torch.Tensor] = None
    packed: Optional[torch.Tensor] = None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def use(self, impl: str) -> "LinearWeight":
        """Switch to implementation ``impl`` (building or dropping its copies); returns self.

        Raises:
            ValueError: an unknown implementation name (lists the known ones).
        """
        if impl not in IMPLS:
            raise ValueError(f"linear: unknown implementation {impl!r}; known: {list(IMPLS)}")
        self.impl = impl
        self.w16 = self.weight.to(torch.float16) if impl == "fp16" else None
        self.packed = _pack(self.weight) if impl in ("cpp", "onednn") else None
        return self

    def numel(self) -> int:
        """Elements read per product (weight + bias; copies excluded)."""
        return self.weight.numel() + (0 if self.bias is None else self.bias.numel())

    def nbytes(self) -> int:
        """Resident bytes of the weight and bias (copies excluded)."""
        return self.numel() * self.weight.element_size()


def _torch(x: torch.Tensor, lw: LinearWeight) -> torch.Tensor:
    return F.linear(x, lw.weight, lw.bias)


def _fp16(x: torch.Tensor, lw: LinearWeight) -> torch.Tensor:
    if x.shape[0] != 1 or lw.w16 is None:
        return _torch(x, lw)
    y = F.linear(x.to(torch.float16), lw.w16).to(x.dtype)
    return y if lw.bias is None else y + lw.bias


def _pack(w: torch.Tensor) -> Optional[torch.Tensor]:
    """``w`` [N, K] reordered once into oneDNN's blocked layout (an opaque mkldnn tensor), or None
    where that does not apply (not CPU bf16, oneDNN without bf16 support, a failed reorder)."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.dim() != 2 or not torch.backends.mkldnn.is_available():
        return None
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS_HINT)
    except (RuntimeError, AttributeError) as e:  # an older torch / a build without these ops
        log.warning("linear: oneDNN weight prepacking unavailable (%s); batches use F.linear", e)
        return None


def _packed(x: torch.Tensor, lw: LinearWeight) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), lw.packed, lw.bias, "none", [], "")


def _cpp(x: torch.Tensor, lw: LinearWeight) -> torch.Tensor:
    m = x.shape[0]
    path = gemm_paths.float_path(m, cpu_gemv.supports(x, lw.weight), lw.packed is not None and x.dtype == lw.weight.dtype)
    if path == "gemv":
        return cpu_gemv.gemv(x, lw.weight, lw.bias)
    if path == "onednn_packed":
        return _packed(x, lw)
    return _torch(x, lw)


def _onednn(x: torch.Tensor, lw: LinearWeight) -> torch.Tensor:
    if lw.packed is not None and x.shape[0] >= 1 and x.dtype == lw.weight.dtype and gemm_paths.mode() != "torch":
        return _packed(x, lw)
    return _torch(x, lw)


def _invariant(x: torch.Tensor, lw: LinearWeight) -> torch.Tensor:
    return linear_invariant(x, lw.weight, lw.bias)


def _quant_cpp(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    return quant_cpu.linear(x, w)  # only chosen (quant_linear.best_impl) where the kernel loaded


def _quant_invariant(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    if quant_cpu.available() and x.device.type == "cpu":  # every valid group size (16: 8-bit codes)
        return quant_cpu.linear(x, w, invariant=True)
    if x.shape[0] == 0:
        return reference_linear(x, w)
    return torch.cat([reference_linear(x[i:i + 1], w) for i in range(x.shape[0])])  # one row at a time


def _quant_triton(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    from . import triton_quant  # imports triton: only on the CUDA path

    return triton_quant.linear(x, w)


IMPLS: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    # float weights (LinearWeight)
    "torch": _torch, "fp16": _fp16, "cpp": _cpp, "onednn": _onednn, "invariant": _invariant,
    # group-quantized integer weights (QuantLinearWeight; the names of quant_linear.QUANT_IMPLS)
    "quant_ref": reference_linear, "quant_cpp": _quant_cpp, "quant_invariant": _quant_invariant,
    "quant_triton": _quant_triton,
    # 8-bit weights with per-channel or block scales (w8_linear)
    "fp8": w8_linear.fp8_linear, "fp8_ref": w8_linear.fp8_reference, "fp8_invariant": w8_linear.fp8_invariant,
    "fp8_block": w8_linear.fp8_block_linear, "fp8_block_ref": w8_linear.fp8_block_reference,
    "fp8_block_invariant": w8_linear.fp8_block_invariant,
    "w8a8": w8_linear.w8a8_linear, "w8a8_ref": w8_linear.w8a8_reference}

AnyLinearWeight = Union[LinearWeight, QuantLinearWeight]


def make_linear(parts: list, bias: Optional[torch.Tensor], dtype: torch.dtype, device) -> AnyLinearWeight:
    """One matmul weight from ``parts`` stacked along N (e.g. q, k, v projections -> fused QKV).

    Args:
        parts: [N_i, K] float tensors and/or :class:`QuantLinearWeight`.
        bias: [sum N_i] or None (cast to ``dtype``).
        dtype: the activation dtype (float parts are cast to it).
        device: where the weight lives.
    Returns:
        A :class:`QuantLinearWeight` when every part is one and they share a layout
        (:func:`.quant_linear.cat_rows`); otherwise a :class:`LinearWeight`, quantized parts
        dequantized to ``dtype`` (formats that cannot be fused still run, unquantized).
    """
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    if len({type(p) for p in parts}) == 1 and hasattr(type(parts[0]), "concat"):  # 8-bit (w8_linear)
        q = (parts[0] if len(parts) == 1 else type(parts[0]).concat(parts)).to(device)
        q.bias = bias
        return q
    if all(isinstance(p, QuantLinearWeight) for p in parts):
        try:
            q = parts[0] if len(parts) == 1 else quant_linear.cat_rows(parts)
        except ValueError as e:
            log.warning("quantized parts cannot be fused (%s); dequantizing them", e)
        else:
            q = q.to(device)
            q.bias = bias
            return q
    ts = [p if isinstance(p, torch.Tensor) else p.dequantize(dtype) for p in parts]
    w = ts[0] if len(ts) == 1 else torch.cat([t.to(dtype) for t in ts])
    return LinearWeight(w.to(device=device, dtype=dtype).contiguous(), bias)


def linear(x: torch.Tensor, weight: Union[LinearWeight, QuantLinearWeight, torch.Tensor],
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` through the weight's implementation.

    Args:
        x: [M, K] activations (M >= 0), the weight's dtype.
        weight: a :class:`LinearWeight` or :class:`QuantLinearWeight` (its ``bias`` and ``impl``
            apply) or a plain [N, K] tensor (``F.linear`` with ``bias``).
        bias: [N] or None; only with a plain tensor (a LinearWeight carries its own).
    Returns:
        [M, N] in x's dtype.
    Raises:
        ValueError: ``bias`` given together with a LinearWeight.
    """
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    if bias is not None:
        raise ValueError("linear: a LinearWeight carries its own bias; pass bias=None")
    return IMPLS[weight.impl](x, weight)


def linear_silu(x: torch.Tensor, weight: Union[LinearWeight, QuantLinearWeight]) -> Optional[torch.Tensor]:
    """SwiGLU's activation ``silu(g) * u`` [M, I] straight from a fused gate/up ``weight`` [2I, K]
    (``g, u = linear(x, weight).chunk(2, -1)``) where its implementation writes it from the GEMM's
    output stage: ``quant_cpp`` tiled weights on the AMX path (:func:`.quant_cpu.linear_silu_mul`,
    bit-identical to :func:`linear` then ``silu_mul``). x: [M, K] bf16 (other dtypes: None); returns
    [M, I] bf16, or None otherwise (the caller runs both). Raises nothing of its own: a weight it
    cannot take is None, not an error."""
    if isinstance(weight, QuantLinearWeight) and weight.impl == "quant_cpp" and x.device.type == "cpu":
        return quant_cpu.linear_silu_mul(x, weight)
    return None


def probe_times(weights: list[torch.Tensor], candidates: tuple[str, ...] = ("off", "fp16", "cpp"),
                reps: int = 3) -> dict[str, float]:
    """Seconds for one-row products against every matrix of ``weights`` ([N, K] bf16, CPU), best
    pass of ``reps``, per candidate path (``off``: ``F.linear`` in bf16; ``fp16``: float16 copies,
    made here and dropped; ``cpp``: the C++ kernel, skipped when unavailable). Pass the model's own
    matrices so they stream from memory as in decoding."""
    xs = {w.shape[1]: torch.randn(1, w.shape[1]).to(w.dtype) for w in weights}
    mod = cpu_gemv.load()

    def best(ws, x, f) -> float:
        t = float("inf")
        for _ in range(reps):
            s = time.perf_counter()
            for w in ws:
                f(x[w.shape[1]], w)
            t = min(t, time.perf_counter() - s)
        return t

    out = {}
    for c in candidates:
        if c == "off":
            out[c] = best(weights, xs, F.linear)
        elif c == "fp16":
            out[c] = best([w.to(torch.float16) for w in weights],
                          {k: v.to(torch.float16) for k, v in xs.items()}, F.linear)
        elif c == "cpp" and mod is not None:
            out[c] = best(weights, xs, lambda x, w: mod.gemv_bf16(x, w, None))
    return out


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"cpu_decode_gemv: must be {'|'.join(MODES)}, got {mode!r}")


def choose_gemv(mode: str, dtype: torch.dtype, device: str, probe_weights: list[torch.Tensor]) -> str:
    """The one-row matmul path of ``EngineConfig.cpu_decode_gemv``: ``"cpp"``, ``"fp16"`` or ``"off"``.

    ``mode``: ``off``; ``fp16`` / ``cpp`` force that path on CPU bf16 models (``cpp`` degrades to
    ``off`` when the kernel is unavailable); ``auto`` on CPU bf16 models picks the fastest of
    :func:`probe_times` over ``probe_weights`` (the model's [N, K] matrices), counting fp16 only
    when >= :data:`MIN_SPEEDUP` x faster than ``off``. Other devices or dtypes: ``off``.
    Raises ValueError for an unknown mode.
    """
    _check_mode(mode)
    if mode == "off" or device != "cpu" or dtype != torch.bfloat16:
        return "off"
    if mode == "fp16":
        return "fp16"
    if mode == "cpp":
        if not cpu_gemv.available():
            log.warning("cpu_decode_gemv=cpp: the C++ GEMV is unavailable here (needs AVX-512-BF16 and a "
                        "compiler); using oneDNN bf16")
            return "off"
        return "cpp"
    if not probe_weights:  # every matmul quantized (a GGUF model's blocks): nothing to time or choose
        return "off"
    t = probe_times(probe_weights)
    log.info("one-row matmul probe over %d matrices: %s", len(probe_weights),
             ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()))
    if t["fp16"] * MIN_SPEEDUP > t["off"]:
        del t["fp16"]
    return min(t, key=t.get)


def choose_impl(mode: str, dtype: torch.dtype, device: str, probe_weights: list[torch.Tensor],
                deterministic: bool = False) -> str:
    """The :data:`IMPLS` name every matmul of a model uses, decided once at load.

    ``deterministic`` (``EngineConfig.enable_deterministic_inference``) gives ``invariant`` (the
    mode is still validated); otherwise :func:`choose_gemv`'s answer, ``off`` mapped to ``torch``.
    On CPU it logs :func:`.gemm_paths.describe` (the path per row count; builds the VNNI GEMM).
    Raises ValueError for an unknown mode.
    """
    if deterministic:
        _check_mode(mode)
        return "invariant"
    g = choose_gemv(mode, dtype, device, probe_weights)
    impl = "torch" if g == "off" else g
    if device == "cpu":  # the dispatcher's table, once per model load
        log.info("CPU matmul paths: %s", gemm_paths.describe(
            gemv_ok=impl == "cpp", packed_ok=impl == "cpp" and dtype == torch.bfloat16,
            vnni_gemm_ok=dtype == torch.bfloat16 and quant_gemm.available(),
            amx_ok=dtype == torch.bfloat16 and quant_amx.available()))
    return impl
