"""Compiler passes over a traced request graph (see :mod:`.tracer` for the graph's shape).

* :func:`check_roles` — nested or unmatched role blocks, found before any request is sent.
* :func:`constant_prefix` — the prompt text every run of the graph starts with (text and role
  ops of the main stream up to the first gen/select/fork/placeholder), rendered with the chat
  template.
* :func:`shared_prefix` / :func:`hoist_prefix` — the prefix a whole batch shares, prefilled
  once (``backend.cache_prefix``) before the batch fans out, so every program finds it in the
  radix cache (SGLang's ``enable_precache_with_tracing``; the SGLang paper, §3 and §4).
* :func:`stream_order` — the ops of one stream in execution order.
"""
from __future__ import annotations

import os

import networkx as nx

from sglite.errors import InvalidRequestError

from .chat_template import ChatTemplate, TextAssembler, role_transition

#: below this many characters a shared prefix is not worth a separate prefill (SGLang: 64)
MIN_HOIST_CHARS = 64


def stream_order(graph: nx.DiGraph, stream: int = 0) -> list:
    """Node ids of ``stream`` in execution order (ids are assigned in creation order)."""
    return sorted(n for n, a in graph.nodes(data=True) if a["stream"] == stream)


def check_roles(graph: nx.DiGraph) -> None:
    """Check that role blocks neither nest nor mismatch, in every stream.

    A fork branch starts inside whatever role its parent had open at the fork.

    Raises:
        InvalidRequestError: naming the two roles (``field="role"``).
    """
    open_role: dict = {0: None}
    for nid in sorted(graph.nodes):
        a = graph.nodes[nid]
        s, cur = a["stream"], open_role.get(a["stream"])
        if a["op"] == "role":
            open_role[s] = role_transition(cur, a["role"], a["phase"] == "begin")
        elif a["op"] == "fork":
            for b in a["branches"]:
                open_role[b] = cur


def constant_prefix(graph: nx.DiGraph, template: ChatTemplate) -> str:
    """The text the main stream holds when its first non-constant op runs."""
    asm = TextAssembler(template)
    for nid in stream_order(graph, 0):
        a = graph.nodes[nid]
        if a["op"] == "text" and a.get("text") is not None:
            asm.append(a["text"])
        elif a["op"] == "role":
            try:
                (asm.role_begin if a["phase"] == "begin" else asm.role_end)(a["role"])
            except InvalidRequestError:
                break
        else:
            break
    return asm.text


def shared_prefix(prefixes: list) -> str:
    """The longest common prefix of ``prefixes``, cut back to a token-friendly boundary.

    When the prefixes differ, the common part is cut just before its last space or newline,
    so the token that spans the cut (BPE tokens usually start with the space) is not split.
    """
    if not prefixes:
        return ""
    lcp = os.path.commonprefix(list(prefixes))
    if all(len(p) == len(lcp) for p in prefixes):
        return lcp
    cut = max(lcp.rfind(" "), lcp.rfind("\n"))
    return lcp[:cut] if cut > 0 else ""


def hoist_prefix(backend, prefixes: list, min_chars: int = MIN_HOIST_CHARS):
    """Prefill the prefix shared by ``prefixes`` once; returns it, or None when too short.

    Only worth it for two programs or more; errors from the backend propagate.
    """
    if len(prefixes) < 2:
        return None
    prefix = shared_prefix(prefixes)
    if len(prefix) < min_chars:
        return None
    backend.cache_prefix(prefix)
    return prefix
