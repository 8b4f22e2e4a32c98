"""Tensor parallelism's rendezvous off the network (issue 26, finding 3 and the end of 8): one
machine's engine opens no listening socket outside loopback (a private FileStore, gloo on
127.0.0.1), a multi-node store listens on the ``dist_init_addr`` host only, and a script that
creates a ``tp_size > 1`` engine without the main guard gets an error saying what to do."""
import os
import subprocess
import sys
import textwrap

import pytest

from tests.sockets import listening

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc (Linux)")


def is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("::1", "::ffff:127.0.0.1")


@needs_proc
def test_a_multi_node_store_listens_on_its_host_only():
    from sglite.runtime.parallel.control import open_store
    from sglite.runtime.parallel.ports import free_port

    port = free_port()
    store = open_store(f"127.0.0.1:{port}", 2, True)
    assert [a for a in listening([os.getpid()]) if a[1] == port] == [("127.0.0.1", port)]
    store.set("k", b"v")


@needs_proc
def test_a_file_store_lives_in_a_private_folder():
    from sglite.runtime.parallel.control import FILE_STORE, open_store, private_store_dir, remove_store_dir

    d = private_store_dir()
    addr = FILE_STORE + os.path.join(d, "store")
    try:
        assert os.stat(d).st_mode & 0o777 == 0o700
        open_store(addr, 2, True).set("k", b"v")
        assert open_store(addr, 2, False).get("k") == b"v"
    finally:
        remove_store_dir(addr)
    assert not os.path.exists(d)


@pytest.mark.slow
@needs_proc
@pytest.mark.timeout(300)
def test_tp_engine_listens_on_loopback_only(tiny_model_dir):
    """tp_size=2 on one machine: neither the engine process nor its workers listen on anything
    but loopback (torch's TCPStore listened on every interface), and the store folder goes at
    shutdown."""
    from sglite import Engine

    with Engine(str(tiny_model_dir), tp_size=2, dtype="float32", max_total_tokens=1024, log_level="warning") as e:
        pids = [os.getpid()] + [p.pid for p in e.runner._procs]  # noqa: SLF001
        socks = listening(pids)
        out = e.generate("The capital of France is", {"max_new_tokens": 2, "temperature": 0})
        assert len(out["output_ids"]) == 2
    bad = [a for a in socks if not is_loopback(a[0])]
    assert not bad, f"listening beyond loopback: {bad}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_missing_main_guard_says_what_to_do(tiny_model_dir, tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(f"""
        from sglite import Engine
        engine = Engine({str(tiny_model_dir)!r}, tp_size=2, dtype="float32", max_total_tokens=1024,
                        log_level="warning")
        engine.shutdown()
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                       cwd=str(tmp_path))
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError") and 'if __name__ == "__main__":' in last, r.stderr[-2000:]
