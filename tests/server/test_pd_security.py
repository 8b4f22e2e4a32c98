"""Prefill/decode transfers as an attacker on the network would try them (issue 26, finding 1 and 3),
on 127.0.0.1 only: the decode server connects only to loopback or configured peers, a shared
secret makes each transfer need a one-time token and a peer that proves the secret, every
received header / id / K/V value is checked before the radix cache sees it, connection attempts
fail in seconds (counted), the router forwards ``Authorization``, the bootstrap store listens on
the configured interface only, and a server not in P/D mode has no ``/disagg`` routes."""
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.sockets import listening
import torch

from sglite.config import EngineConfig, parse_peers
from sglite.errors import InvalidRequestError
from sglite.server import disaggregation as pd
from sglite.server.disaggregation import (Bootstrap, TokenCheck, TransferError, TransferRefused, check_peer,
                                          connect_store, issue_token, load_secret, open_room, recv_kv, send_kv)

SECRET = b"0123456789abcdef-test-secret"


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc (Linux)")


# ---------------------------------------------------------------- tokens, peers, secrets (unit)
def test_tokens_are_one_time_bound_to_the_room_and_expire():
    tok, exp = issue_token(SECRET, 7, ttl=60, now=1000.0)
    check = TokenCheck(SECRET, ttl=60)
    check.verify(7, tok, now=1001.0)
    with pytest.raises(TransferRefused, match="already used"):
        check.verify(7, tok, now=1002.0)
    with pytest.raises(TransferRefused, match="invalid"):
        TokenCheck(SECRET, 60).verify(8, tok, now=1001.0)  # another room
    with pytest.raises(TransferRefused, match="invalid"):
        TokenCheck(b"another-secret-of-16+bytes", 60).verify(7, tok, now=1001.0)
    with pytest.raises(TransferRefused, match="expired"):
        TokenCheck(SECRET, 60).verify(7, tok, now=exp + 5.0)
    forged = tok.split(".")[0] + "." + "0" * 64
    for bad in (None, "", "x", forged, f"{exp + 1}.{tok.split('.')[1]}"):
        with pytest.raises(TransferRefused, match="transfer_token"):
            TokenCheck(SECRET, 60).verify(7, bad, now=1001.0)
    far, _ = issue_token(SECRET, 9, ttl=10_000, now=1000.0)
    with pytest.raises(TransferRefused, match="disaggregation_token_ttl"):
        TokenCheck(SECRET, 60).verify(9, far, now=1001.0)


def test_peers_default_to_loopback_and_name_the_flag():
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        check_peer(host, 8998, None)
    for host in ("10.0.0.5", "0.0.0.0", "example.com", "169.254.169.254"):
        with pytest.raises(TransferRefused, match="--disaggregation-peers"):
            check_peer(host, 8998, None)
    peers = parse_peers("10.0.0.5:8998, [fe80::1]:9000,Prefill-A:8998")
    check_peer("10.0.0.5", 8998, peers)
    check_peer("fe80::1", 9000, peers)
    check_peer("prefill-a", 8998, peers)
    for host, port in (("10.0.0.5", 8999), ("127.0.0.1", 8998), ("10.0.0.6", 8998)):
        with pytest.raises(TransferRefused, match="--disaggregation-peers"):
            check_peer(host, port, peers)
    for bad in ("10.0.0.5", "h:0", ":80", "h:x", ","):
        with pytest.raises(InvalidRequestError) as ei:
            EngineConfig(disaggregation_peers=bad)
        assert ei.value.field == "disaggregation_peers"


def test_secret_from_file_or_env_and_its_minimum_length(tmp_path, monkeypatch):
    monkeypatch.delenv(pd.SECRET_ENV, raising=False)
    assert load_secret(None) is None
    monkeypatch.setenv(pd.SECRET_ENV, "short")
    with pytest.raises(InvalidRequestError, match="at least 16") as ei:
        load_secret(None)
    assert ei.value.field == "disaggregation_secret_file"
    monkeypatch.setenv(pd.SECRET_ENV, SECRET.decode())
    assert load_secret(None) == SECRET
    f = tmp_path / "secret"
    f.write_bytes(b"file-secret-0123456789\n")
    f.chmod(0o600)
    assert load_secret(str(f)) == b"file-secret-0123456789"  # the file wins over the environment
    with pytest.raises(InvalidRequestError) as ei:
        EngineConfig(disaggregation_secret_file=str(tmp_path / "missing"))
    assert ei.value.field == "disaggregation_secret_file"
    for name in ("disaggregation_connect_timeout", "disaggregation_token_ttl"):
        with pytest.raises(InvalidRequestError) as ei:
            EngineConfig(**{name: 0})
        assert ei.value.field == name


# ---------------------------------------------------------------- the wire (in process, loopback)
@pytest.fixture(scope="module")
def store():
    from sglite.runtime.parallel.control import bound_tcp_store

    return bound_tcp_store("127.0.0.1", 0)


_rooms = iter(range(10_000, 20_000))


def exchange(store, send, *, secret=None, dtype=torch.float32, shape=(2, 2, 4), vocab=100, max_tokens=64):
    """Run ``send(pg, room)`` as the prefill side (a thread) against :func:`recv_kv`; returns what
    recv_kv returned, or raises what it raised. The sender must not hang once the receiver stops."""
    room = next(_rooms)
    sender_done = threading.Event()

    def sender():
        try:
            send(open_room(connect_store("127.0.0.1", store.port, 5), room, 0, 5, "127.0.0.1"), room)
        except Exception:  # noqa: BLE001 - the receiver refused and closed the connection
            pass
        finally:
            sender_done.set()
    t = threading.Thread(target=sender, daemon=True)
    t.start()
    pg = open_room(connect_store("127.0.0.1", store.port, 5), room, 1, 5, "127.0.0.1")
    try:
        return recv_kv(pg, room, dtype, shape, vocab, max_tokens, secret)
    finally:
        pg.close()
        assert sender_done.wait(30), "the sender still blocks after the receiver gave up"


def kv(n, L=2, H=2, D=4, dtype=torch.float32):
    return torch.randn(L, n, H, D).to(dtype), torch.randn(L, n, H, D).to(dtype)


def test_a_valid_payload_is_received(store):
    k, v = kv(3)
    ids, k2, v2 = exchange(store, lambda pg, room: send_kv(pg, room, [1, 2, 99], k, v))
    assert ids == [1, 2, 99] and torch.equal(k2, k) and torch.equal(v2, v)
    k, v = kv(3)
    ids, _, _ = exchange(store, lambda pg, room: send_kv(pg, room, [4, 5, 6], k, v, SECRET), secret=SECRET)
    assert ids == [4, 5, 6]


@pytest.mark.parametrize("case, match", [
    ("id_over_vocab", "outside the vocabulary"),
    ("negative_id", "outside the vocabulary"),
    ("layers", "not the same model"),
    ("head_dim", "not the same model"),
    ("dtype", "not the same model and dtype"),
    ("too_many_tokens", "at most 64"),
    ("nan_k", "non-finite"),
    ("inf_v", "non-finite"),
    ("no_secret_proof", "did not prove"),
])
def test_a_bad_payload_is_a_transfer_error(store, case, match):
    """Nothing the peer sends reaches the caller unchecked: the header against this pool, the
    ids against the vocabulary, the values for finiteness, the peer against the secret."""
    n, ids = 3, [1, 2, 3]
    k, v = kv(n)
    secret = None
    if case == "id_over_vocab":
        ids = [1, 100, 2]
    elif case == "negative_id":
        ids = [1, -1, 2]
    elif case == "layers":
        k, v = kv(n, L=3)
    elif case == "head_dim":
        k, v = kv(n, D=8)
    elif case == "dtype":
        k, v = kv(n, dtype=torch.float16)
    elif case == "too_many_tokens":
        n, ids = 65, list(range(65))
        k, v = kv(n)
    elif case == "nan_k":
        k[1, 2, 0, 3] = float("nan")
    elif case == "inf_v":
        v[0, 0, 1, 1] = float("inf")
    elif case == "no_secret_proof":
        secret = SECRET
    with pytest.raises(TransferError, match=match):
        exchange(store, lambda pg, room: send_kv(pg, room, ids, k, v), secret=secret)


def test_a_peer_that_never_joins_fails_in_seconds(store):
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="disaggregation_connect_timeout"):
        open_room(connect_store("127.0.0.1", store.port, 5), next(_rooms), 1, 1.0, "127.0.0.1")
    assert time.monotonic() - t0 < 10


def test_connecting_to_a_closed_port_fails_at_once():
    from sglite.runtime.parallel.ports import free_port

    t0 = time.monotonic()
    with pytest.raises(TransferError, match="cannot reach"):
        connect_store("127.0.0.1", free_port(), 10.0)
    assert time.monotonic() - t0 < 5


@needs_proc
def test_the_bootstrap_store_listens_on_the_configured_interface_only():
    from sglite.runtime.parallel.ports import free_port

    boot = Bootstrap(free_port())  # the default: loopback
    mine = [a for a in listening([os.getpid()]) if a[1] == boot.port]
    assert mine == [("127.0.0.1", boot.port)], mine
    client = boot.connect()
    client.set("k", b"v")
    assert boot.server.get("k") == b"v"


def test_routes_exist_only_in_pd_mode():
    from fastapi.testclient import TestClient

    from sglite.server.app import create_app
    from sglite.server.testing import FakeEngine

    with TestClient(create_app(FakeEngine())) as c:
        for path in ("/disagg/receive", "/disagg/prefill", "/disagg/token"):
            assert c.post(path, json={"bootstrap_room": 1, "bootstrap_host": "127.0.0.1",
                                      "bootstrap_port": 1}).status_code == 404
        assert c.get("/disagg/stats").status_code == 404
        paths = c.app.openapi()["paths"]
        assert "/generate" in paths and not [p for p in paths if p.startswith("/disagg")]


# ---------------------------------------------------------------- servers (slow)
KW = dict(dtype="float32", max_total_tokens=2048, log_level="warning")
SP = {"max_new_tokens": 6, "temperature": 0}


def evictable(engine) -> int:
    return engine._loop.call(lambda: engine.scheduler.kv.cache.evictable_size)  # noqa: SLF001


@pytest.fixture(scope="module")
def plain_decode(tiny_model_dir):
    """A decode server with no P/D configuration (loopback peers only, no secret), connect
    timeout 1 s."""
    from sglite import Engine
    from sglite.server.runner import ServerThread

    e = Engine(str(tiny_model_dir), disaggregation_mode="decode", disaggregation_connect_timeout=1.0, **KW)
    s = ServerThread(e).start()
    yield e, s
    s.stop()
    e.shutdown()


def receive(url, host, port, room, token=None, headers=None, timeout=60):
    body = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    if token is not None:
        body["transfer_token"] = token
    return httpx.post(url + "/disagg/receive", json=body, headers=headers or {}, timeout=timeout)


@pytest.mark.slow
def test_non_loopback_peers_are_refused_without_a_connection(plain_decode):
    e, s = plain_decode
    before = httpx.get(s.url + "/disagg/stats").json()
    t0 = time.monotonic()
    for host in ("10.255.255.1", "192.0.2.1", "example.com"):
        r = receive(s.url, host, 8998, 5)
        assert r.status_code == 403 and "--disaggregation-peers" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5  # nothing was connected to
    after = httpx.get(s.url + "/disagg/stats").json()
    assert after["refused"] - before["refused"] == 3 and after["connect_failed"] == before["connect_failed"]


@pytest.mark.slow
def test_64_receives_to_a_closed_port_do_not_hold_the_transfer_threads(plain_decode):
    """The blind port probe of finding 1: 64 requests to a closed port all answer 502 in seconds
    (counted in connect_failed), a port that accepts but never speaks fails within the connect
    timeout, and a real transfer still goes through at once afterwards."""
    from sglite.runtime.parallel.ports import free_port

    e, s = plain_decode
    before = httpx.get(s.url + "/disagg/stats").json()
    closed = free_port()
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as ex:
        codes = list(ex.map(lambda i: receive(s.url, "127.0.0.1", closed, 100 + i).status_code, range(64)))
    assert codes == [502] * 64
    assert time.monotonic() - t0 < 30
    with socket.socket() as silent:  # accepts connections (kernel backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        t0 = time.monotonic()
        r = receive(s.url, "127.0.0.1", silent.getsockname()[1], 999)
        assert r.status_code == 502 and time.monotonic() - t0 < 15
    after = httpx.get(s.url + "/disagg/stats").json()
    assert after["connect_failed"] - before["connect_failed"] == 65
    assert httpx.get(s.url + "/health", timeout=5).status_code == 200


def attacker(store, send):
    """Play a prefill server on ``store`` (a bootstrap store on loopback) in a thread: ``send(pg, room)``."""
    def run(room):
        try:
            send(open_room(connect_store("127.0.0.1", store.port, 5), room, 0, 5, "127.0.0.1"), room)
        except Exception:  # noqa: BLE001 - refused: the receiver closed the connection
            pass
    return run


@pytest.mark.slow
def test_poisoned_kv_from_a_loopback_store_never_reaches_the_cache(plain_decode, store):
    """An attacker with a store on the decode machine sends ids outside the vocabulary or NaN K/V
    for a prompt's ids: 502 and the radix cache holds nothing of it."""
    e, s = plain_decode
    ids = e.tokenizer.encode("The capital of France is")
    L, H, D = e.kv_layout()[1]
    cases = {"outside the vocabulary": (ids[:-1] + [10 ** 9], torch.zeros(L, len(ids), H, D)),
             "non-finite": (ids, torch.full((L, len(ids), H, D), float("nan")))}
    for i, (match, (send_ids, kt)) in enumerate(cases.items()):
        room = 50_000 + i
        t = threading.Thread(target=attacker(store, lambda pg, r: send_kv(pg, r, send_ids, kt, kt)), args=(room,))
        t.start()
        r = receive(s.url, "127.0.0.1", store.port, room)
        t.join(30)
        assert r.status_code == 502 and match in r.json()["error"]["message"]
    assert evictable(e) == 0
    assert e.export_prefix(ids)[0] == []


@pytest.fixture(scope="module")
def secured(tiny_model_dir, tmp_path_factory):
    """Prefill + decode servers with ``--api-key``, the same secret file and (decode) a peer list
    naming the prefill's bootstrap store and one more loopback port (for an attacker's store)."""
    from sglite import Engine
    from sglite.runtime.parallel.ports import free_port
    from sglite.server.runner import ServerThread
    from sglite.server.settings import ServerConfig

    f = tmp_path_factory.mktemp("pdsecret") / "secret"
    f.write_bytes(SECRET)
    f.chmod(0o600)
    bport, aport = free_port(), free_port()
    common = dict(disaggregation_secret_file=str(f), disaggregation_connect_timeout=2.0, **KW)
    pre_e = Engine(str(tiny_model_dir), disaggregation_mode="prefill", disaggregation_bootstrap_port=bport, **common)
    dec_e = Engine(str(tiny_model_dir), disaggregation_mode="decode",
                   disaggregation_peers=f"127.0.0.1:{bport},127.0.0.1:{aport}", **common)
    conf = ServerConfig(port=0, api_key="sk-pd")
    pre, dec = ServerThread(pre_e, conf).start(), ServerThread(dec_e, conf).start()
    yield {"pre_e": pre_e, "dec_e": dec_e, "pre": pre, "dec": dec, "bport": bport, "aport": aport}
    for x in (pre, dec):
        x.stop()
    for x in (pre_e, dec_e):
        x.shutdown()


AUTH = {"Authorization": "Bearer sk-pd"}


@pytest.mark.slow
def test_router_forwards_authorization_and_obtains_a_token(secured):
    """With --api-key on both P/D servers the router's transfer goes through (it forwards the
    client's Authorization and fetches a transfer token); without a key the fallback is counted
    in ``unauthorized`` and logged, not silent."""
    from sglite.router.app import RouterThread
    from sglite.router.policy import RouterConfig

    pre, dec = secured["pre"], secured["dec"]
    conf = RouterConfig(pd_disaggregation=True, prefill_urls=((pre.url, secured["bport"]),),
                        decode_urls=(dec.url,), port=0)
    text = "Once upon a time, in a small village,"
    with RouterThread(conf) as r:
        got = httpx.post(r.url + "/generate", json={"text": text, "sampling_params": SP}, headers=AUTH, timeout=120)
        assert got.status_code == 200
        assert got.json()["meta_info"]["cached_tokens"] == got.json()["meta_info"]["prompt_tokens"] - 1
        pairing = r.app.state.pairing
        assert (pairing.transfers, pairing.failures, pairing.unauthorized) == (1, 0, 0)
        nokey = httpx.post(r.url + "/generate", json={"text": "x y z", "sampling_params": SP}, timeout=120)
        assert nokey.status_code == 401
        assert (pairing.failures, pairing.unauthorized) == (1, 1)
    assert got.json()["output_ids"] == secured["pre_e"].generate(text, SP)["output_ids"]
    assert httpx.get(pre.url + "/disagg/stats", headers=AUTH).json()["tokens_issued"] >= 1


@pytest.mark.slow
def test_with_a_secret_receives_need_a_fresh_token(secured):
    pre, dec = secured["pre"], secured["dec"]
    bport = secured["bport"]
    for token in (None, "123.abc", issue_token(b"not-the-deployment-secret", 77, 60)[0]):
        r = receive(dec.url, "127.0.0.1", bport, 77, token, AUTH)
        assert r.status_code == 403 and "transfer_token" in r.json()["error"]["message"]
    tok = httpx.post(pre.url + "/disagg/token", json={"bootstrap_room": 78}, headers=AUTH).json()["token"]
    r1 = receive(dec.url, "127.0.0.1", bport, 78, tok, AUTH)  # no prefill comes: 502 after the 2 s timeout
    assert r1.status_code == 502 and "did not join" in r1.json()["error"]["message"]
    r2 = receive(dec.url, "127.0.0.1", bport, 78, tok, AUTH)
    assert r2.status_code == 403 and "already used" in r2.json()["error"]["message"]
    other = free_loopback_port_not_listed(secured)
    tok = httpx.post(pre.url + "/disagg/token", json={"bootstrap_room": 79}, headers=AUTH).json()["token"]
    r3 = receive(dec.url, "127.0.0.1", other, 79, tok, AUTH)  # loopback, but not a configured peer
    assert r3.status_code == 403 and "--disaggregation-peers" in r3.json()["error"]["message"]


def free_loopback_port_not_listed(secured) -> int:
    from sglite.runtime.parallel.ports import free_port

    while True:
        p = free_port()
        if p not in (secured["bport"], secured["aport"]):
            return p


@pytest.mark.slow
def test_a_store_without_the_secret_cannot_feed_the_decode_server(secured):
    """The attacker holds a valid token (say, sniffed) and runs a store at a listed peer address,
    but not the secret: its payload is refused before any id is read; nothing is cached."""
    from sglite.runtime.parallel.control import bound_tcp_store

    dec_e, dec, pre = secured["dec_e"], secured["dec"], secured["pre"]
    evil = bound_tcp_store("127.0.0.1", secured["aport"])
    ids = dec_e.tokenizer.encode("You are a helpful assistant.")
    L, H, D = dec_e.kv_layout()[1]
    kt = torch.randn(L, len(ids), H, D)
    room = 4242
    tok = httpx.post(pre.url + "/disagg/token", json={"bootstrap_room": room}, headers=AUTH).json()["token"]
    before = evictable(dec_e)
    t = threading.Thread(target=attacker(evil, lambda pg, r: send_kv(pg, r, ids, kt, kt)), args=(room,))
    t.start()
    r = receive(dec.url, "127.0.0.1", secured["aport"], room, tok, AUTH)
    t.join(30)
    assert r.status_code == 502 and "did not prove" in r.json()["error"]["message"]
    assert evictable(dec_e) == before and dec_e.export_prefix(ids)[0] == []
    stats = httpx.get(dec.url + "/disagg/stats", headers=AUTH).json()
    assert stats["invalid"] >= 1
