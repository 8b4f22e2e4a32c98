"""Record llama.cpp's greedy tokens and top-1 / top-2 logits on tiny random Granite, OLMo 2 and SmolLM3
GGUF files, for tests/data/gguf_families_llamacpp.json (the oracle of tests/runtime/test_gguf_families.py).

The checkpoints are the test's (:func:`sglite.testing.make_tiny_family`, same seeds and fields:
Granite tied with non-default multipliers, OLMo 2 untied -- llama.cpp's OLMo 2 graph needs an
``output.weight``; SmolLM3 with 4 layers, so that its last is a NoPE layer), written by :func:`sglite.testing_gguf.write_family_gguf` in F32 and Q8_0 (its
tensors are bit for bit those of llama.cpp's ``convert_hf_to_gguf.py``, and llama.cpp's output on
the two files is byte-identical). The tool is scripts/llamacpp_greedy.cpp built against
llama.cpp (see its header); nothing here downloads anything.

    python scripts/record_llamacpp_families.py --tool /tmp/llamacpp_greedy --version "llama.cpp ..."
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "gguf_families_llamacpp.json"
PROMPT = "The cat sat on the mat. Alpha beta gamma delta, 42 and then\n"
FAMILIES = {  # arch -> (HF architecture, seed, config fields): the test's fixtures
    "granite": ("GraniteForCausalLM", 3, dict(tie_word_embeddings=True, embedding_multiplier=3.0,
                                              residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0)),
    "olmo2": ("Olmo2ForCausalLM", 4, dict(tie_word_embeddings=False)),
    "smollm3": ("SmolLM3ForCausalLM", 6, dict(num_hidden_layers=4)),  # layer 3 NoPE (llama.cpp: every 4th)
}
TYPES = ("F32", "Q8_0")
N_PREDICT = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tool", required=True, help="the built scripts/llamacpp_greedy.cpp")
    ap.add_argument("--version", required=True, help="llama.cpp's version and build flags, recorded as is")
    a = ap.parse_args()
    from sglite.testing import make_tiny_family
    from sglite.testing_gguf import write_family_gguf

    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompt = Path(tmp) / "prompt.txt"
        prompt.write_text(PROMPT)
        for arch, (hf_arch, seed, fields) in FAMILIES.items():
            hf = make_tiny_family(Path(tmp) / arch, arch, hf_arch, seed=seed, **fields)
            for t in TYPES:
                path = write_family_gguf(Path(tmp) / f"{arch}-{t}.gguf", hf, arch, tensor_type=t)
                out = subprocess.run([a.tool, str(path), str(prompt), str(N_PREDICT), "2"], capture_output=True,
                                     text=True, check=True).stdout
                records[f"{arch}/{t}"] = json.loads(out)
    OUT.write_text(json.dumps({
        "llama_cpp": a.version, "prompt": PROMPT, "n_predict": N_PREDICT,
        "command": f"llamacpp_greedy MODEL.gguf PROMPT_FILE {N_PREDICT} 2 (raw completion, greedy argmax, llama.cpp's "
                   "default context: f16 KV cache, 2 threads)",
        "families": {k: {"hf_architecture": v[0], "seed": v[1], "fields": v[2]} for k, v in FAMILIES.items()},
        "records": records}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
