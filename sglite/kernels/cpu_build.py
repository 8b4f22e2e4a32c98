"""Compile small C++ CPU kernels on first use and reuse the build in later processes.

:func:`load_cpp` wraps ``torch.utils.cpp_extension.load_inline``; the sources live in
``sglite/kernels/csrc/*.cpp`` (package data, read by :func:`read_source`). The build directory is
``<cache>/torch_extensions/<name>_<tag>`` where ``<cache>`` is ``$SGLITE_CACHE_DIR`` or
``~/.cache/sglite`` (the same root as ``sglite.runtime.model_loader.default_cache_dir``; kernels
import nothing of the runtime, so the rule is repeated here) and ``<tag>`` hashes the source, the
flags, the torch version and the CPU's feature flags: a rebuilt source, another torch, or another
CPU (``-march``-style flags differ) never loads a stale binary, while every later process with the
same inputs loads the existing one in milliseconds. ``load_inline`` itself locks the directory, so
two processes building at once do not clash; :func:`build_owner` adds a ``flock`` beside torch's
lock, so a lock left by a killed build is cleared at the next start instead of hanging it.

Failure (no compiler, no ninja, a compile error, a read-only cache, ...) logs ONE warning naming
the kernel and returns None: callers keep their torch path.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Optional, Sequence

import torch

from .device import cpu_flags  # noqa: F401  (hashed into build_tag; the probe lives in .device)

log = logging.getLogger(__name__)


CSRC = Path(__file__).resolve().parent / "csrc"  # the C++ sources (package data ``csrc/*.cpp``)


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.MULTILINE)


def read_source(filename: str, csrc: Optional[Path] = None) -> str:
    """Text of ``csrc/<filename>`` (shipped as package data) with each ``#include "x.h"`` of a
    ``csrc`` header replaced by the header's text (once per source), so the build tag hashes every
    line compiled and an edited header rebuilds too. ``csrc``: another folder of sources (A/B
    scripts build another checkout's kernels beside this one's); default this package's. Raises
    FileNotFoundError when a file is missing (a broken install)."""
    folder = CSRC if csrc is None else Path(csrc)
    seen: set[str] = set()

    def splice(m: "re.Match") -> str:
        name = m.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return _LOCAL_INCLUDE.sub(splice, (folder / name).read_text())

    return _LOCAL_INCLUDE.sub(splice, (folder / filename).read_text())


def cache_root() -> Path:
    """``$SGLITE_CACHE_DIR`` if set, else ``~/.cache/sglite`` (as the model loader's cache)."""
    env = os.environ.get("SGLITE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sglite"


def build_tag(*parts: str) -> str:
    """12-hex hash of ``parts``, the torch version and install folder (two virtualenvs compile with
    different include paths, so sharing a build directory would make each rebuild the other's) and
    the CPU flags (names a build directory)."""
    where = os.path.dirname(torch.__file__)
    h = hashlib.sha1("\0".join((*parts, torch.__version__, where, " ".join(sorted(cpu_flags())))).encode())
    return h.hexdigest()[:12]


STALE_LOCK_S = 600.0  # without flock (not POSIX): a build lock this old is a killed build's leftover


@contextlib.contextmanager
def build_owner(build_dir: Path):
    """Hold an exclusive ``flock`` on ``build_dir/owner.lock`` for the duration (blocking while
    another process builds or loads there); then clear torch's build ``lock`` if one is left.

    torch's ``load_inline`` marks a build with an empty ``lock`` file and waits forever on one left
    by a build that was killed (a timed-out test, Ctrl-C, a server stopped during start-up), which
    hangs every later engine start on this machine. The kernel releases a ``flock`` when its holder
    dies, so a torch lock seen while holding ours has no live builder and is removed at once.
    Where ``fcntl`` is missing (Windows) the lock is waited for and removed once
    ``STALE_LOCK_S`` old (:func:`clear_stale_lock`)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        clear_stale_lock(build_dir / "lock")
        yield
        return
    with open(build_dir / "owner.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            clear_stale_lock(build_dir / "lock", stale_after_s=0.0)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def clear_stale_lock(lock: Path, stale_after_s: float = STALE_LOCK_S, poll_s: float = 0.5) -> bool:
    """Wait while another process holds torch's build ``lock`` (a file it deletes when its build
    ends); remove the lock once it is ``stale_after_s`` seconds old (mtime), with a warning
    (0: at once, for a caller that knows no live process builds there, :func:`build_owner`).
    Returns True when a stale lock was removed."""
    import time

    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return False
        if age >= stale_after_s:
            log.warning("removing a stale C++ build lock %s (%.0f s old, no live build holds it: a killed "
                        "build's leftover)", lock, age)
            try:
                lock.unlink()
            except FileNotFoundError:
                pass
            return True
        time.sleep(poll_s)


def with_bindings(source: str, functions: Sequence[str]) -> str:
    """``source`` plus its pybind module: each of ``functions`` bound through torch's
    ``wrap_pybind_function_no_gil`` (torch's error translation, the GIL released while the kernel
    runs). ``load_inline(functions=...)`` binds them holding the GIL, so a fused decode step (one
    C++ call of tens of ms) stopped every other Python thread of the process -- the server's event
    loop and request preparation -- for its whole length. The kernels touch no Python object;
    calls from two threads at once were already possible (torch's own ops release the GIL), and
    the decode thread pool runs a second caller serially (``csrc/thread_pool.h``).

    Raises:
        ValueError: a name in ``functions`` that is not a C++ identifier.
    """
    for f in functions:
        if not re.fullmatch(r"[A-Za-z_]\w*", f):
            raise ValueError(f"load_cpp: function name {f!r} is not a C++ identifier")
    binds = "\n".join(f'  m.def("{f}", torch::wrap_pybind_function_no_gil({f}), "{f}");' for f in functions)
    return f"{source}\n\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{binds}\n}}\n"


def load_cpp(name: str, source: str, extra_cflags: Sequence[str] = ("-O3",), *,
             functions: Optional[Sequence[str]] = None, ops_namespace: Optional[str] = None):
    """Build (or reuse) and load C++ ``source``; None after one logged warning on any failure.

    Args:
        name: extension name (a Python identifier); the build lands in
            ``cache_root()/torch_extensions/<name>_<tag>``.
        source: C++ text. With ``functions``, torch's headers are included and pybind bindings
            are generated for those function names (:func:`with_bindings`: the GIL is released
            while one runs); with ``ops_namespace`` the source registers
            its own ``TORCH_LIBRARY(ops_namespace, ...)`` and includes what it needs.
        extra_cflags: compiler flags (e.g. ``-O3 -mavx512bf16``).
        functions: names of C++ functions to expose on the returned module.
        ops_namespace: instead of a module, return ``getattr(torch.ops, ops_namespace)``.
    Returns:
        The Python module (``functions``) or the ``torch.ops`` namespace (``ops_namespace``); None
        when the build or the load failed. Raises ValueError when neither or both are given, or
        for a function name that is not a C++ identifier.
    """
    if (functions is None) == (ops_namespace is None):
        raise ValueError("load_cpp: pass exactly one of functions= or ops_namespace=")
    if functions is not None:  # a bad name is the caller's error, not an unavailable kernel
        source = with_bindings(source, functions)
    try:
        from torch.utils.cpp_extension import load_inline

        full = f"{name}_{build_tag(source, ' '.join(extra_cflags))}"
        build_dir = cache_root() / "torch_extensions" / full
        build_dir.mkdir(parents=True, exist_ok=True)
        with build_owner(build_dir):
            if functions is not None:
                return load_inline(name=full, cpp_sources=[source], extra_cflags=list(extra_cflags),
                                   build_directory=str(build_dir), verbose=False)
            load_inline(name=full, cpp_sources=[source], extra_cflags=list(extra_cflags),
                        build_directory=str(build_dir), is_python_module=False, no_implicit_headers=True,
                        verbose=False)
        return getattr(torch.ops, ops_namespace)
    except Exception as e:  # no compiler / ninja, compile error, unwritable cache, unsupported platform
        msg = (str(e).strip().splitlines() or [""])[-1]
        log.warning("sglite C++ kernel %r unavailable (%s: %s); using the torch path", name, type(e).__name__, msg)
        return None
