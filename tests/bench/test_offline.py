"""Smoke run of `sglite bench offline` on the tiny random model with tiny sizes (all four parts)."""
import json
import math

import pytest

from sglite.bench import offline
from sglite.bench.offline_hf import measure_read_bandwidth

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a whole benchmark run (several engines)
def test_offline_all_parts_tiny(tiny_model_dir, tmp_path, capsys):
    out, png = tmp_path / "off.json", tmp_path / "off.png"
    rc = offline.main(["--model-path", str(tiny_model_dir), "--dtype", "float32", "--parts", "a,b,c,d",
                       "--repeats", "2", "--latency-prompt-len", "12", "--latency-new-tokens", "6",
                       "--num-requests", "6", "--min-len", "4", "--max-len", "12", "--hf-batch-size", "4",
                       "--prefix-len", "60", "--num-questions", "4", "--question-len", "6", "--prefix-new-tokens", "2",
                       "--noreuse-requests", "4", "--noreuse-input-len", "10", "--noreuse-output-len", "3",
                       "--max-total-tokens", "4096", "--bandwidth-mib", "32", "--output-json", str(out), "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert {r["part"] for r in data["rows"]} == {"a", "b", "c", "d"}
    assert "| a | TPOT (ms) |" in capsys.readouterr().out
    a = data["parts"]["a"]
    assert a["weight_bytes"] > 0 and a["bandwidth"]["read_gbps"] > 0 and a["floor_tpot_s"] > 0
    for who in ("sglite", "hf"):
        assert 0 < a[who]["ttft_s"] <= a[who]["e2e_s"] and a[who]["tpot_s"] > 0
    b = data["parts"]["b"]
    assert b["sglite"]["completed"] == 6 and b["hf"]["requests"] == 6 and b["hf"]["batches"] == 2
    assert b["sglite"]["total_output_tokens"] == b["hf"]["output_tokens"]   # same requests both sides
    c = data["parts"]["c"]
    assert c["off"]["cache_hit_rate"] == 0 and c["on"]["completed"] == c["off"]["completed"] == 4
    d = data["parts"]["d"]
    assert len(d["walls_s"]["on"]) == len(d["walls_s"]["off"]) == 2
    assert math.isfinite(d["slowdown_with_cache"])
    ratios = [r["ratio"] for r in data["rows"] if r["ratio"] is not None]
    assert ratios and all(x > 0 and math.isfinite(x) for x in ratios)
    assert png.read_bytes()[:8] == PNG


def test_bandwidth_probe_is_plausible():
    bw = measure_read_bandwidth(n_bytes=16 << 20, repeats=2)
    assert 0.1 < bw["read_gbps"] < 10_000 and 0.1 < bw["copy_gbps"] < 10_000


def test_unknown_part_is_named(tiny_model_dir):
    a = offline.build_parser().parse_args(["--model-path", str(tiny_model_dir), "--parts", "a,x"])
    with pytest.raises(ValueError, match="parts"):
        offline.run(a)
