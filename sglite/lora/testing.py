"""Test helpers of the LoRA oracle (tests/runtime/test_lora.py): random PEFT adapters for a tiny
checkpoint and PEFT-in-transformers' greedy tokens and prompt log-softmax in float32. Needs
``peft`` (the dev extra); imported only by tests and benchmarks."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence


def make_tiny_lora(base_dir, out_dir, *, r: int, target_modules: Sequence[str], seed: int,
                   lora_alpha: Optional[int] = None, use_rslora: bool = False, std: float = 0.3) -> Path:
    """Write a PEFT LoRA adapter of rank ``r`` over ``target_modules`` for the checkpoint at
    ``base_dir`` into ``out_dir`` (``adapter_config.json`` + ``adapter_model.safetensors``) and
    return its path. Both ``lora_A`` and ``lora_B`` are drawn ~ N(0, std) from a generator seeded
    with ``seed`` (PEFT's default zero ``lora_B`` would make the adapter a no-op)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=lora_alpha or 2 * r, target_modules=list(target_modules),
                     use_rslora=use_rslora, init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


def peft_greedy(base_dir, adapter_dir, prompts_ids, new: int):
    """PEFT's reference (``adapter_dir`` None: the base model alone) in float32, eager attention:
    per prompt the ``new`` greedy tokens (EOS ignored) and the prompt's log-softmax ``[T, V]``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, attn_implementation="eager")
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    outs, logps = [], []
    for ids in prompts_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            g = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
            logits = model(input_ids=x).logits[0].float()
        outs.append(g[0, len(ids):].tolist())
        logps.append(torch.log_softmax(logits, -1))
    return outs, logps
