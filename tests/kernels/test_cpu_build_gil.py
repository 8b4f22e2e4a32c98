"""C++ kernels built by ``cpu_build.load_cpp(functions=...)`` run without the GIL, so the server's
event loop and request preparation keep running during a long kernel call (a fused decode step)."""
import threading
import time

import pytest

from sglite.kernels import cpu_build

SLEEP_SRC = """
#include <chrono>
#include <thread>
int64_t sleep_ms(int64_t ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); return ms; }
void fail(int64_t n) { TORCH_CHECK(n > 0, "fail: n must be > 0, got ", n); }
"""


def test_bindings_release_the_gil_and_name_each_function():
    src = cpu_build.with_bindings("int f(int);", ["f", "g_2"])
    assert src.startswith("int f(int);")
    assert 'm.def("f", torch::wrap_pybind_function_no_gil(f), "f");' in src
    assert 'm.def("g_2", torch::wrap_pybind_function_no_gil(g_2), "g_2");' in src
    with pytest.raises(ValueError, match="not a C\\+\\+ identifier"):
        cpu_build.with_bindings("", ["f); evil("])


@pytest.mark.slow  # builds a small extension (tens of seconds the first time on a machine)
def test_python_threads_run_during_a_kernel_call():
    mod = cpu_build.load_cpp("sglite_test_gil_sleep", SLEEP_SRC, functions=["sleep_ms", "fail"])
    if mod is None:
        pytest.skip("no C++ toolchain")
    stamps, done = [], threading.Event()

    def ticker():
        while not done.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    try:
        t0 = time.perf_counter()
        assert mod.sleep_ms(400) == 400
        t1 = time.perf_counter()
    finally:
        done.set()
        t.join()
    inside = [s for s in stamps if t0 <= s <= t1]
    gaps = [b - a for a, b in zip([t0] + inside, inside + [t1])]
    assert max(gaps) < 0.5 * (t1 - t0), "another Python thread was stopped for the whole kernel call"
    with pytest.raises(RuntimeError, match="fail: n must be > 0, got 0"):  # errors still become Python ones
        mod.fail(0)
