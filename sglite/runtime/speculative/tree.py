"""Token-tree drafts: several candidate continuations verified in one forward.

The tree is the request's last pending token (the root) with nodes below it, stored as *chains*:
runs of nodes each the child of the one before. Chain ``b`` hangs off its parent ``(pc, pd)``:
the root (``(-1, 0)``: n-gram candidates with distinct first tokens) or the ``pd``-th node of an
earlier chain ``pc`` (EAGLE-2's tree, Li et al. 2024 §4, whose kept nodes branch at any depth).
Siblings spell distinct tokens (Medusa, Cai et al. 2024 §2.1.2 "tree attention"; SpecInfer, Miao
et al. 2024). Node ``i`` at depth ``d`` must attend to the request's prefix, the root and its own
ancestors only. With the paged slot table that is a *decode row* of length ``root_pos + d + 1``
over a row of the table holding the prefix and then the node's path: chain 0 uses the request's
own row (its nodes take the positions after the root), every other chain a scratch row (the
prefix slots copied, then the slots of its ancestors below the root, then its own). So the tree
mask needs no new kernel: each node reads exactly its ancestors through its row.

Acceptance walks down from the root: at each node the target token is the plain sampler's draw
from ``p`` at the node's output position (``kernels.sample`` with the request's ``(seed,
position)`` noise, :meth:`.verify.Draws.targets`; greedy: the argmax), and the walk follows the
child spelling it, if any: the longest root path whose every token is the target's. Each token
is a draw from ``p`` itself, so the output is exactly distributed, and it is the plain run's
token: a seeded request's output does not depend on the tree. (For deterministic drafts this
keeps child ``c`` with probability ``p(c)`` in the order of no child, as sequential rejection
among siblings does: Miao et al. 2024, SpecInfer §4.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Optional, Sequence

import torch

from .verify import Draws

ROOT = (-1, 0)  # the parent of a chain hanging off the root


@dataclass
class TreeDraft:
    """Chains of draft tokens under one root.

    Attributes:
        chains: the chains' tokens, chain 0 first (it hangs off the root).
        rows: the slot-table row of each chain (chain 0: the request's row), set by the decoder.
        scratch: rows borrowed for this step (freed after it).
        parents: per chain ``(pc, pd)``: its first node is a child of node ``pd - 1`` (0-based) of
            the earlier chain ``pc``, or of the root (:data:`ROOT`); missing entries: the root.
    Raises:
        ValueError: a parent that is not an earlier chain's node, or siblings with one token.
    """

    chains: list[list[int]]
    rows: list[int] = field(default_factory=list)
    scratch: list[int] = field(default_factory=list)
    parents: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.parents = [tuple(self.parents[b]) if b < len(self.parents) else ROOT for b in range(len(self.chains))]
        self.offsets, self.base, off = [], [], 0  # layout offset of each chain's first node; depth above it
        for b, c in enumerate(self.chains):
            pc, pd = self.parents[b]
            if pc >= b or (pc >= 0 and not 1 <= pd <= len(self.chains[pc])) or (pc < 0 and pd != 0):
                raise ValueError(f"parents[{b}]: {self.parents[b]} is no node of an earlier chain")
            self.offsets.append(off)
            self.base.append(0 if pc < 0 else self.base[pc] + pd)
            off += len(c)
        self.owner = [(b, j) for b, c in enumerate(self.chains) for j in range(len(c))]  # node -> (chain, index)
        self.kids: dict[int, list[int]] = {-1: []}  # node (layout index; -1: the root) -> child nodes
        for b, c in enumerate(self.chains):
            if not c:
                continue
            pc, pd = self.parents[b]
            self.kids.setdefault(-1 if pc < 0 else self.offsets[pc] + pd - 1, []).append(self.offsets[b])
            for j in range(1, len(c)):
                self.kids.setdefault(self.offsets[b] + j - 1, []).append(self.offsets[b] + j)
        toks = self.tokens
        for node, ks in self.kids.items():
            if len({toks[k] for k in ks}) < len(ks):
                raise ValueError(f"chains: two children of node {node} spell the same token")

    @property
    def tokens(self) -> list[int]:
        """Node tokens in layout order (chain after chain)."""
        return [t for c in self.chains for t in c]

    @property
    def nested(self) -> bool:
        """Whether some chain branches below the root."""
        return any(p != ROOT for p in self.parents)

    def path(self, b: int, j: int) -> list[int]:
        """Layout indices of the nodes from the root's child down to node ``j`` (0-based) of
        chain ``b`` (``j = -1``: the path above the chain)."""
        pc, pd = self.parents[b]
        head = self.path(pc, pd - 1) if pc >= 0 else []
        return head + [self.offsets[b] + i for i in range(j + 1)]

    def chain_of(self, node: int) -> tuple[int, int]:
        """``(chain, index in it)`` of a node's layout index."""
        return self.owner[node]

    def depths(self) -> list[int]:
        """Per node (layout order), its depth below the root (1: a child of the root)."""
        return [self.base[b] + j + 1 for b, j in self.owner]

    def paths(self) -> list[list[int]]:
        """Per node (layout order), the node tokens from the root's child down to it."""
        toks = self.tokens
        return [[toks[i] for i in self.path(b, j)] for b, c in enumerate(self.chains) for j in range(len(c))]

    def scratch_paths(self) -> list[tuple[int, list[int]]]:
        """What each scratch chain row holds after the root: ``(row, nodes)``: the layout indices
        of the nodes on the path to the chain's last node (their slots sit in the request's row
        after the root, in layout order); the decoder copies the prefix and then these slots."""
        return [(self.rows[b], self.path(b, len(self.chains[b]) - 1)) for b in range(1, len(self.chains))]

    def layout(self, row: int, start: int, n: int) -> tuple[list[int], list[int], list[int]]:
        """Positions, decode rows and attention lengths of an entry's ``n`` tokens (pending tokens,
        then the nodes)."""
        n_nodes = sum(len(c) for c in self.chains)
        pending = n - n_nodes
        root = start + pending - 1
        pos = list(range(start, start + pending))
        rows = [row] * pending
        lens = list(range(start + 1, start + pending + 1))
        for b, c in enumerate(self.chains):
            for j in range(len(c)):
                d = self.base[b] + j + 1
                pos.append(root + d)
                rows.append(self.rows[b])
                lens.append(root + d + 1)
        return pos, rows, lens

    def accepted(self, chain: int, a: int) -> list[int]:
        """Layout indices of the ``a`` accepted nodes (the path down to depth ``a``, ending in
        ``chain``)."""
        return self.path(chain, a - self.base[chain] - 1) if a else []

    def kept_per_chain(self, chain: int, a: int) -> list[int]:
        """How many accepted nodes each chain holds."""
        out = [0] * len(self.chains)
        for i in self.accepted(chain, a):
            out[self.chain_of(i)[0]] += 1
        return out

    def accepted_order(self, chain: int, a: int) -> list[int]:
        """Layout indices of all nodes with the ``a`` accepted ones (ending in ``chain``) first
        (the new order of the reserved slots after the root)."""
        kept = self.accepted(chain, a)
        rest = set(kept)
        return kept + [i for i in range(len(self.tokens)) if i not in rest]


def prune(chains: Sequence[Sequence[int]], parents: Sequence[tuple[int, int]], keep: Sequence[int]) -> tuple[list[int], list]:
    """The chains of ``keep`` (indices, in order) whose parent is kept and still long enough,
    and their parents renumbered to the kept chains. Returns ``(kept indices, parents)``."""
    new, out, ps = {}, [], []
    for i in keep:
        pc, pd = parents[i]
        if not chains[i] or (pc >= 0 and (pc not in new or len(chains[pc]) < pd)):
            continue
        new[i] = len(out)
        out.append(i)
        ps.append(ROOT if pc < 0 else (new[pc], pd))
    return out, ps


def cut_tree(chains: Sequence[Sequence[int]], budget: int) -> list[list[int]]:
    """The chains cut to ``budget`` nodes in layout order (later chains lose nodes first; empty
    chains stay, :func:`prune` drops what lost its parent)."""
    out = []
    for c in chains:
        out.append(list(c[:max(0, budget)]))
        budget -= len(out[-1])
    return out


def verify_tree(x: torch.Tensor, tree: TreeDraft, params, draws: Optional[Draws] = None,
                forced: Sequence[Collection[int]] = ()) -> tuple[list[int], int, int]:
    """Walk ``tree`` against the transformed rows ``x`` ([1 + nodes, V] float32: the root's row,
    then one per node in layout order). ``draws``: the request's seed and the output position of
    the root's row (sampling only; required then). ``forced[b]``: the depths (0-based, within
    the chain) of chain ``b``'s jump-forward tokens, kept whenever reached from the node before
    them in the chain without a look at ``x`` (never a chain's first).

    Returns:
        (tokens, accepted, chain): the accepted draft tokens plus one target token, how many were
        accepted, and the chain of the last accepted node (0 when none).
    Raises:
        ValueError: a sampled request without ``draws``.
    """
    if params.temperature <= 1e-6:
        target = x.argmax(dim=-1).tolist()
    elif draws is None:
        raise ValueError("draws: sampled verification needs the request's seed and output position")
    else:  # row -> its output position's offset: the root 0, a node its depth
        target = draws.targets(x, params, [0] + tree.depths())
    toks = tree.tokens
    node, chain, out = -1, 0, []
    while True:
        kids = tree.kids.get(node, [])
        nxt = node + 1 if node >= 0 and node + 1 in kids else None  # the next node in the same chain
        if nxt is not None and tree.chain_of(nxt)[1] in (forced[chain] if chain < len(forced) else ()):
            t, hit = toks[nxt], nxt
        else:
            t = target[node + 1]
            hit = next((k for k in kids if toks[k] == t), None)
        out.append(t)
        if hit is None:
            return out, len(out) - 1, chain
        node, chain = hit, tree.chain_of(hit)[0]


def tree_contexts(tree: TreeDraft) -> list[Sequence[int]]:
    """Per verify row (root, then nodes), the draft tokens that precede its prediction."""
    return [[]] + tree.paths()
