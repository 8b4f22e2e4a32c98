"""LoRA adapters over a quantized base through the fused C++ decode (issue 30's leftovers) against
PEFT-in-transformers on the dequantized base in float32: a tiny random Llama quantized to 4-bit
32-groups (RTN) serves three adapters and the base model in one batch; PEFT runs the same adapters
on an HF checkpoint holding the dequantized weights. Greedy tokens must be equal (the fused float32
GEMV is exact up to summation order) and prompt logprobs within 1e-4; the decode steps must have
gone through the fused path with adapters. Slow tier: PEFT references (~15 s)."""
import pytest
import torch

pytest.importorskip("peft", reason="peft (dev extra) builds and runs the reference adapters")

from sglite.lora.testing import make_tiny_lora, peft_greedy  # noqa: E402

pytestmark = pytest.mark.slow

NEW = 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS = {"all4": (4, ALL, 1), "qv8": (8, ["q_proj", "v_proj"], 2), "mlp2": (2, ["o_proj", "gate_proj", "up_proj", "down_proj"], 3)}


def dequantized_checkpoint(tiny_dir, qdir, out):
    """An HF folder of ``tiny_dir``'s model with every projection (and a quantized LM head /
    embedding) replaced by the dequantized weights sglite serves from ``qdir``."""
    from transformers import AutoModelForCausalLM

    from sglite import Engine

    with Engine(model_path=str(qdir), dtype="float32", max_total_tokens=256) as e:
        model = e.runner.model
        a = model.arch
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
        sd = {}
        for i, L in enumerate(model.layers):
            p = f"model.layers.{i}."
            qkv, gu = L["qkv"].dequantize(), L["gate_up"].dequantize()
            sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"] = qkv[:q], qkv[q:q + kv]
            sd[p + "self_attn.v_proj.weight"], sd[p + "self_attn.o_proj.weight"] = qkv[q + kv:], L["o"].dequantize()
            I = a.intermediate_size
            sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gu[:I], gu[I:]
            sd[p + "mlp.down_proj.weight"] = L["down"].dequantize()
        head = model.lm_head
        sd["lm_head.weight"] = head.dequantize() if hasattr(head, "dequantize") else getattr(head, "weight", head).float()
        if hasattr(model.embed, "dequantize"):
            sd["model.embed_tokens.weight"] = model.embed.dequantize()
        missing, unexpected = hf.load_state_dict(sd, strict=False)
        assert not unexpected
    hf.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def quantized_setup(tiny_model_dir, tmp_path_factory):
    import shutil

    from sglite.quant.calibrate import QuantOptions
    from sglite.quantize import quantize
    from sglite.runtime.tokenizer import Tokenizer
    from sglite.testing import word_prompts

    root = tmp_path_factory.mktemp("lora_fused_peft")
    qdir = quantize(str(tiny_model_dir), root / "rtn4", QuantOptions(method="rtn", bits=4, group_size=32),
                    n_samples=1, seq_len=16)
    deq = dequantized_checkpoint(tiny_model_dir, qdir, root / "deq")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny_model_dir / f).exists():
            shutil.copy(tiny_model_dir / f, deq / f)
    paths = {n: make_tiny_lora(tiny_model_dir, root / n, r=r, target_modules=t, seed=s) for n, (r, t, s) in SPECS.items()}
    prompts = word_prompts(Tokenizer.from_dir(tiny_model_dir), 4, 6, 30, seed=12)
    ref = {}
    for i, name in enumerate([*SPECS, None]):
        outs, logps = peft_greedy(deq, paths.get(name), [prompts[i]], NEW)
        ref[name] = (outs[0], logps[0])
    assert len({tuple(o) for o, _ in ref.values()}) == 4  # the adapters change the model
    return qdir, paths, prompts, ref


def test_quantized_base_fused_decode_matches_peft_on_dequantized(quantized_setup):
    from sglite import Engine

    qdir, paths, prompts, ref = quantized_setup
    names = [*SPECS, None]
    with Engine(model_path=str(qdir), dtype="float32", max_total_tokens=4096, check_invariants=True,
                lora_paths={n: str(p) for n, p in paths.items()}) as e:
        model = e.runner.model
        fused, seen = model.decode_fused, []
        assert fused is not None

        class Seen:
            def forward(self, fb, kb, vb):
                got = fused.forward(fb, kb, vb)
                if got is not None and fb.lora is not None:
                    seen.append(fb.input_ids.shape[0])
                return got

        model.decode_fused = Seen()
        res = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
                         lora_path=names, return_logprob=True, logprob_start_len=0)
        assert 4 in seen  # decode steps of the 3 adapters and the base row ran in the fused C++ decode
        for i, (name, r) in enumerate(zip(names, res)):
            want, logp = ref[name]
            assert r["output_ids"] == want, f"adapter {name}: tokens diverge from PEFT on the dequantized base"
            ours = torch.tensor([x[0] for x in r["meta_info"]["input_token_logprobs"][1:]])
            p = prompts[i]
            theirs = logp[torch.arange(len(p) - 1), torch.tensor(p[1:])]
            assert torch.allclose(ours, theirs, atol=1e-4), f"adapter {name}: {(ours - theirs).abs().max()}"
        e.check_invariants()
