"""Prefill/decode disaggregation when things go wrong, on 127.0.0.1 (tiny random models, servers
in threads): a failed prefill tells its decode peer at once, a model mismatch is refused and the
router falls back to a local prefill (same output), a client that leaves during the transfer is
not forwarded; in every case both servers' KV pools end with no page leaked or locked."""
import threading
import time

import httpx
import pytest

from sglite.server import disaggregation
from sglite.router.app import RouterThread
from sglite.router.policy import RouterConfig

pytestmark = pytest.mark.slow
SP = {"max_new_tokens": 6, "temperature": 0}
KW = dict(dtype="float32", max_total_tokens=2048, log_level="warning")


def kv_state(engine):
    """(free + evictable tokens, tokens in the radix tree) of ``engine``'s pool; asserts the pool
    and tree invariants (every page free, in the tree, or owned by a running request: none run)."""
    def fn():
        kv = engine.scheduler.kv
        kv.check_invariants([])
        return kv.available_tokens(), kv.cache.evictable_size
    return engine._loop.call(fn)  # noqa: SLF001


class PD:
    """A prefill and a decode server (ServerThread) on tiny engines; ``decode_model`` may differ."""

    def __init__(self, prefill_model, decode_model):
        from sglite import Engine
        from sglite.runtime.parallel.ports import free_port
        from sglite.server.runner import ServerThread

        self.bport = free_port()
        self.pre_e = Engine(str(prefill_model), disaggregation_mode="prefill",
                            disaggregation_bootstrap_port=self.bport, **KW)
        self.dec_e = Engine(str(decode_model), disaggregation_mode="decode", **KW)
        self.pre, self.dec = ServerThread(self.pre_e).start(), ServerThread(self.dec_e).start()
        self.total = (kv_state(self.pre_e)[0], kv_state(self.dec_e)[0])

    def router(self):
        return RouterThread(RouterConfig(pd_disaggregation=True, prefill_urls=((self.pre.url, self.bport),),
                                         decode_urls=(self.dec.url,), port=0))

    def assert_no_leak(self):
        assert (kv_state(self.pre_e)[0], kv_state(self.dec_e)[0]) == self.total

    def stats(self):
        return (httpx.get(self.pre.url + "/disagg/stats").json(), httpx.get(self.dec.url + "/disagg/stats").json())

    def close(self):
        for s in (self.pre, self.dec):
            s.stop()
        for e in (self.pre_e, self.dec_e):
            e.shutdown()


@pytest.fixture
def pd(tiny_model_dir):
    p = PD(tiny_model_dir, tiny_model_dir)
    yield p
    p.close()


def test_failed_prefill_stops_the_waiting_decode_server(pd):
    """The bootstrap handshake of a room whose prefill fails (prompt longer than the pool): the
    prefill server sends a failure header, the decode server answers 502 at once, no KV moves."""
    room = 12345
    out = {}

    def receive():
        out["dec"] = httpx.post(pd.dec.url + "/disagg/receive", json={
            "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bport, "bootstrap_room": room}, timeout=120)
    t = threading.Thread(target=receive)
    t0 = time.monotonic()
    t.start()
    rp = httpx.post(pd.pre.url + "/disagg/prefill", json={"input_ids": [5] * 4000, "bootstrap_room": room},
                    timeout=120)
    t.join(120)
    assert time.monotonic() - t0 < 60  # not the 600 s rendezvous timeout
    assert rp.status_code in (400, 502) and "error" in rp.json()
    assert out["dec"].status_code == 502
    assert "failed this request's prefill" in out["dec"].json()["error"]["message"]
    pre_stats, dec_stats = pd.stats()
    assert pre_stats["failed"] == 1 and pre_stats["sent"] == 0
    assert dec_stats == {"disaggregation_mode": "decode", "received": 0, "received_tokens": 0, "failed": 1,
                         "refused": 0, "connect_failed": 0, "invalid": 0}
    pd.assert_no_leak()
    # the handshake works again afterwards: a good prompt through the same rooms' store
    ids = pd.pre_e.tokenizer.encode("Once upon a time, in a small village,")
    t = threading.Thread(target=lambda: out.update(dec=httpx.post(pd.dec.url + "/disagg/receive", json={
        "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bport, "bootstrap_room": room + 1}, timeout=120)))
    t.start()
    rp = httpx.post(pd.pre.url + "/disagg/prefill", json={"input_ids": ids, "bootstrap_room": room + 1}, timeout=120)
    t.join(120)
    assert rp.status_code == 200 and out["dec"].status_code == 200
    assert out["dec"].json()["received_tokens"] == len(ids) == rp.json()["transferred_tokens"]
    pd.assert_no_leak()  # the imported KV sits unlocked in the decode server's radix cache
    assert kv_state(pd.dec_e)[1] > 0


def test_model_mismatch_is_refused_and_the_router_falls_back(tiny_model_dir, tmp_path):
    """Decode server of another model (3 layers): the transfer is refused (502 naming both
    shapes, nothing inserted), the router counts a failure and the decode server prefills itself: the answer is
    what that server alone generates."""
    from sglite.testing import make_tiny_llama

    other = make_tiny_llama(tmp_path / "three_layers", seed=0, vocab_from=tiny_model_dir, num_hidden_layers=3)
    p = PD(tiny_model_dir, other)
    try:
        text = "The capital of France is"
        want = p.dec_e.generate(text, SP)["output_ids"]
        p.dec_e.flush_cache()
        with p.router() as r:
            t0 = time.monotonic()
            got = httpx.post(r.url + "/generate", json={"text": text, "sampling_params": SP}, timeout=120)
            assert time.monotonic() - t0 < 60
            assert got.status_code == 200 and got.json()["output_ids"] == want
            info = httpx.get(r.url + "/get_server_info").json()["pd"]
            assert info["failures"] == 1 and info["transfers"] == 0
        pre_stats, dec_stats = p.stats()
        assert dec_stats["failed"] == 1 and dec_stats["received"] == 0
        assert pre_stats["sent"] == 0
        p.assert_no_leak()
    finally:
        p.close()


def test_client_leaving_during_the_transfer_is_not_forwarded(pd, monkeypatch):
    """Abort during transfer: the client disconnects while the KV is on its way; the transfer
    completes, the router counts the request as aborted and sends nothing to the decode server;
    no page stays locked on either side, and the next request works."""
    real = disaggregation.send_kv

    def slow_send(*a, **k):
        time.sleep(2.0)
        return real(*a, **k)
    monkeypatch.setattr(disaggregation, "send_kv", slow_send)
    text = "def fibonacci(n):\n    "
    served = pd.dec_e.get_server_info()["prompt_tokens"]  # prompt tokens the decode server admitted
    with pd.router() as r:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(r.url + "/generate", json={"text": text, "sampling_params": SP}, timeout=0.5)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = httpx.get(r.url + "/get_server_info").json()["pd"]
            if info["aborted"]:
                break
            time.sleep(0.2)
        assert info["aborted"] == 1 and info["transfers"] == 1 and info["failures"] == 0
        time.sleep(0.5)
        assert pd.dec_e.get_server_info()["prompt_tokens"] == served  # no generate reached it
        assert pd.stats()[1]["received"] == 1
        pd.assert_no_leak()
        monkeypatch.setattr(disaggregation, "send_kv", real)
        got = httpx.post(r.url + "/generate", json={"text": text, "sampling_params": SP}, timeout=120).json()
        assert got["meta_info"]["cached_tokens"] == got["meta_info"]["prompt_tokens"] - 1
        assert got["output_ids"] == pd.pre_e.generate(text, SP)["output_ids"]
    pd.assert_no_leak()


def test_concurrent_transfers_do_not_deadlock(pd):
    """Six rooms at once, the decode server joining them in the opposite order: every transfer
    completes (each has its own store connection; a shared one serialized the rendezvous waits
    and deadlocked two overlapping transfers)."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"Request {i}: tell me about the number {i} and its friends" for i in range(6)]
    ids = [pd.pre_e.tokenizer.encode(p) for p in prompts]
    rooms = list(range(1000, 1006))

    def receive(room):
        return httpx.post(pd.dec.url + "/disagg/receive", json={
            "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bport, "bootstrap_room": room}, timeout=90)

    def send(i):
        return httpx.post(pd.pre.url + "/disagg/prefill", json={"input_ids": ids[i], "bootstrap_room": rooms[i]},
                          timeout=90)
    t0 = time.monotonic()
    with ThreadPoolExecutor(12) as ex:
        recvs = [ex.submit(receive, r) for r in reversed(rooms)]
        sends = [ex.submit(send, i) for i in range(6)]
        rs, rr = [f.result() for f in sends], [f.result() for f in recvs][::-1]
    assert time.monotonic() - t0 < 80
    assert [r.status_code for r in rs + rr] == [200] * 12
    assert [r.json()["received_tokens"] for r in rr] == [len(x) for x in ids]
    pre_stats, dec_stats = pd.stats()
    assert pre_stats["sent"] == 6 and dec_stats["received"] == 6 and dec_stats["failed"] == 0
    pd.assert_no_leak()
