"""Grammar (rules of AST nodes) → a recursive transition network of lazy byte DFAs.

Every rule reference that is not recursive is inlined, so a non-recursive grammar (every regex, most
JSON schemas) becomes a single DFA (DESIGN §5 lead 2). A reference that closes a cycle makes its
target a *called rule*: it gets its own DFA and the reference becomes a call edge, executed by the
pushdown matcher (:mod:`.matcher`). Direct left recursion (``A ::= A x | y``) is rewritten to
``y x*``; remaining left recursion, unknown rules and rules that derive no string (a ``$ref`` cycle
without a base case) raise :class:`GrammarError`.
"""
from __future__ import annotations

from sglite.errors import GrammarError

from . import ast as A
from .dfa import LazyDFA
from .nfa import NFA


class Automaton:
    """Compiled grammar: ``dfas[rule]`` for the root and every called rule.

    Attributes:
        root: name of the start rule.
        dfas: dict rule name → :class:`LazyDFA` (one NFA each).
        has_calls: False when the grammar is one DFA (regex fast path).
    """

    def __init__(self, rules: dict, root: str, max_states: int = 250_000):
        if root not in rules:
            raise GrammarError(f"grammar has no root rule {root!r}")
        rules = {name: _drop_left_recursion(name, body) for name, body in rules.items()}
        self.root = root
        bodies = _inline(rules, root)
        nfas = {}
        for name, body in bodies.items():
            nfa = NFA(max_states)
            final = nfa.new()
            nfas[name] = (nfa, nfa.build(body, final), final)
        productive = _productive(nfas)
        if root not in productive:
            raise GrammarError(f"rule {root!r} derives no finite string (recursion without a base case?)")
        self.dfas = {}
        for name, (nfa, start, final) in nfas.items():
            if name in productive:
                for calls in nfa.calls:
                    calls[:] = [c for c in calls if c[0] in productive]
                self.dfas[name] = LazyDFA(nfa, start, final, coreachable(nfa, final))
        self.has_calls = len(self.dfas) > 1
        self._check_left_recursion()

    def _check_left_recursion(self):
        graph = {name: {r for r, _ in d.calls(d.start)} for name, d in self.dfas.items()}
        state: dict = {}

        def visit(n, path):
            if state.get(n) == 1:
                cyc = " -> ".join(path[path.index(n):] + [n])
                raise GrammarError(f"left recursion is not supported: {cyc}")
            if state.get(n) == 2:
                return
            state[n] = 1
            for m in graph.get(n, ()):
                visit(m, path + [n])
            state[n] = 2

        for n in graph:
            visit(n, [])


def _drop_left_recursion(name, body):
    alts = body[1] if body[0] == "alt" else (body,)
    rec, base = [], []
    for a in alts:
        items = a[1] if a[0] == "seq" else (a,)
        if items and items[0] == ("ref", name):
            rec.append(A.seq(*items[1:]))
        else:
            base.append(a)
    if not rec:
        return body
    if not base:
        raise GrammarError(f"rule {name!r} is left-recursive with no base alternative")
    return A.seq(A.alt(*base), A.star(A.alt(*rec)))


def _refs(node, out):
    kind = node[0]
    if kind == "ref":
        out.append(node[1])
    elif kind in ("seq", "alt"):
        for c in node[1]:
            _refs(c, out)
    elif kind == "rep":
        _refs(node[1], out)
    return out


def _inline(rules: dict, root: str) -> dict:
    """Inline non-recursive references; returns bodies of the root and the called rules."""
    called, queue, bodies, memo, seen = {root}, [root], {}, {}, {}

    def go(node, path):  # memoized on (node identity, path): AST is a DAG (shared suffixes)
        key = (id(node), path)
        hit = seen.get(key)
        if hit is not None and hit[0] is node:
            return hit[1]
        out = go1(node, path)
        seen[key] = (node, out)
        return out

    def go1(node, path):
        kind = node[0]
        if kind == "ref":
            name = node[1]
            if name not in rules:
                raise GrammarError(f"reference to undefined rule {name!r}")
            if name in called:
                return node
            if name in path:
                called.add(name)
                queue.append(name)
                return node
            if name not in memo:
                memo[name] = go(rules[name], path | {name})
            return memo[name]
        if kind in ("seq", "alt"):
            kids = tuple(go(c, path) for c in node[1])
            return node if all(a is b for a, b in zip(kids, node[1])) else (kind, kids)
        if kind == "rep":
            body = go(node[1], path)
            return node if body is node[1] else ("rep", body, node[2], node[3])
        return node

    while queue:
        name = queue.pop()
        if name not in bodies:
            bodies[name] = go(rules[name], frozenset({name}))
    return bodies


def _reaches_final(nfa: NFA, start: int, final: int, ok_rules) -> bool:
    seen, stack = {start}, [start]
    while stack:
        s = stack.pop()
        if s == final:
            return True
        nxt = list(nfa.eps[s]) + [t for _, _, t in nfa.edges[s]] + [t for r, t in nfa.calls[s] if r in ok_rules]
        for t in nxt:
            if t not in seen:
                seen.add(t)
                stack.append(t)
    return False


def _productive(nfas: dict) -> set:
    ok: set = set()
    changed = True
    while changed:
        changed = False
        for name, (nfa, start, final) in nfas.items():
            if name not in ok and _reaches_final(nfa, start, final, ok):
                ok.add(name)
                changed = True
    return ok


def coreachable(nfa: NFA, final: int) -> set:
    rev: list[list[int]] = [[] for _ in nfa.eps]
    for s in range(len(nfa.eps)):
        for t in nfa.eps[s]:
            rev[t].append(s)
        for _, _, t in nfa.edges[s]:
            rev[t].append(s)
        for _, t in nfa.calls[s]:
            rev[t].append(s)
    seen, stack = {final}, [final]
    while stack:
        for s in rev[stack.pop()]:
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return seen
