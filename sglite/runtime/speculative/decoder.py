"""SpecDecoder: speculative decoding inside the scheduler's mixed extend/decode step.

Per step (``Scheduler.schedule`` → :meth:`SpecDecoder.attach_drafts`, ``Scheduler.process`` →
:meth:`SpecDecoder.process`):

1. **draft** — each decoding request (caught up with its sequence, no logprobs asked, room left)
   gets up to ``k`` draft tokens: n-gram continuations of its own prompt and output plus
   text-level matches of its tail in the prompt, re-encoded (:mod:`.text_lookup`: values copied
   into JSON after a ``"`` where the prompt had a space) (``NGRAM``), or
   ``speculative_num_steps`` greedy steps of a small draft model (``STANDALONE``). A request
   with a grammar walks the draft through its matcher: a token the grammar forbids ends the draft
   and the matcher is rolled back; sampled requests keep the mask of every position for
   verification, greedy ones need none (:func:`.verify.greedy_walk` checks the argmax against the
   matcher instead; :mod:`.grammar_walk`: jump-forward text after a draft token is appended as
   always-kept drafts, a copied JSON value is closed at a word boundary while the request's
   values tend to end at one: ``CLOSE_MIN_RATE``). Its KV reservation
   grows by ``k`` slots (free pages only); its entry becomes
   an extend of ``pending + k`` tokens with a logits row at each of the last ``k + 1`` positions.
   Pending jump-forward tokens go first: the grammar's forced text (e.g. ``","city":"``) and the
   draft that continues after it are verified in the same forward, and the forced text is part
   of the lookup tail. With several candidates (distinct next tokens) the draft is a token tree
   (:mod:`.tree`): each candidate a chain under the pending token, verified together with a tree
   attention mask (scratch slot-table rows, borrowed for the step and returned even when the step
   raises: :meth:`release_scratch`, checked by :meth:`check_invariants`).
2. **verify** — the one forward of the step computes all rows; :mod:`.verify` keeps a prefix of
   each draft by exact speculative sampling (greedy: prefix matching) and adds one target token.
3. **commit** — accepted tokens are appended one by one through the output processor (grammar,
   stop strings, EOS, length), the KV of the pending and accepted tokens is committed and the
   slots of rejected drafts go back to the pool at once (``KVManager.trim``): they never reach
   the radix tree.

Cost model (NGRAM on CPU): what a step of ``R`` rows costs is measured (:mod:`.policy`: the
model's forward of 1..32 decode rows timed at start-up, plus the per-step overhead learned from
the time between steps; with the int8-activation GEMV each row after the first costs ~0.4 of a
one-row step), every candidate draft token gets the probability that it is kept (per draft
source: n-gram match length, text match, learned online over all requests and per request), and
the step carries the tokens that maximize its expected tokens per second
(:func:`.policy.choose`): none in open chat once its drafts keep failing, the whole copy in a
copy task. Without a measured cost (GPU, ``STANDALONE``) the older rule holds: on CPU in bf16
the drafts of a step only fill the rows left in the step's current block of ``row_block`` rows
(:meth:`_step_rows`; weak candidates only the first ``FREE_ROWS``), and a per-request cap (doubled
after a draft kept whole, cut after a rejection) and a pause after low acceptance.
Speculation is per request and off for steps with more than ``speculative_disable_by_batch_size``
decoding requests (the forward is then compute bound and extra rows cost their full price).
Verify entries run as decode rows (:meth:`.StepPlan.layout`), so on CPU they take the fused decode.
Requests asking for logprobs are never drafted.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from ..runner_protocol import RunnerProtocol
from ..step_plan import SMALL_EXTEND, StepEntry, StepPlan
from .grammar_walk import CLOSE, CLOSE_MIN_RATE, FORCED, GrammarWalk, whole_forced
from .ngram import NgramIndex
from .policy import AcceptModel, StepCost, choose, may_pay, probe_forward
from .state import SpecState
from .text_lookup import CONT_CHARS_PER_TOKEN, TextLookup, TokenText
from .tree import TreeDraft, tree_contexts, verify_tree
from .verify import greedy_walk, row_logits, verify_chain, verify_seed

log = logging.getLogger("sglite.speculative")

FREE_ROWS = 4  # rows of a CPU GEMV block that cost about nothing (measured: 1-4 rows alike, 8 rows 1.4x)
GEMM_ROWS = 32  # steps with more rows run their matmuls as GEMMs: extra draft rows cost little
TREE_BRANCHES = 3  # most n-gram candidates (token-tree chains) verified per request and step
TEXT_TAIL_TOKENS = 12  # output tokens decoded as the tail of a text-level lookup
TEXT_MIN_CHARS = 3  # a text match shorter than this (and not word-aligned) is no draft
TEXT_TRUST_CHARS = 8  # a text match this long drafts the full length, whatever the cap
STRONG_NGRAM = 3  # an n-gram match this long looks for drafts whatever the request's backoff


class SpecDecoder:
    """Drafts, verifies and commits speculative tokens for one scheduler.

    Args:
        config: engine options (``speculative_*``).
        kv: the scheduler's ``KVManager``.
        sampler: the scheduler's ``Sampler`` (its penalties and vocabulary size).
        out: the scheduler's ``OutputProcessor``.
        draft_model: a :class:`~.draft_model.DraftModel` (``STANDALONE``) or None (``NGRAM``).
        row_block: rows a forward carries at about the price of one (CPU GEMV kernels:
            ``MAX_ROWS``); drafts then fill the step's last block only (see :meth:`_step_rows`).
            None: no such limit (GPU).
    """

    def __init__(self, config, kv, sampler, out, draft_model=None, row_block: Optional[int] = None,
                 cost: Optional[StepCost] = None):
        self.algorithm = config.speculative_algorithm
        self.k_max = config.speculative_num_draft_tokens
        self.max_batch = config.speculative_disable_by_batch_size
        self.kv, self.sampler, self.out = kv, sampler, out
        self.draft_model = draft_model
        self.counters = {"spec_verify_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
                         "spec_tree_steps": 0, "spec_forced_tokens": 0, "spec_head_rows_skipped": 0}
        # token trees (several n-gram candidates per step) need a slot per position: page size 1
        self.tree_ok = self.draft_model is None and config.page_size == 1
        self.tree_branches = TREE_BRANCHES
        self.row_block = row_block
        self.free_rows_cheap = FREE_ROWS
        self._free_rows = 1 << 30
        self._borrowed: list[int] = []  # scratch rows lent to this step's token trees
        # measured step costs (NGRAM on CPU): drafts chosen for expected tokens per second
        # (policy.choose) instead of the row block and the adaptive cap
        self.cost = cost if draft_model is None else None
        self.accept = AcceptModel()
        self._last_step: Optional[tuple] = None  # (start time, rows, drafted) of a decode-only step
        # per-token text for the lookups (its byte cache fills as tokens are seen)
        self.token_text = TokenText(out.tokenizer) if out is not None else None
        self._gate: Optional[tuple] = None  # this step's (decoding, rows, cost) for policy.may_pay
        self.grammar_walk = GrammarWalk(out, sampler, self.token_text)

    @property
    def stats(self) -> dict:
        """Counters since start: verify steps (request-steps), draft and accepted tokens (of
        which ``spec_forced_tokens`` were jump-forward text verified as drafts)."""
        return dict(self.counters)

    # ------------------------------------------------------------------ drafting
    def _eligible(self, e: StepEntry) -> bool:
        r = e.req
        return (not r.prefilling and e.ends_sequence and e.n <= SMALL_EXTEND and r.finished is None
                and not r.return_logprob and r.params.max_new_tokens - len(r.output_ids) > 1
                and (r.spec is None or self.cost is not None or r.spec.may_draft()))

    def _room(self, e: StepEntry) -> int:
        r = e.req
        left = r.params.max_new_tokens - len(r.output_ids) - 1  # the verify step adds one more
        ctx = self.kv.req_pool.max_context - 8 - (e.start + e.n)
        return max(0, min(self.k_max, left, ctx, self._free_rows))

    def _step_rows(self, entries: list[StepEntry]) -> int:
        """Draft tokens the step can carry at about the price of the rows it has already: with a
        ``row_block`` (CPU: the GEMV kernels read the weights once per block of that many rows)
        the rows left to the end of the current block, none when the step's rows fill whole
        blocks; unlimited without one, or when the step is a GEMM anyway (more than
        ``GEMM_ROWS`` rows)."""
        rows = sum(e.n for e in entries)
        if self.row_block is None or rows > GEMM_ROWS:
            return 1 << 30
        return -rows % self.row_block

    def attach_drafts(self, entries: list[StepEntry]) -> None:
        """Give the eligible decoding entries of a step their drafts (KV reserved). Called after
        admission, before ``StepPlan.layout``."""
        now = time.perf_counter()
        if self.cost is not None and self._last_step is not None:
            self.cost.observe(self._last_step[1], now - self._last_step[0], self._last_step[2])
        try:
            self._attach(entries)
        finally:
            decode_only = entries and not any(e.req.prefilling for e in entries)
            self._last_step = (now, sum(e.n for e in entries), any(e.draft for e in entries)) if decode_only else None

    def _attach(self, entries: list[StepEntry]) -> None:
        self.release_scratch()  # rows a failed step left borrowed
        decoding = [e for e in entries if not e.req.prefilling]
        if not decoding or len(decoding) > self.max_batch:
            return
        cands = [e for e in decoding if self._eligible(e)]
        self._free_rows = self._step_rows(entries) if self.cost is None else 1 << 30
        if not cands or self._free_rows < 1:
            return
        self._gate = None
        if self.cost is not None:  # may_pay's view of the step (see _ngram)
            rows = sum(e.n for e in entries)
            cost = self.cost
            if rows > GEMM_ROWS:
                cost = lambda rows, drafted=False: 1.0  # noqa: E731  (as _choose: rows are free)
            elif len(decoding) > 1:  # the verify extra is paid once per step: not this request's alone
                cost = lambda rows, drafted=False, c=self.cost: c(rows)  # noqa: E731
            self._gate = (len(decoding), rows, cost)
        if self.draft_model is not None:
            share = max(1, self._free_rows // len(cands))
            found = self.draft_model.propose([e.req for e in cands], [min(share, self._room(e)) for e in cands])
            drafts = iter([[(d, ["model"] * len(d))] if d else [] for d in found])
        else:
            drafts = None
        proposals = []
        for e in cands:
            found = next(drafts) if drafts is not None else self._ngram(e)
            chains, sources = [c for c, _ in found], [s for _, s in found]
            r = e.req
            if r.spec is None:
                r.spec = SpecState()
            r.spec.masks = None
            chain_masks = None
            r.spec.close_points = None  # filled by the walk where closes are not drafted
            if chains and r.grammar is not None:
                close = self.accept.rate(CLOSE, r.spec.own) >= CLOSE_MIN_RATE
                if not close:
                    r.spec.close_points = []
                chains, chain_masks = self.grammar_walk.walk(r, chains, need_masks=r.params.temperature > 1e-6,
                                                             sources=sources, limit=self._forced_room(e), close=close,
                                                             close_points=r.spec.close_points)
            proposals.append((e, chains, sources, chain_masks))
        if self.cost is not None:
            lens = self._choose(proposals, entries) if any(p[1] for p in proposals) else [[] for _ in proposals]
            proposals = [(e, [c[:n] for c, n in zip(chains, ns)], src, m)
                         for (e, chains, src, m), ns in zip(proposals, lens)]
            for e, chains, _, _ in proposals:  # a look that drafts nothing counts toward the backoff
                if e.req.spec.looked and not any(chains):
                    e.req.spec.missed()
        for e, chains, sources, chain_masks in proposals:
            r = e.req
            if self.cost is None:
                chains = self._fit(chains, self._free_rows, sources)
            keep = [i for i, c in enumerate(chains) if c]
            rows = self._scratch_rows(len(keep) - 1) if len(keep) > 1 else []
            keep = keep[:1 + len(rows)]
            chains = [chains[i] for i in keep]
            n_nodes = sum(len(c) for c in chains)
            if not chains or not self.kv.reserve_more(r, n_nodes):
                self.release_scratch(rows)
                continue
            self._free_rows -= n_nodes
            r.spec.sources = [sources[i] for i in keep]
            if r.spec.close_points is not None:
                r.spec.close_points = [r.spec.close_points[i] for i in keep]
            if chain_masks is not None:
                r.spec.masks = torch.cat([chain_masks[0]] + [chain_masks[1 + i][:len(chains[j])]
                                                             for j, i in enumerate(keep)])
            root_pos = e.start + e.n - 1
            if len(chains) > 1:
                e.tree = TreeDraft(chains, [r.kv.row] + rows, rows)
                e.tree.fill_rows(self.kv.req_to_token, r.kv.row, root_pos)
            e.draft = tuple(t for c in chains for t in c)
            e.skip_rows = _rows_before_forced(chains, r.spec.sources)
            self.counters["spec_head_rows_skipped"] += len(e.skip_rows)
            e.n += n_nodes

    def _choose(self, proposals: list, entries: list[StepEntry]) -> list[list[int]]:
        """Per proposal, the tokens of each chain worth verifying this step (:func:`.policy.choose`
        over the whole step: the keep probability of every candidate token against the measured
        cost of the rows it adds)."""
        probs, owner = [], []
        for j, (e, chains, sources, _) in enumerate(proposals):
            q = 1.0  # a later chain of a tree is only reached where the earlier first tokens fail
            for c, srcs in zip(chains, sources):
                ps, p = [], q
                for src in srcs[:len(c)]:
                    if src != FORCED:  # jump-forward text: kept whenever the token before it is
                        p *= self.accept.rate(src, e.req.spec.own)
                    ps.append(p)
                probs.append(ps)
                owner.append(j)
                q *= 1.0 - (ps[0] / q if ps and q > 0 else 0.0)
        base_rows = sum(e.n for e in entries)
        if base_rows > GEMM_ROWS:  # a GEMM step (prefill chunk): a few more rows cost next to nothing
            cost = lambda rows, drafted=False: 1.0  # noqa: E731
        else:
            cost = self.cost
        base_tokens = sum(1 for e in entries if not e.req.prefilling)
        flat = choose(base_tokens, base_rows, probs, cost)
        out: list[list[int]] = [[] for _ in proposals]
        for j, n in zip(owner, flat):
            out[j].append(n)
        for (_, chains, sources, _), lens in zip(proposals, out):
            for b, (c, srcs) in enumerate(zip(chains, sources)):
                lens[b] = whole_forced(srcs[:len(c)], lens[b], up=True)
        return out

    @staticmethod
    def _fit(chains: list[list[int]], budget: int, sources: Optional[list] = None) -> list[list[int]]:
        """The chains cut to ``budget`` nodes in all: the first takes what it needs, each later
        one at most half of what is left (empty chains stay, to keep the mask rows aligned); a
        cut inside a chain's jump-forward text moves before the token that forces it."""
        out = []
        for i, c in enumerate(chains):
            n = min(len(c), budget if i == 0 or not any(out) else budget // 2)
            if sources is not None:
                n = whole_forced(sources[i][:len(c)], n, up=False)
            out.append(c[:n])
            budget -= n
        return out

    def release_scratch(self, rows: Optional[list] = None) -> None:
        """Give back borrowed slot-table rows: ``rows``, or (None) every row still borrowed (a
        step that raised between drafting and verification left them)."""
        rows = list(self._borrowed) if rows is None else rows
        for row in rows:
            if row in self._borrowed:
                self._borrowed.remove(row)
                self.kv.req_pool.free(row)

    def check_invariants(self, running) -> None:
        """Assert the slot-table rows are accounted for: free, held by a running request, or
        borrowed by the step in flight (none between steps)."""
        pool = self.kv.req_pool
        held = {r.kv.row for r in running if r.kv is not None and r.kv.row is not None}
        assert not self._borrowed, f"scratch rows {self._borrowed} still borrowed between steps"
        assert len(held) + pool.available() == pool.req_to_token.shape[0], (
            f"slot-table rows lost: {len(held)} held + {pool.available()} free of {pool.req_to_token.shape[0]}")

    def _scratch_rows(self, n: int) -> list[int]:
        """Up to ``n`` free slot-table rows for the extra chains of a token tree (fewer when
        the table is short: the tree then keeps fewer chains); borrowed until the step's
        verification (or :meth:`release_scratch`) gives them back."""
        out = []
        while len(out) < n:
            row = self.kv.req_pool.alloc()
            if row is None:
                break
            out.append(row)
        self._borrowed.extend(out)
        return out

    def _ngram(self, e: StepEntry) -> list[tuple[list[int], list[str]]]:
        """Draft chains of a request with their per-token sources (:class:`.policy.AcceptModel`): token
        n-gram continuations (``ngram<n>``) and text-level prompt matches (:mod:`.text_lookup`;
        ``text`` / ``text_weak``), strongest match (in characters) first, distinct first tokens.

        With the measured-cost policy the lookups are gated, cheapest first: the n-gram lookup
        (a few dict probes) runs every step; the text lookup follows the request's backoff
        (:meth:`.SpecState.may_look`: after a run of fruitless looks, one look every 2, 4, 8
        steps, unless an n-gram of ``STRONG_NGRAM`` tokens matches, grammar text was forced, or
        the request has a grammar);
        then :func:`.policy.may_pay` on the candidates' sources, before a text match is
        re-encoded: where even the optimistic bound does not pay, no chain is built."""
        r, k = e.req, self._room(e)
        if k < 1:
            if r.spec is not None:
                r.spec.looked = False
            return []
        st = r.spec
        if st is None:
            st = r.spec = SpecState(index=NgramIndex())
        elif st.index is None:
            st.index = NgramIndex()
        st.index.sync(r.seq_len, r.tokens)
        tt = self.token_text
        width = self.tree_branches if self.tree_ok else 1
        cap = k if self.cost is not None else min(k, st.cap)
        found = st.index.propose_with_match(cap, candidates=width)
        gate = self._gate if self.cost is not None else None
        st.looked = gate is not None
        # the text lookup backs off after a run of fruitless looks (the n-gram one is cheap);
        # not for grammar requests (JSON values are copied by text, right after the forced key)
        strong = e.n > 1 or r.grammar is not None or (bool(found) and found[0][1] >= STRONG_NGRAM)
        look_text = gate is None or st.may_look(strong)
        texts = self._text_drafts(r, k, width) if look_text else []
        if gate is not None and not self._may_pay_any(gate, r, found, texts, k):
            return []
        cands = []  # (matched chars, strong, chain or text to encode, source)
        if found:
            tail_chars = len(tt.text(r.tokens(r.seq_len - found[0][1], r.seq_len)))
            for cont, n in found:  # a short match predicts little: at most twice its length (no cost model)
                cont = cont if self.cost is not None else cont[:2 * n]
                cands.append((tail_chars if n == found[0][1] else 0, n >= 2, cont, f"ngram{n}"))
        for chars, trusted, cont, src in texts:
            toks = tt.encode(cont)[:k if trusted or self.cost is not None else min(k, st.cap)]
            cands.append((chars, trusted, toks, src))
        cands.sort(key=lambda c: -c[0])  # stable: token n-grams win ties
        # weak candidates (1-token n-gram matches, short text matches) only take the rows that
        # cost next to nothing (the first FREE_ROWS of the block); strong ones the whole block
        weak = k if self.row_block is None or self.cost is not None else max(
            0, min(k, self._free_rows - (self.row_block - self.free_rows_cheap)))
        chains, firsts, budget = [], set(), k
        for _, strong, cont, src in cands:
            if not cont or cont[0] in firsts or len(chains) >= width or budget < 1:
                continue
            c = cont[:budget if not chains else max(1, budget // 2)]
            if not strong:
                c = c[:weak]
                weak -= len(c)
            if not c:
                continue
            chains.append((c, self._token_sources(c, src)))
            firsts.add(c[0])
            budget = max(0, budget - len(c))
        return chains

    def _may_pay_any(self, gate: tuple, r, ngrams: list, texts: list, k: int) -> bool:
        """:func:`.policy.may_pay` for a request's candidates before they are built: n-gram
        continuations (``(tokens, n)``) with their own length, text matches with ``k`` tokens at
        the best rate of their sources (``text``, ``text_word``, ``text_cont`` for a trusted match)."""
        rate, own = self.accept.rate, r.spec.own
        bounds = [(rate(f"ngram{n}", own), len(cont)) for cont, n in ngrams]
        for _, trusted, _, src in texts:
            q = max(rate("text", own), rate("text_word", own), rate("text_cont", own)) if trusted else rate(src, own)
            bounds.append((q, k))
        return may_pay(gate[0], gate[1], bounds, gate[2])

    def _token_sources(self, chain: list[int], src: str) -> list[str]:
        """Per-token sources of a chain: a trusted text draft's tokens after the first that start
        a new word are ``text_word`` (copied JSON values end at such a token), the others
        ``text_cont`` (a copy that started right goes on: kept more often than a first token)."""
        if src != "text":
            return [src] * len(chain)
        starts = self.token_text.starts_word
        return [src] + [("text_word" if starts(t) else "text_cont") for t in chain[1:]]

    def _decode(self, ids) -> str:
        return self.out.tokenizer.decode(ids, skip_special_tokens=False)

    def _text_drafts(self, r, k: int, width: int) -> list[tuple[int, bool, str, str]]:
        """Text-level matches of the sequence's tail in the prompt, not yet re-encoded:
        ``(matched chars, trusted, continuation text, source)``. A word-aligned match (a copied
        value starting) or one of at least ``TEXT_TRUST_CHARS`` characters drafts up to ``k``
        tokens, whatever the request's cap; a weaker one (at least ``TEXT_MIN_CHARS``) at most the
        cap. The tail is the last ``TEXT_TAIL_TOKENS`` tokens' text (:class:`.TokenText`: joined
        cached bytes, no decode)."""
        st, tt = r.spec, self.token_text
        if st.text is None:
            st.text = TextLookup(self._decode(r.input_ids))
            tt.check(r.input_ids, st.text.source)
        tail = tt.text(r.tokens(max(len(r.input_ids), r.seq_len - TEXT_TAIL_TOKENS), r.seq_len))
        out = []
        for m in st.text.find(tail, k * CONT_CHARS_PER_TOKEN, width, min_chars=TEXT_MIN_CHARS):
            trusted = m.aligned or m.chars >= TEXT_TRUST_CHARS
            if not trusted and m.chars < TEXT_MIN_CHARS:
                continue
            out.append((m.chars, trusted, m.cont, "text" if trusted else "text_weak"))
        return out

    def _forced_room(self, e: StepEntry) -> int:
        """Draft tokens an entry can take in all when jump-forward text extends a chain: the
        tokens left to ``max_new_tokens`` and the context, whatever the draft cap (forced tokens
        are no guess)."""
        r = e.req
        left = r.params.max_new_tokens - len(r.output_ids) - 1
        return max(0, min(left, self.kv.req_pool.max_context - 8 - (e.start + e.n)))

    # ------------------------------------------------------------------ verify + commit
    def process(self, plan: StepPlan, logits: torch.Tensor, finish: Callable) -> int:
        """Verify and commit every drafted entry of ``plan`` (``logits``: [M, V] float32, the
        step's rows); ``finish(req, reason)`` ends a request. Returns the tokens appended."""
        appended = 0
        for e in plan.verifying:
            r, nodes, tree = e.req, len(e.draft), e.tree
            pending = e.n - nodes
            contexts = tree_contexts(tree) if tree is not None else [e.draft[:i] for i in range(nodes + 1)]
            x = row_logits(self.sampler, e.verify_rows(logits), r, contexts, r.spec.masks)
            gen, chain = None, 0
            lens = [len(c) for c in tree.chains] if tree is not None else [nodes]
            forced = [{d for d, src in enumerate(srcs[:n]) if src == FORCED} for srcs, n in zip(r.spec.sources, lens)]
            if r.params.temperature > 1e-6:
                gen = torch.Generator().manual_seed(verify_seed(r.seed, len(r.output_ids)))
            if r.grammar is not None and gen is None and r.spec.masks is None:
                tokens, a, chain = self._greedy_grammar(x, e, r, forced)
                if tree is not None:
                    self._settle_tree(r, e.start + pending - 1, tree, chain, a)
                    self.counters["spec_tree_steps"] += 1
                k = len(tree.chains[chain]) if tree is not None else nodes
            elif tree is not None:
                tokens, a, chain = verify_tree(x, tree, r.params, gen, forced=forced)
                self._settle_tree(r, e.start + pending - 1, tree, chain, a)
                k = len(tree.chains[chain])
                self.counters["spec_tree_steps"] += 1
            else:
                tokens, a = verify_chain(x, e.draft, r.params, gen, forced=forced[0] if forced else ())
                k = nodes
            r.spec.masks = None
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
            # a closing draft refused only for how it merged the boundary closed at the right place
            kept = a + self.grammar_walk.learn_close(r.spec.sources[chain][:lens[chain]] if chain < len(lens) else [], a, tokens)
            for b, (srcs, n) in enumerate(zip(r.spec.sources, lens)):
                n = min(n, min(forced[b], default=n))  # forced tokens teach the acceptance model nothing
                self.accept.record(srcs[:n], min(kept, n) if b == chain else 0, r.spec.own)
            if r.spec.close_points:  # closes not drafted: learn them anyway
                self.accept.add(CLOSE, *self.grammar_walk.close_outcomes(r.spec.close_points[chain], a, tokens),
                                own=r.spec.own)
            r.spec.close_points = None
            self.counters["spec_verify_steps"] += 1
            self.counters["spec_draft_tokens"] += nodes
            self.counters["spec_accepted_tokens"] += a
            self.counters["spec_forced_tokens"] += sum(d < a for d in forced[chain]) if chain < len(forced) else 0
            if reason is not None:
                finish(r, reason)
        return appended

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
        table = self.kv.req_to_token
        n = len(tree.tokens)
        seg = table[r.kv.row, root_pos + 1:root_pos + 1 + n].clone()
        table[r.kv.row, root_pos + 1:root_pos + 1 + n] = seg[torch.tensor(tree.accepted_order(chain, a))]
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
    draft = None
    if config.speculative_algorithm == "STANDALONE":
        from .draft_model import DraftModel
        draft = DraftModel.load(config, runner)
    on_cpu = torch.device(runner.device).type == "cpu"
    row_block = None  # GPU, or float32 on CPU (oneDNN GEMMs: a few more rows cost little)
    if on_cpu and runner.dtype in (torch.bfloat16, torch.float16):
        from sglite.kernels.cpu_gemv import MAX_ROWS  # the bf16 / quantized GEMV kernels' row block
        row_block = MAX_ROWS
    cost = None
    if draft is None and on_cpu and runner.measure_forward:
        fwd = probe_forward(runner, kv)  # CPU: rows are not free; what they cost is measured
        if fwd:
            cost = StepCost(fwd, overhead=0.2 * fwd[min(fwd)])
            log.info("speculative: forward of 1/8/32 rows %.1f/%.1f/%.1f ms (draft length from these costs)",
                     1e3 * cost.forward(1), 1e3 * cost.forward(8), 1e3 * cost.forward(32))
    return SpecDecoder(config, kv, sampler, out, draft, row_block, cost)
