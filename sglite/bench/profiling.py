"""``--profile`` of ``sglite bench offline`` and ``sglite bench serving``: a torch.profiler trace of
the run's engine steps (Chrome trace JSON) plus the per-op and per-phase summary of
:mod:`sglite.runtime.profiler`.

``offline`` profiles its in-process engine (:meth:`sglite.runtime.engine.Engine.start_profile`);
``serving`` asks the server (``POST /start_profile`` before the timed run, ``POST /stop_profile``
after it; operator routes: ``--admin-api-key``, else ``--api-key``), so the files are written on
the server's machine. The directory: ``--profile-dir``, else ``$SGLITE_TORCH_PROFILER_DIR`` (of
the process that writes), else ``/tmp/sglite_profiles``.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Optional

import httpx

from sglite.runtime.profiler import PROFILER_DIR_ENV, format_phases

from .report import at_least


def add_profile_args(p: argparse.ArgumentParser, remote: bool = False) -> None:
    """``--profile``, ``--profile-dir``, ``--profile-steps`` (and ``--admin-api-key`` when ``remote``)."""
    p.add_argument("--profile", action="store_true",
                   help="write a torch.profiler trace (Chrome JSON) and per-op / per-phase tables of the run")
    p.add_argument("--profile-dir", default=None,
                   help=f"directory of the profile (default: ${PROFILER_DIR_ENV}, else /tmp/sglite_profiles"
                        + ("; on the server's machine)" if remote else ")"))
    p.add_argument("--profile-steps", type=at_least(1), default=None,
                   help="stop profiling after this many engine steps (default: the whole run)")
    if remote:
        p.add_argument("--admin-api-key", default=None,
                       help="bearer token of /start_profile and /stop_profile (default: --api-key)")


def report(result: dict) -> None:
    """Print the phase table and the files' paths (stderr: stdout keeps the benchmark's tables)."""
    print(format_phases(result["phases"], result["steps"]), file=sys.stderr)
    print(f"profile: trace {result['trace']}\nprofile: summary {result['summary']}", file=sys.stderr)


@contextlib.contextmanager
def engine_profile(a: argparse.Namespace, engine):
    """Profile ``engine`` (an :class:`~sglite.runtime.engine.Engine`) for the ``with`` body when
    ``a.profile``; yields a dict that holds the stop result afterwards (empty when off)."""
    result: dict = {}
    if not a.profile:
        yield result
        return
    engine.start_profile(output_dir=a.profile_dir, num_steps=a.profile_steps)
    try:
        yield result
    finally:
        result.update(engine.stop_profile())
        report(result)


def _post(url: str, key: Optional[str], body: Optional[dict] = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url, json=body, headers=headers, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


@contextlib.contextmanager
def server_profile(a: argparse.Namespace, base_url: str):
    """Profile the server at ``base_url`` for the ``with`` body when ``a.profile``; yields a dict
    that holds ``/stop_profile``'s answer afterwards (empty when off).

    Raises:
        RuntimeError: a route answered other than 200 (its status and message).
    """
    result: dict = {}
    if not a.profile:
        yield result
        return
    key = a.admin_api_key or a.api_key
    _post(base_url + "/start_profile", key, {"output_dir": a.profile_dir, "num_steps": a.profile_steps})
    try:
        yield result
    finally:
        result.update(_post(base_url + "/stop_profile", key))
        report(result)
