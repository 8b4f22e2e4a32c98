"""Prefill/decode disaggregation on 127.0.0.1: a prefill server sends a prompt's KV (torch.distributed
gloo send/recv, bootstrap room through its TCPStore) to a decode server, paired by the router;
greedy output equals the colocated server's, token for token."""
import json

import httpx
import pytest
import torch

from sglite.router.pd import prefill_body
from sglite.router.app import RouterThread
from sglite.router.policy import RouterConfig
from sglite.errors import InvalidRequestError

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]


def test_prefill_body_of_each_route():
    assert prefill_body("/generate", {"text": "hi"}) == {"text": "hi"}
    assert prefill_body("/generate", {"input_ids": [1, 2]}) == {"input_ids": [1, 2]}
    assert prefill_body("/generate", {"text": ["a", "b"]}) is None  # batches prefill on the decode server
    assert prefill_body("/v1/completions", {"prompt": "p"}) == {"text": "p"}
    assert prefill_body("/v1/chat/completions", {"messages": []}) is None


def test_pd_config_needs_both_halves():
    with pytest.raises(InvalidRequestError, match="prefill"):
        RouterConfig(pd_disaggregation=True, decode_urls=("http://a:1",))
    from sglite.config import EngineConfig
    with pytest.raises(InvalidRequestError, match="disaggregation_mode"):
        EngineConfig(disaggregation_mode="both")


@pytest.mark.slow
def test_kv_export_import_round_trip(tiny_model_dir):
    """The KV a decode engine imports is the prefill engine's, slot for slot, and its radix cache
    then serves the prompt."""
    from sglite import Engine

    kw = dict(dtype="float32", max_total_tokens=1024, log_level="warning")
    with Engine(str(tiny_model_dir), **kw) as pre, Engine(str(tiny_model_dir), **kw) as dec:
        ids = pre.tokenizer.encode(PROMPTS[2])
        pre.cache_prefix(input_ids=ids)
        got, k, v = pre.export_prefix(ids)
        assert got == ids and k.shape[:2] == (2, len(ids))
        assert dec.import_prefix(got, k, v) == len(ids)
        got2, k2, v2 = dec.export_prefix(ids)
        assert got2 == ids and torch.equal(k2, k) and torch.equal(v2, v)
        out = dec.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert out["meta_info"]["cached_tokens"] == len(ids) - 1
        assert out["output_ids"] == pre.generate(input_ids=ids, sampling_params={"max_new_tokens": 4,
                                                                                 "temperature": 0})["output_ids"]


@pytest.mark.slow
def test_pd_router_output_equals_colocated(tiny_model_dir):
    from sglite import Engine
    from sglite.runtime.parallel.ports import free_port
    from sglite.server.runner import ServerThread

    kw = dict(dtype="float32", max_total_tokens=4096, log_level="warning")
    bport = free_port()
    engines = [Engine(str(tiny_model_dir), **kw),
               Engine(str(tiny_model_dir), disaggregation_mode="prefill", disaggregation_bootstrap_port=bport, **kw),
               Engine(str(tiny_model_dir), disaggregation_mode="decode", **kw)]
    colo, pre, dec = servers = [ServerThread(e).start() for e in engines]
    try:
        conf = RouterConfig(pd_disaggregation=True, prefill_urls=((pre.url, bport),), decode_urls=(dec.url,), port=0)
        sp = {"max_new_tokens": 16, "temperature": 0}
        with RouterThread(conf) as r:
            for p in PROMPTS:
                want = httpx.post(colo.url + "/generate", json={"text": p, "sampling_params": sp}, timeout=60).json()
                got = httpx.post(r.url + "/generate", json={"text": p, "sampling_params": sp}, timeout=60).json()
                assert got["output_ids"] == want["output_ids"]
                assert got["meta_info"]["cached_tokens"] == got["meta_info"]["prompt_tokens"] - 1  # KV came over
            body = {"text": PROMPTS[0], "sampling_params": sp, "stream": True}
            with httpx.stream("POST", r.url + "/generate", json=body, timeout=60) as resp:
                frames = [ln for ln in resp.iter_lines() if ln.startswith("data: {")]
            last = json.loads(frames[-1][len("data: "):])
            want = httpx.post(colo.url + "/generate", json={"text": PROMPTS[0], "sampling_params": sp}).json()
            assert last["output_ids"] == want["output_ids"]
            oa = httpx.post(r.url + "/v1/completions", json={"model": "default", "prompt": PROMPTS[1],
                                                             "max_tokens": 8, "temperature": 0}, timeout=60)
            assert oa.status_code == 200
            info = httpx.get(r.url + "/get_server_info").json()["pd"]
            assert info["transfers"] == len(PROMPTS) + 2 and info["failures"] == 0
    finally:
        for s in servers:
            s.stop()
        for e in engines:
            e.shutdown()
