"""ModelRunner: loads the model, sizes and owns the KV pools, runs a ForwardBatch → logits."""
from __future__ import annotations

import logging

import torch

from sglite import kernels
from sglite.kernels.host_memory import available_host_bytes

from ..config import EngineConfig
from ..errors import InvalidRequestError
from .forward_batch import ForwardBatch
from . import kv_quant
from . import swa_pool
from .kv_pool import ReqToTokenPool, kv_bytes_per_token
from .models import registry as model_registry

log = logging.getLogger("sglite.model_runner")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_POOL_TOKENS = 1 << 19  # cap of a memory-derived pool (tokens); max_total_tokens may exceed it


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when available, else ``cpu``."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError(f"device={device!r} but CUDA is not available", field="device")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """``auto`` → bfloat16 on CUDA and on CPUs with native bf16 (AVX-512 BF16 / AMX), else float32."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.startswith("cuda"):
        return torch.bfloat16
    cap = torch.backends.cpu.get_cpu_capability()
    has_bf16 = False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read(65536)
        has_bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return torch.bfloat16 if (has_bf16 and "AVX512" in cap) else torch.float32


def available_memory_bytes(device: str) -> int:
    """Free memory of the device (CUDA) or available host memory (CPU), in bytes."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return available_host_bytes()


def pool_tokens(config: EngineConfig, context_length: int, bytes_per_token: int, available_bytes: int) -> int:
    """KV pool size (tokens) when ``max_total_tokens`` is not given: what the configuration can use
    (``max_running_requests`` requests of a full context, plus a few pages of headroom), capped by
    the memory budget (``mem_fraction_static`` of ``available_bytes``) and :data:`MAX_POOL_TOKENS`,
    but never below one full-context request. E.g. SmolLM2-135M in bf16 (23 KiB per token, 8k
    context): 64 requests -> the 20 % budget of the host; ``max_running_requests=1`` -> 8.2k tokens
    (180 MiB)."""
    usable = config.max_running_requests * context_length + 16 * config.page_size
    budget = int(config.mem_fraction_static * available_bytes) // bytes_per_token
    floor = context_length + 16 * config.page_size
    return int(max(floor, min(MAX_POOL_TOKENS, usable, max(budget, 4 * context_length))))


class ModelRunner:
    """Model + KV pools of one engine; implements :class:`~sglite.runtime.runner_protocol.RunnerProtocol`.

    Attributes:
        req_to_token_pool: ReqToTokenPool with ``max_running_requests + 8`` rows × context length.
        token_to_kv_pool: TokenToKVPool sized from ``max_total_tokens`` or the memory budget (a
            hybrid sliding-window pool, :mod:`.swa_pool`, for windowed models unless
            ``hybrid_swa=False``: a tensor-parallel worker, whose scheduler plans one slot space).
    """

    measure_forward = True  # the model runs here: the speculative draft policy may time it
    # speculative draft heads (EAGLE / Medusa) set keep_hidden; each forward then leaves the step's
    # [N, H] float32 final-normed hidden states of all its tokens in last_hidden (CPU)
    keep_hidden = False
    last_hidden = None

    def __init__(self, config: EngineConfig, hf_config, state_dict: dict, hybrid_swa: bool = True):
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.arch = model_registry.arch_from_hf_config(hf_config)  # LlamaArch, or a family's FamilyArch
        deterministic = bool(config.enable_deterministic_inference)
        self.model = model_registry.model_class(self.arch)(self.arch, state_dict, self.dtype, self.device,
                                                           batch_invariant=deterministic)
        a = self.arch
        log.info("model: %s (%s layer; %d layers, hidden %d, %d / %d heads of %d, vocab %d), dtype %s",
                 model_registry.architecture(hf_config), type(self.model).__name__, a.num_layers, a.hidden_size,
                 a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size, self.dtype)
        self.linear_impl = self._choose_linear_impl(config)
        self.model.decode_fused = kernels.decode_family.prepare(self.model)  # None: per-op decode (Llama or a family layer)
        self.vocab_size = self.arch.vocab_size
        self.context_length = config.context_length or self.arch.max_position_embeddings
        if self.context_length > self.arch.max_position_embeddings:
            raise InvalidRequestError(
                f"context_length={self.context_length} exceeds the model's max_position_embeddings "
                f"({self.arch.max_position_embeddings})", field="context_length")
        a = self.arch
        kvd, group, rows = config.kv_cache_dtype, config.kv_cache_quant_group_size, config.max_running_requests + 8
        self.bytes_per_token = kv_bytes_per_token(kvd, a.num_layers, a.num_kv_heads, a.head_dim,
                                                  torch.finfo(self.dtype).bits // 8, group)
        if config.max_total_tokens:
            tokens = config.max_total_tokens
        else:
            extra = kv_quant.residual_bytes(kvd, a.num_layers, a.num_kv_heads, a.head_dim, self.dtype, group, rows)
            tokens = pool_tokens(config, self.context_length, self.bytes_per_token,
                                 available_memory_bytes(self.device) - int(extra / config.mem_fraction_static))
        if hybrid_swa and swa_pool.wants_hybrid(a, kvd):  # sliding-window layers: their own, smaller slot space
            # the memory a full-attention pool of ``tokens`` would take; its full pool holds only the
            # global layers' K/V, so the same bytes buy more full-pool tokens (swa_pool.split_budget)
            cap = None if config.max_total_tokens else max(tokens, MAX_POOL_TOKENS)
            self.token_to_kv_pool = swa_pool.make_pool(a, kvd, tokens * self.bytes_per_token, config.page_size, rows,
                                                       self.context_length, self.dtype, self.device, cap)
        else:
            self.token_to_kv_pool = kv_quant.make_pool(kvd, tokens, config.page_size, a.num_layers, a.num_kv_heads,
                                                       a.head_dim, self.dtype, self.device, group, rows)
        if self.device == "cpu":  # build (or load) the C++ kernels of a step now, not in the first request
            kernels.prepare_cpu(self.token_to_kv_pool.k_buffers[0], self.dtype)
        self.req_to_token_pool = ReqToTokenPool(rows, self.context_length + 8, self.device)
        self.lora = None  # the engine's sglite.lora.LoraManager when it serves adapters
        self.max_total_tokens = self.token_to_kv_pool.capacity
        pool_bpt = getattr(self.token_to_kv_pool, "global_bytes_per_token", self.bytes_per_token)  # hybrid: global layers
        pool = self.token_to_kv_pool
        stored = (f"{kvd} codes (model dtype {self.dtype})" if isinstance(pool, kv_quant.QuantTokenToKVPool)
                  else f"dtype {pool.k_buffers[0].dtype}")
        log.info("KV pool: %d tokens, %d bytes per token (%.1f MiB), %s, device %s", self.max_total_tokens, pool_bpt,
                 self.max_total_tokens * pool_bpt / 2**20, stored, self.device)
        if isinstance(self.token_to_kv_pool, swa_pool.SWATokenToKVPool):
            log.info("%s", swa_pool.describe(self.token_to_kv_pool))
        if not config.max_total_tokens and tokens >= MAX_POOL_TOKENS:
            log.info("KV pool sized at its cap of %d tokens (MAX_POOL_TOKENS); --max-total-tokens sets a larger "
                     "one", MAX_POOL_TOKENS)
        log.info("KV cache dtype %s", kv_quant.describe(kvd, self.bytes_per_token,
                                                         self.token_to_kv_pool.residual_bytes))
        if kvd in kv_quant.INT_KINDS:
            log.info("%s KV pool: pages of %d tokens hold whole key groups of %d, so a cached prefix is reused in "
                     "whole groups (up to %d tokens fewer than with a bf16 pool)", kvd, config.page_size, group,
                     group - 1)

    def _choose_linear_impl(self, config: EngineConfig) -> str:
        """Pick every matmul's implementation once (:func:`sglite.kernels.choose_impl`: the
        ``cpu_decode_gemv`` probe, or ``invariant`` in deterministic mode) and prepare the weights."""
        cpu_bf16 = self.device == "cpu" and self.dtype == torch.bfloat16
        deterministic = bool(config.enable_deterministic_inference)
        if (cpu_bf16 and config.cpu_decode_gemv in ("auto", "cpp")) or (deterministic and self.device == "cpu"):
            self.model.pack_hugepages()  # what the C++ kernels read fastest: probe and run on it
        probe = [lw.weight for lw in self.model.linear_weights()[:-1] if isinstance(lw, kernels.LinearWeight)]
        impl = kernels.choose_impl(config.cpu_decode_gemv, self.dtype, self.device, probe, deterministic)
        self.model.use_linear_impl(impl)
        if cpu_bf16 and kernels.resolve_impl(None, torch.empty(0), "extend_attention") == "cpp":
            from sglite.kernels import cpu_attention

            kvd = config.kv_cache_dtype
            if kvd in ("auto", "bfloat16"):
                log.info("%s", cpu_attention.describe())
            else:  # sglite/kernels/kv_quant_extend.py, kv_quant_cpu.py
                log.info("%s KV pool attention: prefill through the bf16 pool's C++ extend (%s) over a dequantized "
                         "scratch buffer; decode reading the codes in C++ (no shared-prefix pass)", kvd,
                         "AMX tiles" if cpu_attention.amx_mode() and cpu_attention.amx_ready() else "AVX-512")
        if impl == "invariant":
            log.info("deterministic inference: batch-invariant matmuls, attention and activations")
        elif impl != "torch":
            log.info("batch-1 decode matmuls through %s (cpu_decode_gemv=%s)",
                     {"fp16": "float16 weight copies", "cpp": "the C++ bf16 GEMV"}[impl], config.cpu_decode_gemv)
        return impl

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Run one step. Returns [M, V] float32 logits (on CPU) for ``fb.logits_indices``."""
        if self.device != "cpu":
            fb = fb.to(self.device)
        if fb.lora_segments is not None and self.lora is not None:  # LoRA adapters of this step's rows
            fb.lora = self.lora.batch(fb.lora_segments)
        pool = self.token_to_kv_pool
        pool.begin_step(fb)  # quantized pool: token rows / positions of this step (plain pool: no-op)
        if self.keep_hidden:  # EAGLE / Medusa heads read the step's final-normed hidden states
            got: list = []
            logits = self.model.forward(fb, pool.k_buffers, pool.v_buffers, hidden=got)
            self.last_hidden = got[0].cpu() if got else None
        else:
            logits = self.model.forward(fb, pool.k_buffers, pool.v_buffers)
        return logits.cpu() if self.device != "cpu" else logits

    def close(self) -> None:
        """Nothing to release (the model and pools are freed with the runner); the protocol's hook."""
