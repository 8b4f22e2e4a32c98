"""Token-tree drafts: several candidate continuations verified in one forward.

The tree is the request's last pending token (the root) with ``m`` chains hanging off it (n-gram
candidates with distinct first tokens; Medusa, Cai et al. 2024 §2.1.2 "tree attention";
SpecInfer, Miao et al. 2024). Node ``i`` at depth ``d`` must attend to the request's prefix, the
root and its own ancestors only. With the paged slot table that is a *decode row* of length
``root_pos + d + 1`` over a row of the table holding the prefix and then the node's chain: chain 0
uses the request's own row (its nodes take the positions after the root), every other chain a
scratch row (the prefix slots copied, then its chain's slots). So the tree mask needs no new
kernel: each node reads exactly its ancestors through its row.

Acceptance walks down from the root: at each node the target token is the plain sampler's draw
from ``p`` at the node's output position (``kernels.sample`` with the request's ``(seed,
position)`` noise, :meth:`.verify.Draws.targets`; greedy: the argmax), and the walk follows the
child spelling it, if any. Each token is a draw from ``p`` itself, so the output is exactly
distributed, and it is the plain run's token: a seeded request's output does not depend on the
tree. (For deterministic drafts this keeps child ``c`` with probability ``p(c)`` in the order of
no child, as sequential rejection among siblings does: Miao et al. 2024, SpecInfer §4.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Optional, Sequence

import torch

from .verify import Draws


@dataclass
class TreeDraft:
    """Chains of draft tokens under one root.

    Attributes:
        chains: the candidate continuations (distinct first tokens), chain 0 first.
        rows: the slot-table row of each chain (chain 0: the request's row), set by the decoder.
        scratch: rows borrowed for this step (freed after it).
    """

    chains: list[list[int]]
    rows: list[int] = field(default_factory=list)
    scratch: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        """Node tokens in layout order (chain after chain)."""
        return [t for c in self.chains for t in c]

    def paths(self) -> list[list[int]]:
        """Per node (layout order), the node tokens from the root's child down to it."""
        out = []
        for c in self.chains:
            out.extend(c[:j + 1] for j in range(len(c)))
        return out

    def scratch_spans(self, root_pos: int) -> list[tuple[int, int, int]]:
        """What each scratch chain row holds: ``(row, start, n)``: the request's slots up to the
        root (position ``root_pos``), then its ``n`` chain slots, which the request's row holds
        from position ``start`` (after the root, in layout order); written by
        ``KVManager.fill_scratch_row``."""
        out, off = [], root_pos + 1 + len(self.chains[0])
        for b in range(1, len(self.chains)):
            n = len(self.chains[b])
            out.append((self.rows[b], off, n))
            off += n
        return out

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
            for d in range(1, len(c) + 1):
                pos.append(root + d)
                rows.append(self.rows[b])
                lens.append(root + d + 1)
        return pos, rows, lens

    def accepted_order(self, chain: int, a: int) -> list[int]:
        """Layout indices of all nodes with the ``a`` accepted nodes of ``chain`` first (the new
        order of the reserved slots after the root)."""
        first = sum(len(c) for c in self.chains[:chain])
        kept = list(range(first, first + a))
        return kept + [i for i in range(len(self.tokens)) if i not in set(kept)]


def verify_tree(x: torch.Tensor, tree: TreeDraft, params, draws: Optional[Draws] = None,
                forced: Sequence[Collection[int]] = ()) -> tuple[list[int], int, int]:
    """Walk ``tree`` against the transformed rows ``x`` ([1 + nodes, V] float32: the root's row,
    then one per node in layout order). ``draws``: the request's seed and the output position of
    the root's row (sampling only; required then). ``forced[b]``: the depths (0-based) of chain
    ``b``'s jump-forward tokens, kept whenever reached without a look at ``x`` (never a chain's
    first).

    Returns:
        (tokens, accepted, chain): the accepted draft tokens plus one target token, how many were
        accepted, and the chain they came from.
    Raises:
        ValueError: a sampled request without ``draws``.
    """
    if params.temperature <= 1e-6:
        target = x.argmax(dim=-1).tolist()
    elif draws is None:
        raise ValueError("draws: sampled verification needs the request's seed and output position")
    else:  # row -> its output position's offset: the root 0, a node its depth
        target = draws.targets(x, params, [0] + [d + 1 for c in tree.chains for d in range(len(c))])
    starts, off = [], 1
    for c in tree.chains:
        starts.append(off)
        off += len(c)
    # at the root: one child per chain
    row, chain, depth = 0, -1, 0
    out: list[int] = []
    while True:
        if chain < 0:
            kids = [(b, c[0]) for b, c in enumerate(tree.chains) if c]
        else:
            c = tree.chains[chain]
            kids = [(chain, c[depth])] if depth < len(c) else []
        if chain >= 0 and kids and chain < len(forced) and depth in forced[chain]:
            hit, t = chain, kids[0][1]
        else:
            t = target[row]
            hit = next((b for b, tok in kids if tok == t), None)
        out.append(t)
        if hit is None:
            return out, len(out) - 1, max(chain, 0)
        chain = hit
        depth += 1
        row = starts[chain] + depth - 1


def tree_contexts(tree: TreeDraft) -> list[Sequence[int]]:
    """Per verify row (root, then nodes), the draft tokens that precede its prediction."""
    return [[]] + tree.paths()
