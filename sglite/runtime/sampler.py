"""Sampler: logits of the sampling rows → next tokens (+ logprobs).

Order (DESIGN §3): penalties (frequency, presence, repetition) and ``logit_bias`` → min-new-tokens
EOS block → grammar bitmask → temperature → top-k / top-p / min-p → draw, through
``sglite.kernels.sample`` (fused with the bitmask). Reported logprobs are those of the model's
distribution after penalties and temperature (temperature 0 counts as 1), before the grammar
mask and truncation — SGLang's convention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglite import kernels

from .req import Req


@dataclass
class SampleOutput:
    """Result of one sampling call: ``next_ids[i]`` for ``reqs[i]`` and optional logprob data."""

    next_ids: list[int]
    logprobs: Optional[torch.Tensor]  # [B, V] float32 log-softmax, only when any row asked for it


def select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]`` ([M, V] -> [B, V]) without a copy when ``rows`` are consecutive (the usual
    layout of a step's sampling rows): ``logits`` itself when they are all of its rows, else a view.
    Callers must not write the result in place (it may be the step's logits)."""
    first, b = rows[0], len(rows)
    if rows != list(range(first, first + b)):
        return logits[torch.tensor(rows)]  # a gathered copy
    return logits if b == logits.shape[0] else logits[first:first + b]


class Sampler:
    """Stateless per step; per-request state lives on :class:`Req`."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset, device="cpu"):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos = sorted(i for i in eos_token_ids if i < vocab_size)
        self.device = device

    @staticmethod
    def changes_logits(r: Req) -> bool:
        """Whether :meth:`_penalize` changes ``r``'s row: a logit bias, the min-new-tokens EOS
        block, or a frequency / presence / repetition penalty once it has output."""
        p = r.params
        return bool(p.logit_bias or len(r.output_ids) < p.min_new_tokens or (r.output_ids and (
            p.frequency_penalty != 0 or p.presence_penalty != 0 or p.repetition_penalty != 1)))

    def _penalize(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        for i, r in enumerate(reqs):
            p = r.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
            if len(r.output_ids) < p.min_new_tokens:
                block = self.eos + list(p.stop_token_ids or [])
                if block:
                    logits[i, block] = float("-inf")
            if not r.output_ids or (p.frequency_penalty == 0 and p.presence_penalty == 0 and p.repetition_penalty == 1):
                continue
            ids = torch.tensor(r.output_ids, dtype=torch.int64, device=logits.device)  # [T]
            counts = torch.zeros(self.vocab_size, device=logits.device).scatter_add_(
                0, ids, torch.ones_like(ids, dtype=torch.float32))  # [V]
            seen = counts > 0  # [V]
            row = logits[i]
            if p.repetition_penalty != 1:
                rp = p.repetition_penalty
                row[seen] = torch.where(row[seen] > 0, row[seen] / rp, row[seen] * rp)
            row -= p.frequency_penalty * counts + p.presence_penalty * seen.float()

    def grammar_bitmask(self, reqs: list[Req]) -> Optional[torch.Tensor]:
        """The grammar masks of ``reqs`` as ``int32 [B, ceil(V/32)]`` (-1 rows for unconstrained
        requests), or None when no request has a grammar. Reads the matchers only, so the scheduler
        may run it on another thread while the model's forward runs (the matchers advance after)."""
        if all(r.grammar is None for r in reqs):
            return None
        bitmask = torch.full((len(reqs), self.words), -1, dtype=torch.int32)  # [B, W] all allowed
        for i, r in enumerate(reqs):
            if r.grammar is not None:
                r.grammar.fill_next_token_bitmask(bitmask, i)
        return bitmask

    def sample(self, logits: torch.Tensor, reqs: list[Req],
               bitmask: Optional[torch.Tensor] = None) -> SampleOutput:
        """Pick the next token of each request.

        Args:
            logits: [B, V] float32 next-token logits, row i for ``reqs[i]`` (not mutated).
            reqs: the requests, for their sampling params, output so far and grammar matchers.
            bitmask: ``grammar_bitmask(reqs)`` when already computed (e.g. overlapped with the
                forward); computed here when None.
        Returns:
            SampleOutput with B token ids.
        """
        ps = [r.params for r in reqs]
        changes = want_lp = False
        greedy = True
        for r, p in zip(reqs, ps):  # one pass over the batch for the three questions
            changes = changes or self.changes_logits(r)
            want_lp = want_lp or r.return_logprob
            greedy = greedy and p.temperature <= 1e-6
        if changes:
            logits = logits.clone()  # the caller's rows (often a view of the step's logits) stay as they are
            self._penalize(logits, reqs)
        logprobs = None
        if want_lp:
            temps = torch.tensor([p.temperature if p.temperature > 1e-6 else 1.0 for p in ps], device=logits.device)
            logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)  # [B, V]
        if bitmask is None:
            bitmask = self.grammar_bitmask(reqs)
        if bitmask is not None:
            bitmask = bitmask.to(logits.device)
        if greedy:  # a greedy batch: argmax, no per-row tensors
            return SampleOutput(kernels.greedy(logits, bitmask).tolist(), logprobs)
        dev = logits.device
        next_ids = kernels.sample(
            logits,
            torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev),
            torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev),
            torch.tensor([p.top_k for p in ps], dtype=torch.int64, device=dev),
            torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev),
            torch.tensor([r.seed for r in reqs], dtype=torch.int64, device=dev),
            torch.tensor([len(r.output_ids) for r in reqs], dtype=torch.int64, device=dev),
            bitmask,
        )
        return SampleOutput(next_ids.tolist(), logprobs)
