"""Run one program eagerly: the body runs in the caller's thread (or a background thread when
streaming) and its ops run in the state's executor thread (SGLang's ``run_program``)."""
from __future__ import annotations

import threading

from .executor import StreamExecutor
from .state import ProgramState


def run_program(func, arguments: dict, backend, defaults: dict, stream: bool = False) -> ProgramState:
    """Run ``func(s, **arguments)`` on ``backend``; returns its state.

    Without ``stream`` this returns when the program has finished; an exception raised by the
    body itself propagates, one raised by an op (a backend error) is in ``state.error()``.
    With ``stream`` it returns at once; body exceptions go to ``state.error()`` too.
    """
    ex = StreamExecutor(backend, defaults, stream)
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

    def guarded():
        try:
            body()
        except Exception as e:  # reported through state.error()
            ex.set_error(e)

    t = threading.Thread(target=guarded, daemon=True, name="sglite-program-body")
    state._body_thread = t
    t.start()
    return state
