"""ProgramState (the ``s`` of a running program) and ProgramStateGroup (the result of ``s.fork``).

API as SGLang's ``ProgramState`` (interpreter.py): ``s += expr``, ``s[name]``, ``s.text()``,
``s.messages()``, ``s.get_meta_info(name)``, ``s.error()``, ``s.text_iter(name)``, role blocks
``with s.user(): ...`` or ``s.user(expr)``, ``s.var_scope(name)``, ``s.fork(n)``.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

from ..errors import InvalidRequestError
from .executor import StreamExecutor
from .ir import ExprList, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd


class RoleMixin:
    """``system/user/assistant(expr=None)`` and ``var_scope`` on a state (real or tracing).

    With ``expr`` the whole turn is appended at once; without, a context manager opens the
    role on enter and closes it on exit.
    """

    def _role(self, role: str, expr=None):
        if expr is not None:
            self += ExprList.of(RoleBegin(role), expr, RoleEnd(role))
            return None
        return self._role_scope(role)

    @contextlib.contextmanager
    def _role_scope(self, role: str):
        self += RoleBegin(role)
        yield self
        self += RoleEnd(role)

    def system(self, expr=None):
        """A system turn (call with an expression, or use as ``with s.system():``)."""
        return self._role("system", expr)

    def user(self, expr=None):
        """A user turn (call with an expression, or use as ``with s.user():``)."""
        return self._role("user", expr)

    def assistant(self, expr=None):
        """An assistant turn (call with an expression, or use as ``with s.assistant():``)."""
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str):
        """Capture the text appended inside the block into variable ``name``."""
        self += VarScopeBegin(name)
        yield self
        self += VarScopeEnd(name)


class ProgramState(RoleMixin):
    """State of one running program. Reads block until the value exists.

    ``stream=True`` runs keep the body in a background thread; reads from other threads wait
    for it. ``ret_value`` is what the program function returned.
    """

    def __init__(self, executor: StreamExecutor, body_done: Optional[threading.Event] = None):
        self._ex = executor
        self._body_done = body_done
        self._body_thread: Optional[threading.Thread] = None
        self.ret_value = None

    # ------------------------------------------------------------------ writing
    def __iadd__(self, expr):
        self._ex.submit(expr)
        return self

    def fork(self, size: int = 1, position_ids_offset=None) -> "ProgramStateGroup":
        """``size`` branches continuing from the current text; they run concurrently.

        When ``size > 1`` the shared prefix is prefilled once (``backend.cache_prefix``) before
        any branch runs, so every branch, the first included, finds it cached.

        Raises:
            InvalidRequestError: ``size`` not an integer >= 1 (field ``fork``).
        """
        if not isinstance(size, int) or size < 1:
            raise InvalidRequestError(f"fork: size must be an integer >= 1, got {size!r}", field="fork")
        self._ex.sync()
        if size > 1 and self._ex.asm.text and self._ex.error() is None:
            self._ex.backend.cache_prefix(self._ex.asm.text)
        return ProgramStateGroup([ProgramState(self._ex.fork_child()) for _ in range(size)], self)

    def copy(self) -> "ProgramStateGroup":
        """``fork(1)``."""
        return self.fork(1)

    # ------------------------------------------------------------------ reading
    def _in_body(self) -> bool:
        return self._body_thread is None or threading.current_thread() is self._body_thread

    def sync(self) -> None:
        """Wait until every op appended so far (and, from outside the body, the body) has finished."""
        if self._body_done is not None and not self._in_body():
            self._body_done.wait()
        self._ex.sync()

    def _wait_var(self, name: str) -> None:
        if self._in_body():
            self._ex.sync()
            return
        with self._ex.cond:
            self._ex.cond.wait_for(lambda: name in self._ex.var_done or self._ex.finished
                                   or self._ex.error() is not None)

    def get_var(self, name: str):
        """The value of variable ``name`` (blocks until produced).

        Raises:
            KeyError: the program did not produce it (the message carries the program's error, if any).
        """
        self._wait_var(name)
        if name in self._ex.variables:
            return self._ex.variables[name]
        err = self._ex.error()
        if err is not None:
            raise KeyError(f"variable {name!r} was not produced: the program failed with {err!r}") from err
        raise KeyError(f"variable {name!r} was not produced; known: {sorted(self._ex.variables)}")

    __getitem__ = get_var

    def set_var(self, name: str, value) -> None:
        """Set variable ``name``."""
        self._ex.set_var(name, value)

    __setitem__ = set_var

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._ex.variables

    def get_meta_info(self, name: str):
        """Meta of variable ``name``: the backend's meta_info for a gen (a list when ``n > 1``),
        the ChoicesDecision meta for a select (``normalized_prompt_logprobs`` of every choice, …)."""
        self._wait_var(name)
        if name not in self._ex.meta_info:
            self.get_var(name)  # raises the informative KeyError
        return self._ex.meta_info.get(name)

    def text(self) -> str:
        """The whole program text (after syncing)."""
        self.sync()
        return self._ex.asm.text

    def messages(self) -> list:
        """The chat turns so far as OpenAI-style ``{"role", "content"}`` dicts (after syncing)."""
        self.sync()
        return [dict(m) for m in self._ex.asm.messages]

    def variables(self) -> dict:
        """All variables (after syncing)."""
        self.sync()
        return dict(self._ex.variables)

    def error(self) -> Optional[BaseException]:
        """The exception the program raised while running, or None."""
        self.sync()
        return self._ex.error()

    def text_iter(self, var_name: Optional[str] = None) -> Iterator[str]:
        """Yield the text (or one variable's text) as it is produced.

        In a ``stream=True`` run the chunks join to exactly ``text()`` (or the variable's
        final value); otherwise the final value is yielded once.
        """
        ex = self._ex
        if not ex.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return

        def source():
            return ex.chunks if var_name is None else ex.var_chunks.get(var_name, [])

        def done():
            return (ex.finished or ex.error() is not None
                    or (var_name is not None and var_name in ex.var_done))
        pos = 0
        while True:
            with ex.cond:
                ex.cond.wait_for(lambda: len(source()) > pos or done())
                new = source()[pos:]
                pos += len(new)
                last = done() and pos == len(source())
            yield from new
            if last:
                return

    async def text_async_iter(self, var_name: Optional[str] = None, return_meta_data: bool = False):
        """:meth:`text_iter` as an async iterator (SGLang's ``text_async_iter``): the blocking
        waits run in the event loop's default executor, so other tasks keep running.

        With ``return_meta_data`` each item is ``(chunk, meta)``: the last one carries the
        variable's final meta_info (the backend's), earlier ones ``{}`` (one chunk is held back
        to know which is last); ``{}`` throughout for the whole text (``var_name=None``).
        """
        import asyncio

        it = self.text_iter(var_name)
        loop = asyncio.get_running_loop()
        end = object()
        held = end
        while True:
            chunk = await loop.run_in_executor(None, next, it, end)
            if not return_meta_data:
                if chunk is end:
                    return
                yield chunk
                continue
            if chunk is end:
                if held is not end:
                    yield held, (self._ex.meta_info.get(var_name) or {}) if var_name is not None else {}
                return
            if held is not end:
                yield held, {}
            held = chunk

    def __repr__(self):
        return f"ProgramState(text={self._ex.asm.text[-80:]!r}, vars={sorted(self._ex.variables)})"


class ForkGroupMixin:
    """Branch access and ``+=`` broadcasting shared by run-time and traced fork groups
    (``forks += expr`` broadcasts, ``forks += [e0, e1, …]`` one per branch,
    ``forks += lambda i: …`` builds one per branch). Subclasses set ``self.states``."""

    def __getitem__(self, i: int):
        return self.states[i]

    def __setitem__(self, i, value):
        # ``forks[i] += expr`` assigns the (same) branch back
        if value is not self.states[i]:
            raise TypeError("fork branches cannot be replaced")

    def __len__(self):
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, other):
        if callable(other) and not hasattr(other, "__add__"):
            for i, s in enumerate(self.states):
                s += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise InvalidRequestError(f"fork: got {len(other)} expressions for {len(self.states)} branches",
                                          field="fork")
            for s, e in zip(self.states, other):
                s += e
        else:
            for s in self.states:
                s += other
        return self


class ProgramStateGroup(ForkGroupMixin):
    """The branches of ``s.fork(n)``. ``forks += expr`` broadcasts; ``forks += [e0, e1, …]``
    gives each branch its own; ``forks += lambda i: …`` builds one per branch."""

    def __init__(self, states: list, parent: ProgramState):
        self.states = states
        self.parent = parent

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch, then merge into the parent.

        ``gather_variable`` (default): each variable created in the branches becomes a list on
        the parent, in branch order (missing ones are None); the parent text is unchanged.
        ``concate_and_append``: each branch's new text is appended to the parent, in order.

        Raises:
            InvalidRequestError: unknown mode (field ``join``).
        """
        if mode not in ("gather_variable", "concate_and_append"):
            raise InvalidRequestError(f"join: mode must be 'gather_variable' or 'concate_and_append', got {mode!r}",
                                      field="join")
        pex = self.parent._ex
        for s in self.states:
            s._ex.sync()
            if s._ex.error() is not None:
                pex.set_error(s._ex.error())
        if mode == "gather_variable":
            names: list = []
            for s in self.states:
                names += [k for k in s._ex.variables if k not in pex.variables and k not in names]
            for k in names:
                pex.set_var(k, [s._ex.variables.get(k) for s in self.states],
                            [s._ex.meta_info.get(k) for s in self.states])
        else:
            for s in self.states:
                self.parent += s._ex.asm.text[s._ex.fork_start:]
        for s in self.states:
            s._ex.close()

    def text(self) -> list:
        """Each branch's whole text."""
        return [s.text() for s in self.states]

