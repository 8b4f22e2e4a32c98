"""The router's ``/v1/responses``: a response's follow-ups (``previous_response_id``, retrieve,
delete, input items) go to the worker that created it, under round-robin routing that would
otherwise alternate workers; the affinity map is bounded."""
import httpx
import openai
import pytest

from sglite.router.app import RouterThread, request_text
from sglite.router.policy import RouterConfig
from sglite.router.responses_routes import ResponseAffinity


@pytest.fixture()
def two_workers():
    from sglite.server.runner import ServerThread
    from sglite.server.testing import FakeEngine

    engines = [FakeEngine(), FakeEngine()]
    servers = [ServerThread(e).start() for e in engines]
    yield engines, servers
    for s in servers:
        s.stop()


def test_previous_response_id_goes_to_the_worker_that_holds_it(two_workers):
    engines, servers = two_workers
    conf = RouterConfig(worker_urls=tuple(s.url for s in servers), port=0, policy="round_robin")
    with RouterThread(conf) as r:
        c = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=30)
        first = c.responses.create(model="fake-model", input="Hello", temperature=0, max_output_tokens=4)
        owner = next(i for i, e in enumerate(engines) if e.calls)
        for k in range(4):  # round robin alone would alternate workers
            nxt = c.responses.create(model="fake-model", input=f"more {k}", previous_response_id=first.id,
                                     max_output_tokens=4)
            assert nxt.previous_response_id == first.id and nxt.status == "incomplete"  # 4 tokens: cut
        assert len(engines[owner].calls) == 5 and not engines[1 - owner].calls
        assert c.responses.retrieve(first.id).id == first.id
        assert c.responses.input_items.list(first.id).data[0].content[0].text == "Hello"
        # a background response is polled and cancelled on its worker too
        bg = c.responses.create(model="fake-model", input="Hello", max_output_tokens=4, background=True)
        c.responses.cancel(bg.id)
        for _ in range(200):
            if c.responses.retrieve(bg.id).status not in ("queued", "in_progress"):
                break
        assert c.responses.retrieve(bg.id).status in ("cancelled", "incomplete")
        c.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve("resp_unknown")
        # streamed through the router: the same event sequence, ending with response.completed
        with c.responses.stream(model="fake-model", input="Hi", max_output_tokens=4, temperature=0) as s:
            types = [e.type for e in s]
        assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
        bad = httpx.post(r.url + "/v1/responses", json={"input": "x", "max_output_tokens": "many"})
        assert bad.status_code == 400  # checked against the server's model before forwarding


def test_affinity_map_is_bounded_lru_and_request_text():
    a = ResponseAffinity(max_size=2)
    a.remember("r1", 0)
    a.remember("r2", 1)
    assert a.worker("r1") == 0  # r1 is now the most recent
    a.remember("r3", 1)
    assert a.worker("r2") is None and a.worker("r1") == 0 and a.worker("r3") == 1 and a.worker(None) is None
    a.forget("r1")
    assert a.worker("r1") is None
    body = {"instructions": "S", "input": [{"role": "user", "content": "U"},
                                           {"type": "function_call_output", "call_id": "c", "output": "O"}]}
    assert request_text("/v1/responses", body) == "<system>S<user>U<function_call_output>O"
    assert request_text("/v1/responses", {"input": "hi"}) == "<user>hi"
