"""RadixCache: prefix reuse of KV across requests (SGLang paper, §3 "RadixAttention").

A radix tree keyed by token ids whose nodes own KV slots. Running requests lock the node their
prefix ends in (``lock_ref`` counts on the path to the root), so eviction (LRU over unlocked
leaves) never frees KV a running request reads. With ``page_size > 1`` keys are matched and
inserted in whole pages. ``disabled=True`` turns the cache into a pass-through (no reuse).

Namespaces (LoRA adapters): ``match_prefix`` / ``insert`` take ``ns`` (None: the base model). A
namespace's entries hang under their own child of the root (key ``("ns", ns)``, no tokens, locked
for good), so the namespace is part of every key: identical tokens of two namespaces never share
KV. :meth:`RadixCache.drop_namespace` frees one namespace's entries (an unloaded adapter).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Optional

import torch

from .kv_pool import TokenToKVPool


class TreeNode:
    """One edge of the radix tree: ``key`` tokens whose KV lives in ``value`` slots."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: Optional["TreeNode"] = None, key=None, value=None):
        self.children: dict = {}
        self.parent = parent
        self.key: list[int] = key or []
        self.value: torch.Tensor = value if value is not None else torch.empty(0, dtype=torch.int64)
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    """Radix tree over token ids → KV slots in ``pool``.

    Counters: ``evictable_size`` (tokens in unlocked nodes), ``protected_size`` (locked nodes).
    """

    def __init__(self, pool: TokenToKVPool, page_size: int = 1, disabled: bool = False):
        self.pool = pool
        self.page_size = page_size
        self.disabled = disabled
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Drop the whole tree (its slots must be freed by the caller first; see ``flush``)."""
        self.root = TreeNode()
        self.root.lock_ref = 1
        self.evictable_size = 0
        self.protected_size = 0

    # ------------------------------------------------------------------ helpers
    def _child_key(self, ids, pos):
        return ids[pos] if self.page_size == 1 else tuple(ids[pos:pos + self.page_size])

    def _match_len(self, a, b) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i - i % self.page_size

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Split ``child`` so its first ``at`` tokens become a new parent node."""
        new = TreeNode(child.parent, child.key[:at], child.value[:at])
        new.lock_ref = child.lock_ref
        new.last_access = child.last_access
        new.children = {self._child_key(child.key, at): child}
        child.parent.children[self._child_key(child.key, 0)] = new
        child.parent = new
        child.key = child.key[at:]
        child.value = child.value[at:]
        return new

    # ------------------------------------------------------------------ public API
    def _ns_root(self, ns, create: bool) -> Optional[TreeNode]:
        """The root of namespace ``ns`` (the tree's root for None); created when ``create``."""
        if ns is None:
            return self.root
        node = self.root.children.get(("ns", ns))
        if node is None and create:
            node = TreeNode(self.root)
            node.lock_ref = 1  # never evicted; its subtree is, leaf by leaf
            self.root.children[("ns", ns)] = node
        return node

    def _is_ns_root(self, node: TreeNode) -> bool:
        return node.parent is self.root and not node.key

    def match_prefix(self, ids: list[int], ns=None) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of ``ids`` (whole pages) in namespace ``ns``.

        Returns ([m] int64 slots, node where the match ends). Splits a node when the match
        ends inside it. Does not lock.
        """
        node = self.root
        if self.disabled:
            return torch.empty(0, dtype=torch.int64), node
        node = self._ns_root(ns, create=False)
        if node is None:
            return torch.empty(0, dtype=torch.int64), self.root
        ids = ids[:len(ids) - len(ids) % self.page_size]
        values = []
        pos = 0
        t = next(self._clock)
        node.last_access = t
        while pos < len(ids):
            child = node.children.get(self._child_key(ids, pos))
            if child is None:
                break
            m = self._match_len(child.key, ids[pos:])
            if m == 0:
                break
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = t
            values.append(child.value)
            pos += m
            node = child
        if not values:
            return torch.empty(0, dtype=torch.int64), node
        return torch.cat(values), node

    def insert(self, ids: list[int], slots: torch.Tensor, ns=None) -> int:
        """Insert ``ids`` (length a multiple of the page size) with their ``slots`` into namespace
        ``ns`` (None: the base model's).

        Returns the length of the prefix that was already in the tree: the caller owns and must
        free its own slots in ``[own_prefix_len, returned)`` (duplicates), the tree takes the rest.
        With the cache disabled returns ``len(ids)`` (the tree takes nothing).
        """
        assert len(ids) == len(slots), "insert: ids and slots differ in length"
        assert len(ids) % self.page_size == 0, "insert: length not page aligned"
        if self.disabled:
            return len(ids)
        node, pos, t = self._ns_root(ns, create=bool(len(ids))), 0, next(self._clock)
        while pos < len(ids):
            key = self._child_key(ids, pos)
            child = node.children.get(key)
            if child is None:
                new = TreeNode(node, list(ids[pos:]), slots[pos:].clone())
                new.last_access = t
                node.children[key] = new
                self.evictable_size += len(new.key)
                return pos
            m = self._match_len(child.key, ids[pos:])
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = t
            pos += m
            node = child
        return pos

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node`` and its ancestors against eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock_ref`."""
        while node is not self.root:
            assert node.lock_ref > 0, "dec_lock_ref below zero"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, least recently used first.

        Returns the number of tokens freed (may be less when not enough is evictable).
        """
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            self.pool.free(leaf.value)
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def drop_namespace(self, ns) -> int:
        """Free every entry of namespace ``ns`` and forget it; returns the tokens freed. Only valid
        when none of its entries is locked (AssertionError otherwise)."""
        node = self.root.children.get(("ns", ns))
        if node is None:
            return 0
        assert node.lock_ref == 1, f"drop_namespace({ns!r}) with locked entries"
        freed, stack = 0, list(node.children.values())
        while stack:
            n = stack.pop()
            self.pool.free(n.value)
            freed += len(n.key)
            stack.extend(n.children.values())
        self.evictable_size -= freed
        del self.root.children[("ns", ns)]
        return freed

    def flush(self) -> None:
        """Free every slot of the tree and reset it. Only valid when nothing is locked."""
        assert self.protected_size == 0, "flush with locked nodes"
        for n in self._nodes():
            self.pool.free(n.value)
        self.reset()

    def total_size(self) -> int:
        return sum(len(n.key) for n in self._nodes())

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def tree_slots(self) -> list[int]:
        out = []
        for n in self._nodes():
            out.extend(n.value.tolist())
        return out

    def check_invariants(self) -> None:
        """Assert the tree's internal consistency (locks, sizes, key/value lengths, page alignment)."""
        ev = prot = 0
        for n in self._nodes():
            if self._is_ns_root(n):  # a namespace's root: no tokens, locked for good
                assert n.lock_ref >= 1 and all(n.lock_ref >= c.lock_ref for c in n.children.values())
                continue
            assert len(n.key) == len(n.value), "node key/value length mismatch"
            assert len(n.key) > 0, "empty non-root node"
            assert len(n.key) % self.page_size == 0, "node not page aligned"
            assert n.lock_ref >= 0, "negative lock_ref"
            assert n.parent.children.get(self._child_key(n.key, 0)) is n, "broken parent link"
            for c in n.children.values():
                assert n.lock_ref >= c.lock_ref, "child locked more than parent"
            if n.lock_ref == 0:
                ev += len(n.key)
            else:
                prot += len(n.key)
        assert ev == self.evictable_size, f"evictable_size {self.evictable_size} != {ev}"
        assert prot == self.protected_size, f"protected_size {self.protected_size} != {prot}"
