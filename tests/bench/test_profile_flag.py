"""``--profile`` on `sglite bench offline` and `sglite bench serving` (tiny random model): each writes
a parseable Chrome trace and a summary with the phase rows (issue 33, profiling built in)."""
import json

import pytest

from sglite.bench import offline, serving
from sglite.runtime.profiler import CATEGORIES, OTHER
from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig


def _check(prof: dict, tmp_path) -> None:
    assert prof["trace"].startswith(str(tmp_path)) and prof["steps"] >= 1
    events = json.load(open(prof["trace"]))["traceEvents"]
    assert any(e.get("name") == "sglite::forward" for e in events)
    text = open(prof["summary"]).read()
    assert all(row in text for row, _ in CATEGORIES) and OTHER in text
    assert prof["phases"]["GEMM"]["us"] > 0 and prof["phases"]["step total"]["us"] > 0


def test_offline_profile(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "off.json"
    rc = offline.main(["--model-path", str(tiny_model_dir), "--dtype", "float32", "--parts", "d", "--repeats", "1",
                       "--noreuse-requests", "3", "--noreuse-input-len", "10", "--noreuse-output-len", "3",
                       "--max-total-tokens", "4096", "--output-json", str(out),
                       "--profile", "--profile-dir", str(tmp_path / "prof")])
    assert rc == 0
    _check(json.loads(out.read_text())["profile"], tmp_path / "prof")
    assert "per-phase time" in capsys.readouterr().err


def test_serving_profile_and_profile_steps(tiny_model_dir, tmp_path):
    out = tmp_path / "res.json"
    from sglite import Engine

    eng = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096)
    with eng, ServerThread(eng, ServerConfig(port=0, admin_api_key="adm")) as srv:
        args = ["--base-url", srv.url, "--dataset", "random", "--num-prompts", "4", "--input-len", "16",
                "--output-len", "6", "--disable-tqdm", "--profile", "--profile-dir", str(tmp_path / "prof"),
                "--admin-api-key", "adm", "--output-json", str(out)]
        assert serving.main(args + ["--profile-steps", "3"]) == 0
        prof = json.loads(out.read_text())["config"]["profile"]
        _check(prof, tmp_path / "prof")
        assert prof["steps"] == 3
        with pytest.raises(RuntimeError, match="401"):  # the operator routes need the admin key
            serving.main(args[:-4] + ["--output-json", str(out)])
