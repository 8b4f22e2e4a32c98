"""Parsers of ``EngineConfig`` values given as text or lists (``disaggregation_peers``,
``lora_paths``), re-exported by :mod:`sglite.config`."""
from __future__ import annotations

from .errors import InvalidRequestError


def parse_peers(text: str) -> frozenset:
    """``"host:port,host:port"`` (``[v6]:port`` too) -> a frozenset of ``(host, port)``, hosts
    lower-cased. Raises ValueError naming the bad entry."""
    out = set()
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        host = host.strip("[]").lower()
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"must be host:port entries separated by commas, got {item!r}")
        out.add((host, int(port)))
    if not out:
        raise ValueError(f"no host:port entry in {text!r}")
    return frozenset(out)


def parse_lora_paths(value) -> tuple:
    """``{"name": path}``, ``["name=path", ...]`` (SGLang's ``--lora-paths``) or ``["path", ...]``
    (named by the path) -> ``((name, path), ...)``; None -> ``()``. Raises InvalidRequestError
    naming ``lora_paths`` for a malformed entry or a repeated name."""
    if value is None:
        return ()
    if isinstance(value, dict):
        items = [(str(k), str(v)) for k, v in value.items()]
    else:
        items = []
        for v in ([value] if isinstance(value, str) else list(value)):
            if isinstance(v, (tuple, list)) and len(v) == 2:
                items.append((str(v[0]), str(v[1])))
            elif isinstance(v, str) and v:
                name, sep, path = v.partition("=")
                items.append((name, path) if sep else (v, v))
            else:
                raise InvalidRequestError(f"lora_paths: entries must be 'name=path' strings, got {v!r}",
                                          field="lora_paths")
    names = [n for n, _ in items]
    if len(set(names)) != len(names) or not all(names):
        raise InvalidRequestError(f"lora_paths: adapter names must be non-empty and unique, got {names}",
                                  field="lora_paths")
    return tuple(items)
