"""The regression gate's logic on fake counts (sglite.bench.regress): comparison, parsing of
callgrind dumps, the baseline round trip and the exit codes. No valgrind run here: the gate itself
is `make test-all`'s separate step (`sglite bench regress`)."""
import json

import pytest

from sglite.bench import regress
from sglite.bench.regress import Verdict, compare, environment_mismatch, parse_dump, read_dumps, spread_pct

BASE = {"prefill": 1_000_000, "decode": 2_000_000}


def test_within_threshold_passes_and_names_each_phase():
    vs = compare(BASE, {"prefill": 1_009_000, "decode": 1_990_000}, threshold_pct=1.0)
    assert [v.phase for v in vs] == ["prefill", "decode"]
    assert vs[0].change_pct == pytest.approx(0.9)
    assert vs[1].change_pct == pytest.approx(-0.5)
    assert not any(v.regressed for v in vs) and not any(v.improved for v in vs)


def test_rise_beyond_threshold_fails_only_that_phase():
    vs = compare(BASE, {"prefill": 1_000_000, "decode": 2_030_000}, threshold_pct=1.0)
    assert [v.regressed for v in vs] == [False, True]
    line = vs[1].line()
    assert "decode" in line and "2,000,000" in line and "2,030,000" in line and "+1.50 %" in line
    assert "REGRESSION" in line


def test_exactly_at_threshold_passes_and_a_large_fall_is_an_improvement():
    vs = compare(BASE, {"prefill": 1_010_000, "decode": 1_500_000}, threshold_pct=1.0)
    assert not vs[0].regressed
    assert vs[1].improved and "improved" in vs[1].line()


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="threshold_pct"):
        compare(BASE, BASE, -1)
    with pytest.raises(ValueError, match="'decode'.*not measured"):
        compare(BASE, {"prefill": 1}, 1.0)
    with pytest.raises(ValueError, match="baseline count of phase 'prefill'"):
        compare({"prefill": 0}, {"prefill": 1}, 1.0)


def test_spread():
    assert spread_pct([100, 101, 100]) == pytest.approx(1.0)
    assert spread_pct([7]) == 0.0
    with pytest.raises(ValueError, match="counts"):
        spread_pct([])


DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 42
cmd:  python -m sglite.bench.regress_workload
part: 1

desc: I1 cache:
desc: Timerange: Basic block 0 - 123
desc: Trigger: Client Request: {phase}

positions: line
events: Ir
summary: {total}

fn=(1) main
0 5
totals: {total}
"""


def test_parse_and_read_dumps(tmp_path):
    assert parse_dump(DUMP.format(phase="prefill", total=12345)) == ("prefill", 12345)
    assert parse_dump("events: Ir\n") == (None, None)
    (tmp_path / "cg.out.1").write_text(DUMP.format(phase="prefill", total=11))
    (tmp_path / "cg.out.2").write_text(DUMP.format(phase="decode", total=22))
    (tmp_path / "cg.out").write_text(DUMP.replace("desc: Trigger: Client Request: {phase}\n", "")
                                     .format(total=3))  # the final dump at exit: no phase
    assert read_dumps(tmp_path) == {"prefill": 11, "decode": 22}


def test_environment_mismatch_ignores_the_cpu():
    a = {"torch": "2.13.0+cpu", "compiler": "g++ 12", "valgrind": "3.19", "python": "3.11", "cpu_model": "X"}
    assert environment_mismatch(a, {**a, "cpu_model": "Y"}) == []
    assert environment_mismatch(a, {**a, "torch": "2.14.0"}) == ["torch"]


@pytest.fixture
def fake_measure(monkeypatch):
    """measure_once returns queued fake counts; machine() a fixed record."""
    queue = []
    monkeypatch.setattr(regress, "measure_once", lambda model_path, timeout_s: (queue.pop(0), 1.0))
    monkeypatch.setattr(regress, "machine", lambda: {"torch": "t", "compiler": "c", "valgrind": "v", "python": "p"})
    return queue


def test_update_then_gate_pass_and_fail(tmp_path, fake_measure, capsys):
    path = tmp_path / "baseline.json"
    fake_measure += [dict(BASE), {"prefill": 1_000_100, "decode": 2_000_000}, {"prefill": 999_900, "decode": 2_000_050}]
    assert regress.main(["--baseline", str(path), "--update", "--runs", "3", "--threshold-pct", "0.5",
                         "--reason", "test"]) == 0
    data = json.loads(path.read_text())
    assert data["counts"] == {"prefill": 1_000_000, "decode": 2_000_000}  # medians
    assert data["threshold_pct"] == 0.5 and data["reason"] == "test"
    assert data["spread_pct"]["prefill"] == pytest.approx(100 * 200 / 999_900)
    assert data["workload"]["batch"] == 8 and data["workload"]["decode_steps"] == 4
    assert data["workload"]["dtype"] == "float32" and data["workload"]["quantization"] == "none"

    fake_measure.append({"prefill": 1_004_000, "decode": 2_000_000})
    assert regress.main(["--baseline", str(path)]) == 0
    assert "passed" in capsys.readouterr().out

    fake_measure.append({"prefill": 1_000_000, "decode": 2_020_000})
    assert regress.main(["--baseline", str(path)]) == 1
    err = capsys.readouterr().err
    assert "FAILED: decode +1.00 % (2,000,000 -> 2,020,000 Ir) exceeds +0.5 %" in err


def test_missing_baseline_or_failed_run_is_exit_2(tmp_path, monkeypatch, capsys):
    assert regress.main(["--baseline", str(tmp_path / "none.json")]) == 2
    assert "--update" in capsys.readouterr().err

    def boom(model_path, timeout_s):
        raise RuntimeError("valgrind not found")
    monkeypatch.setattr(regress, "measure_once", boom)
    assert regress.main(["--baseline", str(tmp_path / "b.json"), "--update"]) == 2
    assert "valgrind not found" in capsys.readouterr().err


def test_verdict_is_plain_data():
    v = Verdict("prefill", 10, 12, 20.0, 1.0)
    assert v.regressed and not v.improved
