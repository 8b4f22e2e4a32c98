"""What one ``sglite bench sweep --config LABEL=SPEC`` runs against: a deployment with one root URL.

Three kinds, told apart by ``SPEC``:

* ``FLAGS`` (flags of ``sglite serve``, possibly empty): one server (:class:`~sglite.server.launcher.LaunchedServer`);
  ``--dp-size N`` among them gives N workers behind the cache-aware router, as ``sglite serve`` does.
* ``--pd-disaggregation FLAGS``: prefill/decode disaggregation (DistServe, Zhong et al. OSDI'24):
  a prefill server (``FLAGS --disaggregation-mode prefill --disaggregation-bootstrap-port P``), a
  decode server (``FLAGS --disaggregation-mode decode``), both started at once, and ``sglite router
  --pd-disaggregation --prefill URL P --decode URL`` in front (its own process in ``subprocess``
  mode, a :class:`~sglite.router.app.RouterThread` in ``thread`` mode).
* ``@URL``: a deployment already running at ``URL`` (nothing started or stopped).

:meth:`Deployment.warm_workers` sends one short request straight to each server behind a router
when the deployment starts (a benchmark's warmup request through the router reaches only one).
:meth:`Deployment.pd_counters` reads the router's KV-transfer counters (``transfers``,
``transferred_tokens``, ``failures`` = requests whose transfer failed and whose prompt the decode
server prefilled itself); ``{}`` for deployments without a P/D router.
"""
from __future__ import annotations

import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import httpx

from ..server.launcher import MODES, LaunchedServer

PD_FLAG = "--pd-disaggregation"
KINDS = ("server", "pd", "url")


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """``SPEC`` → ``(kind, flags)``: ``("url", [URL])``, ``("pd", FLAGS)`` or ``("server", FLAGS)``.

    Raises:
        ValueError: ``@`` without an ``http(s)://`` URL, or ``--pd-disaggregation`` beside
            ``--disaggregation-mode`` / ``--dp-size`` (the deployment sets the mode itself).
    """
    spec = spec.strip()
    if spec.startswith("@"):
        url = spec[1:].strip().rstrip("/")
        if not url.startswith(("http://", "https://")) or " " in url:
            raise ValueError(f"config: '@URL' needs one http(s)://host:port URL, got {spec!r}")
        return "url", [url]
    flags = shlex.split(spec)
    if PD_FLAG not in flags:
        return "server", flags
    flags = [f for f in flags if f != PD_FLAG]
    clash = [f for f in flags if f.split("=", 1)[0] in ("--disaggregation-mode", "--dp-size")]
    if clash:
        raise ValueError(f"config: {PD_FLAG} sets each server's --disaggregation-mode itself and runs one "
                         f"prefill + one decode server; remove {clash[0].split('=', 1)[0]}")
    return "pd", flags


def _wait_healthy(url: str, proc: Optional[subprocess.Popen], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} at {url} not healthy after {timeout:.0f} s")


class Deployment:
    """A context manager whose ``url`` takes the benchmark's requests.

    Args:
        spec: ``FLAGS`` | ``--pd-disaggregation FLAGS`` | ``@URL`` (see the module docstring).
        common: flags of ``sglite serve`` given to every server started (``--server-args``, ``--model-path``).
        mode: ``subprocess`` | ``thread`` (how servers are started; see :mod:`sglite.server.launcher`).
        startup_timeout: seconds each server may take to answer ``/health``.
    Raises:
        ValueError: a bad ``spec`` or ``mode``.
        RuntimeError: a server or the router did not come up (from ``__enter__``).
    """

    def __init__(self, spec: str, common: Sequence[str] = (), mode: str = "subprocess",
                 startup_timeout: float = 900.0):
        self.kind, flags = parse_spec(spec)
        self.mode, self.startup_timeout = mode, startup_timeout
        self.server_args = [] if self.kind == "url" else [*common, *flags]
        self.url = flags[0] if self.kind == "url" else ""
        self._servers: list[LaunchedServer] = []
        self._router = None  # subprocess.Popen or RouterThread
        if mode not in MODES:
            raise ValueError(f"launch_mode: must be one of {MODES}, got {mode!r}")

    def __enter__(self) -> "Deployment":
        try:
            if self.kind == "server":
                self._servers = [LaunchedServer(self.server_args, self.mode, self.startup_timeout).__enter__()]
                self.url = self._servers[0].url
            elif self.kind == "pd":
                self._start_pd()
            if self.kind != "url":
                self.warm_workers()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start_pd(self) -> None:
        from sglite.runtime.parallel.ports import free_port

        bport = free_port()
        halves = [LaunchedServer([*self.server_args, "--disaggregation-mode", "prefill",
                                  "--disaggregation-bootstrap-port", str(bport)], self.mode, self.startup_timeout),
                  LaunchedServer([*self.server_args, "--disaggregation-mode", "decode"], self.mode,
                                 self.startup_timeout)]
        self._servers = halves
        if self.mode == "subprocess":  # both load their model at once
            with ThreadPoolExecutor(2) as ex:
                for f in [ex.submit(s.__enter__) for s in halves]:
                    f.result()
        else:
            for s in halves:
                s.__enter__()
        pre, dec = halves
        if self.mode == "thread":
            from sglite.router.app import RouterThread
            from sglite.router.policy import RouterConfig

            self._router = RouterThread(RouterConfig(pd_disaggregation=True, prefill_urls=((pre.url, bport),),
                                                     decode_urls=(dec.url,), port=0)).__enter__()
            self.url = self._router.url
            return
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._router = subprocess.Popen([sys.executable, "-m", "sglite.cli", "router", PD_FLAG, "--prefill", pre.url,
                                         str(bport), "--decode", dec.url, "--port", str(port),
                                         "--log-level", "warning"])
        _wait_healthy(self.url, self._router, 120.0, "sglite router")

    def worker_urls(self) -> list[str]:
        """The servers behind a router (its ``/get_server_info`` ``workers`` and ``pd.prefill_urls``);
        ``[]`` for a single server."""
        try:
            info = httpx.get(self.url + "/get_server_info", timeout=30).json()
        except (httpx.HTTPError, ValueError):
            return []
        if not isinstance(info, dict) or not isinstance(info.get("workers"), list):
            return []
        pd = info.get("pd") if isinstance(info.get("pd"), dict) else {}
        workers = [w["url"] for w in info["workers"] if isinstance(w, dict) and "url" in w]
        return workers + list(pd.get("prefill_urls", []))

    def warm_workers(self, max_new_tokens: int = 4) -> int:
        """One short greedy request straight to every server behind a router, so each has run a
        step before timing (the benchmark's own warmup request reaches one worker only). Returns
        how many servers answered 200."""
        body = {"text": "Warm up the server.", "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                   "temperature": 0}}
        ok = 0
        for u in self.worker_urls():
            try:
                ok += httpx.post(u + "/generate", json=body, timeout=self.startup_timeout).status_code == 200
            except httpx.HTTPError:
                pass
        return ok

    def pd_counters(self) -> dict:
        """The P/D router's transfer counters (``transfers``, ``transferred_tokens``, ``failures``)
        now; ``{}`` when this deployment has none or it cannot be read."""
        try:
            info = httpx.get(self.url + "/get_server_info", timeout=30).json()
        except (httpx.HTTPError, ValueError):
            return {}
        pd = info.get("pd") if isinstance(info, dict) else None
        return {k: v for k, v in pd.items() if isinstance(v, (int, float))} if isinstance(pd, dict) else {}

    def stop(self) -> None:
        """Stop the router, then the servers (idempotent; nothing for ``@URL``)."""
        r, self._router = self._router, None
        if isinstance(r, subprocess.Popen):
            if r.poll() is None:
                r.terminate()
                try:
                    r.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    r.kill()
                    r.wait()
        elif r is not None:
            r.__exit__(None, None, None)
        for s in self._servers:
            s.stop()
        self._servers = []
