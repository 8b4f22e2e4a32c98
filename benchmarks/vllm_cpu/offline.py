"""vLLM CPU on sglite's offline workload: 48 mixed prompts of 16-200 words x 64 tokens, greedy,
``ignore_eos``, one warm-up call of the first two prompts, then one timed ``LLM.generate``.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 \\
        <vllm venv>/bin/python benchmarks/vllm_cpu/offline.py HF_DIR [--seed 0]

The prompts are the same words in the same order as sglite's side of the comparison (the same
``random.Random(seed)`` draws), so both engines get identical text. Prints one line:
``engine=vllm-cpu tokens=N S s T tok/s``.
"""
import argparse
import random
import time

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which "
         "but have an they you").split()


def prompts(seed: int = 0, n: int = 48) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 200))) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="bf16 HF folder (convert.py)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default: 64)")
    a = ap.parse_args()
    from vllm import LLM, SamplingParams

    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=2048, seed=0)
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    ps = prompts(a.seed)
    llm.generate(ps[:2], sp, use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"engine=vllm-cpu tokens={n} {dt:.2f}s {n / dt:.1f} tok/s")


if __name__ == "__main__":
    main()
