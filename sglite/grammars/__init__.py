"""Builtin grammars shipped with sglite (lark syntax): ``read(name)`` returns the text."""
from __future__ import annotations

from importlib import resources


def available() -> list[str]:
    """Names of the builtin grammars (file stems), sorted."""
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".lark"))


def read(name: str) -> str:
    """Text of builtin grammar ``name`` (e.g. ``"json"``). Raises ValueError listing known names."""
    if name not in available():
        raise ValueError(f"unknown grammar {name!r}; available: {', '.join(available())}")
    return resources.files(__name__).joinpath(f"{name}.lark").read_text(encoding="utf-8")
