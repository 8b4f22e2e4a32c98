"""Baselines of ``sglite bench offline`` measured in the same process: HF ``generate`` and the
machine's memory read bandwidth (for the weight-bandwidth floor of a decode step)."""
from __future__ import annotations

import statistics
import time
from typing import Optional, Sequence

import torch


def measure_read_bandwidth(n_bytes: int = 512 << 20, repeats: int = 5) -> dict:
    """Memory read bandwidth in GB/s (1e9 bytes/s), best of ``repeats``.

    Two probes on an fp32 tensor of ``n_bytes`` (far larger than the caches): ``sum`` reads
    ``n_bytes`` and writes nothing, so ``read_gbps`` = its rate is the read bandwidth a decode
    step (which only reads weights) can use; ``copy_`` into a second tensor (reads and writes
    ``n_bytes``, counted as 2·``n_bytes`` moved) is reported for reference as ``copy_gbps``.
    """
    x = torch.rand(n_bytes // 4, dtype=torch.float32)  # [n] fp32
    y = torch.empty_like(x)  # [n] fp32
    best_sum = best_copy = float("inf")
    x.sum(), y.copy_(x)  # warm-up (page faults)
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best_sum = min(best_sum, time.perf_counter() - t)
        t = time.perf_counter()
        y.copy_(x)
        best_copy = min(best_copy, time.perf_counter() - t)
    sum_gbps, copy_gbps = n_bytes / best_sum / 1e9, 2 * n_bytes / best_copy / 1e9
    return {"bytes": n_bytes, "read_gbps": sum_gbps, "copy_gbps": copy_gbps}


class HFBaseline:
    """``transformers`` ``AutoModelForCausalLM`` on the same checkpoint and dtype, greedy.

    Args:
        model_dir: HF folder (``Checkpoint.model_dir``).
        dtype: torch dtype of weights and activations (the engine's).
        pad_id: id used for left padding (masked out).
    """

    def __init__(self, model_dir: str, dtype: torch.dtype, pad_id: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        self.pad_id = pad_id

    @property
    def weight_bytes(self) -> int:
        """Bytes of all (deduplicated, so tied embeddings once) parameters: one decode step reads them all."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def _generate(self, batch: Sequence[Sequence[int]], new_tokens: int) -> float:
        """Seconds to generate exactly ``new_tokens`` for the left-padded ``batch``."""
        width = max(len(x) for x in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [B, L]
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, L]
        for i, x in enumerate(batch):
            ids[i, width - len(x):] = torch.tensor(list(x))
            mask[i, width - len(x):] = 1
        t = time.perf_counter()
        self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=self.pad_id)
        return time.perf_counter() - t

    def latency(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict:
        """Batch-1 latency, median over ``prompts``: ``ttft_s`` (a 1-token generate), ``e2e_s``
        (``new_tokens``), ``tpot_s`` = (e2e − ttft) / (new_tokens − 1)."""
        self._generate([prompts[0]], 2)  # warm-up
        ttft = statistics.median(self._generate([p], 1) for p in prompts)
        e2e = statistics.median(self._generate([p], new_tokens) for p in prompts)
        return {"ttft_s": ttft, "e2e_s": e2e, "tpot_s": (e2e - ttft) / max(1, new_tokens - 1)}

    def static_batches(self, prompts: Sequence[Sequence[int]], out_lens: Sequence[int], batch_size: int = 16,
                       max_batches: Optional[int] = None) -> dict:
        """Static batching in submission order: each batch runs to its longest output.

        Only the requested tokens count as output (the padding steps of shorter requests are the
        cost of static batching). With ``max_batches`` only the first batches run; the rate is
        their useful tokens over their time (the batches are i.i.d. draws).
        """
        batches = [range(i, min(i + batch_size, len(prompts))) for i in range(0, len(prompts), batch_size)]
        batches = batches[:max_batches] if max_batches else batches
        self._generate([prompts[0]], 2)  # warm-up
        elapsed, useful, requests = 0.0, 0, 0
        for b in batches:
            elapsed += self._generate([prompts[i] for i in b], max(out_lens[i] for i in b))
            useful += sum(out_lens[i] for i in b)
            requests += len(b)
        return {"requests": requests, "batches": len(batches), "output_tokens": useful, "time_s": elapsed,
                "output_throughput": useful / elapsed, "request_throughput": requests / elapsed}
