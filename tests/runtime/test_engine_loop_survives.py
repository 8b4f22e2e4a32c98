"""The engine's loop thread survives callers that go away (a breaker's report): an asyncio caller
whose event loop closed while the engine still held its request killed the scheduler thread
(``call_soon_threadsafe`` on a closed loop raised in the abort's final event), after which
``generate`` raised and ``get_server_info`` hung forever."""
import asyncio

from sglite import Engine
from sglite.runtime.engine_loop import loop_sink


def test_a_sink_to_a_closed_event_loop_drops_its_events():
    loop = asyncio.new_event_loop()
    q: asyncio.Queue = asyncio.Queue()
    put = loop_sink(loop, q, 3)
    put("first")
    loop.run_until_complete(asyncio.sleep(0))
    assert q.get_nowait() == (3, "first")
    loop.close()
    put("after close")  # raised RuntimeError("Event loop is closed") on the engine's thread
    assert q.empty()


def test_callers_whose_event_loops_closed_leave_the_engine_serving(tiny_model_dir):
    with Engine(str(tiny_model_dir), dtype="float32", device="cpu", max_total_tokens=1024) as e:
        avail0 = e.get_server_info()["available_tokens"]
        want = e.generate("Hi", {"max_new_tokens": 4, "temperature": 0})["output_ids"]

        async def timed_out():
            try:
                await asyncio.wait_for(e.async_generate("Once upon", {"max_new_tokens": 64, "ignore_eos": True}),
                                       0.005)
            except asyncio.TimeoutError:
                pass

        async def walked_away():
            it = await e.async_generate("Once upon", {"max_new_tokens": 64, "ignore_eos": True}, stream=True)
            async for _ in it:
                break

        for _ in range(4):
            asyncio.run(timed_out())
            asyncio.run(walked_away())
        assert e._loop.alive
        out = e.generate("Hi", {"max_new_tokens": 4, "temperature": 0})
        assert out["output_ids"] == want
        info = e.get_server_info()  # hung forever once the loop thread had died
        assert info["running_requests"] == info["waiting_requests"] == 0
        assert info["available_tokens"] == avail0  # every aborted request's KV is back (or evictable)
        e.check_invariants()
