"""Start-up cache of a GGUF file's quantized weights (sglite.runtime.native_cache): a round trip
keeps every field and byte, a cache of another version or a damaged file reads as absent (and is
rebuilt), weights that are not plain GGUF blocks are not cached, and (slow) the real model's
weights from the cache equal those read from its GGUF blocks."""
import json

import pytest
import torch

from sglite.kernels.quant_linear import QuantLinearWeight, tile_rows
from sglite.runtime import native_cache


def weights():
    g = torch.Generator().manual_seed(0)
    w4 = QuantLinearWeight.from_codes(torch.randint(0, 16, (32, 64), generator=g, dtype=torch.uint8),
                                      torch.rand(32, 2, generator=g), torch.randn(32, 2, generator=g), 4, 32,
                                      fmt="gguf:Q4_1")
    w8 = QuantLinearWeight.from_codes(torch.randint(0, 256, (16, 96), generator=g, dtype=torch.uint8),
                                      torch.rand(16, 3, generator=g), None, 8, 32, fmt="gguf:Q8_0")
    return {"model.layers.0.mlp.down_proj.weight": w4, "model.embed_tokens.weight": w8,
            "model.norm.weight": torch.ones(8)}  # a float tensor: not the cache's business


def test_round_trip(tmp_path):
    src = weights()
    path = native_cache.cache_path(tmp_path)
    assert native_cache.load(path) is None  # nothing there yet
    assert native_cache.save(path, src) and path.is_file()
    got = native_cache.load(path)
    assert set(got) == {"model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"}
    for name, w in got.items():
        ref = src[name]
        for f in ("bits", "group_size", "in_features", "fmt"):
            assert getattr(w, f) == getattr(ref, f)
        assert torch.equal(w.qweight, ref.qweight) and torch.equal(w.scales, ref.scales)
        assert (w.mins is None) == (ref.mins is None) and (ref.mins is None or torch.equal(w.mins, ref.mins))
        assert torch.equal(w.dequantize(), ref.dequantize())
    assert not list(tmp_path.glob("*.safetensors"))  # never taken for the float weights of the folder


def test_other_version_or_damage_reads_as_absent(tmp_path, monkeypatch):
    path = native_cache.cache_path(tmp_path)
    assert native_cache.save(path, weights())
    monkeypatch.setattr(native_cache, "VERSION", "999")
    assert native_cache.load(path) is None
    monkeypatch.undo()
    path.write_bytes(path.read_bytes()[:100])  # truncated
    assert native_cache.load(path) is None
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00" + json.dumps({}).encode().ljust(8))
    assert native_cache.load(path) is None


def test_only_plain_gguf_weights_are_cached(tmp_path):
    src = weights()
    w = src["model.layers.0.mlp.down_proj.weight"]
    assert tile_rows(w)
    assert not native_cache.save(native_cache.cache_path(tmp_path), src)
    assert not native_cache.cache_path(tmp_path).exists()


@pytest.mark.slow
def test_real_model_cache_equals_its_gguf_blocks(real_checkpoint):
    import gguf

    from sglite.runtime import gguf_native

    path = native_cache.cache_path(real_checkpoint.model_dir)
    cached = native_cache.load(path)
    if cached is None:  # the first native load of this machine writes it
        gguf_native.load_state_dict(real_checkpoint, torch.float32)
        cached = native_cache.load(path)
    fresh = gguf_native._read_blocks(gguf.GGUFReader(real_checkpoint.source), real_checkpoint.hf_config, "cpu")
    assert set(cached) == set(fresh) and len(fresh) == 30 * 7 + 1
    for name, w in fresh.items():
        c = cached[name]
        assert (c.bits, c.group_size, c.fmt) == (w.bits, w.group_size, w.fmt)
        assert torch.equal(c.qweight, w.qweight) and torch.equal(c.scales, w.scales) and torch.equal(c.mins, w.mins)
