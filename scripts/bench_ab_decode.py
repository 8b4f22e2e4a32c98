"""A/B decode timing on the default model: batch 1 (128 new tokens) and batch 16 (64 each); greedy."""
import sys, time
import sglite
e = sglite.Engine()
sp1 = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
e.generate("Write a story about a lighthouse.", {"max_new_tokens": 8, "temperature": 0})  # warm-up
t = time.perf_counter(); o = e.generate("Write a story about a lighthouse keeper and the sea.", sp1); d1 = time.perf_counter() - t
prompts = [f"Question {i}: tell me about topic number {i} in detail." for i in range(16)]
sp16 = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
t = time.perf_counter(); outs = e.generate(prompts, sp16); d16 = time.perf_counter() - t
print(f"RESULT b1_tok_s={128/d1:.1f} b16_tok_s={16*64/d16:.1f} first={o['text'][:40]!r}")
e.shutdown()
