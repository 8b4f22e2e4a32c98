"""Per-request caps and the waiting-queue bound (issue 26 §4): each is an EngineConfig field (a
flag), refused before any work is scheduled with an error naming the field and the limit; the
engine keeps serving and holds no KV afterwards."""
import threading
import time

import pytest

from sglite import Engine
from sglite.errors import InvalidRequestError, QueueFullError


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    e = Engine(str(tiny_model_dir), dtype="float32", device="cpu", max_total_tokens=2048, check_invariants=True,
               max_sequences_per_request=8, max_stop_strings=3, max_stop_string_length=10,
               max_running_requests=1, max_queued_requests=2)
    yield e
    e.shutdown()


def _free(e):
    info = e.get_server_info()
    return info["running_requests"] == 0 and info["waiting_requests"] == 0


def test_prompt_list_over_the_cap_is_refused_before_tokenizing(engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized a refused call"))
    with pytest.raises(InvalidRequestError, match="max_sequences_per_request=8") as e:
        engine.generate(["hi"] * 9, {"max_new_tokens": 1})
    assert e.value.field == "text"
    with pytest.raises(InvalidRequestError, match="max_sequences_per_request=8") as e:
        engine.generate(input_ids=[[1, 2]] * 9, sampling_params={"max_new_tokens": 1})
    assert e.value.field == "input_ids"


def test_prompts_times_n_over_the_cap(engine):
    with pytest.raises(InvalidRequestError, match="make 9 sequences.*max_sequences_per_request=8") as e:
        engine.generate(["a", "b", "c"], {"max_new_tokens": 1, "n": 3})
    assert e.value.field == "n"
    outs = engine.generate(["a", "b"], {"max_new_tokens": 1, "n": 4, "temperature": 0})  # 8: at the cap
    assert len(outs) == 8 and _free(engine)


@pytest.mark.parametrize("field,value,limit", [("stop", ["a", "b", "c", "d"], "max_stop_strings=3"),
                                               ("stop_regex", ["a", "b", "c", "d"], "max_stop_strings=3"),
                                               ("stop", ["x" * 11], "max_stop_string_length=10"),
                                               ("stop_regex", ["(a|b)*a(a|b){13}"], "max_stop_string_length=10")])
def test_stop_caps(engine, field, value, limit):
    with pytest.raises(InvalidRequestError, match=limit) as e:
        engine.generate("hi", {"max_new_tokens": 1, field: value})
    assert e.value.field == field
    assert engine.generate("hi", {"max_new_tokens": 2, field: value[:3] if len(value) > 1 else ["ab"]})["text"] is not None


def test_queue_bound_refuses_then_recovers(engine):
    """With the step loop held, two requests wait (the cap); a third is refused at once with
    QueueFullError; once the loop runs, both finish and a new request is served."""
    hold, held = threading.Event(), threading.Event()

    def block_loop():
        held.set()
        hold.wait(30)
    blocker = threading.Thread(target=lambda: engine._loop.call(block_loop))
    blocker.start()
    held.wait(30)
    outs, errors = [], []

    def call(i):
        try:
            outs.append(engine.generate(f"story {i}", {"max_new_tokens": 8, "temperature": 0}))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for _ in range(3000):  # at most 30 s
        if len(engine._loop._active) >= 2:
            break
        time.sleep(0.01)
    assert len(engine._loop._active) == 2
    try:
        with pytest.raises(QueueFullError, match="max_queued_requests=2") as e:
            engine.generate("one too many", {"max_new_tokens": 1})
        assert e.value.retry_after >= 1
    finally:
        hold.set()
    blocker.join()
    for t in threads:
        t.join()
    assert not errors and len(outs) == 2
    assert engine.generate("now there is room", {"max_new_tokens": 1})["text"] is not None
    assert _free(engine)
    engine.check_invariants()


def test_limits_are_flags_with_defaults():
    from sglite.config import EngineConfig

    cfg = EngineConfig()
    assert (cfg.max_queued_requests, cfg.max_sequences_per_request, cfg.max_stop_strings,
            cfg.max_stop_string_length) == (1024, 1024, 64, 256)
    with pytest.raises(InvalidRequestError, match="max_queued_requests"):
        EngineConfig(max_queued_requests=0)
