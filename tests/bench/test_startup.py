"""`sglite bench startup` on the tiny random model: one fresh process, sane JSON (no speed thresholds)."""
import json
import math

import pytest

from sglite.bench import startup


@pytest.mark.slow  # starts an engine in a child process
def test_one_repeat_on_the_tiny_model_gives_sane_phase_times(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "startup.json"
    rc = startup.main(["--repeats", "1", "--model-path", str(tiny_model_dir), "--max-total-tokens", "4096",
                       "--num-threads", "1", "--engine-args=--disable-radix-cache", "--new-tokens", "3",
                       "--output-json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["repeats"] == 1 and data["warmup"] == 0 and len(data["runs"]) == 1 and data["new_tokens"] == 3
    kw = data["engine_kwargs"]
    assert kw["max_total_tokens"] == 4096 and kw["num_threads"] == 1 and kw["disable_radix_cache"] is True
    assert kw["model_path"] == str(tiny_model_dir.resolve())
    run = data["runs"][0]
    assert run["output_tokens"] == 3                       # the first generate really produced the tokens
    for ph in startup.PHASES:
        v = run[ph]
        assert isinstance(v, float) and math.isfinite(v) and v >= 0, ph
        assert data["summary"][ph]["median"] == data["summary"][ph]["min"] == data[f"median_{ph}"] == v
    assert run["engine_init_s"] > 0 and run["first_generate_s"] > 0 and run["import_s"] > 0
    assert run["engine_ready_s"] == pytest.approx(run["engine_import_s"] + run["engine_init_s"])
    assert run["total_s"] == pytest.approx(run["import_s"] + run["engine_ready_s"] + run["first_generate_s"],
                                           abs=0.05)      # only json/sys imports and argv parsing in between
    assert run["process_wall_s"] >= run["total_s"]          # the parent's view includes start-up and shutdown
    table = capsys.readouterr().out
    assert "| phase | mean (s) | median (s) | min (s) | max (s) |" in table
    assert all(f"| {ph} |" in table for ph in startup.PHASES)


@pytest.mark.parametrize("argv, flag", [
    (["--repeats", "0"], "--repeats"),
    (["--warmup", "-1"], "--warmup"),
    (["--new-tokens", "0"], "--new-tokens"),
    (["--timeout-s", "0"], "--timeout-s"),
    (["--engine-args", "--no-such-flag 3"], "--engine-args"),
    (["--max-total-tokens", "-5"], "max_total_tokens"),
])
def test_bad_flags_are_named_before_any_child_starts(argv, flag, capsys, monkeypatch):
    def no_child(*a, **k):
        raise AssertionError("a child process was started")

    monkeypatch.setattr(startup, "measure_once", no_child)
    with pytest.raises(SystemExit) as exc:
        startup.main(argv)
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_summary_statistics_by_hand():
    runs = [{ph: float(i) for ph in startup.PHASES} for i in (3, 1, 2, 10)]
    s = startup.summarize_runs(runs)
    assert s["import_s"] == {"mean": 4.0, "median": 2.5, "min": 1.0, "max": 10.0}
