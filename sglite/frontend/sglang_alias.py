"""``import sglang`` → sglite: run SGLang frontend programs unchanged.

    import sglite.frontend.sglang_alias as alias
    alias.install()
    import sglang as sgl                      # sglite's DSL under SGLang's names
    from sglang.lang.ir import REGEX_INT

or, for a script: ``python -m sglite.frontend.sglang_alias program.py [args]``.

Module paths (each an alias module that reads its attributes from the sglite module):
``sglang`` and ``sglang.api`` (``sglite``), ``sglang.lang.ir`` (``sglite.lang.ir``),
``sglang.lang.choices``, ``sglang.lang.interpreter`` (``ProgramState``), ``sglang.lang.api``,
``sglang.global_config`` / ``sglang.lang.global_config``, ``sglang.lang.backend.runtime_endpoint``,
``sglang.lang.backend.openai``, ``sglang.lang.backend.base_backend`` (``BaseBackend`` is
sglite's ``Backend``). Anything else under ``sglang`` (``sglang.srt``, ``sglang.utils`` …) is
not there: importing it raises ModuleNotFoundError.
"""
from __future__ import annotations

import importlib
import runpy
import sys
import types

#: alias → sglite module, parents before children
ALIASES = {
    "sglang": "sglite",
    "sglang.api": "sglite",
    "sglang.global_config": "sglite.frontend.global_config",
    "sglang.lang": "sglite.lang",
    "sglang.lang.ir": "sglite.lang.ir",
    "sglang.lang.api": "sglite.frontend.api",
    "sglang.lang.choices": "sglite.frontend.choices",
    "sglang.lang.interpreter": "sglite.frontend.state",
    "sglang.lang.global_config": "sglite.frontend.global_config",
    "sglang.lang.backend": "sglite.frontend.backend",
    "sglang.lang.backend.base_backend": "sglite.frontend.backend",
    "sglang.lang.backend.runtime_endpoint": "sglite.frontend.runtime_endpoint",
    "sglang.lang.backend.openai": "sglite.frontend.openai_backend",
}
#: SGLang names that sglite spells differently: alias module → {name: (sglite module, attribute)}
RENAMES = {"sglang.lang.backend.base_backend": {"BaseBackend": ("sglite.frontend.backend", "Backend")}}


class AliasModule(types.ModuleType):
    """A module named ``name`` whose attributes are read from the sglite module ``target``."""

    __sglite_alias__ = True

    def __init__(self, name: str, target: str):
        super().__init__(name, f"alias of {target}")
        self.__path__ = []  # a package: unknown submodules raise ModuleNotFoundError
        self._target = target

    def __getattr__(self, attr):
        if attr.startswith("__") and attr != "__all__":
            raise AttributeError(attr)
        renamed = RENAMES.get(self.__name__, {}).get(attr)
        if renamed is not None:
            return getattr(importlib.import_module(renamed[0]), renamed[1])
        return getattr(importlib.import_module(self._target), attr)

    def __dir__(self):
        return sorted(set(dir(importlib.import_module(self._target))) | set(self.__dict__))


def install() -> types.ModuleType:
    """Register the ``sglang`` alias modules in ``sys.modules``; returns the ``sglang`` alias.

    Idempotent. Raises:
        RuntimeError: the real ``sglang`` package is already imported in this process.
    """
    current = sys.modules.get("sglang")
    if current is not None:
        if getattr(current, "__sglite_alias__", False):
            return current
        raise RuntimeError("the real sglang package is already imported; the sglite alias cannot replace it")
    for name, target in ALIASES.items():
        mod = AliasModule(name, target)
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)
    # as in SGLang, ``sglang.global_config`` is the config object, not its module
    from .global_config import global_config
    sys.modules["sglang"].global_config = global_config
    return sys.modules["sglang"]


def uninstall() -> None:
    """Remove the alias modules from ``sys.modules`` (the real sglang may be imported after)."""
    for name in list(sys.modules):
        if (name == "sglang" or name.startswith("sglang.")) and getattr(sys.modules[name], "__sglite_alias__", False):
            del sys.modules[name]


def main(argv=None) -> None:
    """``python -m sglite.frontend.sglang_alias SCRIPT [ARGS]``: run SCRIPT with the alias installed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m sglite.frontend.sglang_alias SCRIPT [ARGS...]")
    install()
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
