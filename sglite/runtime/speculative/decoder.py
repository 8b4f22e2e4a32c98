"""SpecDecoder: speculative decoding inside the scheduler's mixed extend/decode step.

Per step (``Scheduler.schedule`` → :meth:`SpecDecoder.attach_drafts`, ``Scheduler.process`` →
:meth:`SpecDecoder.process`):

1. **draft** — each decoding request (caught up with its sequence, no logprobs asked, room left)
   gets up to ``k`` draft tokens: an n-gram continuation of its own prompt and output (``NGRAM``)
   or ``speculative_num_steps`` greedy steps of a small draft model (``STANDALONE``). A request
   with a grammar walks the draft through its matcher: a token the grammar forbids ends the draft,
   the mask of every position is kept for verification, and the matcher is rolled back. Its KV
   reservation grows by ``k`` slots (free pages only); its entry becomes an extend of
   ``pending + k`` tokens with a logits row at each of the last ``k + 1`` positions. Pending
   jump-forward tokens go first: forced strings ride along as free, always-accepted drafts.
2. **verify** — the one forward of the step computes all rows; :mod:`.verify` keeps a prefix of
   each draft by exact speculative sampling (greedy: prefix matching) and adds one target token.
3. **commit** — accepted tokens are appended one by one through the output processor (grammar,
   stop strings, EOS, length), the KV of the pending and accepted tokens is committed and the
   slots of rejected drafts go back to the pool at once (``KVManager.trim``): they never reach
   the radix tree.

Speculation is per request and switches itself off when it cannot pay: for steps with more than
``speculative_disable_by_batch_size`` decoding requests (the forward is then compute bound and
extra rows cost their full price), and for a while for a request whose acceptance rate fell low.
Requests asking for logprobs are never drafted.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from ..step_plan import SMALL_EXTEND, StepEntry, StepPlan
from .ngram import NgramIndex
from .state import SpecState
from .verify import row_logits, verify_chain

log = logging.getLogger("sglite.speculative")


class SpecDecoder:
    """Drafts, verifies and commits speculative tokens for one scheduler.

    Args:
        config: engine options (``speculative_*``).
        kv: the scheduler's ``KVManager``.
        sampler: the scheduler's ``Sampler`` (its penalties and vocabulary size).
        out: the scheduler's ``OutputProcessor``.
        draft_model: a :class:`~.draft_model.DraftModel` (``STANDALONE``) or None (``NGRAM``).
    """

    def __init__(self, config, kv, sampler, out, draft_model=None):
        self.algorithm = config.speculative_algorithm
        self.k_max = config.speculative_num_draft_tokens
        self.max_batch = config.speculative_disable_by_batch_size
        self.kv, self.sampler, self.out = kv, sampler, out
        self.draft_model = draft_model
        self.counters = {"spec_verify_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}

    @property
    def stats(self) -> dict:
        """Counters since start: verify steps (request-steps), draft and accepted tokens."""
        return dict(self.counters)

    # ------------------------------------------------------------------ drafting
    def _eligible(self, e: StepEntry) -> bool:
        r = e.req
        return (not r.prefilling and e.ends_sequence and e.n <= SMALL_EXTEND and r.finished is None
                and not r.return_logprob and r.params.max_new_tokens - len(r.output_ids) > 1
                and (r.spec is None or r.spec.may_draft()))

    def _room(self, e: StepEntry) -> int:
        r = e.req
        left = r.params.max_new_tokens - len(r.output_ids) - 1  # the verify step adds one more
        ctx = self.kv.req_pool.max_context - 8 - (e.start + e.n)
        return max(0, min(self.k_max, left, ctx))

    def attach_drafts(self, entries: list[StepEntry]) -> None:
        """Give the eligible decoding entries of a step their drafts (KV reserved). Called after
        admission, before ``StepPlan.layout``."""
        decoding = [e for e in entries if not e.req.prefilling]
        if not decoding or len(decoding) > self.max_batch:
            return
        cands = [e for e in decoding if self._eligible(e)]
        if not cands:
            return
        if self.draft_model is not None:
            drafts = self.draft_model.propose([e.req for e in cands], [self._room(e) for e in cands])
        else:
            drafts = [self._ngram(e) for e in cands]
        for e, draft in zip(cands, drafts):
            r = e.req
            if r.spec is None:
                r.spec = SpecState()
            if draft and r.grammar is not None:
                draft = self._walk_grammar(r, draft)
            if not draft or not self.kv.reserve_more(r, len(draft)):
                r.spec.masks = None
                continue
            e.draft = tuple(draft)
            e.n += len(draft)

    def _ngram(self, e: StepEntry) -> list[int]:
        r, k = e.req, self._room(e)
        if k < 1:
            return []
        if r.spec is None:
            r.spec = SpecState(index=NgramIndex())
        elif r.spec.index is None:
            r.spec.index = NgramIndex()
        r.spec.index.sync(r.seq_len, r.tokens)
        found = r.spec.index.propose_with_match(min(k, r.spec.cap))
        if not found:
            return []
        cont, n = found[0]
        return cont[:2 * n]  # a short match predicts little: at most twice its length

    def _walk_grammar(self, r, draft: list[int]) -> list[int]:
        """The longest prefix of ``draft`` the grammar allows; ``r.spec.masks`` gets the bitmask
        of every verify row ([len + 1, W] int32). The matcher is left where it was."""
        g = r.grammar
        masks = torch.full((len(draft) + 1, self.sampler.words), -1, dtype=torch.int32)
        g.fill_next_token_bitmask(masks, 0)
        kept = 0
        for i, t in enumerate(draft):
            if g.is_terminated() or not g.accept_token(t):
                break
            kept += 1
            g.fill_next_token_bitmask(masks, i + 1)
        g.rollback(kept)
        r.spec.masks = masks[:kept + 1]
        return draft[:kept]

    # ------------------------------------------------------------------ verify + commit
    def process(self, plan: StepPlan, logits: torch.Tensor, finish: Callable) -> int:
        """Verify and commit every drafted entry of ``plan`` (``logits``: [M, V] float32, the
        step's rows); ``finish(req, reason)`` ends a request. Returns the tokens appended."""
        appended = 0
        for e in plan.verifying:
            r, k = e.req, len(e.draft)
            pending = e.n - k
            x = row_logits(self.sampler, logits[e.sample_row:e.sample_row + k + 1], r, e.draft, r.spec.masks)
            r.spec.masks = None
            gen = None
            if r.params.temperature > 1e-6:
                gen = torch.Generator().manual_seed((r.seed * 1_000_003 + len(r.output_ids)) % (1 << 62))
            tokens, a = verify_chain(x, e.draft, r.params, gen)
            reason: Optional[object] = None
            done = 0
            for i, tok in enumerate(tokens):
                reason = self.out.append_token(r, tok, None, jump=i == len(tokens) - 1)
                done += 1
                if reason is not None:
                    break
            appended += done
            self.kv.commit(r, pending + min(a, done), share=False)
            self.kv.trim(r)
            r.spec.record(k, a, self.k_max)
            self.counters["spec_verify_steps"] += 1
            self.counters["spec_draft_tokens"] += k
            self.counters["spec_accepted_tokens"] += a
            if reason is not None:
                finish(r, reason)
        return appended


def make_spec_decoder(config, runner, kv, sampler, out) -> Optional[SpecDecoder]:
    """The scheduler's speculative decoder, or None when ``config.speculative_algorithm`` is None.
    ``STANDALONE`` loads the draft model here (its own small KV pool, on the target's device)."""
    if config.speculative_algorithm is None:
        return None
    draft = None
    if config.speculative_algorithm == "STANDALONE":
        from .draft_model import DraftModel
        draft = DraftModel.load(config, runner)
    return SpecDecoder(config, kv, sampler, out, draft)
