"""Fused CPU decode: every decoder layer of a Llama-family model with group-quantized weights in ONE
C++ call per step (source ``csrc/decode_layer.cpp``), for steps of 1..32 decode rows (GEMVs in
blocks of 8 rows).

Why: at batch 1 the per-op path (:meth:`sglite.runtime.models.llama.LlamaModel._forward`) issues
~25 torch / dispatcher calls per layer (norms, splits, RoPE, KV scatter, attention, residual adds,
SiLU), ~5 ms of a ~17 ms step of the default model on one thread; the fused call runs the same
math in C++ with float32 activations between the ops.

Per layer (Llama: RMSNorm of Zhang & Sennrich 2019, RoPE of Su et al. 2021 in the rotate-half
form, GQA, SwiGLU of Shazeer 2020): RMSNorm -> QKV GEMV -> RoPE on q and k -> K/V written into the
paged pool at ``out_cache_loc`` (in the pool's dtype) -> paged decode attention reading the pool in
place (the ``sglite_cpu_attention`` op of :mod:`.cpu_attention`) -> o_proj + residual -> RMSNorm ->
gate/up GEMV -> ``silu(g) * u`` -> down + residual; then the final RMSNorm in C++ and the LM head
through :mod:`.quant_cpu` (or ``kernels.linear`` for a float head).

Matmul arithmetic (``q8``): float32 models (``dtype=float32``) run the float-exact GEMV of
:mod:`.quant_cpu` (x split into three bf16 planes), so logits match the per-op path up to float32
summation order and greedy tokens are identical (tests). bf16 models run the int8-activation GEMV
(:func:`.quant_cpu.gemv_q8`: each 32-block of the activation row rounded to int8 with its own
scale, integer dots on AVX-512 VNNI, as llama.cpp's Q8_1 activations; CPUs without VNNI keep the
float GEMV): faster, not bf16-exact
(its greedy agreement with the per-op path is measured in docs/benchmarks.md).

bf16 models also get their weights' scales and mins stored as float16 where that is exact
(:func:`.quant_layout.compact_scales`; GGUF's are float16 in the file): the default model's
resident weights go from 115 MB to 98 MB, the bytes every decode step streams. On VNNI CPUs their
group-32 weights (the LM head / tied embedding too) are then interleaved in 16-row tiles
(:func:`.quant_layout.tile_rows`, ``csrc/quant_tiles.h``): same bytes, about 4x fewer vector
instructions per weight byte than the row layout's GEMV, so the step becomes memory-bound.

Threads (``csrc/thread_pool.h``): the C++ calls split each GEMV's output rows (16-row tiles) and
the LM head in contiguous shares over a persistent pool of pinned workers (spin, then sleep), one
fork/join per matrix, and the attention's (row, KV head) tasks the same way; the elementwise ops
between the matrices (norms, RoPE, KV store, SiLU, residuals) run on the calling thread. Every
output is computed by one thread with the same code whatever the split, so the logits are bitwise
those of one thread (tests/kernels/test_decode_threads.py). The thread count is
:attr:`FusedDecode.threads`, else ``torch.get_num_threads()`` (the engine's ``num_threads``, by
default the fastest measured at start-up: :mod:`.decode_threads`). Before the pool these kernels
had no threads at all: sglite builds its extensions without ``-fopenmp``, so ``at::parallel_for``
in them runs serially.

LoRA (``csrc/lora_fused.h``, docs/lora.md): a step whose rows have adapters (``fb.lora``, a
:class:`LoraStep`) passes, per layer and matmul, the adapter slots' stacked ``A`` [S, RT, in] and
``B`` [S, RT, out] (float32 or bf16, scaling folded in), each row's slot per matmul (-1: none) and
per slot the rank rows and output columns each rank block uses; after each GEMV the C++ adds
``t . B[slot]`` with ``t = x . A[slot]ᵀ`` (float32) to the adapted rows, rows grouped by slot. A
shrink or expand splits over the pool from :attr:`FusedDecode.lora_split_min` multiply-adds.
Without adapters the call gets empty LoRA arguments and runs as before.

Used only when the preconditions hold (:func:`prepare`, static; :meth:`FusedDecode.forward`, per
step): a plain Llama layer (the model's ``fused_decode_ok`` is not False: MoE models set it
False), or a family layer (Gemma 2/3, OLMo 2, Granite, Qwen3's QK-norm: their norms, scales,
GeGLU, QK-norm, sliding windows and soft-capping as the options of :mod:`.decode_family`, whose
``prepare`` the model runner calls), CPU, float32/bf16, no tensor parallelism, no batch-invariant
mode, no QKV bias,
every layer matmul a :class:`.quant_linear.QuantLinearWeight` with group size 32 (or 16 with 8-bit
codes: GGUF Q6_K, read as two scales per 32-block; every GGUF native type qualifies), no input
permutation and no bias, a float KV pool or a quantized one (int8 / int4 / fp8_e4m3:
:meth:`FusedDecode.quant_pool_args`; family layers too, unless the model has local (sliding-window)
layers or attention soft-capping, which quantized pools do not support), a step of only decode
rows, 1..32 of them;
otherwise the per-op path runs (it is the reference). RoPE: the C++ rotates with the model's own
cos/sin rows (``model.cos[positions]``, float32 [N, D/2]), the tables the per-op path reads, so
every RoPE variant that only changes those tables (``sglite/runtime/models/rope.py``: linear,
dynamic, YaRN and LongRoPE with their attention factor folded in, Llama 3) is computed the same;
a table that does not rotate the whole head (partial rotary: width != D/2) is refused.
``SGLITE_KERNEL=torch`` switches it off; a
failed build logs one warning and leaves the per-op path.
"""
from __future__ import annotations

import functools
import os
from typing import Optional, Protocol

import torch

from .cpu_build import load_cpp, read_source
from .device import cpu_flags, serial_torch
from .quant_layout import compact_scales, tile_rows, tileable_group
from .quant_linear import QuantLinearWeight
from . import cpu_attention, gemm_paths, kv_quant, kv_quant_cpu, quant_amx, quant_cpu

MAX_ROWS = 32  # more decode rows: the per-op path (its GEMM on dequantized weights wins there)
MAX_ROWS_AMX = 128  # with the AMX tile GEMM (quant_amx.h) from gemm_paths.AMX_MIN_ROWS rows; csrc kMaxRows
LINEAR_KEYS = ("qkv", "o", "gate_up", "down")
_NO_ROWS = torch.empty(0, dtype=torch.int64)  # lora_rows of a step without adapters
_PLAIN_POOL = ([], torch.empty(0, dtype=torch.int64), 0)  # decode_forward's kvq arguments of a float pool
ATTN_SPLIT_MIN = 1 << 16  # K/V values per step (sum of lens x KV heads x head dim); see FusedDecode.attn_split_min
LORA_SPLIT_MIN = 1 << 21  # multiply-adds of one LoRA shrink or expand; see FusedDecode.lora_split_min


def many_row_gemm(portable: bool = False) -> Optional[str]:
    """The many-row GEMM the fused decode's build compiles on this CPU: ``"amx"`` (the AMX tile
    GEMM, quant_amx.h), ``"vnni"`` (the int8 VNNI GEMM, quant_gemm_kernel.h: AVX-512 with VNNI and
    no AMX) or None (the GEMV in 8-row blocks only: ``portable``, or no AVX-512)."""
    flags = cpu_flags()
    if portable or not all(f in flags for f in quant_cpu.AVX_FLAGS):
        return None
    if all(f in flags for f in quant_amx.REQUIRED_FLAGS):
        return "amx"
    return "vnni" if quant_cpu.VNNI_FLAG in flags else None


@functools.lru_cache(maxsize=None)
def load(portable: bool = False):
    """The compiled module (the AVX-512 build with :data:`.quant_cpu.AVX_FLAGS` (+ VNNI) on CPUs that
    have them unless ``portable``; + the AMX tile GEMM's flags where :func:`many_row_gemm` is
    ``"amx"``), or None after one logged warning."""
    flags = cpu_flags()
    simd = not portable and all(f in flags for f in quant_cpu.AVX_FLAGS)
    cflags = quant_cpu.CFLAGS_AVX + (("-mavx512vnni",) if quant_cpu.VNNI_FLAG in flags else ()) if simd \
        else quant_cpu.CFLAGS_PORTABLE
    if many_row_gemm(portable) == "amx":
        cflags = cflags + ("-mavx512dq", "-mamx-tile", "-mamx-bf16")  # quant_amx.h: the many-row steps' tile GEMM
    return load_cpp("sglite_decode_layer" + ("" if simd else "_portable"), read_source("decode_layer.cpp"), cflags,
                    functions=["decode_forward", "head_q8", "probe_gemvs", "decode_family_forward"])


def _tileable(w) -> bool:
    return _quant_ok(w) and w.shape[0] % 16 == 0


def _quant_ok(w) -> bool:
    return (isinstance(w, QuantLinearWeight) and tileable_group(w.group_size, w.bits) and w.perm is None
            and w.bias is None and w.device.type == "cpu")


class LoraStep(Protocol):
    """One step's LoRA adapters as the fused decode reads them (:class:`sglite.lora.LoraBatch`)."""

    def fused_args(self, keys: tuple, num_rows: int) -> tuple[list, torch.Tensor, list]:
        """(per layer and key ``a`` [S, RT, in], ``b`` [S, RT, out] float32/bf16 or two empty
        tensors; ``rows`` [len(keys), num_rows] int64 slots, -1: none; per key ``spans`` [S,
        blocks, 3] int64: rank rows used, output columns [lo, hi))."""


class FusedDecode:
    """The packed inputs of one model's fused decode (built once at load by :func:`prepare`).

    Attributes:
        q8: int8 activations (bf16 models) or the float-exact GEMV (float32 models).
        quant_kv: whether steps over a quantized KV pool may run here (:meth:`quant_pool_args`).
    """

    quant_kv = True

    def __init__(self, model, q8: bool, portable: bool = False):
        a = model.arch
        self.model, self.q8, self.portable = model, q8, portable
        self.threads: Optional[int] = getattr(self, "threads", None)  # None: torch.get_num_threads() per step
        # the attention splits over threads from this many K/V values read per step (below, one op call
        # costs less than the calls of a split; 0: always split)
        self.attn_split_min: int = getattr(self, "attn_split_min", ATTN_SPLIT_MIN)
        self.norms = self._norms(model)

        # a LoRA shrink / expand splits over threads from this many multiply-adds (0: always split)
        self.lora_split_min: int = getattr(self, "lora_split_min", LORA_SPLIT_MIN)
        self._amx: Optional[bool] = None  # amx_min()'s static conditions, filled on first use
        self._vnni: Optional[bool] = None  # the same for the VNNI GEMM (_vnni_on)
        self._layers_amx: Optional[tuple] = None  # (gemm_paths.fused_constants(), the layers' threshold)
        self._kvq: Optional[tuple] = None  # quant_pool_args' per-pool lists (key, layers, res K, res V, kvq)
        self.final_norm = model.norm.float().contiguous()  # [H]
        self.lin, self.bits, self.packed = [], [], []
        self.shapes: list = []  # (n, k, bits) of every layer weight: gemm_paths.fused_layers_amx_min
        for L in model.layers:
            for k in LINEAR_KEYS:
                w = L[k]
                self.lin += [w.qweight, w.scales, w.mins if w.mins is not None else torch.empty(0)]
                self.bits.append(w.bits)
                self.shapes.append((int(w.shape[0]), int(w.shape[1]), int(w.bits)))
                self.packed.append(quant_amx.packed_arg(w))
        if not any(p.numel() for p in self.packed):
            self.packed = []  # none repacked (quant_amx.repack): every call dequantizes
        self.dims = (a.num_heads, a.num_kv_heads, a.head_dim, float(a.rms_norm_eps), float(model.sm_scale))
        head = model.lm_head
        self.head_kind = ("q8" if q8 and _quant_ok(head) else "quant") if isinstance(head, QuantLinearWeight) else "float"
        tiled = {L[k].tiled for L in model.layers for k in LINEAR_KEYS}
        if len(tiled) != 1:
            raise ValueError("fused decode: the layer weights must be all tiled or none")
        self.tiled = tiled.pop()

    def _norms(self, model) -> torch.Tensor:
        """[L, 2, H] float32 (input, post-attention) RMSNorm weights of every layer."""
        return torch.stack([torch.stack([L["in_norm"].float(), L["post_norm"].float()])
                            for L in model.layers]).contiguous()

    def refresh(self) -> None:
        """Re-read the weight tensors (after :meth:`LlamaModel.pack_hugepages` moved them)."""
        self.__init__(self.model, self.q8, self.portable)

    def quant_pool_args(self, fb, layers) -> Optional[tuple]:
        """``(k_buffers, v_buffers, out_cache_loc, kvq args)`` for a step over an int8 / int4 KIVI
        pool (``layers``: its :class:`.kv_quant.QuantKVLayer` list), or None when such a step is
        not for the fused path: the C++ attention unavailable or not covering the layer, a layer
        whose :attr:`quant_kv` is False (a family model with local layers or attention
        soft-capping: :class:`.decode_family.FamilyFusedDecode`), or several rows of one request (a short extend) in different key groups (the per-op
        path reads such a step's sealed group from its stash); fp8 pools: :meth:`_fp8_pool_args`.

        The step's K/V go into the residual windows (viewed [R * G, Hkv, D], row ``request row * G +
        position % G``), where the per-op :func:`.kv_quant.store_kv` puts a token that completes
        no key group; a row that completes its group has the group quantized into the pool in C++
        (``csrc/decode_kv_quant.h``, :func:`.kv_quant.quantize`'s arithmetic bit for bit) before each
        layer's attention, :mod:`.kv_quant_cpu`'s op (the per-op path's kernel)."""
        L0 = layers[0]
        if L0.kind == "fp8_e4m3":
            return self._fp8_pool_args(fb, layers)
        if (not self.quant_kv or L0.kind not in kv_quant.INT_KINDS or L0.res_k.dtype not in (torch.float32, torch.bfloat16)
                or not kv_quant_cpu.available() or L0.head_dim > kv_quant_cpu.MAX_HEAD_DIM):
            return None
        G, lens, rows = L0.group, fb.dec_seq_lens, fb.dec_req_pool_indices
        if rows.shape[0] > 1:  # a short extend's rows of one request across a key group (chunks, jump-forward):
            # the rows past the group's end would overwrite its residual rows before it is sealed
            with serial_torch():
                g = (lens - 1) // G
                if bool(((rows[:, None] == rows[None, :]) & (g[:, None] != g[None, :])).any()):
                    return None
        key = (id(L0), len(layers))  # the cache keeps the layers alive: an id is not reused meanwhile
        if self._kvq is None or self._kvq[0] != key:
            R, _, Hkv, D = L0.res_k.shape
            kvq = [t for x in layers for t in (x.k_data, x.v_data, x.k_scale, x.v_scale, x.res_k, x.res_v)]
            if not all(t.stride(-1) == 1 for t in kvq) or not all(x.res_k.is_contiguous() and x.res_v.is_contiguous()
                                                                  and x.k_scale.is_contiguous() for x in layers):
                return None
            self._kvq = (key, layers, [x.res_k.view(R * G, Hkv, D) for x in layers],
                         [x.res_v.view(R * G, Hkv, D) for x in layers], kvq)
        _, _, kb, vb, kvq = self._kvq
        L0.step.stash.clear()  # as store_kv: only extend rows read the stash, and this step has none
        with serial_torch():
            loc = (fb.dec_req_pool_indices * G + (lens - 1) % G).contiguous()
        return kb, vb, loc, (kvq, fb.out_cache_loc.contiguous(), L0.bits)

    def _fp8_pool_args(self, fb, layers) -> Optional[tuple]:
        """:meth:`quant_pool_args` of an fp8_e4m3 pool: its float8 codes as the buffers, stored at the
        step's slots as ``x / scale`` (as :func:`.kv_quant.store_kv`), and per layer the key and
        value scales ([Hkv] float32, the pool's own tensors): the attention (:mod:`.cpu_attention`'s
        kernel, which reads the codes) runs on ``q * key scale`` of each query head's KV head and the
        output is scaled by the value scale, as :func:`.kv_quant_cpu.decode_attention_fp8`."""
        L0 = layers[0]
        if not self.quant_kv or not cpu_attention.available() or L0.k_data.stride(-1) != 1:
            return None
        key = ("fp8", id(L0), len(layers))
        if self._kvq is None or self._kvq[0] != key:
            kvq = [t.float().contiguous() for x in layers for t in (x.k_scale, x.v_scale)]  # the pool's own float32 [Hkv]
            self._kvq = (key, layers, [x.k_data for x in layers], [x.v_data for x in layers], kvq)
        _, _, kb, vb, kvq = self._kvq
        return kb, vb, fb.out_cache_loc, (kvq, _PLAIN_POOL[1], 0)

    def hidden(self, fb, k_buffers, v_buffers, quant: Optional[tuple] = None) -> torch.Tensor:
        """[N, H] float32 final-normed hidden states of the step's decode rows (KV written), with
        the rows' LoRA deltas when the step has adapters (``fb.lora``: a :class:`LoraStep`).
        ``quant``: :meth:`quant_pool_args` of a step over a quantized pool (replaces the buffers
        and slots), None for a float pool."""
        m = self.model
        kvq_args, loc = _PLAIN_POOL, fb.out_cache_loc
        if quant is not None:
            k_buffers, v_buffers, loc, kvq_args = quant
        with serial_torch():  # the torch glue on this thread (device.serial_torch: OpenMP stalls under load)
            x = m.embed_rows(fb.input_ids).float().contiguous()  # [N, H]
            cos, sin = m.cos[fb.positions].contiguous(), m.sin[fb.positions].contiguous()  # [N, D/2] float32
            rt = fb.req_to_token
            if rt.dtype != torch.int32:
                rt = rt.to(torch.int32)
        Hq, Hkv, D, eps, sm = self.dims
        lora = getattr(fb, "lora", None)
        ab, rows, spans = ([], _NO_ROWS, []) if lora is None else lora.fused_args(LINEAR_KEYS, x.shape[0])
        return load(self.portable).decode_forward(
            x, self.norms, self.lin, self.bits, self.final_norm, cos, sin, list(k_buffers),
            list(v_buffers), loc.contiguous(), rt, fb.dec_req_pool_indices.contiguous(),
            fb.dec_seq_lens.contiguous(), Hq, Hkv, D, eps, sm, self.q8, self.tiled, self.num_threads(),
            self.attn_split_min, ab, rows, spans, self.lora_split_min, self.amx_min(), self.packed,
            0 if kvq_args[0] else self.cascade_min(), *kvq_args)

    def amx_min(self) -> int:
        """Rows from which this step's tiled layer GEMMs run on a many-row GEMM instead of the int8
        GEMV in 8-row blocks: the AMX tiles (quant_amx.h; bf16 activations, float32 sums;
        :func:`.gemm_paths.fused_layers_amx_min` of the layer weights), or on a build with VNNI and
        no AMX the int8 VNNI GEMM (quant_gemm_kernel.h, the GEMV's activation rounding; from
        :data:`.gemm_paths.FUSED_VNNI_MIN_ROWS`), or 0: off (a float32 or row-layout model, the
        portable build, ``SGLITE_GEMM`` other than ``auto``; read per step, as the dispatcher)."""
        gemm = self._many_rows()
        if gemm != "amx":
            return gemm_paths.FUSED_VNNI_MIN_ROWS if gemm else 0
        key = gemm_paths.fused_constants()  # the fold over ~4L weights once per change of the constants
        if self._layers_amx is None or self._layers_amx[0] != key:
            self._layers_amx = (key, gemm_paths.fused_layers_amx_min(self.shapes))
        return self._layers_amx[1]

    def head_amx_min(self) -> int:
        """As :meth:`amx_min` for the tiled LM head (:func:`.gemm_paths.fused_amx_min` of its shape:
        from 9 rows for a head of 8 MiB of codes or more), or 0: off."""
        w = self.model.lm_head
        if self.head_kind != "q8" or not w.tiled:
            return 0
        gemm = self._many_rows()
        if gemm != "amx":
            return gemm_paths.FUSED_VNNI_MIN_ROWS if gemm else 0
        return gemm_paths.fused_amx_min(int(w.shape[0]), int(w.shape[1]), int(w.bits))

    def _amx_on(self) -> bool:
        if self._amx is None:  # the static part, once (the build and the tile grant are per process)
            self._amx = bool(self.q8 and self.tiled and not self.portable and self.model.dtype == torch.bfloat16
                             and quant_amx.available())
        return self._amx and gemm_paths.mode() == "auto"

    def _many_rows(self) -> Optional[str]:
        """This step's many-row GEMM: ``"amx"`` (:meth:`_amx_on`), ``"vnni"`` (:meth:`_vnni_on`) or
        None (the GEMV in 8-row blocks only); read per step, as ``SGLITE_GEMM`` may change."""
        return "amx" if self._amx_on() else ("vnni" if self._vnni_on() else None)

    def _vnni_on(self) -> bool:
        """Whether the many-row steps take the int8 VNNI GEMM: a tiled int8-path model on the AVX-512
        build with VNNI and without the AMX tile GEMM (whose build takes the many-row steps there),
        ``SGLITE_GEMM`` ``auto``."""
        if self._vnni is None:  # the static part, once
            self._vnni = bool(self.q8 and self.tiled and many_row_gemm(self.portable) == "vnni")
        return self._vnni and gemm_paths.mode() == "auto"

    def cascade_min(self) -> int:
        """Shared keys from which the step's rows that continue one cached prefix attend it once
        per group (:func:`.cpu_attention.decode_attention`'s ``cascade_min``; bf16 pools on the AMX
        tiles), or 0: off (float32 models; ``SGLITE_ATTN_AMX=0``; read per step)."""
        return cpu_attention.default_cascade_min() if self.model.dtype == torch.bfloat16 and not self.portable else 0

    def max_rows(self) -> int:
        """Most decode rows of a fused step: :data:`MAX_ROWS_AMX` where the many-row GEMMs run on
        AMX or the VNNI GEMM (:meth:`amx_min`), else :data:`MAX_ROWS`."""
        return MAX_ROWS_AMX if self._many_rows() else MAX_ROWS

    def num_threads(self) -> int:
        """Threads of the C++ pool for this step: :attr:`threads`, or torch's intra-op count (the
        engine sets it from ``num_threads``)."""
        return self.threads or torch.get_num_threads()

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """LM head of final-normed rows h [M, H] float32 -> [M, V] float32 logits (M may be 0: a
        step whose rows only fill the cache, e.g. ``max_new_tokens=0`` on a short prompt)."""
        w = self.model.lm_head
        if h.shape[0] == 0:
            return h.new_zeros((0, w.shape[0]))
        if self.head_kind == "q8":  # quant_cpu.gemv_q8's arithmetic, on the decode's thread pool
            mins = w.mins if w.mins is not None else torch.empty(0, dtype=w.scales.dtype)
            return load(self.portable).head_q8(h.float().contiguous(), w.qweight, w.scales, mins, w.bits, w.tiled,
                                                self.num_threads(), self.head_amx_min(), quant_amx.packed_arg(w))
        if self.head_kind == "quant":
            return quant_cpu.linear(h.to(self.model.dtype), w, portable=self.portable).float()
        from .matmul import linear

        return linear(h.to(self.model.dtype), w).float()

    def forward(self, fb, k_buffers, v_buffers, hidden: Optional[list] = None) -> Optional[torch.Tensor]:
        """[M, V] float32 logits of ``fb.logits_indices``, or None when this step is not for the
        fused path (extend rows, more than :data:`MAX_ROWS` rows, a quantized KV pool step that
        :meth:`quant_pool_args` declines, a model made a tensor-parallel shard after load). ``hidden``: a list the step's [N, H] float32
        final-normed hidden states are appended to (speculative draft heads), or None."""
        n = fb.input_ids.shape[0]
        if (self.model.tp is not None or fb.num_extend_tokens or not 1 <= n <= self.max_rows()
                or fb.dec_req_pool_indices.shape[0] != n):
            return None
        kb, quant = k_buffers[0], None
        if isinstance(kb, kv_quant.QuantKVLayer):
            quant = self.quant_pool_args(fb, k_buffers)
            if quant is None:
                return None
        elif not isinstance(kb, torch.Tensor) or kb.dtype not in (torch.float32, torch.bfloat16):
            return None
        h = self.hidden(fb, k_buffers, v_buffers) if quant is None else self.hidden(fb, k_buffers, v_buffers, quant)
        if hidden is not None:
            hidden.append(h)
        if fb.logits_indices.shape[0] != n:
            with serial_torch():
                h = h[fb.logits_indices].contiguous()
        return self.head(h.contiguous())


def is_family(model) -> bool:
    """Whether ``model`` needs the families' layer (:mod:`.decode_family`): a family model
    (``fused_decode_family``) or a Llama layer with per-head QK-norm (Qwen3)."""
    return bool(getattr(model, "fused_decode_family", False)) or bool(model.arch.qk_norm)


def prepare(model, portable: bool = False, family: Optional[type] = None) -> Optional[FusedDecode]:
    """A :class:`FusedDecode` for ``model`` (a ``LlamaModel``) when its static preconditions hold
    (module docstring) and the kernels build; else None (the per-op path runs). ``family``: the
    class built for a model of :func:`is_family` (:func:`.decode_family.prepare` passes its
    ``FamilyFusedDecode`` after checking the options); None refuses those models."""
    a = model.arch
    fam = is_family(model)
    if (os.environ.get("SGLITE_KERNEL") in ("torch", "triton") or model.device != "cpu" or model.tp is not None
            or getattr(model, "fused_decode_ok", True) is False or (fam and family is None)
            or model.batch_invariant or a.qkv_bias or a.head_dim > cpu_attention.MAX_HEAD_DIM
            or tuple(model.cos.shape[1:]) != (a.head_dim // 2,)  # RoPE over the whole head only
            or model.dtype not in (torch.float32, torch.bfloat16)
            or not all(_quant_ok(L[k]) for L in model.layers for k in LINEAR_KEYS)):
        return None
    if load(portable) is None or not quant_cpu.available() or not cpu_attention.available():
        return None
    q8 = model.dtype == torch.bfloat16 and (portable or quant_cpu.vnni())  # no VNNI: the float GEMV
    if q8:  # float16 scales / mins where exact: 4 bytes less per 32 weights streamed every step
        qws = list({id(w): w for w in model.linear_weights() if isinstance(w, QuantLinearWeight)}.values())
        changed = sum(compact_scales(w) for w in qws)
        if not portable and quant_cpu.vnni() and all(_tileable(L[k]) for L in model.layers for k in LINEAR_KEYS):
            changed += sum(tile_rows(w) for w in qws if _tileable(w))  # 16-row tiles (module docstring)
            if model.dtype == torch.bfloat16:
                changed += quant_amx.repack(qws)  # bf16 copies for the AMX GEMM where memory allows
        if changed:
            model.pack_hugepages()  # one fresh buffer: the replaced arrays' memory is released
    return (family if fam else FusedDecode)(model, q8=q8, portable=portable)
