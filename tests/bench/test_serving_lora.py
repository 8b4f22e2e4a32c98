"""`sglite bench serving --lora-names` (issue 30): sessions spread over LoRA adapters, sent as the
native ``lora_path`` / the OpenAI ``model``, against a live server on the tiny model."""
import json

import pytest

from sglite.bench import serving
from sglite.bench.workloads import Session, Turn, with_adapters
from sglite.server.launcher import LaunchedServer
from tests.server.test_lora_server import tiny_adapter


def test_with_adapters_round_robin():
    sessions = [Session([Turn("x", 2), Turn("y", 2)]) for _ in range(3)]
    out = with_adapters(sessions, ["a", "b"])
    assert [[t.extra["lora_path"] for t in s.turns] for s in out] == [["a", "a"], ["b", "b"], ["a", "a"]]
    assert with_adapters(sessions, None) == sessions and "lora_path" not in sessions[0].turns[0].extra


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_lora")
    a, b = tiny_adapter(root / "a", 1), tiny_adapter(root / "b", 2)
    argv = ["--model-path", str(tiny_model_dir), "--max-total-tokens", "8192", "--lora-paths", f"a={a}", f"b={b}"]
    with LaunchedServer(argv, mode="thread") as srv:
        yield srv


@pytest.mark.parametrize("backend", ["sglite", "openai"])
def test_serving_spreads_requests_over_adapters(server, tmp_path, backend):
    common = ["--base-url", server.url, "--backend", backend, "--dataset", "random", "--num-prompts", "4",
              "--input-len", "12", "--output-len", "4", "--disable-tqdm", "--warmup-requests", "0"]
    out = tmp_path / "res.json"
    assert serving.main(common + ["--lora-names", "a", "b", "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["completed"] == 4 and data["metrics"]["failed"] == 0 and data["config"]["lora_names"] == ["a", "b"]
    bad = tmp_path / "bad.json"
    serving.main(common + ["--lora-names", "zzz", "--output-json", str(bad)])
    assert json.loads(bad.read_text())["metrics"]["failed"] == 4  # the name reaches the server
