"""RoPE variants (sglite/runtime/models/rope.py) against transformers' own rotary embeddings.

For each variant: the inverse frequencies equal ``ROPE_INIT_FUNCTIONS[rope_type]`` and the cos/sin
tables equal what the model's rotary module (``LlamaRotaryEmbedding`` / ``Phi3RotaryEmbedding``)
gives, to float32 tolerance; for the length-dependent variants each position is compared with
transformers' output for a forward that ends at that position (a decode step).
"""
import pytest
import torch

from sglite.errors import InvalidRequestError
from sglite.runtime.models import rope

D = 16  # head_dim of the tiny configs
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(D // 2)],
            "long_factor": [2.0 + 0.5 * i for i in range(D // 2)]}
VARIANTS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def _llama_config(params, max_pos=256):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=D,
                       intermediate_size=128, num_hidden_layers=1, vocab_size=32, max_position_embeddings=max_pos,
                       rope_parameters={"rope_theta": 10000.0, **params})


def _phi3_config(params, max_pos=256, orig=64, **kw):
    from transformers import Phi3Config

    return Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      num_hidden_layers=1, vocab_size=32, max_position_embeddings=max_pos, sliding_window=None,
                      original_max_position_embeddings=orig, rope_parameters={"rope_theta": 10000.0, **params}, **kw)


def _hf_rotary(cfg):
    if cfg.model_type == "phi3":
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding as R
    else:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as R
    return R(cfg)


def _hf_cos_sin(rot, positions):
    """HF's cos/sin [len(positions), D] for one forward over ``positions``."""
    x = torch.zeros(1, len(positions), D)
    cos, sin = rot(x, torch.tensor([positions]))
    return cos[0], sin[0]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_inv_freq_and_tables_match_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _llama_config(dict(VARIANTS[name]))
    spec = rope.spec_from_hf_config(cfg, D)
    assert spec.rope_type == VARIANTS[name]["rope_type"]
    if name != "default":
        ref, att = ROPE_INIT_FUNCTIONS[spec.rope_type](cfg, "cpu")
        torch.testing.assert_close(rope.inv_freq(spec).float(), ref, rtol=1e-6, atol=0)
        assert rope.attention_factor(spec) == pytest.approx(att, rel=1e-12)
    P = cfg.max_position_embeddings
    cos, sin = rope.rope_cache(spec, P, "cpu")  # [P, D/2]
    hc, hs = _hf_cos_sin(_hf_rotary(cfg), list(range(P)))  # [P, D]
    for ours, ref in ((cos, hc), (sin, hs)):
        torch.testing.assert_close(ours, ref[:, :D // 2], rtol=0, atol=2e-5)
        torch.testing.assert_close(ours, ref[:, D // 2:], rtol=0, atol=2e-5)  # rotate-half: halves share


def test_dynamic_beyond_original_length_matches_a_decode_step():
    """Position p >= Lo is rotated as transformers rotates the token of a decode step at p."""
    cfg = _llama_config(dict(VARIANTS["dynamic"]), max_pos=64)
    spec = rope.spec_from_hf_config(cfg, D)
    assert spec.table_positions == 128  # factor * max_position_embeddings
    cos, sin = rope.rope_cache(spec, spec.table_positions, "cpu")
    rot = _hf_rotary(cfg)
    for p in (0, 63, 64, 65, 100, 127):
        hc, hs = _hf_cos_sin(rot, [p])  # one decoded token: seq_len = p + 1
        torch.testing.assert_close(cos[p], hc[0, :D // 2], rtol=0, atol=2e-5)
        torch.testing.assert_close(sin[p], hs[0, :D // 2], rtol=0, atol=2e-5)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=100)
    torch.testing.assert_close(rope.inv_freq(spec, 100).float(), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rtype", ["longrope", "su"])
def test_longrope_short_and_long_factors_and_attention_factor(rtype):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _phi3_config({**LONGROPE, "rope_type": rtype})
    spec = rope.spec_from_hf_config(cfg, D)
    assert spec.rope_type == "longrope" and spec.original_max_position_embeddings == 64
    short, att = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=65)
    torch.testing.assert_close(rope.inv_freq(spec).float(), short, rtol=1e-6, atol=0)
    torch.testing.assert_close(rope.inv_freq(spec, 65).float(), long, rtol=1e-6, atol=0)
    assert att > 1 and rope.attention_factor(spec) == pytest.approx(att, rel=1e-12)
    cos, sin = rope.rope_cache(spec, 256, "cpu")
    rot = _hf_rotary(cfg)
    hc, hs = _hf_cos_sin(rot, list(range(64)))  # a prompt within Lo: short factors
    torch.testing.assert_close(cos[:64], hc[:, :D // 2], rtol=0, atol=2e-5)
    torch.testing.assert_close(sin[:64], hs[:, :D // 2], rtol=0, atol=2e-5)
    for p in (64, 65, 200, 255):  # decode steps past Lo: long factors
        hc, hs = _hf_cos_sin(rot, [p])
        torch.testing.assert_close(cos[p], hc[0, :D // 2], rtol=0, atol=2e-5)
        torch.testing.assert_close(sin[p], hs[0, :D // 2], rtol=0, atol=2e-5)


def test_old_style_rope_scaling_dict_is_read():
    class Cfg:  # a config as older transformers kept it: rope_scaling + rope_theta attributes
        rope_scaling = {"type": "linear", "factor": 2.0}
        rope_theta = 500000.0
        max_position_embeddings = 128

    spec = rope.spec_from_hf_config(Cfg(), D)
    assert (spec.rope_type, spec.factor, spec.theta) == ("linear", 2.0, 500000.0)


@pytest.mark.parametrize("params,field,words", [
    ({"rope_type": "mrope"}, "rope_parameters", ["'mrope'", "llama3", "longrope", "yarn"]),
    ({"rope_type": "llama3", "factor": 8.0}, "rope_parameters", ["low_freq_factor"]),
    ({"rope_type": "default", "partial_rotary_factor": 1.5}, "partial_rotary_factor", ["1.5", "(0, 1]"]),
    ({"rope_type": "default", "partial_rotary_factor": 0.1}, "partial_rotary_factor", ["0.1", "even"]),
])
def test_unsupported_rope_is_refused_naming_the_field(params, field, words):
    class Cfg:
        rope_parameters = {"rope_theta": 10000.0, **params}
        max_position_embeddings = 128

    with pytest.raises(InvalidRequestError) as ei:
        rope.spec_from_hf_config(Cfg(), D)
    assert ei.value.field == field
    for w in words:
        assert w in str(ei.value)


@pytest.mark.parametrize("params", [{"rope_type": "default"},
                                    {**LONGROPE, "short_factor": LONGROPE["short_factor"][:6],
                                     "long_factor": LONGROPE["long_factor"][:6]}])
def test_partial_rotary_as_reordered_full_head_rope_matches_transformers(params):
    """Phi-4-mini's partial rotary (factor 0.75: 12 of 16 dims rotated): sglite's tables (pass-through
    columns 1/0) applied to Q / K rows in :func:`rope.rotary_row_order` equal transformers' rotated
    Q / K in the same order, at positions within and past Lo (a decode step each)."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    from sglite.runtime.models.llama import _apply_rope

    cfg = _phi3_config(params, partial_rotary_factor=0.75)
    spec = rope.spec_from_hf_config(cfg, D)
    assert (spec.dim, spec.head_dim) == (12, D)
    cos, sin = rope.rope_cache(spec, 256)  # [P, D/2]
    assert torch.equal(cos[:, 6:], torch.ones(256, 2)) and torch.equal(sin[:, 6:], torch.zeros(256, 2))
    rot = _hf_rotary(cfg)
    idx = rope.rotary_row_order(2 * D, D, 12)
    assert sorted(idx.tolist()) == list(range(2 * D))
    gen = torch.Generator().manual_seed(0)
    for p in (0, 5, 63, 64, 200):
        q, k = torch.randn(1, 2, 1, D, generator=gen), torch.randn(1, 2, 1, D, generator=gen)  # [B, H, T, D]
        hc, hs = rot(q, torch.tensor([[p]]))
        hq, hk = apply_rotary_pos_emb(q, k, hc, hs)
        for x, hx in ((q, hq), (k, hk)):
            ours = _apply_rope(x.reshape(1, 2 * D)[:, idx].reshape(1, 2, D), cos[[p]], sin[[p]])
            assert torch.allclose(ours.reshape(-1), hx.reshape(-1)[idx], atol=2e-5), p


def test_llama_arch_reads_the_rope_variant():
    from sglite.runtime.models.llama import LlamaArch

    cfg = _llama_config(dict(VARIANTS["llama3"]))
    cfg.architectures = ["LlamaForCausalLM"]
    arch = LlamaArch.from_hf_config(cfg)
    assert arch.rope.rope_type == "llama3" and arch.rope.factor == 8.0 and arch.max_position_embeddings == 256
    cfg.rope_parameters = {"rope_type": "mrope", "rope_theta": 10000.0}
    with pytest.raises(InvalidRequestError, match="supported"):
        LlamaArch.from_hf_config(cfg)
