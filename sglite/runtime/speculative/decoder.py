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
   With several n-gram candidates (distinct next tokens) the draft is a token tree (:mod:`.tree`):
   each candidate a chain under the pending token, verified together with a tree attention mask.
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
from .tree import TreeDraft, tree_contexts, verify_tree
from .verify import row_logits, verify_chain

log = logging.getLogger("sglite.speculative")

TREE_BRANCHES = 3  # most n-gram candidates (token-tree chains) verified per request and step


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
        self.counters = {"spec_verify_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
                         "spec_tree_steps": 0}
        # token trees (several n-gram candidates per step) need a slot per position: page size 1
        self.tree_ok = self.draft_model is None and config.page_size == 1
        self.tree_branches = TREE_BRANCHES

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
            found = self.draft_model.propose([e.req for e in cands], [self._room(e) for e in cands])
            drafts = [[d] if d else [] for d in found]
        else:
            drafts = [self._ngram(e) for e in cands]
        for e, chains in zip(cands, drafts):
            r = e.req
            if r.spec is None:
                r.spec = SpecState()
            r.spec.masks = None
            chain_masks = None
            if chains and r.grammar is not None:
                chains, chain_masks = self._walk_grammar(r, chains)
            keep = [i for i, c in enumerate(chains) if c]
            rows = self._scratch_rows(len(keep) - 1) if len(keep) > 1 else []
            keep = keep[:1 + len(rows)]
            chains = [chains[i] for i in keep]
            n_nodes = sum(len(c) for c in chains)
            if not chains or not self.kv.reserve_more(r, n_nodes):
                for row in rows:
                    self.kv.req_pool.free(row)
                continue
            if chain_masks is not None:
                r.spec.masks = torch.cat([chain_masks[0]] + [chain_masks[1 + i] for i in keep])
            root_pos = e.start + e.n - 1
            if len(chains) > 1:
                e.tree = TreeDraft(chains, [r.kv.row] + rows, rows)
                e.tree.fill_rows(self.kv.req_to_token, r.kv.row, root_pos)
            e.draft = tuple(t for c in chains for t in c)
            e.n += n_nodes

    def _scratch_rows(self, n: int) -> list[int]:
        """Up to ``n`` free slot-table rows for the extra chains of a token tree (fewer when
        the table is short: the tree then keeps fewer chains)."""
        out = []
        while len(out) < n:
            row = self.kv.req_pool.alloc()
            if row is None:
                break
            out.append(row)
        return out

    def _ngram(self, e: StepEntry) -> list[list[int]]:
        r, k = e.req, self._room(e)
        if k < 1:
            return []
        if r.spec is None:
            r.spec = SpecState(index=NgramIndex())
        elif r.spec.index is None:
            r.spec.index = NgramIndex()
        r.spec.index.sync(r.seq_len, r.tokens)
        k = min(k, r.spec.cap)
        found = r.spec.index.propose_with_match(k, candidates=self.tree_branches if self.tree_ok else 1)
        chains, budget = [], k
        for cont, n in found:  # a short match predicts little: at most twice its length
            c = cont[:min(2 * n, budget if not chains else max(1, budget // 2))]
            if not c:
                break
            chains.append(c)
            budget -= len(c)
        return chains

    def _walk_grammar(self, r, chains: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """The longest prefix of each chain the grammar allows, and the bitmask rows of the verify
        step: ``[root mask [1, W]] + [one [len, W] per chain]`` (the mask after each node). The
        matcher is left where it was."""
        g, W = r.grammar, self.sampler.words
        root = torch.full((1, W), -1, dtype=torch.int32)
        g.fill_next_token_bitmask(root, 0)
        kept_chains, masks = [], [root]
        for c in chains:
            m = torch.full((len(c), W), -1, dtype=torch.int32)
            kept = 0
            for t in c:
                if g.is_terminated() or not g.accept_token(t):
                    break
                g.fill_next_token_bitmask(m, kept)
                kept += 1
            g.rollback(kept)
            kept_chains.append(c[:kept])
            masks.append(m[:kept])
        return kept_chains, masks

    # ------------------------------------------------------------------ verify + commit
    def process(self, plan: StepPlan, logits: torch.Tensor, finish: Callable) -> int:
        """Verify and commit every drafted entry of ``plan`` (``logits``: [M, V] float32, the
        step's rows); ``finish(req, reason)`` ends a request. Returns the tokens appended."""
        appended = 0
        for e in plan.verifying:
            r, nodes, tree = e.req, len(e.draft), e.tree
            pending = e.n - nodes
            contexts = tree_contexts(tree) if tree is not None else [e.draft[:i] for i in range(nodes + 1)]
            x = row_logits(self.sampler, logits[e.sample_row:e.sample_row + nodes + 1], r, contexts, r.spec.masks)
            r.spec.masks = None
            gen = None
            if r.params.temperature > 1e-6:
                gen = torch.Generator().manual_seed((r.seed * 1_000_003 + len(r.output_ids)) % (1 << 62))
            if tree is not None:
                tokens, a, chain = verify_tree(x, tree, r.params, gen)
                self._settle_tree(r, e.start + pending - 1, tree, chain, a)
                k = len(tree.chains[chain])
                self.counters["spec_tree_steps"] += 1
            else:
                tokens, a = verify_chain(x, e.draft, r.params, gen)
                k = nodes
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
            self.counters["spec_draft_tokens"] += nodes
            self.counters["spec_accepted_tokens"] += a
            if reason is not None:
                finish(r, reason)
        return appended

    def _settle_tree(self, r, root_pos: int, tree: TreeDraft, chain: int, a: int) -> None:
        """Move the accepted chain's slots to the positions right after the root (the rest after
        them, to be trimmed) and give back the scratch rows."""
        table = self.kv.req_to_token
        n = len(tree.tokens)
        seg = table[r.kv.row, root_pos + 1:root_pos + 1 + n].clone()
        table[r.kv.row, root_pos + 1:root_pos + 1 + n] = seg[torch.tensor(tree.accepted_order(chain, a))]
        for row in tree.scratch:
            self.kv.req_pool.free(row)
        tree.scratch = []


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
