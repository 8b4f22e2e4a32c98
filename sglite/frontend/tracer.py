"""Tracer: runs a program body on a recording state and builds its request graph.

The graph is a ``networkx.DiGraph``. Nodes are integer ids in creation order (already a
topological order) with attributes ``op`` ∈ {text, gen, select, role, fork, join} and
``stream`` (0 = the main stream, fork branches get new ids), plus per kind: text — ``text``
(None when not constant), ``arg`` / ``var`` (what it reads); gen — ``name``, ``params``;
select — ``name``, ``choices``, ``method``; role — ``role``, ``phase`` (begin/end); fork —
``size``, ``branches`` (stream ids); join — ``mode``. Edges carry ``stream`` (consecutive ops
of one stream, fork → branch start, branch end → join) and ``data`` (an op reads a variable
an earlier gen/select/join produced) booleans.

Two modes: a full trace (``fn.trace()``: arguments without values become :class:`Argument`
placeholders, variable reads return :class:`VarRef`), and a *prefix* trace (``strict``) used
before running: it stops at the first read of a generated value, since what follows depends
on it. Source of the idea: SGLang's tracer.py / compiler.py.
"""
from __future__ import annotations

import networkx as nx

from sglite.errors import InvalidRequestError

from .ir import (Argument, Gen, RoleBegin, RoleEnd, Select, Text, VarRef, VarScopeBegin, VarScopeEnd,
                 flatten)
from .state import ForkGroupMixin, RoleMixin

MAX_TRACE_OPS = 20_000


class StopTrace(BaseException):
    """Raised inside a strict trace when the program reads a value only a backend can produce.

    A BaseException, so a broad ``except Exception`` in the program body cannot swallow it.
    """


class _TraceContext:
    def __init__(self, strict: bool, max_ops: int):
        self.graph = nx.DiGraph()
        self.strict = strict
        self.max_ops = max_ops
        self.next_stream = 1

    def new_node(self, **attrs) -> int:
        nid = self.graph.number_of_nodes()
        if nid >= self.max_ops:
            if self.strict:
                raise StopTrace("op limit")
            raise InvalidRequestError(f"trace: the program appended more than {self.max_ops} ops", field="trace")
        self.graph.add_node(nid, **attrs)
        return nid


class TracerState(RoleMixin):
    """Stands in for ProgramState while tracing; records ops as graph nodes."""

    def __init__(self, ctx: _TraceContext, stream: int, last=None, producers=None):
        self._ctx = ctx
        self._stream = stream
        self._last = last
        self._producers = dict(producers or {})
        self._scopes: dict = {}
        self.ret_value = None

    # ------------------------------------------------------------------ recording
    def _node(self, **attrs) -> int:
        nid = self._ctx.new_node(stream=self._stream, **attrs)
        if self._last is not None:
            self._ctx.graph.add_edge(self._last, nid, stream=True, data=False)
        self._last = nid
        return nid

    def _depend(self, src: int, dst: int) -> None:
        g = self._ctx.graph
        if g.has_edge(src, dst):
            g.edges[src, dst]["data"] = True
        else:
            g.add_edge(src, dst, stream=False, data=True)

    def __iadd__(self, expr):
        for op in flatten(expr):
            self._record(op)
        return self

    def _record(self, op) -> None:
        if isinstance(op, Text):
            self._node(op="text", text=op.value)
        elif isinstance(op, Argument):
            self._node(op="text", text=None, arg=op.name)
        elif isinstance(op, VarRef):
            nid = self._node(op="text", text=None, var=op.name)
            for src in op.sources:
                self._depend(src, nid)
        elif isinstance(op, (RoleBegin, RoleEnd)):
            self._node(op="role", role=op.role, phase="begin" if isinstance(op, RoleBegin) else "end")
        elif isinstance(op, Gen):
            nid = self._node(op="gen", name=op.name, params=dict(op.params))
            if op.name:
                self._producers[op.name] = (nid,)
        elif isinstance(op, Select):
            nid = self._node(op="select", name=op.name, method=op.choices_method.name,
                             choices=[c if isinstance(c, str) else None for c in op.choices])
            for c in op.choices:
                for src in getattr(c, "sources", ()):
                    self._depend(src, nid)
            if op.name:
                self._producers[op.name] = (nid,)
        elif isinstance(op, VarScopeBegin):
            self._scopes[op.name] = self._last
        elif isinstance(op, VarScopeEnd):
            self._scopes.pop(op.name, None)
            self._producers[op.name] = (self._last,) if self._last is not None else ()
        else:
            raise InvalidRequestError(f"trace: unknown op {type(op).__name__}", field="expr")

    def fork(self, size: int = 1, position_ids_offset=None) -> "TracerGroup":
        """Record a fork node and return ``size`` branch tracers."""
        if not isinstance(size, int) or size < 1:
            raise InvalidRequestError(f"fork: size must be an integer >= 1, got {size!r}", field="fork")
        ctx = self._ctx
        branches = list(range(ctx.next_stream, ctx.next_stream + size))
        ctx.next_stream += size
        nid = self._node(op="fork", size=size, branches=branches)
        children = [TracerState(ctx, b, nid, self._producers) for b in branches]
        return TracerGroup(children, self, nid)

    def copy(self) -> "TracerGroup":
        """``fork(1)``."""
        return self.fork(1)

    # ------------------------------------------------------------------ reading
    def get_var(self, name: str):
        """A :class:`VarRef` (full trace); stops a strict trace."""
        if self._ctx.strict:
            raise StopTrace(name)
        return VarRef(name, self._producers.get(name, ()))

    __getitem__ = get_var

    def set_var(self, name: str, value) -> None:
        """Record a variable set by the program itself (no producer node)."""
        self._producers[name] = ()

    __setitem__ = set_var

    def get_meta_info(self, name: str):
        """Meta info has no value while tracing: an empty dict (full) or a stop (strict)."""
        if self._ctx.strict:
            raise StopTrace(name)
        return {}

    def __contains__(self, name):
        if self._ctx.strict:
            raise StopTrace(name)
        return name in self._producers

    def _no_value(self, what: str):
        if self._ctx.strict:
            raise StopTrace(what)
        raise TypeError(f"{what}() has no value while tracing")

    def text(self):
        self._no_value("text")

    def messages(self):
        self._no_value("messages")

    def error(self):
        return None

    def sync(self):
        return None


class TracerGroup(ForkGroupMixin):
    """Fork branches while tracing (same ``+=`` forms as ProgramStateGroup)."""

    def __init__(self, states: list, parent: TracerState, fork_node: int):
        self.states, self.parent, self.fork_node = states, parent, fork_node

    def join(self, mode: str = "gather_variable") -> None:
        """Record a join node fed by every branch's last op; new branch variables now come from it."""
        parent = self.parent
        nid = parent._node(op="join", mode=mode, size=len(self.states))
        g = parent._ctx.graph
        for s in self.states:
            if s._last is not None and s._last != self.fork_node:
                g.add_edge(s._last, nid, stream=True, data=True)
            for k, src in s._producers.items():
                if parent._producers.get(k) != src:
                    parent._producers[k] = (nid,)


def trace_program(func, arguments: dict, strict: bool = False, max_ops: int = MAX_TRACE_OPS) -> nx.DiGraph:
    """Run ``func(s, **arguments)`` on a tracer and return the graph.

    ``graph.graph["complete"]`` is False when a strict trace stopped at a value read.

    Raises:
        whatever the body raises (a strict trace swallows only its own stop).
    """
    ctx = _TraceContext(strict, max_ops)
    root = TracerState(ctx, 0)
    ctx.graph.graph["complete"] = True
    try:
        root.ret_value = func(root, **arguments)
    except StopTrace:
        ctx.graph.graph["complete"] = False
    ctx.graph.graph["streams"] = ctx.next_stream
    return ctx.graph
