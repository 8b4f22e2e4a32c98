"""``MEDUSA`` and ``EAGLE`` proposers: drafts from heads on the target's own hidden states.

The target runs with ``ModelRunner.keep_hidden`` on: after every step :meth:`HeadProposer.observe`
stores, per request, the final-normed hidden state of every position the step committed
(:class:`FeatureLog` in ``req.spec.feats``; for a verify step the pending tokens and the accepted
nodes of the accepted chain). A draft then reads them:

* :class:`MedusaProposer` (Cai et al. 2024): heads on the feature of the last computed position
  give the tokens after the pending one; candidates are the Cartesian top-k of the heads in a
  static tree (:data:`MEDUSA_TREE`: index tuples, one per chain).
* :class:`EagleProposer` (EAGLE-2, Li et al. 2024 §4): the draft layer catches up on the
  positions it has not seen (its own K/V per request, ``req.spec.draft_kv``), then grows a tree:
  the ``topk`` most confident nodes of each depth (cumulative log-probability, the product of
  the draft's probabilities along the path) are expanded by their ``topk`` best children for
  ``num_steps`` depths, and all nodes are reranked: the ``num_draft_tokens`` best form the draft.

EAGLE's kept nodes go to the verify path as they are: a tree branching at any depth, written as
chains each hanging off a node of an earlier one (:class:`.tree.TreeDraft`), all verified in one
target step. A request with a grammar keeps the chains off the root only (its grammar walk
follows chains from the root). Drafts are point masses: verification stays exact whatever the
heads predict.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from ..step_plan import StepEntry
from .budget import DraftBudget
from .draft_fast import FastEagle, FastLMHead, FastMedusa
from .proposer import Chain
from .state import SpecState
from .tree import ROOT

# Medusa's static tree: per chain, the rank taken from each head (root branches: distinct first ranks)
MEDUSA_TREE = ((0, 0, 0, 0, 0), (1, 0, 0), (2, 0))


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the draft's compute on one torch thread, restoring the count after: a draft is a
    handful of tiny ops (a few rows), where a two-thread parallel region per op costs more than
    it saves, and on a loaded CPU each region waits for the other core (measured on the shared
    2-core box: an EAGLE layer pass of 4 rows took 216 ms on 2 threads, 6.8 ms on 1)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class FeatureLog:
    """Final-normed hidden states of a request's positions ``start .. start + n - 1`` ([n, H]
    float32). ``dirty``: the lowest position rewritten since :meth:`clean` (retraction, radix)."""

    def __init__(self, hidden: int):
        self.buf = torch.empty(64, hidden)
        self.start, self.n, self.dirty = 0, 0, None

    @property
    def end(self) -> int:
        return self.start + self.n

    def put(self, pos: int, rows: torch.Tensor) -> None:
        """Store ``rows`` [m, H] as the features of positions ``pos ..`` (later ones dropped)."""
        if pos < self.start or pos > self.end:  # a gap (a cached prefix) or before the log: restart
            self.start, self.n, self.dirty = pos, 0, pos
        elif pos < self.end:
            self.dirty = pos if self.dirty is None else min(self.dirty, pos)
        self.n = pos - self.start
        need = self.n + rows.shape[0]
        if need > self.buf.shape[0]:
            grown = torch.empty(max(need, 2 * self.buf.shape[0]), self.buf.shape[1])
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        self.buf[self.n:need] = rows
        self.n = need

    def rows(self, a: int, b: int) -> torch.Tensor:
        return self.buf[a - self.start:b - self.start]

    def clean(self) -> Optional[int]:
        d, self.dirty = self.dirty, None
        return d


class _HeadBase:
    """What both proposers share: the draft LM head and the observed features.

    Args:
        module: the heads (:mod:`.heads`), float32, eval mode.
        model: the target ``LlamaModel`` (its embedding and LM head).
        draft_vocab: the token ids the heads may propose, or None (all).
    """

    source = "head"
    costs_forward = True  # its candidates cost a forward: the decoder's .head_gate decides first

    def __init__(self, module, model, draft_vocab: Optional[torch.Tensor]):
        self.module, self.model = module, model
        lm = model.lm_head
        ids = draft_vocab if draft_vocab is not None else torch.arange(model.arch.vocab_size)
        w = lm.rows(ids, torch.float32) if hasattr(lm, "rows") else lm.weight[ids]
        self.head_w = w.float().contiguous()  # [Vd, H]
        self.ids = ids.to(torch.int64)
        self.hidden = model.arch.hidden_size
        # the bf16 GEMV draft LM head on CPU (.draft_fast); None: the float32 torch reference
        self.fast_lm: Optional[FastLMHead] = FastLMHead(self.head_w) if self.head_w.device.type == "cpu" else None

    def logp(self, feat: torch.Tensor) -> torch.Tensor:
        """[..., H] features -> [..., Vd] draft log-probabilities over :attr:`ids` (float32)."""
        if self.fast_lm is not None:
            return self.fast_lm(feat)
        return torch.log_softmax(feat @ self.head_w.T, dim=-1)

    @torch.inference_mode()
    def propose(self, entries: list[StepEntry], rooms: list[int], budget: DraftBudget) -> list[list[Chain]]:
        """Per entry, at most ``rooms[i]`` draft tokens as chains with distinct first tokens (the
        verify path's tree); ``[]`` for a request without stored features. Runs on one torch thread."""
        with one_thread():
            return [self._propose_one(e.req, e.req.spec.feats if e.req.spec is not None else None, room)
                    for e, room in zip(entries, rooms)]

    def _propose_one(self, r, log: Optional[FeatureLog], room: int) -> list[Chain]:
        raise NotImplementedError

    def observe(self, plan, hidden: Optional[torch.Tensor], verdicts: dict) -> None:
        """Store the features of the positions ``plan``'s step committed (``hidden``: [N, H] of
        its tokens in entry order; ``verdicts``: ``id(entry) -> (chain, accepted)`` of verify
        entries)."""
        if hidden is None:
            return
        off = 0
        for e in plan.entries:
            r = e.req
            if SpecState.of(r).feats is None:
                r.spec.feats = FeatureLog(self.hidden)
            pending = e.n - len(e.draft)
            r.spec.feats.put(e.start, hidden[off:off + pending])
            if e.draft and id(e) in verdicts:
                chain, a = verdicts[id(e)]
                if a:  # the accepted nodes' rows (a tree's path may cross chains)
                    nodes = e.tree.accepted(chain, a) if e.tree is not None else range(a)
                    r.spec.feats.put(e.start + pending, hidden[[off + pending + i for i in nodes]])
            off += e.n


class MedusaProposer(_HeadBase):
    """``MEDUSA`` (module docstring)."""

    source = "medusa"

    def __init__(self, module, model, draft_vocab=None, tree=MEDUSA_TREE):
        super().__init__(module, model, draft_vocab)
        k = len(module.blocks)
        self.tree = [t[:k] for t in tree]
        self.depth = max(len(t) for t in self.tree)
        # the bf16 GEMV blocks on CPU (.draft_fast); None: the float32 module itself
        self.fast: Optional[FastMedusa] = FastMedusa(module) if self.fast_lm is not None else None

    def _propose_one(self, r, log: Optional[FeatureLog], room: int) -> list[Chain]:
        last = r.seq_len - 2  # the position whose logits gave the pending token
        if room < 1 or log is None or not log.start <= last < log.end:
            return []
        f = (self.fast or self.module)(log.rows(last, last + 1)[0])  # [K, H]
        if self.module.heads is not None:
            lp = torch.stack([torch.log_softmax(h(f[i]), -1)[self.ids] for i, h in enumerate(self.module.heads)])
        else:
            lp = self.logp(f)  # [K, Vd]
        top = lp.topk(max(max(t) for t in self.tree) + 1, dim=-1).indices  # [K, R]
        chains, left = [], room
        for t in self.tree:
            c = [int(self.ids[top[d, j]]) for d, j in enumerate(t)][:left]
            if c and c[0] not in {ch[0][0] for ch in chains}:
                chains.append((c, [self.source] * len(c)))
                left -= len(c)
            if left < 1:
                break
        return chains


class _EagleKV:
    """The draft layer's K/V of a request's positions ``start .. start + m - 1`` ([1, m, Hkv, D])."""

    def __init__(self, start: int):
        self.start, self.k, self.v = start, None, None

    @property
    def m(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def cut(self, m: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :max(0, m)], self.v[:, :max(0, m)]


class EagleProposer(_HeadBase):
    """``EAGLE`` (module docstring). ``num_steps``: tree depth; ``topk``: nodes expanded per depth
    and children per node; ``num_draft_tokens``: nodes kept after reranking. ``branch_below_root``
    (attribute, default True): False keeps only the chains off the root (each root child followed
    down its most confident kept child: the verify path before nested trees), for A/B runs."""

    source = "eagle"
    branch_below_root = True

    def __init__(self, module, model, draft_vocab=None, num_steps: int = 4, topk: int = 4, num_draft_tokens: int = 8):
        super().__init__(module, model, draft_vocab)
        self.num_steps, self.topk, self.num_draft_tokens = num_steps, topk, num_draft_tokens
        # the bf16 GEMV draft layer on CPU (.draft_fast); None: the float32 module itself
        self.fast: Optional[FastEagle] = FastEagle(module) if self.fast_lm is not None else None

    def layer(self, emb, feat, pos, past=None, mask=None) -> tuple:
        """One pass of the draft layer (:meth:`.heads.EagleHead.forward`'s arguments and results;
        ``past`` may hold lists of K / V chunks, concatenated only for the float32 module)."""
        if self.fast is not None:
            return self.fast(emb, feat, pos, past, mask)
        if past is not None and isinstance(past[0], list):
            past = (torch.cat(past[0], 1), torch.cat(past[1], 1))
        return self.module(emb, feat, pos, past, mask)

    def _embed(self, ids: list[int]) -> torch.Tensor:
        return self.model.embed_rows(torch.tensor(ids, dtype=torch.int64)).float()[None]  # [1, T, H]

    def _catch_up(self, r, log: FeatureLog) -> Optional[torch.Tensor]:
        """Run the draft layer over the positions with features it has not seen (inputs
        ``(x_{i+1}, f_i)``, i up to the pending token's position - 1). Returns its output at the
        last one ([H]: the predicted feature of the pending token's position), or None."""
        st = r.spec
        last = r.seq_len - 2
        if not log.start <= last < log.end:
            return None
        kv = st.draft_kv
        dirty = log.clean()
        if kv is None or kv.start != log.start:
            kv = st.draft_kv = _EagleKV(log.start)
        elif dirty is not None:
            kv.cut(dirty - kv.start)
        kv.cut(last - kv.start)  # recompute at least the last position (its output is the root's)
        a = kv.start + kv.m
        toks = r.tokens(a + 1, last + 2)
        pos = torch.arange(a, last + 1)[None]
        past = (kv.k, kv.v) if kv.k is not None else None
        out, (k, v) = self.layer(self._embed(toks), log.rows(a, last + 1)[None], pos, past)
        kv.k = k if past is None else torch.cat((kv.k, k), 1)
        kv.v = v if past is None else torch.cat((kv.v, v), 1)
        return out[0, -1]

    def _propose_one(self, r, log: Optional[FeatureLog], room: int) -> list[Chain]:
        root = self._catch_up(r, log) if room >= 1 and log is not None else None
        return self._grow(r, root, room) if root is not None else []

    def _grow(self, r, root_feat: torch.Tensor, room: int) -> list[Chain]:
        """EAGLE-2's tree (module docstring) under the pending token, as root-branching chains."""
        kv, k = r.spec.draft_kv, min(self.topk, self.head_w.shape[0])
        base = r.seq_len - 1  # position of the pending token (the first node input's position)
        # nodes: (token, parent node index or -1, cumulative log-prob, depth)
        nodes: list[tuple[int, int, float, int]] = []
        lp, ix = self.logp(root_feat).topk(k)
        frontier = []
        for s, j in zip(lp.tolist(), ix.tolist()):
            nodes.append((int(self.ids[j]), -1, s, 1))
            frontier.append(len(nodes) - 1)
        # K/V of expanded nodes (tree rows after the request's cache), and their ancestry
        tk, tv, rows_of, outs = [], [], {}, {}  # outs: node -> its predicted feature
        for _depth in range(1, self.num_steps):
            if not frontier:
                break
            n_prev = sum(t.shape[1] for t in tk)
            mask = torch.zeros(len(frontier), kv.m + n_prev + len(frontier), dtype=torch.bool)
            mask[:, :kv.m] = True
            feats = []
            for qi, ni in enumerate(frontier):
                p = nodes[ni][1]
                while p >= 0:  # ancestors' rows
                    mask[qi, kv.m + rows_of[p]] = True
                    p = nodes[p][1]
                mask[qi, kv.m + n_prev + qi] = True
                feats.append(root_feat if nodes[ni][1] < 0 else outs[nodes[ni][1]])
            past_k, past_v = [kv.k] + tk, [kv.v] + tv  # chunks: read in place by the fast layer
            pos = torch.tensor([[base + nodes[ni][3] - 1 for ni in frontier]])
            o, (nk, nv) = self.layer(self._embed([nodes[ni][0] for ni in frontier]), torch.stack(feats)[None],
                                      pos, (past_k, past_v), mask)
            tk.append(nk)
            tv.append(nv)
            for qi, ni in enumerate(frontier):
                rows_of[ni] = n_prev + qi
                outs[ni] = o[0, qi]
            lp, ix = self.logp(o[0]).topk(k, dim=-1)  # [F, k]
            cands = []
            for qi, ni in enumerate(frontier):
                for s, j in zip(lp[qi].tolist(), ix[qi].tolist()):
                    nodes.append((int(self.ids[j]), ni, nodes[ni][2] + s, nodes[ni][3] + 1))
                    cands.append(len(nodes) - 1)
            frontier = sorted(cands, key=lambda i: -nodes[i][2])[:k]
        chains = _chains(nodes, min(room, self.num_draft_tokens), k, self.source)
        return chains if self.branch_below_root else [c for c in chains if c[2] == ROOT]


def _chains(nodes: list, budget: int, width: int, source: str) -> list:
    """The ``budget`` most confident nodes (EAGLE-2's rerank; a node whose parent is not kept is
    dropped) as a tree of chains: chain 0 follows the most confident child from the root down;
    each other kept child starts a chain ``(tokens, sources, (parent chain, parent depth))``
    that follows its most confident child (:class:`.tree.TreeDraft`'s parents), chains in order
    of their first node's confidence, at most ``width`` children per node."""
    order = sorted(range(len(nodes)), key=lambda i: -nodes[i][2])
    keep: set = set()
    for i in order:
        if len(keep) >= budget:
            break
        if nodes[i][1] < 0 or nodes[i][1] in keep:
            keep.add(i)
    kids: dict = {}
    for i in order:
        if i in keep and len(kids.setdefault(nodes[i][1], [])) < width:
            kids[nodes[i][1]].append(i)
    chains: list = []
    starts = [(first, ROOT) for first in kids.get(-1, [])[:1]]
    while starts:  # the most confident pending start first; its parent's chain is already placed
        starts.sort(key=lambda s: -nodes[s[0]][2])
        i, parent = starts.pop(0)
        b, c = len(chains), []
        while i is not None:
            c.append(nodes[i][0])
            ks = kids.get(i, [])
            starts.extend((k, (b, len(c))) for k in ks[1:])
            i = ks[0] if ks else None
        chains.append((c, [source] * len(c), parent))
        if len(chains) == 1:
            starts.extend((k, ROOT) for k in kids.get(-1, [])[1:])
    return chains


def load_head_proposer(config, runner):
    """The ``EAGLE`` / ``MEDUSA`` proposer of ``config`` for the target in ``runner`` (its
    ``keep_hidden`` switched on): heads from ``speculative_draft_model_path``, or the ones shipped
    for the default model. Raises InvalidRequestError (field ``speculative_algorithm``) for a
    target without hidden states for heads (Gemma / OLMo 2 / Granite layers, tensor parallelism),
    and :func:`.heads.load_heads`' errors."""
    from ...errors import InvalidRequestError
    from .heads import default_heads_dir, load_heads

    alg = config.speculative_algorithm
    model = getattr(runner, "model", None)
    if model is None or not getattr(model, "emits_hidden", False) or model.tp is not None:
        raise InvalidRequestError(f"{alg} needs a Llama-family model in this process (its hidden states); "
                                  f"this target gives none", field="speculative_algorithm")
    method = alg.lower()
    path = config.speculative_draft_model_path or default_heads_dir(method)
    module, vocab = load_heads(path, model.arch.hidden_size, model.arch.vocab_size, method)
    runner.keep_hidden = True
    if method == "medusa":
        return MedusaProposer(module, model, vocab)
    return EagleProposer(module, model, vocab, config.speculative_num_steps, config.speculative_eagle_topk,
                         config.speculative_num_draft_tokens)
