"""Run one program eagerly: the body runs in the caller's thread (or a background thread when
streaming) and its ops run in the state's executor thread (SGLang's ``run_program``).

The body runs exactly once. Its ops are held until its first value read (see
:class:`~sglite.frontend.executor.StreamExecutor`, ``defer``), so role errors and bad expressions
before that read raise from the body before any request is sent; no prefix trace is needed.
"""
from __future__ import annotations

import threading

from .executor import StreamExecutor
from .state import ProgramState


def run_program(func, arguments: dict, backend, defaults: dict, stream: bool = False) -> ProgramState:
    """Run ``func(s, **arguments)`` on ``backend``; returns its state.

    Without ``stream`` this returns when the program has finished; an exception raised by the
    body itself propagates, one raised by an op (a backend error) is in ``state.error()``.
    With ``stream`` it returns once the program's first ops reach the backend (its first value
    read, or the end of the body); an exception the body raises before that propagates as
    without ``stream`` (nothing was sent), later ones go to ``state.error()``.
    """
    ex = StreamExecutor(backend, defaults, stream, defer=True)
    done = threading.Event()
    state = ProgramState(ex, done)

    def body():
        try:
            state.ret_value = func(state, **arguments)
            ex.sync()
        finally:
            done.set()
            ex.mark_finished()
            ex.close()

    if not stream:
        body()
        return state

    early: list = []   # what the body raised before anything was sent

    def guarded():
        try:
            body()
        except Exception as e:  # reported through state.error(), or raised by run_program
            if ex.sent:
                ex.set_error(e)
            else:
                early.append(e)
        finally:
            ex.released.set()

    t = threading.Thread(target=guarded, daemon=True, name="sglite-program-body")
    state._body_thread = t
    t.start()
    ex.released.wait()
    if early:
        t.join()
        raise early[0]
    return state
