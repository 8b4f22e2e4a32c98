"""Start an sglite server for a self-contained benchmark (``--launch``) and stop it afterwards.

Two modes:

* ``subprocess`` (default for benchmarks) – ``python -m sglite.launch_server ARGS --port P`` in
  its own process, so the client's Python does not share the engine's GIL.
* ``thread`` – an in-process :class:`sglite.Engine` served by
  :class:`sglite.server.runner.ServerThread` (fast to start; used by the tests).

Both take the flags of ``sglite serve`` (``--model-path``, ``--disable-radix-cache``,
``--chunked-prefill-size``, ``--dtype`` …); host and port are chosen here (127.0.0.1, a free port).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import httpx

MODES = ("subprocess", "thread")


class LaunchedServer:
    """A server started with ``server_args``; use as a context manager; ``url`` is its root.

    Args:
        server_args: flags of ``sglite serve`` (no ``--host``/``--port``).
        mode: ``subprocess`` or ``thread``.
        startup_timeout: seconds to wait for ``GET /health`` to answer 200.
        port: the subprocess's port (default: a free one).
    Raises:
        ValueError: unknown ``mode``.
        RuntimeError: the server exited or did not become healthy in time (the subprocess log
            tail is in the message).
    """

    def __init__(self, server_args: Sequence[str] = (), mode: str = "subprocess", startup_timeout: float = 900.0,
                 port: Optional[int] = None):
        if mode not in MODES:
            raise ValueError(f"launch_mode: must be one of {MODES}, got {mode!r}")
        self.server_args, self.mode, self.startup_timeout = list(server_args), mode, startup_timeout
        self.url, self.port = "", port
        self._proc: Optional[subprocess.Popen] = None
        self._log = None
        self._thread = None
        self._engine = None

    def __enter__(self) -> "LaunchedServer":
        try:
            self._start_thread() if self.mode == "thread" else self._start_subprocess()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start_thread(self) -> None:
        from sglite.flags import engine_kwargs
        from sglite.runtime.engine import Engine
        from sglite.server.runner import ServerThread
        from sglite.server.settings import ServerConfig, build_parser

        args = build_parser().parse_args(self.server_args)
        self._engine = Engine(**engine_kwargs(args))
        self._thread = ServerThread(self._engine, ServerConfig(host="127.0.0.1", port=0, log_level="warning"),
                                    startup_timeout=self.startup_timeout).start()
        self.url = self._thread.url

    def _start_subprocess(self) -> None:
        from sglite.runtime.parallel.ports import free_port

        port = self.port or free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._log = tempfile.NamedTemporaryFile("w+b", prefix="sglite-bench-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "sglite.launch_server", *self.server_args, "--host", "127.0.0.1",
               "--port", str(port)]
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self._proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server did not become healthy in {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n_bytes: int = 4000) -> str:
        """The last ``n_bytes`` of the subprocess's output ('' in thread mode)."""
        if self._log is None:
            return ""
        self._log.flush()
        with open(self._log.name, "rb") as f:
            f.seek(max(0, os.path.getsize(self._log.name) - n_bytes))
            return f.read().decode(errors="replace")

    def stop(self) -> None:
        """Stop the server (idempotent): SIGTERM then SIGKILL for a subprocess."""
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc = None
        if self._log is not None:
            self._log.close()
            os.unlink(self._log.name)
            self._log = None
