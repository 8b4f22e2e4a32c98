"""An approximate radix tree of the texts a router sent one worker (character level, LRU-evicted).

The router cannot see a worker's KV cache; it mirrors it approximately by inserting every request
text it routes to that worker (SGLang's cache-aware router, "approximate radix tree" per worker).
Characters, not tokens: the router does not tokenize. Eviction drops least-recently-matched leaves
until the tree holds at most ``max_chars`` characters, as the worker's own LRU would.
"""
from __future__ import annotations

import itertools
from typing import Optional


class _Node:
    __slots__ = ("edge", "children", "parent", "last")

    def __init__(self, edge: str, parent: Optional["_Node"], last: int):
        self.edge, self.parent, self.last = edge, parent, last
        self.children: dict[str, _Node] = {}


class ApproxRadixTree:
    """Character radix tree with ``insert``, ``match`` (longest common prefix) and LRU eviction.

    Attributes:
        size: characters stored (sum of edge lengths).
    """

    def __init__(self, max_chars: int = 1 << 22):
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        self._clock = itertools.count(1)
        self.root = _Node("", None, 0)
        self.size = 0

    def match(self, text: str) -> int:
        """Length (characters) of the longest prefix of ``text`` in the tree; touches the path."""
        node, i, now = self.root, 0, next(self._clock)
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            e = child.edge
            k = _common(e, text, i)
            child.last = now
            i += k
            if k < len(e):
                break
            node = child
        return i

    def insert(self, text: str) -> None:
        """Add ``text`` (splitting an edge where it diverges), then evict down to ``max_chars``."""
        node, i, now = self.root, 0, next(self._clock)
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, now)
                node.children[text[i]] = leaf
                self.size += len(leaf.edge)
                break
            e = child.edge
            k = _common(e, text, i)
            child.last = now
            if k < len(e):  # split: child keeps e[k:] under a new node for e[:k]
                mid = _Node(e[:k], node, now)
                node.children[text[i]] = mid
                child.edge, child.parent = e[k:], mid
                mid.children[e[k]] = child
                child = mid
            i += k
            node = child
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_chars:
            leaves = [n for n in self._nodes() if not n.children and n is not self.root]
            if not leaves:
                return
            for leaf in sorted(leaves, key=lambda n: n.last):
                self._remove(leaf)
                if self.size <= self.max_chars:
                    return

    def _remove(self, leaf: _Node) -> None:
        parent = leaf.parent
        del parent.children[leaf.edge[0]]
        self.size -= len(leaf.edge)
        if parent is not self.root and len(parent.children) == 1:  # merge the lone child up
            (only,) = parent.children.values()
            parent.edge += only.edge
            parent.children = only.children
            for c in parent.children.values():
                c.parent = parent
            parent.last = max(parent.last, only.last)

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def clear(self) -> None:
        self.root, self.size = _Node("", None, 0), 0


def _common(edge: str, text: str, i: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[i:]``."""
    n = min(len(edge), len(text) - i)
    k = 0
    while k < n and edge[k] == text[i + k]:
        k += 1
    return k
