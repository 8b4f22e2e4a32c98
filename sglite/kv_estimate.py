"""KV-cache memory estimator: bytes per token and totals for a model config.

bytes/token = 2 (K and V) × layers × KV heads × head dim × bytes per element. For LLaMA-7B
(32 layers, 32 KV heads, head dim 128, fp16) that is 512 KiB; LLaMA-2-70B (80 layers, 8 KV heads)
320 KiB; Mistral-7B (32 layers, 8 KV heads) 128 KiB.

Quantized pools (``--kv-cache-dtype``) count their scales (the runtime's own formula,
:func:`sglite.runtime.kv_pool.kv_bytes_per_token`): int8 / int4
(KIVI layout, ``sglite/runtime/kv_quant.py``) store codes plus a float16 scale and minimum per
token and head (values) and per channel, head and group of G tokens (keys); fp8_e4m3 one byte per
element (its per-head scales are per layer, not per token).

Sliding-window models (Gemma 2 / Gemma 3: ``layer_types``, or ``sliding_window_pattern``, and
``sliding_window``) on a float KV cache keep the local layers' K/V for the last ``sliding_window``
tokens of a sequence only (:mod:`sglite.runtime.swa_pool`): a sequence costs the global layers'
bytes per token x its length plus the local layers' x ``min(length, window)``; the saving is
reported beside the full-attention figure. The runtime's full pool holds only the global layers'
K/V, so the memory of a full-attention pool of ``batch x seq_len`` tokens buys more full-pool
tokens there (:func:`sglite.runtime.swa_pool.split_budget`, ``batch`` rows, one-token pages):
:meth:`KVEstimate.pool_capacity` gives both capacities, and the output prints them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import KV_CACHE_DTYPES
from .errors import InvalidRequestError
from .runtime.kv_pool import kv_bytes_per_token
from .runtime.swa_pool import split_budget
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8": 1}


@dataclass(frozen=True)
class KVEstimate:
    """KV memory of one config. All sizes in bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    bytes_per_token: int
    seq_len: int
    batch: int
    kv_cache_dtype: str = "auto"
    local_layers: int = 0  # sliding-window layers whose K/V is kept for the window only
    sliding_window: int = 0
    local_bytes_per_token: int = 0  # the local layers' share of bytes_per_token

    @property
    def tokens_per_gib(self) -> int:
        """Tokens one GiB of pool holds."""
        return (1 << 30) // self.bytes_per_token

    @property
    def bytes_per_sequence(self) -> int:
        """KV bytes one sequence of ``seq_len`` tokens holds (local layers: its window only)."""
        return self.bytes_per_token * self.seq_len - self.saved_bytes_per_sequence

    @property
    def saved_bytes_per_sequence(self) -> int:
        """Bytes the sliding-window layers do not hold against full attention on every layer."""
        if not self.local_layers:
            return 0
        return self.local_bytes_per_token * max(0, self.seq_len - self.sliding_window)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_sequence * self.batch

    def pool_capacity(self, budget_bytes: int | None = None) -> tuple[int, int]:
        """(full-pool tokens, local slots) of the runtime's pool in ``budget_bytes`` (default: a
        full-attention pool of ``batch x seq_len`` tokens), ``batch`` rows of ``seq_len``-token
        context, one-token pages. Without sliding-window layers: (budget // bytes_per_token, 0)."""
        budget = self.bytes_per_token * self.batch * self.seq_len if budget_bytes is None else int(budget_bytes)
        if not self.local_layers:
            return budget // self.bytes_per_token, 0
        return split_budget(budget, self.bytes_per_token - self.local_bytes_per_token, self.local_bytes_per_token,
                            self.sliding_window, self.batch, self.seq_len, 1)


def estimate(config: dict, seq_len: int = 4096, batch: int = 16, dtype: str = "float16",
             kv_cache_dtype: str = "auto", group: int = 128) -> KVEstimate:
    """Estimate from a HF ``config.json`` dict; ``dtype`` is the model's (the ``auto`` KV dtype),
    ``kv_cache_dtype`` / ``group`` as ``EngineConfig.kv_cache_dtype`` / ``kv_cache_quant_group_size``.

    Raises:
        InvalidRequestError: a missing config field, an unknown dtype or KV cache dtype.
    """
    if dtype not in DTYPE_BYTES:
        raise InvalidRequestError(f"dtype: must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}", field="dtype")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidRequestError(f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}",
                                  field="kv_cache_dtype")
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if name not in config:
            raise InvalidRequestError(f"config: missing field {name!r}", field=name)
    if seq_len < 1 or batch < 1:
        raise InvalidRequestError("seq_len and batch must be >= 1", field="seq_len")
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or config["hidden_size"] // heads
    layers = config["num_hidden_layers"]
    b = DTYPE_BYTES[dtype]
    n_local, window = _local_layers(config, layers)
    if kv_cache_dtype not in ("auto", "bfloat16"):  # the runtime keeps sliding windows on float pools only
        n_local = 0
    local_b = kv_bytes_per_token(kv_cache_dtype, n_local, kv, hd, b, group) if n_local else 0
    return KVEstimate(layers, kv, hd, b, kv_bytes_per_token(kv_cache_dtype, layers, kv, hd, b, group),
                      seq_len, batch, kv_cache_dtype, n_local, window if n_local else 0, local_b)


SWA_ARCHS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")  # the families whose local layers sglite windows


def _local_layers(config: dict, layers: int) -> tuple[int, int]:
    """(sliding-window layers, window) of a config dict; (0, 0) for other architectures."""
    archs = config.get("architectures") or []
    window = int(config.get("sliding_window") or 0)
    if not archs or archs[0] not in SWA_ARCHS or window <= 0:
        return 0, 0
    types = config.get("layer_types")
    if types:
        return sum(t == "sliding_attention" for t in types), window
    pat = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 2
    return sum(1 for i in range(layers) if (i + 1) % pat), window


def load_config(model_path: str | None = None, config_path: str | None = None) -> dict:
    """A config dict from ``--config`` (a config.json) or ``--model-path`` (HF folder or GGUF)."""
    if config_path:
        p = Path(config_path)
        if not p.is_file():
            raise InvalidRequestError(f"config: {config_path!r} does not exist", field="config")
        return json.loads(p.read_text())
    from .runtime.model_loader import load_checkpoint

    return load_checkpoint(model_path).hf_config.to_dict()


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def format_estimate(e: KVEstimate) -> str:
    out = (f"layers={e.num_layers} kv_heads={e.num_kv_heads} head_dim={e.head_dim} dtype_bytes={e.dtype_bytes} "
           f"kv_cache_dtype={e.kv_cache_dtype}\n"
           f"bytes per token: {e.bytes_per_token} ({_fmt(e.bytes_per_token)}), {e.tokens_per_gib} tokens per GiB\n"
           f"per sequence ({e.seq_len} tokens): {_fmt(e.bytes_per_sequence)}\n"
           f"total (batch {e.batch}): {_fmt(e.total_bytes)}")
    if e.local_layers:
        out += (f"\nsliding window: {e.local_layers} of {e.num_layers} layers keep the last {e.sliding_window} "
                f"tokens only: {_fmt(e.saved_bytes_per_sequence)} per sequence, "
                f"{_fmt(e.saved_bytes_per_sequence * e.batch)} in total saved against full attention")
        full, local = e.pool_capacity()
        gb = e.bytes_per_token - e.local_bytes_per_token
        out += (f"\npool in the memory of {e.batch * e.seq_len} full-attention tokens "
                f"({_fmt(e.bytes_per_token * e.batch * e.seq_len)}): full pool {full} tokens "
                f"({e.num_layers - e.local_layers} global layers, {gb} bytes per token), {local} local slots "
                f"({e.local_bytes_per_token} bytes per token): {full / (e.batch * e.seq_len):.1f}x the tokens")
    return out
