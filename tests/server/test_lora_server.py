"""LoRA adapters over HTTP (issue 30) on the tiny random model: ``lora_path`` in ``/generate``,
an adapter's name as the OpenAI ``model`` (listed by ``/v1/models``), and the operator routes
``/load_lora_adapter`` / ``/unload_lora_adapter`` behind ``--admin-api-key``."""
import json

import httpx
import pytest
import torch
from safetensors.torch import save_file

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig

ADMIN = {"Authorization": "Bearer adm"}
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def tiny_adapter(path, seed):
    """A rank-4 q/v adapter for the tiny Llama (hidden 64, q 64, kv 32 wide), non-zero B."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    t = {}
    for i in range(2):
        for m, out in (("q_proj", 64), ("v_proj", 32)):
            pre = f"base_model.model.model.layers.{i}.self_attn.{m}"
            t[pre + ".lora_A.weight"] = torch.randn(4, 64, generator=g) * 0.5
            t[pre + ".lora_B.weight"] = torch.randn(out, 4, generator=g) * 0.5
    save_file(t, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    return path


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    from sglite import Engine

    root = tmp_path_factory.mktemp("lora_http")
    a, b = tiny_adapter(root / "a", 1), tiny_adapter(root / "b", 2)
    eng = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096, lora_paths=[f"a={a}"])
    with ServerThread(eng, ServerConfig(port=0, admin_api_key="adm")) as srv:
        yield srv, eng, b
    eng.shutdown()


def test_generate_lora_path_and_openai_model(served):
    srv, eng, _ = served
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        want = eng.generate(prompt="The sea is", sampling_params=GREEDY, lora_path="a")["text"]
        base = eng.generate(prompt="The sea is", sampling_params=GREEDY)["text"]
        assert want != base
        r = c.post("/generate", json={"text": "The sea is", "sampling_params": GREEDY, "lora_path": "a"})
        assert r.status_code == 200 and r.json()["text"] == want
        r = c.post("/generate", json={"text": ["The sea is"] * 2, "sampling_params": GREEDY, "lora_path": ["a", None]})
        assert [o["text"] for o in r.json()] == [want, base]
        r = c.post("/generate", json={"text": "x", "sampling_params": GREEDY, "lora_path": "nope"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert len(ids) == 2 and ids[1] == "a"
        r = c.post("/v1/completions", json={"model": "a", "prompt": "The sea is", "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        r = c.post("/v1/completions", json={"model": "zzz", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 404 and "'a'" in r.json()["error"]["message"]


def test_load_and_unload_routes_are_admin_guarded(served):
    srv, eng, b = served
    body = {"lora_name": "b", "lora_path": str(b)}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.post("/load_lora_adapter", json=body).status_code == 401
        r = c.post("/load_lora_adapter", json=body, headers=ADMIN)
        assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a", "b"}
        models = c.get("/v1/models").json()["data"]  # a run-time adapter is a model too
        assert [m["id"] for m in models][1:] == ["a", "b"] and models[2]["parent"] == models[0]["id"]
        want = eng.generate(prompt="Hi there", sampling_params=GREEDY, lora_path="b")["text"]
        r = c.post("/v1/chat/completions", json={"model": "b", "messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200
        assert c.post("/generate", json={"text": "Hi there", "sampling_params": GREEDY,
                                         "lora_path": "b"}).json()["text"] == want
        r = c.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": str(b.parent / "missing")}, headers=ADMIN)
        assert r.status_code == 400 and "'c'" in r.json()["error"]["message"]
        assert c.post("/unload_lora_adapter", json={"lora_name": "b"}).status_code == 401
        r = c.post("/unload_lora_adapter", json={"lora_name": "b"}, headers=ADMIN)
        assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a"}
        r = c.post("/unload_lora_adapter", json={"lora_name": "b"}, headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
        assert c.post("/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2}).status_code == 404
        assert [m["id"] for m in c.get("/v1/models").json()["data"]][1:] == ["a"]


def test_streaming_with_an_adapter(served):
    """``/generate`` and ``/v1/completions`` streams with an adapter end in its non-streamed text."""
    srv, eng, _ = served
    want = eng.generate(prompt="The sea is", sampling_params=GREEDY, lora_path="a")["text"]
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        body = {"text": "The sea is", "sampling_params": GREEDY, "lora_path": "a", "stream": True}
        with c.stream("POST", "/generate", json=body) as r:
            events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert len(events) > 1 and events[-1]["text"] == want
        body = {"model": "a", "prompt": "The sea is", "max_tokens": 6, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert "".join(ch["choices"][0]["text"] for ch in chunks if ch.get("choices")) == want
