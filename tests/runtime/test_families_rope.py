"""Llama 3.x (and the other RoPE-scaled Llamas) and Phi-3 against transformers, float32.

Tiny random checkpoints (2 layers, hidden 64, the default model's tokenizer): sglite's greedy
tokens and prompt logprobs equal transformers', radix cache on/off x chunked prefill (16) or not,
alone and batched. Phi-3 long-RoPE (generation past ``original_max_position_embeddings`` (Lo),
prompts longer than Lo): transformers fed one token at a time (each position rotated for a
sequence ending at it: the per-position rule of sglite/runtime/models/rope.py), which is
``generate`` until the sequence passes Lo (there Phi-3's ``generate`` recomputes the whole
sequence with the long factors; see docs/models.md). The fused C++ decode is checked on RoPE-scaled quantized models.
"""
import itertools
import shutil

import pytest
import torch

from sglite.testing import word_prompts

NEW = 32
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
LO = 64  # original_max_position_embeddings of the scaled tiny models
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.15 * i for i in range(8)], "long_factor": [1.5 + 0.7 * i for i in range(8)]}
PARTIAL_LONGROPE = {**LONGROPE, "short_factor": LONGROPE["short_factor"][:6],
                    "long_factor": LONGROPE["long_factor"][:6]}  # rotary dim 12 of 16: 6 factors
LLAMA_ROPES = {
    "llama3": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": LO}),
    "linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": LO}),
    "dynamic": dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
                    max_position_embeddings=LO),
}


def make_tiny_phi3(out_dir, vocab_from, seed=0, **overrides):
    """A tiny random ``Phi3ForCausalLM`` (fused qkv_proj / gate_up_proj) with the given tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from sglite.testing import _TOKENIZER_FILES, _fill_weights, _vocab_facts

    out = out_dir
    out.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (vocab_from / name).is_file():
            shutil.copyfile(vocab_from / name, out / name)
    vocab, special = _vocab_facts(out)
    fields = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=2048,
                  original_max_position_embeddings=2048, rms_norm_eps=1e-5, hidden_act="silu", sliding_window=None,
                  bos_token_id=special.get("bos"), eos_token_id=special.get("eos"),
                  pad_token_id=special.get("pad"), dtype="float32")
    fields.update(overrides)
    config = AutoConfig.for_model("phi3", **fields)
    config.architectures = ["Phi3ForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_weights(model, config, seed)
    model.save_pretrained(str(out))
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(str(out))
    return out


def _model_dir(kind, root, vocab_from):
    from sglite.testing import make_tiny_llama

    if kind == "phi3":
        return make_tiny_phi3(root / kind, vocab_from, seed=3)
    if kind == "phi3_longrope":
        return make_tiny_phi3(root / kind, vocab_from, seed=4, max_position_embeddings=512,
                              original_max_position_embeddings=LO, rope_parameters=dict(LONGROPE))
    if kind == "phi4_partial":  # Phi-4-mini's shape of RoPE: partial rotary 0.75 (12 of 16 dims), longrope
        return make_tiny_phi3(root / kind, vocab_from, seed=6, max_position_embeddings=512, partial_rotary_factor=0.75,
                              original_max_position_embeddings=LO, rope_parameters=dict(PARTIAL_LONGROPE))
    return make_tiny_llama(root / kind, seed=5, vocab_from=vocab_from, **LLAMA_ROPES[kind])


def _hf_generate(hf, ids, new=NEW):
    """transformers' greedy tokens (one-shot prefill, then decode steps) and prompt log-probs [P, V]."""
    x = torch.tensor([ids])
    with torch.no_grad():
        g = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
        logits = hf(x).logits[0].float()
    return g[0, len(ids):].tolist(), torch.log_softmax(logits, -1)


def _hf_token_by_token(hf, ids, new=NEW):
    """transformers fed one token per forward (KV cache), prompt included: every position is
    rotated for a sequence that ends at it. Greedy tokens and prompt log-probs [P, V]."""
    from transformers import DynamicCache

    cache, rows, toks = DynamicCache(config=hf.config), [], []
    with torch.no_grad():
        for t in ids:
            rows.append(hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0, -1].float())
        last = rows[-1]
        for _ in range(new):
            nxt = int(last.argmax())
            toks.append(nxt)
            last = hf(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True).logits[0, -1].float()
    return toks, torch.log_softmax(torch.stack(rows), -1)


def _prompts(tok, n, lo, hi, seed):
    return word_prompts(tok, n, lo, hi, seed, words_per_token=2, exact=True)


def _engine(model_dir, **kw):
    from sglite import Engine

    kw.setdefault("max_total_tokens", 4096)
    return Engine(model_path=str(model_dir), dtype="float32", check_invariants=True, **kw)


def _check_logprobs(r, ids, ref):
    lp = r["meta_info"]["input_token_logprobs"]
    assert lp[0][0] is None and len(lp) == len(ids)
    ours = torch.tensor([e[0] for e in lp[1:]])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(ours, want, atol=1e-3), f"prompt logprobs differ by {(ours - want).abs().max()}"


KINDS = ["llama3", "phi3", "phi3_longrope", "phi4_partial", "linear", "yarn", "dynamic"]
FULL_MATRIX = ("llama3", "phi3", "phi3_longrope")  # the others: one configuration


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, real_checkpoint):
    """kind -> (model dir, prompts), built on first use (no transformers run: see ``family``)."""
    from sglite.runtime.tokenizer import Tokenizer

    root, made = tmp_path_factory.mktemp("rope_families"), {}

    def get(kind):
        if kind not in made:
            d = _model_dir(kind, root, real_checkpoint.model_dir)
            tok = Tokenizer.from_dir(d)
            # within Lo (or 2048), several long enough that generation runs past Lo
            prompts = _prompts(tok, 3, 5, LO if kind != "phi3" else 300, seed=len(kind))
            prompts.insert(1, _prompts(tok, 1, LO - 12, LO - 12, seed=len(kind))[0])
            made[kind] = (d, prompts)
        return made[kind]

    return get


@pytest.fixture(scope="module")
def family(family_dirs):
    """kind -> (model dir, prompts, HF tokens, HF prompt log-probs, HF model), built on first use."""
    from transformers import AutoModelForCausalLM

    made = {}

    def get(kind):
        if kind not in made:
            d, prompts = family_dirs(kind)
            hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
            # Phi-3's generate() re-runs the whole sequence with the long factors once it passes Lo
            # (prepare_inputs_for_generation drops the cache); sglite keeps the cache, so its oracle is
            # transformers fed token by token (= generate() until the sequence passes Lo)
            by_token = kind in ("phi3_longrope", "phi4_partial")
            refs = [(_hf_token_by_token if by_token else _hf_generate)(hf, p) for p in prompts]
            made[kind] = (d, prompts, [r[0] for r in refs], [r[1] for r in refs], hf)
        return made[kind]

    return get


def test_configs_load_as_the_expected_variant(family_dirs):
    from transformers import AutoConfig

    from sglite.runtime.models.llama import LlamaArch

    # the checkpoints alone (``family`` would also run transformers on each one)
    for kind, want, dim in [("llama3", "llama3", 16), ("phi3_longrope", "longrope", 16), ("phi3", "default", 16),
                            ("phi4_partial", "longrope", 12)]:
        d = family_dirs(kind)[0]
        arch = LlamaArch.from_hf_config(AutoConfig.from_pretrained(str(d)))
        assert (arch.rope.rope_type, arch.rope.dim) == (want, dim)


# the fast tier runs one configuration of Llama 3 and of Phi-3 long-RoPE (radix on, chunked); the
# slow tier the rest (each kind's tables are also checked against transformers in test_rope.py)
FAST = ("llama3", "phi3_longrope")
MATRIX = [pytest.param(k, r, c, marks=() if (r, c) == (True, 16) and k in FAST else pytest.mark.slow)
          for k in KINDS for r, c in itertools.product([True, False], [16, None])
          if k in FULL_MATRIX or (r, c) == (True, 16)]


@pytest.mark.parametrize("kind,radix,chunk", MATRIX)
def test_matches_hf(family, kind, radix, chunk):
    d, prompts, outs, logps, _ = family(kind)
    with _engine(d, disable_radix_cache=not radix, chunked_prefill_size=chunk or -1) as e:
        alone = e.generate(input_ids=prompts[0], sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
        batch = e.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
        again = e.generate(input_ids=prompts[2], sampling_params=GREEDY)  # from the cache when on
        e.check_invariants()
    assert alone["output_ids"] == outs[0]
    _check_logprobs(alone, prompts[0], logps[0])
    for i, r in enumerate(batch):
        assert r["output_ids"] == outs[i], f"batch: prompt {i} ({len(prompts[i])} tokens) diverges"
        _check_logprobs(r, prompts[i], logps[i])
    assert again["output_ids"] == outs[2]
    if kind != "phi3":
        assert max(len(p) for p in prompts) + NEW > LO  # generation ran past the original length


@pytest.mark.parametrize("chunk", [16, pytest.param(None, marks=pytest.mark.slow)])
def test_longrope_prompt_longer_than_original_length(family, chunk):
    """Prompts of 100..200 tokens (Lo = 64): transformers fed token by token, radix cache reused."""
    d, _, _, _, hf = family("phi3_longrope")
    from sglite.runtime.tokenizer import Tokenizer

    prompts = _prompts(Tokenizer.from_dir(d), 2, 100, 200, seed=11)
    refs = [_hf_token_by_token(hf, p) for p in prompts]
    with _engine(d, chunked_prefill_size=chunk or -1) as e:
        res = e.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
        again = e.generate(input_ids=prompts[0][:80], sampling_params=GREEDY)  # a cached prefix, past Lo
    for p, r, (toks, lp) in zip(prompts, res, refs):
        assert r["output_ids"] == toks
        _check_logprobs(r, p, lp)
    assert again["output_ids"] == _hf_token_by_token(hf, prompts[0][:80])[0]
    assert again["meta_info"]["cached_tokens"] > 0


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "llama3"])
def test_fused_decode_reads_the_scaled_tables(family_dirs, kind, tmp_path):
    """The fused C++ decode (quantized model) gives the per-op path's tokens past Lo."""
    from sglite.kernels import decode_fused, quant_cpu
    from sglite.quant.calibrate import QuantOptions
    from sglite.quantize import quantize

    if not quant_cpu.available():
        pytest.skip("the C++ quant kernel did not build here")
    d, prompts = family_dirs(kind)  # the oracle is the per-op path: no transformers run needed
    q = quantize(str(d), tmp_path / "q", QuantOptions(method="rtn", bits=8, group_size=32), n_samples=1, seq_len=16)
    from sglite import Engine

    with Engine(model_path=str(q), dtype="float32", max_total_tokens=2048) as e:
        model = e.runner.model
        fused, seen = model.decode_fused, []
        assert isinstance(fused, decode_fused.FusedDecode)

        class Checked:
            def forward(self, fb, kb, vb):
                got = fused.forward(fb, kb, vb)
                if got is not None:
                    ref = model._forward(fb, kb, vb)
                    assert (got - ref).abs().max().item() <= 1e-5 * (ref.abs().max().item() + 1e-6)
                    seen.append(int(fb.positions.max()))
                return got

        model.decode_fused = Checked()
        got = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
        model.decode_fused = None
        ref = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert got == ref and max(seen) >= LO


@pytest.mark.parametrize("kind", ["phi3", "llama3"])
def test_unsupported_rope_type_refused_before_weights(tmp_path, real_checkpoint, kind):
    """An unknown rope_type is an InvalidRequestError at config read (transformers' own check for
    Phi-3, sglite's naming the supported values for Llama), before any weight is read."""
    import json

    from sglite import Engine
    from sglite.errors import InvalidRequestError

    d = _model_dir(kind, tmp_path, real_checkpoint.model_dir)
    (d / "model.safetensors").write_bytes(b"not weights")  # never read
    cfg = json.loads((d / "config.json").read_text())
    rope = cfg.pop("rope_parameters", None) or cfg.pop("rope_scaling", None) or {}
    cfg["rope_scaling"] = dict(rope, rope_type="mrope")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidRequestError, match="mrope") as ei:
        Engine(model_path=str(d), dtype="float32", max_total_tokens=1024)
    if kind == "llama3":
        assert ei.value.field in ("rope_parameters", "rope_scaling") and "longrope" in str(ei.value)


def test_phi3_tensor_parallel_shards_split_the_fused_rows(tmp_path, real_checkpoint):
    """Each rank's Phi-3 shard (load_shard) equals its slice of the split full weights."""
    from sglite.runtime.model_loader import load_checkpoint, load_state_dict
    from sglite.runtime.parallel.parallel_state import TPLayout, load_shard

    ck = load_checkpoint(_model_dir("phi3", tmp_path, real_checkpoint.model_dir))
    full = load_state_dict(ck, torch.float32)
    assert "model.layers.0.self_attn.qkv_proj.weight" not in full
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        n = f"model.layers.1.{name}.weight"
        shards = [load_shard(ck, TPLayout.make(ck.hf_config, r, 2), torch.float32)[n] for r in range(2)]
        assert torch.equal(torch.cat(shards), full[n]), name


@pytest.mark.slow
def test_transformers_phi3_generate_rerotates_everything_past_lo(family):
    """What sglite's per-position rule is compared against (docs/models.md): transformers' Phi-3
    ``generate`` equals recomputing the whole sequence at every step (no cache), i.e. once the
    sequence is longer than Lo every position is rotated with the long factors. Pinned so a change
    in transformers' behaviour shows here."""
    d, prompts, *_, hf = family("phi3_longrope")
    ids = prompts[1]  # Lo - 12 tokens: generation crosses Lo
    x = torch.tensor([ids])
    with torch.no_grad():
        gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        seq = list(ids)
        for _ in range(24):
            seq.append(int(hf(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    assert len(ids) < LO < len(ids) + 24
    assert gen == seq[len(ids):]
