"""``Function.run`` runs a program's body exactly once (no prefix trace): ops are held until the
body's first value read, so errors before it still send nothing (FakeBackend, no model)."""
import threading

import pytest

import sglite
from sglite.errors import InvalidRequestError
from sglite.frontend.testing import FakeBackend


@pytest.fixture
def fb():
    return FakeBackend()


def _counting_program(calls: list):
    @sglite.function
    def prog(s, q):
        calls.append(q)  # a side effect of the body
        s += sglite.user(q)
        s += sglite.assistant(sglite.gen("a", max_tokens=6))
        first = s["a"]
        s += sglite.user("again: " + first)
        s += sglite.assistant(sglite.gen("b", max_tokens=6))
        return first
    return prog


def test_run_executes_the_body_once(fb):
    calls: list = []
    prog = _counting_program(calls)
    st = prog.run(q="hi", backend=fb)
    assert calls == ["hi"]
    assert st.ret_value == st["a"] and st["b"] and len(fb.calls("generate")) == 2
    prog(q="call", backend=fb)
    assert calls == ["hi", "call"]


def test_stream_run_executes_the_body_once(fb):
    calls: list = []
    prog = _counting_program(calls)
    st = prog.run(q="hi", backend=fb, stream=True)
    text = "".join(st.text_iter())
    assert text == st.text() and st["b"] and st.error() is None
    assert calls == ["hi"]


def test_run_batch_still_checks_every_item_first(fb):
    # run_batch traces (it needs every item checked and the shared prefix): item 2 is bad, so
    # item 1 sends nothing either
    @sglite.function
    def prog(s, bad):
        s += sglite.user("x") + sglite.assistant(sglite.gen("a", max_tokens=3))
        if bad:
            s += sglite.user_begin() + sglite.assistant_begin()

    with pytest.raises(InvalidRequestError, match="Nested roles"):
        prog.run_batch([{"bad": False}, {"bad": True}], backend=fb)
    assert fb.requests == []
    states = prog.run_batch([{"bad": False}, {"bad": False}], backend=fb)
    assert all(st["a"] for st in states)


def test_errors_before_the_first_read_send_nothing(fb):
    @sglite.function
    def nested(s):
        s += sglite.user("q") + sglite.assistant(sglite.gen("x", max_tokens=3))
        with s.user():
            s += sglite.assistant_begin()  # raises here, in the body

    @sglite.function
    def unmatched(s):
        s += "a" + sglite.gen("x", max_tokens=3) + sglite.user_end()

    @sglite.function
    def boom(s):
        s += "a" + sglite.gen("x", max_tokens=3)
        raise RuntimeError("the body failed before reading")

    for stream in (False, True):
        with pytest.raises(InvalidRequestError, match="Nested roles"):
            nested.run(backend=fb, stream=stream)
        with pytest.raises(InvalidRequestError, match="without a matching"):
            unmatched.run(backend=fb, stream=stream)
        with pytest.raises(RuntimeError, match="before reading"):
            boom.run(backend=fb, stream=stream)
    assert fb.requests == []


def test_errors_after_a_read_go_to_state_error(fb):
    @sglite.function
    def late(s):
        s += "a" + sglite.gen("x", max_tokens=3)
        s["x"]
        with s.user():
            s += sglite.assistant_begin()

    st = late.run(backend=fb)
    assert isinstance(st.error(), InvalidRequestError) and len(fb.calls("generate")) == 1


def test_held_ops_keep_order_and_fork_branches_stay_concurrent():
    barrier = threading.Barrier(3, timeout=10)

    def respond(prompt, sp):
        if prompt.endswith("branch "):
            barrier.wait()  # all three branches must be in flight at once
        return "ok"

    fb = FakeBackend(respond=respond)

    @sglite.function
    def prog(s):
        s += "intro " + sglite.gen("a", max_tokens=2) + " then "
        forks = s.fork(3)
        forks += "branch " + sglite.gen("b", max_tokens=2)
        forks.join()

    st = prog.run(backend=fb)
    assert st.error() is None and st["b"] == ["ok", "ok", "ok"]
    assert st.text() == "intro ok then "
    assert [r["prompt"] for r in fb.calls("generate")][0] == "intro "
