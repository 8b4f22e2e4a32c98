"""KV-cache memory estimator: bytes per token and totals for a model config.

bytes/token = 2 (K and V) × layers × KV heads × head dim × bytes per element. For LLaMA-7B
(32 layers, 32 KV heads, head dim 128, fp16) that is 512 KiB; LLaMA-2-70B (80 layers, 8 KV heads)
320 KiB; Mistral-7B (32 layers, 8 KV heads) 128 KiB.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidRequestError

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

    @property
    def bytes_per_sequence(self) -> int:
        return self.bytes_per_token * self.seq_len

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_sequence * self.batch


def estimate(config: dict, seq_len: int = 4096, batch: int = 16, dtype: str = "float16") -> KVEstimate:
    """Estimate from a HF ``config.json`` dict.

    Raises:
        InvalidRequestError: a missing config field or an unknown dtype.
    """
    if dtype not in DTYPE_BYTES:
        raise InvalidRequestError(f"dtype: must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}", field="dtype")
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
    return KVEstimate(layers, kv, hd, b, 2 * layers * kv * hd * b, seq_len, batch)


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
    return (f"layers={e.num_layers} kv_heads={e.num_kv_heads} head_dim={e.head_dim} dtype_bytes={e.dtype_bytes}\n"
            f"bytes per token: {e.bytes_per_token} ({_fmt(e.bytes_per_token)})\n"
            f"per sequence ({e.seq_len} tokens): {_fmt(e.bytes_per_sequence)}\n"
            f"total (batch {e.batch}): {_fmt(e.total_bytes)}")
