"""KV-cache memory estimator: bytes per token and totals for a model config.

bytes/token = 2 (K and V) × layers × KV heads × head dim × bytes per element. For LLaMA-7B
(32 layers, 32 KV heads, head dim 128, fp16) that is 512 KiB; LLaMA-2-70B (80 layers, 8 KV heads)
320 KiB; Mistral-7B (32 layers, 8 KV heads) 128 KiB.

Quantized pools (``--kv-cache-dtype``) count their scales (the runtime's own formula,
:func:`sglite.runtime.kv_pool.kv_bytes_per_token`): int8 / int4
(KIVI layout, ``sglite/runtime/kv_quant.py``) store codes plus a float16 scale and minimum per
token and head (values) and per channel, head and group of G tokens (keys); fp8_e4m3 one byte per
element (its per-head scales are per layer, not per token).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import KV_CACHE_DTYPES
from .errors import InvalidRequestError
from .runtime.kv_pool import kv_bytes_per_token
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

    @property
    def tokens_per_gib(self) -> int:
        """Tokens one GiB of pool holds."""
        return (1 << 30) // self.bytes_per_token

    @property
    def bytes_per_sequence(self) -> int:
        return self.bytes_per_token * self.seq_len

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_sequence * self.batch


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
    return KVEstimate(layers, kv, hd, b, kv_bytes_per_token(kv_cache_dtype, layers, kv, hd, b, group),
                      seq_len, batch, kv_cache_dtype)


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
    return (f"layers={e.num_layers} kv_heads={e.num_kv_heads} head_dim={e.head_dim} dtype_bytes={e.dtype_bytes} "
            f"kv_cache_dtype={e.kv_cache_dtype}\n"
            f"bytes per token: {e.bytes_per_token} ({_fmt(e.bytes_per_token)}), {e.tokens_per_gib} tokens per GiB\n"
            f"per sequence ({e.seq_len} tokens): {_fmt(e.bytes_per_sequence)}\n"
            f"total (batch {e.batch}): {_fmt(e.total_bytes)}")
