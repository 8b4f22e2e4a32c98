"""SpecDecoder: speculative decoding inside the scheduler's mixed extend/decode step.

Per step (``Scheduler.schedule`` → :meth:`SpecDecoder.attach_drafts`, ``Scheduler.process`` →
:meth:`SpecDecoder.process`); each part has one owner:

1. **draft** (:mod:`.proposer`) — each decoding request (caught up with its sequence, no
   logprobs asked, room left) gets candidate chains from the engine's :class:`.Proposer`:
   n-gram and text-level prompt lookups (``NGRAM``) or ``speculative_num_steps`` greedy steps
   of a small draft model (``STANDALONE``). A request with a grammar walks its chains through
   its matcher (:mod:`.grammar_walk`): a token the grammar forbids ends the chain and the
   matcher is rolled back; sampled requests keep the mask of every position for verification,
   greedy ones need none (:func:`.verify.greedy_walk` checks the argmax against the matcher
   instead); jump-forward text after a draft token is appended as always-kept drafts, and a
   copied JSON value is closed at a word boundary while the request's values tend to end at one
   (``CLOSE_MIN_RATE``).
2. **budget** (:mod:`.budget`) — the engine's :class:`.DraftBudget` cuts the step's candidates:
   measured step costs against per-source keep probabilities (``NGRAM`` on CPU), or the rows
   left in the step's GEMV row block and a per-request cap (without a measured cost).
3. **attach** — the request's KV reservation grows by the kept draft tokens (free pages only);
   its entry becomes an extend of ``pending + k`` tokens with a logits row at each of the last
   ``k + 1`` positions. Pending jump-forward tokens go first: the grammar's forced text and the
   draft that continues after it are verified in the same forward. With several chains
   (distinct next tokens) the draft is a token tree (:mod:`.tree`), verified with a tree
   attention mask over scratch slot-table rows (``KVManager.borrow_rows``, returned even when
   the step raises: :meth:`SpecDecoder.release_scratch`, checked by ``KVManager.check_rows``).
4. **verify** — the one forward of the step computes all rows; :mod:`.verify` keeps a prefix of
   each draft by exact speculative sampling (greedy: prefix matching) and adds one target token.
   Sampled rows are the plain sampler's ``(seed, output position)`` draws, so a seeded request's
   output is the plain run's whatever was drafted; ``speculative_verify="block"`` verifies the
   chains of unseeded sampled requests jointly instead (:mod:`.block`).
5. **commit** — accepted tokens are appended one by one through the output processor (grammar,
   stop strings, EOS, length), the KV of the pending and accepted tokens is committed and the
   slots of rejected drafts go back to the pool at once (``KVManager.trim``): they never reach
   the radix tree. The keep/reject outcome of every draft token teaches
   :class:`.policy.AcceptModel` and the request's :class:`.SpecState`.

Speculation is per request and off for steps with more than ``speculative_disable_by_batch_size``
decoding requests (the forward is then compute bound and extra rows cost their full price).
Verify entries run as decode rows (:meth:`.StepPlan.layout`), so on CPU they take the fused decode.
Requests asking for logprobs are never drafted.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..runner_protocol import RunnerProtocol
from ..step_plan import SMALL_EXTEND, StepEntry, StepPlan
from .block import verify_block
from .budget import DraftBudget, MeasuredCost, RowBlock
from .head_gate import HeadGate
from .grammar_walk import CLOSE, CLOSE_MIN_RATE, FORCED, GrammarWalk
from .policy import AcceptModel, StepCost, probe_forward
from .proposer import TREE_BRANCHES, DraftModelProposer, LookupProposer, Proposer
from .state import SpecState
from .text_lookup import TokenText
from .tree import ROOT, TreeDraft, cut_tree, prune, tree_contexts, verify_tree
from .verify import Draws, greedy_walk, row_logits, verify_chain, verify_seed

log = logging.getLogger("sglite.speculative")


@dataclass
class _Verdict:
    """What verification kept of one entry's draft."""

    tokens: list  # the accepted draft tokens plus one target token
    accepted: int  # draft tokens accepted
    chain: int  # the chain they came from (0 for a plain chain)
    drafted: int  # tokens of that chain (all drafted nodes for a plain chain)
    forced: list  # per chain, the depths of its jump-forward tokens
    lens: list  # per chain, its length
    kept: list  # per chain, its accepted nodes


class SpecDecoder:
    """Drafts, verifies and commits speculative tokens for one scheduler.

    Args:
        config: engine options (``speculative_*``, ``page_size``).
        kv: the scheduler's ``KVManager``.
        sampler: the scheduler's ``Sampler`` (its penalties and vocabulary size).
        out: the scheduler's ``OutputProcessor``.
        draft_model: a :class:`~.draft_model.DraftModel` (``STANDALONE``) or None (``NGRAM``).
        row_block: rows a forward carries at about the price of one (CPU GEMV kernels:
            ``MAX_ROWS``) for the :class:`.budget.RowBlock` budget; None: no such limit (GPU).
        cost: a measured step-cost curve (``NGRAM`` on CPU): the :class:`.budget.MeasuredCost`
            budget instead of the row block.

    Attributes:
        proposer: the draft source (:class:`.proposer.Proposer`).
        budget: the draft budget (:class:`.budget.DraftBudget`).
        accept: keep probabilities per draft source, learned from every verify step.
    """

    def __init__(self, config, kv, sampler, out, draft_model=None, row_block: Optional[int] = None,
                 cost: Optional[StepCost] = None, proposer: Optional[Proposer] = None, runner=None):
        self.algorithm = config.speculative_algorithm
        self.k_max = config.speculative_num_draft_tokens
        self.max_batch = config.speculative_disable_by_batch_size
        self.verify_mode = getattr(config, "speculative_verify", "token")  # "token" | "block"
        self.kv, self.sampler, self.out = kv, sampler, out
        self.draft_model = draft_model
        self.counters = {"spec_verify_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
                         "spec_tree_steps": 0, "spec_forced_tokens": 0, "spec_head_rows_skipped": 0,
                         "spec_block_steps": 0}
        self.accept = AcceptModel()
        # per-token text for the lookups (its byte cache fills as tokens are seen)
        self.token_text = TokenText(out.tokenizer) if out is not None else None
        self.grammar_walk = GrammarWalk(out, sampler, self.token_text)
        self.cost = cost if draft_model is None and proposer is None else None
        self.budget: DraftBudget = (MeasuredCost(self.cost, self.accept) if self.cost is not None
                                    else RowBlock(row_block))
        # token trees (several candidates per step; they move slots within a row) need a slot per
        # position: page size 1 only
        self.trees = config.page_size == 1
        # int8 / int4 KV: a key group is quantized when a step stores its last position, and a
        # step's positions past it overwrite the group's full-precision residual; drafts stay
        # short of their group's last position, so only accepted tokens ever seal or cross one
        group = getattr(getattr(kv, "kv_pool", None), "group", 1)  # kv_quant's pools: tokens a key group
        self.key_group: Optional[int] = group if group > 1 else None
        self.proposer: Proposer = proposer or (
            DraftModelProposer(draft_model) if draft_model is not None else
            LookupProposer(self.token_text, out, TREE_BRANCHES if self.trees else 1))
        self.runner = runner  # EAGLE / MEDUSA: its ``last_hidden`` feeds the proposer's ``observe``
        # EAGLE / MEDUSA: whether a request runs its (costly) head at all this step (.head_gate)
        self.gate: Optional[HeadGate] = HeadGate() if getattr(self.proposer, "costs_forward", False) else None

    @property
    def stats(self) -> dict:
        """Counters since start: verify steps (request-steps), draft and accepted tokens (of
        which ``spec_forced_tokens`` were jump-forward text verified as drafts)."""
        return dict(self.counters)

    # ------------------------------------------------------------------ drafting
    def attach_drafts(self, entries: list[StepEntry]) -> None:
        """Give the eligible decoding entries of a step their drafts (KV reserved). Called after
        admission, before ``StepPlan.layout``."""
        now = time.perf_counter()
        self.budget.step_began(now)
        if self.gate is not None:
            self.gate.step_began(now)
        heads = 0
        try:
            heads = self._attach(entries)
        finally:
            self.budget.step_drafted(now, entries)
            if self.gate is not None:
                decode_only = bool(entries) and not any(e.req.prefilling for e in entries)
                self.gate.step_ended(now, len(entries) if decode_only else 0, heads)

    def _attach(self, entries: list[StepEntry]) -> int:
        """Attach the step's drafts; returns for how many requests the proposer ran."""
        self.release_scratch()  # rows a failed step left borrowed
        decoding = [e for e in entries if not e.req.prefilling]
        if not decoding or len(decoding) > self.max_batch:
            return 0
        cands = [e for e in decoding if self._eligible(e)]
        if self.gate is not None:  # a head's forward is spent before its drafts are weighed: gate first
            cands = [e for e in cands if self.gate.wants(SpecState.of(e.req))]
        if not cands or not self.budget.open_step(entries, len(decoding)):
            return 0
        t0 = time.perf_counter()
        props = self._propose(cands)
        if self.gate is not None:
            self.gate.head_ran(time.perf_counter() - t0)
        parents = {id(p[0]): p[4] for p in props}  # where each chain hangs (head trees branch below the root)
        for e, chains, sources, masks in self.budget.choose([p[:4] for p in props], entries):
            self._place(e, chains, sources, masks, parents.get(id(e)))
        return len(cands)

    def _eligible(self, e: StepEntry) -> bool:
        r = e.req
        return (not r.prefilling and e.ends_sequence and e.n <= SMALL_EXTEND and r.finished is None
                and not r.return_logprob and r.params.max_new_tokens - len(r.output_ids) > 1
                and (r.spec is None or self.budget.may_draft(r.spec)))

    def _room(self, e: StepEntry) -> int:
        """Most draft tokens of an entry: the configured most, ``max_new_tokens`` (the verify
        step adds one more), the context and the step's rows left."""
        return max(0, min(self.k_max, self._forced_room(e), self.budget.rows_left))

    def _forced_room(self, e: StepEntry) -> int:
        """Draft tokens an entry can take in all when jump-forward text extends a chain: the
        tokens left to ``max_new_tokens`` and the context, whatever the draft cap (forced tokens
        are no guess)."""
        r = e.req
        left = r.params.max_new_tokens - len(r.output_ids) - 1
        first = e.start + e.n  # the first draft's position
        if self.key_group is not None:  # up to the position before its key group's last one
            left = min(left, self.key_group - 1 - first % self.key_group)
        return max(0, min(left, self.kv.req_pool.max_context - 8 - first))

    def _propose(self, cands: list[StepEntry]) -> list[tuple]:
        """Per candidate entry ``(entry, chains, sources, masks, parents)``: the proposer's chains
        walked through the request's grammar (``masks``: per-position grammar masks of sampled
        grammar requests, else None; ``parents``: where each chain hangs, :class:`.tree.TreeDraft`;
        a grammar request keeps the chains off the root only)."""
        proposals = []
        rooms = [self._room(e) for e in cands]
        for e, found in zip(cands, self.proposer.propose(cands, rooms, self.budget)):
            r = e.req
            if r.grammar is not None:  # the grammar walk follows chains from the root only
                found = [c for c in found if len(c) < 3 or tuple(c[2]) == ROOT]
            chains, sources = [c[0] for c in found], [c[1] for c in found]
            parents = [tuple(c[2]) if len(c) > 2 else ROOT for c in found]
            SpecState.of(r)
            walk = bool(chains) and r.grammar is not None
            close = walk and self.accept.rate(CLOSE, r.spec.own) >= CLOSE_MIN_RATE
            r.spec.begin_draft(track_closes=walk and not close)  # closes not drafted: points kept
            chain_masks = None
            if walk:
                chains, chain_masks = self.grammar_walk.walk(r, chains, need_masks=r.params.temperature > 1e-6,
                                                             sources=sources, limit=self._forced_room(e), close=close,
                                                             close_points=r.spec.close_points)
            proposals.append((e, chains, sources, chain_masks, parents))
        return proposals

    def _place(self, e: StepEntry, chains: list, sources: list, chain_masks, parents=None) -> None:
        """Attach one entry's chains (cut to the budget's rows left): KV reserved past the
        pending tokens, scratch rows for a tree's extra chains (fewer chains when the table is
        short; a chain below a dropped or cut one goes too), the entry grown by the draft tokens.
        Nothing attached when the pool is short. ``parents``: per chain, where it hangs
        (:class:`.tree.TreeDraft`; None: all off the root)."""
        r = e.req
        nested = parents is not None and any(p != ROOT for p in parents)
        chains = cut_tree(chains, self.budget.rows_left) if nested else self.budget.fit(chains, sources)
        keep = [i for i, c in enumerate(chains) if c]
        tree_parents = None
        if nested:  # prune lists a parent before its children: every prefix of keep stays a tree
            keep, tree_parents = prune(chains, parents, keep)
        keep = keep if self.trees else keep[:1]
        rows = self.kv.borrow_rows(len(keep) - 1) if len(keep) > 1 else []
        keep = keep[:1 + len(rows)]
        if tree_parents is not None:
            tree_parents = tree_parents[:len(keep)]
        chains = [chains[i] for i in keep]
        n_nodes = sum(len(c) for c in chains)
        if not chains or not self.kv.reserve_more(r, n_nodes):
            self.release_scratch(rows)
            return
        self.budget.spend(n_nodes)
        masks = None
        if chain_masks is not None:
            masks = torch.cat([chain_masks[0]] + [chain_masks[1 + i][:len(chains[j])] for j, i in enumerate(keep)])
        r.spec.set_draft(sources, keep, masks)
        root_pos = e.start + e.n - 1
        if len(chains) > 1:
            e.tree = TreeDraft(chains, [r.kv.row] + rows, rows, tree_parents or [])
            table = self.kv.req_pool.req_to_token
            for dst, nodes in e.tree.scratch_paths():  # the prefix, then the node's path's slots
                self.kv.fill_scratch_row(dst, r.kv.row, root_pos + 1, root_pos + 1, 0)
                self.kv.write_slots(dst, root_pos + 1, table[r.kv.row, [root_pos + 1 + i for i in nodes]])
        e.draft = tuple(t for c in chains for t in c)
        e.skip_rows = _rows_before_forced(chains, r.spec.sources)
        self.counters["spec_head_rows_skipped"] += len(e.skip_rows)
        e.n += n_nodes

    def release_scratch(self, rows: Optional[list] = None) -> None:
        """Give back borrowed slot-table rows (``KVManager.return_rows``): ``rows``, or (None)
        every row still borrowed (a step that raised between drafting and verification left them)."""
        self.kv.return_rows(rows)

    def check_invariants(self, running) -> None:
        """Assert the slot-table rows are accounted for (``KVManager.check_rows``): free, held by
        a running request, or borrowed by the step in flight (none between steps)."""
        self.kv.check_rows(running)

    # ------------------------------------------------------------------ verify + commit
    def process(self, plan: StepPlan, logits: torch.Tensor, finish: Callable) -> int:
        """Verify and commit every drafted entry of ``plan`` (``logits``: [M, V] float32, the
        step's rows); ``finish(req, reason)`` ends a request. Returns the tokens appended."""
        appended, verdicts = 0, {}
        for e in plan.verifying:
            r = e.req
            v = self._verify(e, logits)
            verdicts[id(e)] = (v.chain, v.accepted)
            r.spec.drop_masks()
            reason, done = self._append(r, v.tokens)
            appended += done
            pending = e.n - len(e.draft)
            self.kv.commit(r, pending + min(v.accepted, done), share=False)
            self.kv.trim(r)
            self._learn(e, v)
            if reason is not None:
                finish(r, reason)
        observe = getattr(self.proposer, "observe", None)  # heads: the step's hidden states
        if observe is not None and self.runner is not None:
            observe(plan, self.runner.last_hidden, verdicts)
        return appended

    def _verify(self, e: StepEntry, logits: torch.Tensor) -> _Verdict:
        """Run one entry's verification over its rows of ``logits`` (a tree's accepted chain is
        settled into the request's row, its scratch rows returned)."""
        r, nodes, tree = e.req, len(e.draft), e.tree
        contexts = tree_contexts(tree) if tree is not None else [e.draft[:i] for i in range(nodes + 1)]
        x = row_logits(self.sampler, e.verify_rows(logits), r, contexts, r.spec.masks)
        lens = [len(c) for c in tree.chains] if tree is not None else [nodes]
        forced = [{d for d, src in enumerate(srcs[:n]) if src == FORCED} for srcs, n in zip(r.spec.sources, lens)]
        chain, sampled = 0, r.params.temperature > 1e-6
        draws = Draws(r.seed, len(r.output_ids)) if sampled else None
        if r.grammar is not None and not sampled and r.spec.masks is None:
            tokens, a, chain = self._greedy_grammar(x, e, r, forced)
        elif tree is not None:
            tokens, a, chain = verify_tree(x, tree, r.params, draws, forced=forced)
        elif sampled and self.verify_mode == "block" and r.params.sampling_seed is None:
            # joint decisions depend on where the block starts: unseeded requests only
            gen = torch.Generator().manual_seed(verify_seed(r.seed, len(r.output_ids)))
            tokens, a = verify_block(x, e.draft, r.params, gen, forced=forced[0] if forced else ())
            self.counters["spec_block_steps"] += 1
        else:
            tokens, a = verify_chain(x, e.draft, r.params, draws, forced=forced[0] if forced else ())
        if tree is not None:
            self._settle_tree(r, e.start + e.n - nodes - 1, tree, chain, a)
            self.counters["spec_tree_steps"] += 1
        drafted = tree.base[chain] + len(tree.chains[chain]) if tree is not None else nodes
        kept = tree.kept_per_chain(chain, a) if tree is not None else [a]
        return _Verdict(tokens, a, chain, drafted, forced, lens, kept)

    def _append(self, r, tokens: list[int]) -> tuple[Optional[object], int]:
        """Append verified tokens one by one until the request finishes: (finish reason or None,
        tokens appended)."""
        reason, done = None, 0
        for i, tok in enumerate(tokens):
            reason = self.out.append_token(r, tok, None, jump=i == len(tokens) - 1)
            done += 1
            if reason is not None:
                break
        return reason, done

    def _learn(self, e: StepEntry, v: _Verdict) -> None:
        """What the verify step teaches: the request's draft cap and backoff, the keep
        probability of every drafted source (forced tokens teach nothing), closes not drafted;
        the step counters."""
        r, a, chain, lens, forced = e.req, v.accepted, v.chain, v.lens, v.forced
        st = r.spec
        st.record(v.drafted, a, self.k_max)
        # a closing draft refused only for how it merged the boundary closed at the right place
        kept = a + self.grammar_walk.learn_close(st.sources[chain][:lens[chain]] if chain < len(lens) else [],
                                                 a, v.tokens)
        for b, (srcs, n) in enumerate(zip(st.sources, lens)):
            n = min(n, min(forced[b], default=n))  # forced tokens teach the acceptance model nothing
            self.accept.record(srcs[:n], min(v.kept[b] + (kept - a if b == chain else 0), n), st.own)
        if st.close_points:  # closes not drafted: learn them anyway
            self.accept.add(CLOSE, *self.grammar_walk.close_outcomes(st.close_points[chain], a, v.tokens), own=st.own)
        st.end_verify()
        if self.gate is not None:
            self.gate.record(st, a)
        self.counters["spec_verify_steps"] += 1
        self.counters["spec_draft_tokens"] += len(e.draft)
        self.counters["spec_accepted_tokens"] += a
        self.counters["spec_forced_tokens"] += sum(d < a for d in forced[chain]) if chain < len(forced) else 0

    def _greedy_grammar(self, x: torch.Tensor, e: StepEntry, r, forced: list) -> tuple[list[int], int, int]:
        """Greedy verification of a grammar request's chain or tree without precomputed masks:
        :func:`.verify.greedy_walk` along the draft (``forced[b]``: the depths of chain ``b``'s
        jump-forward tokens, taken without a look at the logits). Returns (tokens, accepted,
        chain)."""
        tree = e.tree
        if tree is None:
            draft = e.draft
            child = lambda row, t: row + 1 if row < len(draft) and draft[row] == t else None  # noqa: E731
            force = lambda row: draft[row] if row in forced[0] else None  # noqa: E731
        else:
            starts, off = [], 1
            for c in tree.chains:
                starts.append(off)
                off += len(c)
            where = {}  # row -> (chain, depth of the node: its child is chain[depth])
            for b, c in enumerate(tree.chains):
                for d in range(len(c)):
                    where[starts[b] + d] = (b, d + 1)

            def child(row, t):
                if row == 0:
                    return next((starts[b] for b, c in enumerate(tree.chains) if c and c[0] == t), None)
                b, d = where[row]
                c = tree.chains[b]
                return row + 1 if d < len(c) and c[d] == t else None

            def force(row):
                if row == 0:
                    return None
                b, d = where[row]
                return tree.chains[b][d] if d in forced[b] and d < len(tree.chains[b]) else None
        tokens, rows = greedy_walk(x, child, r.grammar, self.sampler.words, force)
        a = len(tokens) - 1
        chain = where[rows[-1]][0] if tree is not None and a > 0 else 0
        return tokens, a, chain

    def _settle_tree(self, r, root_pos: int, tree: TreeDraft, chain: int, a: int) -> None:
        """Move the accepted chain's slots to the positions right after the root (the rest after
        them, to be trimmed) and give back the scratch rows."""
        self.kv.reorder_slots(r.kv.row, root_pos + 1, tree.accepted_order(chain, a))
        self.release_scratch(tree.scratch)
        tree.scratch = []


def _rows_before_forced(chains: list[list[int]], sources: list) -> frozenset:
    """Verify rows (0: the root, then each chain's nodes in layout order) whose logits nobody
    reads: a node followed in its chain by a ``FORCED`` token (kept without a look at the row).
    The root row is always read (it checks every chain's first token)."""
    skip, row = set(), 1
    for c, srcs in zip(chains, sources):
        skip.update(row + d for d in range(len(c) - 1) if d + 1 < len(srcs) and srcs[d + 1] == FORCED)
        row += len(c)
    return frozenset(skip)


def make_spec_decoder(config, runner: RunnerProtocol, kv, sampler, out) -> Optional[SpecDecoder]:
    """The scheduler's speculative decoder, or None when ``config.speculative_algorithm`` is None.
    ``STANDALONE`` loads the draft model here (its own small KV pool, on the target's device)."""
    if config.speculative_algorithm is None:
        return None
    draft, heads = None, None
    if config.speculative_algorithm == "STANDALONE":
        from .draft_model import DraftModel
        draft = DraftModel.load(config, runner)
    elif config.speculative_algorithm in ("EAGLE", "MEDUSA"):
        from .head_proposer import load_head_proposer
        heads = load_head_proposer(config, runner)
    on_cpu = torch.device(runner.device).type == "cpu"
    row_block = None  # GPU, or float32 on CPU (oneDNN GEMMs: a few more rows cost little)
    if on_cpu and runner.dtype in (torch.bfloat16, torch.float16):
        from sglite.kernels.cpu_gemv import MAX_ROWS  # the bf16 / quantized GEMV kernels' row block
        row_block = MAX_ROWS
    cost = None
    if draft is None and heads is None and on_cpu and runner.measure_forward:
        fwd = probe_forward(runner, kv)  # CPU: rows are not free; what they cost is measured
        if fwd:
            cost = StepCost(fwd, overhead=0.2 * fwd[min(fwd)])
            log.info("speculative: forward of 1/8/32 rows %.1f/%.1f/%.1f ms (draft length from these costs)",
                     1e3 * cost.forward(1), 1e3 * cost.forward(8), 1e3 * cost.forward(32))
    return SpecDecoder(config, kv, sampler, out, draft, row_block, cost, heads, runner)
