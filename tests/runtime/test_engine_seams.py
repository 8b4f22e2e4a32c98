"""The engine's internal seams without a model: LogprobOptions, OutputEvent deltas joined by
BatchView, the inbox messages handled by EngineLoop (over a fake scheduler), logging set-up."""
import logging
import threading

import pytest

from sglite.errors import InvalidRequestError
from sglite.runtime.engine_loop import EngineLoop
from sglite.runtime.engine_messages import Abort, Call, Stop, SubmitReqs
from sglite.runtime.engine_protocol import item_rid, matches_rid, sample_rid, sample_seed
from sglite.runtime.engine_stream import BatchView, OutputEvent
from sglite.runtime.logprob_options import LogprobOptions


# ----------------------------------------------------------------------------- LogprobOptions
@pytest.mark.parametrize("kw,field", [
    (dict(return_logprob="yes"), "return_logprob"),
    (dict(top_logprobs_num=21), "top_logprobs_num"),
    (dict(top_logprobs_num=True), "top_logprobs_num"),
    (dict(token_ids_logprob=5), "token_ids_logprob"),
    (dict(token_ids_logprob=[3, 100]), "token_ids_logprob"),
    (dict(token_ids_logprob=[True]), "token_ids_logprob"),
    (dict(logprob_start_len=-2), "logprob_start_len"),
    (dict(logprob_start_len=1.5), "logprob_start_len"),
])
def test_logprob_options_name_the_bad_field(kw, field):
    with pytest.raises(InvalidRequestError) as ei:
        LogprobOptions.from_args(vocab_size=100, **kw)
    assert ei.value.field == field and field in str(ei.value)


def test_logprob_options_round_trip():
    o = LogprobOptions.from_args(True, 2, 3, [4, 5], vocab_size=10)
    assert o.wants_input and o.token_ids_logprob == (4, 5)
    assert LogprobOptions.from_args(vocab_size=10, **o.to_kwargs()) == o
    assert LogprobOptions().to_kwargs() == {} and not LogprobOptions(True).wants_input
    with pytest.raises(InvalidRequestError, match="logprob_start_len"):
        o.with_start(9).check_prompt(8)


# ----------------------------------------------------------------------------- request ids and seeds
def test_rid_scheme():
    assert item_rid("r", 2) == "r-2" and sample_rid("r-2", 1) == "r-2-1"
    assert matches_rid("r-2-1", "r") and matches_rid("r", "r") and not matches_rid("r2", "r")
    assert sample_seed(5, 0) == 5 and sample_seed(5, 1) != sample_seed(6, 1) and 0 <= sample_seed(2 ** 70, 3) < 2 ** 62


# ----------------------------------------------------------------------------- deltas -> outputs
def _ev(text, ids, lps, finish=None):
    return OutputEvent(text, ids, {"id": "x", "completion_tokens": 0, "finish_reason": finish,
                                   "output_token_logprobs": lps})


def test_batch_view_cumulative_and_incremental():
    evs = [(0, _ev("He", [1], [[-1.0, 1, "He"]])), (1, _ev("A", [7], [[-0.5, 7, "A"]])),
           (0, _ev("llo", [2, 3], [[-2.0, 2, "l"], [-3.0, 3, "lo"]], {"type": "length", "length": 3})),
           (1, _ev("", [], [], {"type": "stop", "matched": 7}))]
    cum = BatchView(2)
    outs = [cum.view(i, ev) for i, ev in evs]
    assert [o["text"] for o in outs] == ["He", "A", "Hello", "A"]
    assert outs[2]["output_ids"] == [1, 2, 3] and len(outs[2]["meta_info"]["output_token_logprobs"]) == 3
    assert [o["index"] for o in outs] == [0, 1, 0, 1]
    outs[0]["output_ids"].append(99)  # callers may keep and mutate what they got
    assert cum.view(0, _ev("", [], []))["output_ids"] == [1, 2, 3]
    inc = BatchView(2, incremental=True)
    assert [inc.view(i, ev)["text"] for i, ev in evs] == ["He", "A", "llo", ""]
    assert "index" not in BatchView(1).view(0, _ev("a", [1], []))


# ----------------------------------------------------------------------------- EngineLoop
class _Req:
    def __init__(self, rid):
        self.rid, self.sink = rid, (lambda ev: None)


class FakeScheduler:
    """Just enough of the Scheduler for the loop: queues, step, abort, close."""

    def __init__(self):
        self.waiting, self.running, self.log = [], [], []
        self.closed = False

    def has_work(self):
        return bool(self.waiting)

    def add_request(self, r):
        self.waiting.append(r)
        self.log.append(("add", r.rid))

    def abort(self, rid):
        for r in [r for r in self.waiting if matches_rid(r.rid, rid)]:
            self.waiting.remove(r)
            r.sink(_ev("", [], [], {"type": "abort", "message": "aborted"}))
        self.log.append(("abort", rid))

    fail_steps = 0  # the next this many steps raise, as a broken forward would

    def step(self):
        if self.fail_steps:
            self.fail_steps -= 1
            self.running.extend(self.waiting)  # admitted, then the forward failed
            self.waiting.clear()
            raise RuntimeError("forward failed")
        r = self.waiting.pop(0)
        r.sink(_ev("done", [1], [], {"type": "length", "length": 1}))

    def abort_all(self, message, running_only=False):
        for r in list(self.running) + ([] if running_only else list(self.waiting)):
            (self.running if r in self.running else self.waiting).remove(r)
            r.sink(_ev("", [], [], {"type": "abort", "message": message}))

    def check_invariants(self):
        pass

    def close(self):
        self.closed = True


def test_loop_messages_and_rid_registry():
    sched = FakeScheduler()
    loop = EngineLoop(sched)
    try:
        done = threading.Event()
        got = []
        r = _Req("a")
        r.sink = lambda ev: (got.append(ev), done.set())
        assert loop.call(lambda: 41 + 1) == 42  # Call runs on the loop thread
        with pytest.raises(ZeroDivisionError):
            loop.call(lambda: 1 / 0)
        loop.submit([r])
        loop.wait(done)
        assert got[0].finished and got[0].text == "done"
        assert loop.call(lambda: sched.log) == [("add", "a")]
        loop.submit([_Req("b")])  # "a" finished: its rid is free again, "b" is new
        with pytest.raises(InvalidRequestError, match="rid"):
            loop.submit([_Req("c"), _Req("c")])
    finally:
        loop.stop()
    assert sched.closed and not loop.alive
    with pytest.raises(RuntimeError):
        loop.submit([_Req("z")])
    with pytest.raises(TypeError):
        loop.handle(("req", None))  # string-tagged tuples are gone


def test_a_failed_step_aborts_the_running_requests_and_the_loop_serves_on():
    sched = FakeScheduler()
    sched.fail_steps = 1
    loop = EngineLoop(sched)
    try:
        got, done = [], threading.Event()
        r = _Req("x")
        r.sink = lambda ev: (got.append(ev), done.set())
        loop.submit([r])
        loop.wait(done)
        fr = got[0].meta_info["finish_reason"]
        assert fr["type"] == "abort" and "forward failed" in fr["message"]
        assert loop.alive and loop.call(lambda: sched.running) == []
        done2 = threading.Event()
        r2 = _Req("x")  # the failed request's rid is free again
        r2.sink = lambda ev: done2.set()
        loop.submit([r2])
        loop.wait(done2)
    finally:
        loop.stop()
    assert not loop.alive


def test_messages_are_frozen_records():
    m = Abort("x")
    with pytest.raises(Exception):
        m.rid = "y"
    assert SubmitReqs((1,)).reqs == (1,) and isinstance(Stop(), Stop) and Call(len, None).fn is len


# ----------------------------------------------------------------------------- logging set-up
@pytest.fixture
def clean_sglite_logger():
    lg = logging.getLogger("sglite")
    saved = (list(lg.handlers), lg.level)
    lg.handlers = [h for h in lg.handlers if not getattr(h, "_sglite", False)]
    yield lg
    lg.handlers, lg.level = saved[0], saved[1]


def test_configure_is_idempotent(clean_sglite_logger):
    from sglite.logging_setup import configure

    before = len(clean_sglite_logger.handlers)
    configure("debug")
    configure("warning")
    assert len(clean_sglite_logger.handlers) == before + 1
    assert clean_sglite_logger.level == logging.WARNING
    with pytest.raises(ValueError, match="log_level"):
        configure("loud")


def test_configure_if_unset_respects_the_application(clean_sglite_logger):
    from sglite.logging_setup import configure_if_unset

    root = logging.getLogger()
    app_handler = logging.NullHandler()
    root.addHandler(app_handler)
    try:
        before = list(clean_sglite_logger.handlers)
        configure_if_unset("error")
        assert clean_sglite_logger.handlers == before  # the application's set-up wins
        assert clean_sglite_logger.level == logging.ERROR
    finally:
        root.removeHandler(app_handler)
