"""Helpers for tests: tiny random-weight Llama-family (and OLMo 2 / Granite / Gemma) checkpoints with the real tokenizer, the
chi-square homogeneity test, and the decision z-test of the speculative-sampling distribution
tests (:func:`decision_z`)."""
from __future__ import annotations

import contextlib
import math
import random
import shutil
from pathlib import Path

from .testing_gguf import make_tiny_gguf, random_gguf_blocks  # noqa: F401  (re-exported)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                    "added_tokens.json")


def make_tiny_llama(out_dir, *, seed: int = 0, vocab_from=None, qkv_bias: bool = False,
                    **config_overrides) -> Path:
    """Write a tiny random-weight HF checkpoint into ``out_dir`` and return its path.

    Defaults: hidden 64, 2 layers, 4 heads, 2 KV heads (GQA), head_dim 16, intermediate 128,
    vocabulary of the tokenizer copied in, tied embeddings, rope_theta 10000, 2048 positions,
    float32 safetensors. ``qkv_bias=True`` writes a Qwen2 config (``Qwen2ForCausalLM``, biases
    on q/k/v). ``config_overrides`` go into the config (e.g. ``num_hidden_layers=4``).

    Weights are drawn from a ``torch.Generator`` seeded with ``seed`` (same seed, same files).
    They are scaled so logits are non-degenerate: greedy decoding does not just repeat the last
    token and the distribution is neither flat nor one-hot.

    Args:
        out_dir: folder to create (may exist; files are overwritten).
        vocab_from: HF folder whose tokenizer files are copied; default: the converted default
            model (converted on first use, see :func:`sglite.runtime.model_loader.load_checkpoint`).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out, vocab_size, special = _tokenizer_folder(out_dir, vocab_from)

    model_type = "qwen2" if qkv_bias else "llama"
    fields = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=vocab_size, tie_word_embeddings=True,
        rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_act="silu",
        bos_token_id=special.get("bos"), eos_token_id=special.get("eos"),
        pad_token_id=special.get("pad"), dtype="float32",
    )
    if model_type == "llama":
        fields.update(attention_bias=False, mlp_bias=False)
    else:
        fields.update(use_sliding_window=False)
    fields.update(config_overrides)
    if "head_dim" not in config_overrides and "hidden_size" in config_overrides:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"]

    torch.manual_seed(seed)  # HF init draws from the global generator; overwritten below anyway
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_weights(model, config, seed)
    model.save_pretrained(str(out))
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(str(out))
    return out


def make_tiny_family(out_dir, model_type: str, architecture: str, *, seed: int = 0, vocab_from=None,
                     **config_overrides) -> Path:
    """A tiny random checkpoint of another family (OLMo 2, Granite, Gemma 2/3, ...): the shape of
    :func:`make_tiny_llama` (hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, intermediate
    128, the tokenizer of ``vocab_from`` copied in) for HF ``model_type`` / ``architecture``, with
    ``config_overrides`` (the family's own fields). Weights as :func:`make_tiny_llama`'s, except
    that every norm weight is drawn around its neutral value (1, or 0 for Gemma's ``(1 + w)``
    norms) with std 0.2, so a norm applied in the wrong place or with the wrong offset shows."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out, vocab_size, special = _tokenizer_folder(out_dir, vocab_from)
    fields = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=vocab_size, tie_word_embeddings=True, max_position_embeddings=2048,
        rms_norm_eps=1e-6, bos_token_id=special.get("bos"), eos_token_id=special.get("eos"),
        pad_token_id=special.get("pad"), dtype="float32")
    fields.update(config_overrides)
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    _fill_weights(model, config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    offset = model_type.startswith("gemma")  # (1 + w) norms: neutral at w = 0
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight") and name != "model.norm.weight":
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2 + (0.0 if offset else 1.0))
    model.save_pretrained(str(out))
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(str(out))
    return out


def _tokenizer_folder(out_dir, vocab_from) -> tuple[Path, int, dict]:
    """Create ``out_dir`` holding the tokenizer files of ``vocab_from`` (default: the converted
    default model); returns (folder, vocabulary size, special token ids)."""
    from .runtime.model_loader import load_checkpoint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(vocab_from) if vocab_from is not None else load_checkpoint(None).model_dir
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    vocab_size, special = _vocab_facts(out)
    return out, vocab_size, special


def word_prompts(tok, n: int, lo: int, hi: int, seed: int, words_per_token: int = 1,
                 exact: bool = False) -> list[list[int]]:
    """``n`` prompts of token ids, each cut to a length drawn in ``[lo, hi]``, from mixed words
    (ASCII, accents, an emoji, newlines). ``words_per_token`` words are drawn per target token so
    that the cut lands inside the text; ``exact`` asserts every prompt reached its drawn length."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "the", "cat", "sat", "on", "mat", "42", "é", "🙂", "\n"]
    out = []
    for _ in range(n):
        target = rng.randint(lo, hi)
        out.append(tok.encode(" ".join(rng.choice(words) for _ in range(target * words_per_token)))[:target])
        assert not exact or len(out[-1]) == target
    return out


def hf_greedy(model_dir, prompts_ids, new: int, attn_implementation: str = "eager"):
    """Transformers' reference on ``model_dir`` in float32: per prompt (a list of token ids) the
    ``new`` greedy tokens (``generate``, EOS ignored) and the prompt's log-softmax, float32
    ``[T, V]``. ``attn_implementation``: transformers' attention (``eager``, ``sdpa``)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                              attn_implementation=attn_implementation)
    outs, logps = [], []
    for ids in prompts_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            g = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
            logits = hf(x).logits[0].float()
        outs.append(g[0, len(ids):].tolist())
        logps.append(torch.log_softmax(logits, -1))
    return outs, logps


def _vocab_facts(folder: Path) -> tuple[int, dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    special = {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    return len(tok), special


def _fill_weights(model, config, seed: int) -> None:
    """Overwrite every parameter deterministically.

    Linear weights ~ N(0, 0.02) except the residual-output projections (``o_proj``,
    ``down_proj``), drawn larger (std 1/sqrt(fan_in)) so the layers actually move the residual
    stream away from the input embedding; the final norm weight is scaled up so the tied-head
    logits have a spread of a few units rather than ~0.1 (greedy tokens vary, softmax not flat).
    Biases ~ N(0, 0.02); norm weights 1.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                value = torch.ones_like(param)
                if name == "model.norm.weight":
                    value *= 16.0
            elif name.endswith("bias"):
                value = torch.randn(param.shape, generator=gen) * 0.02
            elif name == "model.embed_tokens.weight":
                value = torch.randn(param.shape, generator=gen) * 0.02
            else:  # projections: std 1/sqrt(fan_in) keeps activations O(1)
                value = torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1])
            param.copy_(value)


def rerun_in_triton_interpreter(test_file: str, timeout: float = 600.0):
    """Run one pytest file in a fresh interpreter with ``TRITON_INTERPRET=1`` set before triton is
    imported (``SGLITE_TEST_DEVICE=cpu``): for Triton test files collected after another module
    imported triton. Returns the ``subprocess.CompletedProcess`` (text stdout/stderr); raises
    ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", SGLITE_TEST_DEVICE="cpu")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file],
                          env=env, capture_output=True, text=True, timeout=timeout)


def homogeneity_p(a: dict, b: dict) -> float:
    """P-value of the chi-square homogeneity test of two samples' category counts (dicts); rare
    categories (pooled expected count < 10) are merged into one."""
    na, nb = sum(a.values()), sum(b.values())
    cats, rare = [], [0, 0]
    for c in set(a) | set(b):
        x, y = a.get(c, 0), b.get(c, 0)
        if x + y < 10:
            rare[0] += x
            rare[1] += y
        else:
            cats.append((x, y))
    if sum(rare):
        cats.append(tuple(rare))
    stat = 0.0
    for x, y in cats:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = len(cats) - 1
    import torch

    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64))) if df > 0 else 1.0


def sampling_oracle(model_dir, prompt_ids, grammar=None, *, temperature: float = 1.0, top_k: int = -1,
                    top_p: float = 1.0):
    """The model's own sampling distribution after ``prompt_ids`` + a context, from HF
    transformers in float32 (the independent oracle of the speculative-sampling tests): the
    grammar's mask at the context, then temperature, top-k, top-p, in the sampler's order
    (``kernels.reference.sample``).

    Args:
        model_dir: the HF checkpoint the engine serves.
        prompt_ids: the prompt's token ids as the engine saw them.
        grammar: a compiled grammar (``.matcher()``) or None.
    Returns:
        ``probs(ctx)``: ctx a tuple of output ids -> [V] float64 probabilities summing to 1, cached
        per context. Raises AssertionError when the grammar refuses ``ctx``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from .kernels.reference import bitmask_to_additive

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    V = hf.config.vocab_size
    cache: dict = {}

    def probs(ctx: tuple) -> "torch.Tensor":
        if ctx not in cache:
            with torch.no_grad():
                x = hf(torch.tensor([list(prompt_ids) + list(ctx)])).logits[0, -1].double()  # [V]
            if grammar is not None:
                m = grammar.matcher()
                assert all(m.accept_token(t) for t in ctx), "an output the grammar refuses"
                mask = torch.full((1, (V + 31) // 32), -1, dtype=torch.int32)
                m.fill_next_token_bitmask(mask, 0)
                x = x + bitmask_to_additive(mask, V)[0].double()
            p = torch.softmax(x / temperature, -1)
            if 0 < top_k < V:
                p[p < p.topk(top_k).values[-1]] = 0
            srt = p.sort(descending=True).values
            p[p < srt[(srt.cumsum(0) - srt) < top_p].min()] = 0  # keep while the mass above is < top_p
            cache[ctx] = p / p.sum()
        return cache[ctx]

    return probs


def martingale_z(events) -> float:
    """``sum(x - p) / sqrt(sum p (1 - p))`` over ``events`` = (x: bool, p: float) pairs, where
    ``p`` is P(x) given everything before it: ~N(0, 1) for an exact sampler (martingale
    differences, Lindeberg CLT), drifting like sqrt(n) for a biased one."""
    dx = var = 0.0
    for x, p in events:
        dx += x - p
        var += p * (1 - p)
    return dx / var ** 0.5


def decision_z(model_dir, tokenizer, prompt_ids, outputs, decisions, grammar=None, **sampling) -> dict:
    """Per decision, the z-score (:func:`martingale_z`) of the sampled outputs against the model's
    own probabilities (:func:`sampling_oracle`; ``sampling``: its temperature, top_k, top_p).

    A decision is ``(before, letter)``: at the token that starts right after the text ``before``
    (context: the prompt and the output ids before it), ``p`` = P(that token's text starts with
    ``letter``); ``x`` = the output's text there does. However the context came about (plain
    sampling, an accepted draft, a resample, a bonus token), ``x - p`` are martingale
    differences. Samples must be independent draws (distinct seeds); two engines' outputs for the
    same seeds are not independent of each other, which is why this tests each against the model
    rather than one against the other.

    Args:
        tokenizer: ``encode`` / ``decode`` of the engine (:class:`sglite.runtime.tokenizer.Tokenizer`).
        outputs: generate results (dicts with ``output_ids`` and ``text``).
    Returns:
        ``{before: z}``.
    Raises:
        AssertionError: an output has no token starting exactly after ``before`` (the test would
            otherwise leave it out, biasing the sample).
    """
    probs = sampling_oracle(model_dir, prompt_ids, grammar, **sampling)
    p_letter: dict = {}  # (context, letter) -> P(the next token's text starts with letter)

    def event(o, before, letter):
        ids = o["output_ids"]
        j = next((j for j in range(len(ids) + 1) if before in tokenizer.decode(ids[:j])), None)
        assert j is not None and tokenizer.decode(ids[:j]).endswith(before), (before, o["text"])
        key = (tuple(ids[:j]), letter)
        if key not in p_letter:
            p = probs(key[0])
            p_letter[key] = sum(float(p[t]) for t in p.nonzero().squeeze(1).tolist()
                                if tokenizer.decode([t]).startswith(letter))
        at = o["text"].index(before) + len(before)
        return o["text"][at:at + len(letter)] == letter, p_letter[key]

    return {before: martingale_z(event(o, before, letter) for o in outputs) for before, letter in decisions}


@contextlib.contextmanager
def oracle_drafts(engine, want: dict, k: int):
    """Within the block, ``engine``'s NGRAM decoder drafts with :func:`oracle_drafter` (``want``,
    ``k``: its arguments) as its proposer; its own proposer comes back after, also on an error."""
    from sglite.runtime.speculative.proposer import EntryProposer

    dec = engine.scheduler.spec
    orig = dec.proposer
    dec.proposer = EntryProposer(oracle_drafter(want, k))
    try:
        yield dec
    finally:
        dec.proposer = orig


def oracle_drafter(want: dict, k: int):
    """A per-entry draft function that drafts the plain run's own next tokens (a proposer once
    wrapped in :class:`sglite.runtime.speculative.proposer.EntryProposer`, as
    :func:`oracle_drafts` does): for tests and bounds of speculative decoding (every draft token
    the target agrees with).

    Args:
        want: ``{prompt token ids (tuple): the plain run's output ids}``; a request matches the
            entry whose ids end its own input ids (a BOS the engine adds is ignored).
        k: draft tokens per step.
    Returns:
        ``drafts(entry) -> [(chain, sources)]``: one chain of up to ``k`` tokens after the
        request's output so far (source ``"text"``), or ``[]`` for an unknown prompt or the end.
    """
    def drafts(e):
        r = e.req
        w = next((v for ids, v in want.items() if tuple(r.input_ids[-len(ids):]) == ids), None)
        chain = list(w[len(r.output_ids):len(r.output_ids) + k]) if w else []
        return [(chain, ["text"] * len(chain))] if chain else []

    return drafts
