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
