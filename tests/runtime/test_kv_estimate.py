"""`sglite kv-estimate` reproduces the published per-token KV sizes."""
import json

import pytest

from sglite.cli import main
from sglite.kv_estimate import estimate

LLAMA_7B = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32}
LLAMA2_70B = {"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80}
MISTRAL_7B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32}


@pytest.mark.parametrize("cfg,kib", [(LLAMA_7B, 512), (LLAMA2_70B, 320), (MISTRAL_7B, 128)])
def test_bytes_per_token(cfg, kib):
    e = estimate(cfg, seq_len=4096, batch=16, dtype="float16")
    assert e.bytes_per_token == kib * 1024
    assert e.total_bytes == kib * 1024 * 4096 * 16


def test_cli_prints_totals(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(MISTRAL_7B))
    assert main(["kv-estimate", "--config", str(p), "--seq-len", "1000", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "bytes per token: 131072 (128.0 KiB)" in out
    assert "total (batch 2): 250.0 MiB" in out


def test_bad_inputs_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        estimate(LLAMA_7B, dtype="int3")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        estimate({"hidden_size": 8, "num_attention_heads": 2})
    assert main(["kv-estimate", "--config", str(tmp_path / "missing.json")]) == 2


def test_kv_cache_dtype_counts_scales(tmp_path, capsys):
    """int8 / int4 pools: codes plus float16 scale + min per token and head (values) and per channel,
    head and group of 128 tokens (keys); the default model's 1.91x / 3.66x of bf16."""
    smol = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}
    bf16 = estimate(smol, dtype="bfloat16").bytes_per_token
    assert bf16 == 23040
    assert estimate(smol, dtype="bfloat16", kv_cache_dtype="int8").bytes_per_token == 90 * (128 + 4) + 90 * 4 * 64 // 128
    assert estimate(smol, dtype="bfloat16", kv_cache_dtype="int4").bytes_per_token == 90 * (64 + 4) + 90 * 2
    assert estimate(smol, dtype="float32", kv_cache_dtype="fp8_e4m3").bytes_per_token == bf16 // 2
    assert estimate(smol, dtype="float32", kv_cache_dtype="auto").bytes_per_token == 2 * bf16
    p = tmp_path / "config.json"
    p.write_text(json.dumps(smol))
    assert main(["kv-estimate", "--config", str(p), "--kv-cache-dtype", "int4", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "kv_cache_dtype=int4" in out and "bytes per token: 6300" in out and "170435 tokens per GiB" in out
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        estimate(smol, kv_cache_dtype="int3")


def test_sliding_window_layers_counted(tmp_path, capsys):
    """Gemma 3 270M's shape (18 layers, every 6th global, window 512, one KV head of 256): the 15
    local layers hold 512 tokens of a 4096-token sequence; the saving is printed. A quantized KV
    cache (full attention in the runtime) and a non-Gemma config with sliding_window count none."""
    g3 = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 640, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 256, "num_hidden_layers": 18, "sliding_window": 512,
          "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]}
    e = estimate(g3, seq_len=4096, batch=16, dtype="bfloat16")
    per_layer = 2 * 256 * 2
    assert (e.local_layers, e.sliding_window, e.bytes_per_token) == (15, 512, 18 * per_layer)
    assert e.bytes_per_sequence == 3 * per_layer * 4096 + 15 * per_layer * 512
    assert e.saved_bytes_per_sequence == 15 * per_layer * (4096 - 512)
    assert e.total_bytes == 16 * e.bytes_per_sequence
    no_types = {k: v for k, v in g3.items() if k != "layer_types"} | {"sliding_window_pattern": 6}
    assert estimate(no_types, seq_len=4096, dtype="bfloat16").bytes_per_sequence == e.bytes_per_sequence
    assert estimate(g3, seq_len=100, dtype="bfloat16").saved_bytes_per_sequence == 0  # shorter than the window
    assert estimate(g3, kv_cache_dtype="int8").local_layers == 0
    assert estimate(dict(MISTRAL_7B, sliding_window=4096, architectures=["MistralForCausalLM"])).local_layers == 0
    p = tmp_path / "config.json"
    p.write_text(json.dumps(g3))
    assert main(["kv-estimate", "--config", str(p), "--seq-len", "4096", "--batch", "16", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "sliding window: 15 of 18 layers keep the last 512 tokens only: 52.5 MiB per sequence" in out
