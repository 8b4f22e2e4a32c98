"""LoRA adapters (sglite.lora, issue 30) against PEFT-in-transformers in float32: greedy tokens and
prompt logprobs per adapter for one batch mixing three adapters and the base model (radix cache
on), prefixes never shared across adapters, adapters loaded and unloaded at run time (their cache
entries dropped), the load-time errors naming the adapter and the field, and the other families
(Qwen2 biases, Phi-3's fused projections, Gemma 2). Slow tier: building PEFT adapters and their
references takes ~15 s; tests/runtime/test_lora_units.py is the fast tier's share."""
import json

import pytest
import torch

pytest.importorskip("peft", reason="peft (dev extra) builds and runs the reference adapters")

from sglite.errors import InvalidRequestError  # noqa: E402
from sglite.lora.testing import make_tiny_lora, peft_greedy  # noqa: E402

pytestmark = pytest.mark.slow

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS = {  # name: (rank, targets, seed, rsLoRA)
    "all4": (4, ALL, 1, False),
    "qv8": (8, ["q_proj", "v_proj"], 2, False),
    "mlp2": (2, ["o_proj", "gate_proj", "up_proj", "down_proj"], 3, True),
}


@pytest.fixture(scope="module")
def lora_setup(tiny_model_dir, tmp_path_factory):
    """(base dir, {name: adapter dir}, prompts, {name or None: (PEFT tokens, PEFT log-softmax)})."""
    from sglite.runtime.tokenizer import Tokenizer
    from sglite.testing import word_prompts

    root = tmp_path_factory.mktemp("loras")
    paths = {n: make_tiny_lora(tiny_model_dir, root / n, r=r, target_modules=t, seed=s, use_rslora=rs)
             for n, (r, t, s, rs) in SPECS.items()}
    prompts = word_prompts(Tokenizer.from_dir(tiny_model_dir), 4, 6, 30, seed=11)
    ref = {}
    for i, name in enumerate([*SPECS, None]):
        outs, logps = peft_greedy(tiny_model_dir, paths.get(name), [prompts[i]], NEW)
        ref[name] = (outs[0], logps[0])
    assert len({tuple(o) for o, _ in ref.values()}) == 4  # the adapters change the model
    return tiny_model_dir, paths, prompts, ref


def engine(model_dir, **kw):
    from sglite import Engine

    return Engine(model_path=str(model_dir), dtype="float32", check_invariants=True, max_total_tokens=4096, **kw)


def test_mixed_batch_matches_peft(lora_setup):
    """Prompt i runs with adapter i (the last with none), all in one batch: PEFT's greedy tokens
    and prompt logprobs (1e-4) for each; the same batch again hits each adapter's own cache."""
    d, paths, prompts, ref = lora_setup
    names = [*SPECS, None]
    with engine(d, lora_paths={n: str(p) for n, p in paths.items()}) as e:
        for rnd in range(2):
            res = e.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names, return_logprob=rnd == 0,
                             logprob_start_len=0)  # prompt logprobs are computed, not read from the cache
            for i, (name, r) in enumerate(zip(names, res)):
                want, logp = ref[name]
                assert r["output_ids"] == want, f"adapter {name}: tokens diverge from PEFT (round {rnd})"
                if rnd == 0:
                    ours = torch.tensor([x[0] for x in r["meta_info"]["input_token_logprobs"][1:]])
                    p = prompts[i]
                    theirs = logp[torch.arange(len(p) - 1), torch.tensor(p[1:])]
                    assert torch.allclose(ours, theirs, atol=1e-4), f"adapter {name}: {(ours - theirs).abs().max()}"
                else:
                    assert r["meta_info"]["cached_tokens"] > 0
        e.check_invariants()


def test_adapters_never_share_a_prefix(lora_setup):
    """One prompt with adapter A, then with B, then with none, then A again: B and the base model
    find nothing cached (A's KV is not theirs), A finds its own; every output equals PEFT's."""
    d, paths, prompts, _ = lora_setup
    p = prompts[1]
    ref = {n: peft_greedy(d, paths.get(n), [p], NEW)[0][0] for n in ("all4", "qv8", None)}
    with engine(d, lora_paths=[f"{n}={paths[n]}" for n in ("all4", "qv8")]) as e:
        seen = []
        for name in ("all4", "qv8", None, "all4"):
            r = e.generate(input_ids=p, sampling_params=GREEDY, lora_path=name)
            seen.append(r["meta_info"]["cached_tokens"])
            assert r["output_ids"] == ref[name], f"adapter {name}"
        assert seen[:3] == [0, 0, 0] and seen[3] > 0


def test_load_unload_at_run_time(lora_setup, tmp_path):
    """An adapter loaded at run time serves as one given at start-up; unloading it drops its cache
    entries and later requests naming it are refused (field lora_path)."""
    d, paths, prompts, ref = lora_setup
    with engine(d, max_lora_rank=8) as e:
        with pytest.raises(InvalidRequestError) as ei:
            e.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="all4")
        assert ei.value.field == "lora_path"
        assert e.load_lora_adapter("all4", str(paths["all4"])) == ["all4"]
        assert e.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="all4")["output_ids"] == ref["all4"][0]
        cache = e.scheduler.kv.cache
        before = cache.total_size()
        assert before > 0
        with pytest.raises(InvalidRequestError, match="already loaded"):
            e.load_lora_adapter("all4", str(paths["all4"]))
        assert e.unload_lora_adapter("all4") == []
        assert cache.total_size() == 0  # its entries were the only ones
        e.check_invariants()
        with pytest.raises(InvalidRequestError):
            e.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="all4")
        with pytest.raises(InvalidRequestError) as ei:
            e.unload_lora_adapter("all4")
        assert ei.value.field == "lora_name"


def test_load_errors_name_adapter_and_field(lora_setup, tmp_path):
    d, paths, _, _ = lora_setup
    with engine(d, max_lora_rank=4) as e:
        with pytest.raises(InvalidRequestError, match="'big'.*r=8 exceeds max_lora_rank=4") as ei:
            e.load_lora_adapter("big", str(paths["qv8"]))
        assert ei.value.field == "max_lora_rank"
        bad = tmp_path / "bad"
        bad.mkdir()
        cfg = json.loads((paths["all4"] / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "conv1"]}))
        (bad / "adapter_model.safetensors").write_bytes((paths["all4"] / "adapter_model.safetensors").read_bytes())
        with pytest.raises(InvalidRequestError, match="'odd'.*conv1") as ei:
            e.load_lora_adapter("odd", str(bad))
        assert ei.value.field == "target_modules"
    from sglite.lora import load_adapter
    from sglite.runtime.models.llama import LlamaArch
    from transformers import AutoConfig

    arch = LlamaArch.from_hf_config(AutoConfig.from_pretrained(str(d)))
    wide = LlamaArch(**{**arch.__dict__, "hidden_size": 128})
    with pytest.raises(InvalidRequestError, match="'all4'.*hidden_size") as ei:
        load_adapter("all4", str(paths["all4"]), wide, 16, torch.float32, 1)
    assert ei.value.field == "hidden_size"
    with pytest.raises(InvalidRequestError, match="no adapter_config.json") as ei:
        load_adapter("none", str(tmp_path), arch, 16, torch.float32, 1)


FAMILY_TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], "qwen2": ALL, "gemma2": ALL}


@pytest.mark.parametrize("family", sorted(FAMILY_TARGETS))
def test_other_families_match_peft(family, tmp_path_factory, real_checkpoint):
    """Qwen2 (q/k/v biases), Phi-3 (an adapter of its fused qkv_proj / gate_up_proj) and Gemma 2
    (softcapping, sliding window, (1 + w) norms): an adapter's greedy tokens and prompt logprobs
    equal PEFT's, beside a base-model request in the same batch."""
    from sglite.runtime.tokenizer import Tokenizer
    from sglite.testing import make_tiny_family, make_tiny_llama, word_prompts

    root = tmp_path_factory.mktemp(f"lora_{family}")
    vocab = real_checkpoint.model_dir
    if family == "phi3":
        from tests.runtime.test_families_rope import make_tiny_phi3

        d = make_tiny_phi3(root / "base", vocab, seed=3)
    elif family == "qwen2":
        d = make_tiny_llama(root / "base", seed=1, qkv_bias=True, vocab_from=vocab)
    else:
        from tests.runtime.test_families_gemma import FAMILIES

        mt, arch, fields = FAMILIES["gemma2"]
        d = make_tiny_family(root / "base", mt, arch, seed=3, vocab_from=vocab, **fields)
    a = make_tiny_lora(d, root / "a", r=4, target_modules=FAMILY_TARGETS[family], seed=5, std=0.2)
    prompts = word_prompts(Tokenizer.from_dir(d), 2, 6, 20, seed=4)
    (want,), (logp,) = peft_greedy(d, a, prompts[:1], NEW)
    (base,), _ = peft_greedy(d, None, prompts[1:], NEW)
    assert want != peft_greedy(d, None, prompts[:1], NEW)[0][0]
    with engine(d, lora_paths={"a": str(a)}) as e:
        res = e.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=["a", None], return_logprob=True,
                         logprob_start_len=0)
    assert res[0]["output_ids"] == want and res[1]["output_ids"] == base
    ours = torch.tensor([x[0] for x in res[0]["meta_info"]["input_token_logprobs"][1:]])
    theirs = logp[torch.arange(len(prompts[0]) - 1), torch.tensor(prompts[0][1:])]
    assert torch.allclose(ours, theirs, atol=1e-4), f"{family}: {(ours - theirs).abs().max()}"
