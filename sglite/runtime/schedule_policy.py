"""Admission order of waiting requests: ``fcfs``, ``lpm`` (longest prefix match) and ``dfs-weight``.

``lpm`` and ``dfs-weight`` are SGLang's cache-aware policies (SGLang paper, §3.2: a longest-
shared-prefix-first order approximates a DFS over the radix tree, maximising hit rate). Both fall
back to ``fcfs`` when the queue is longer than ``LONG_QUEUE`` (matching every request each step
would cost more than it saves) or when the radix cache is disabled.
"""
from __future__ import annotations

from collections import defaultdict

from .radix_cache import RadixCache
from .req import Req

LONG_QUEUE = 128


def order_waiting(policy: str, waiting: list[Req], cache: RadixCache) -> list[Req]:
    """Return ``waiting`` in admission order (does not mutate the list).

    Raises:
        ValueError: an unknown policy name.
    """
    if policy == "fcfs" or cache.disabled or len(waiting) > LONG_QUEUE or len(waiting) < 2:
        if policy not in ("fcfs", "lpm", "dfs-weight"):
            raise ValueError(f"unknown schedule_policy {policy!r}; known: ['fcfs', 'lpm', 'dfs-weight']")
        return list(waiting)
    matches = {}
    for r in waiting:
        slots, node = cache.match_prefix(r.seq[:-1], getattr(r, "cache_ns", None))
        matches[r.rid] = (len(slots), node)
    if policy == "lpm":
        return sorted(waiting, key=lambda r: -matches[r.rid][0])  # stable: ties keep FIFO
    if policy == "dfs-weight":
        # weight of a tree node = waiting requests whose match ends at or below it; visit heavier
        # subtrees first so requests sharing prefixes run back to back.
        by_node = defaultdict(list)
        for r in waiting:
            by_node[id(matches[r.rid][1])].append(r)
        weight = defaultdict(int)
        for r in waiting:
            n = matches[r.rid][1]
            while n is not None:
                weight[id(n)] += 1
                n = n.parent
        out, stack = [], [cache.root]
        while stack:
            n = stack.pop()
            out.extend(by_node.get(id(n), []))
            stack.extend(sorted(n.children.values(), key=lambda c: weight[id(c)]))
        return out
    raise ValueError(f"unknown schedule_policy {policy!r}; known: ['fcfs', 'lpm', 'dfs-weight']")
