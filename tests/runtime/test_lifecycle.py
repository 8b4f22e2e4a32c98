"""Engine lifecycle: a script that never calls ``shutdown()`` exits cleanly (status 0, no
"terminate called"), ``with Engine() as e:`` and garbage collection stop the loop thread.

The exit children leave a long request running when the interpreter exits, with 2 torch threads:
before the exit finalizer, that was "terminate called without an active exception" (exit 134) on
every run on the 2-core machines (the loop thread was inside a torch op while the interpreter
tore down); the README's idle case crashed once in four.
"""
import gc
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

# A Python -c child: build an engine, generate, leave a request running (or not) and exit
# WITHOUT shutdown().
CHILD = r"""
import sys, threading, time
import sglite
e = sglite.Engine(model_path=sys.argv[1], dtype="float32", max_total_tokens=4096, num_threads=2,
                  log_level="warning")
out = e.generate("Hello", {"max_new_tokens": 4, "temperature": 0})
assert len(out["output_ids"]) == 4, out
if sys.argv[2] == "in-flight":
    threading.Thread(target=e.generate, args=("Hi " * 40, {"max_new_tokens": 1900, "ignore_eos": True}),
                     daemon=True).start()
    time.sleep(0.3)
print("generated", flush=True)
"""


def _run_children(model_dir, runs: int) -> None:
    modes = ["in-flight" if i % 2 == 0 else "idle" for i in range(runs)]

    def one(mode):
        return mode, subprocess.run([sys.executable, "-c", CHILD, str(model_dir), mode], capture_output=True,
                                    text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, modes))
    for mode, p in results:
        assert "generated" in p.stdout, (mode, p.stdout, p.stderr[-2000:])
        assert p.returncode == 0, (mode, p.returncode, p.stderr[-2000:])
        assert "terminate called" not in p.stderr and "Traceback" not in p.stderr, (mode, p.stderr[-2000:])


@pytest.mark.slow  # two child processes, each starting an engine
def test_exit_without_shutdown_is_clean(tiny_model_dir):
    _run_children(tiny_model_dir, 2)  # one in flight, one idle (20 runs: the slow tier)


@pytest.mark.slow
def test_exit_without_shutdown_is_clean_20_runs(tiny_model_dir):
    _run_children(tiny_model_dir, 20)


def _engine(tiny_model_dir):
    from sglite import Engine

    return Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=1024, num_threads=1)


def test_context_manager_and_gc_stop_the_loop(tiny_model_dir):
    with _engine(tiny_model_dir) as e:
        assert e.generate("Hi", {"max_new_tokens": 2, "temperature": 0})["meta_info"]["completion_tokens"] == 2
        thread = e._loop._thread
        assert thread.is_alive()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate("Hi", {"max_new_tokens": 2})
    e.shutdown()  # idempotent

    e = _engine(tiny_model_dir)
    thread = e._loop._thread
    del e
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_startup_phases_are_timed(tiny_model_dir, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="sglite")
    with _engine(tiny_model_dir) as e:
        phases = e.startup_phases
    assert list(phases)[:3] == ["checkpoint load", "tokenizer", "weights"]
    assert any("KV pool" in k for k in phases) and all(v >= 0 for v in phases.values())
    text = caplog.text
    for name in phases:
        assert f"Start-up: {name} took" in text
    assert "Engine ready in" in text
