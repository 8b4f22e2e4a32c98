"""The full check of engine options: :class:`~sglite.config.EngineConfig`'s own field checks plus
those that need a floor above the config (the JSON whitespace pattern is parsed by sglite's regex
parser, :mod:`sglite.constrained.regex_parse`, which the base floor may not import).

Every place that validates engine flags before loading anything (``sglite serve``, ``sglite
generate``, ``sglite eval``, ``sglite bench startup``) and :class:`~sglite.runtime.engine.Engine`
itself build their config here, so a bad value fails the same way everywhere.
"""
from __future__ import annotations

from typing import Optional

from ..config import EngineConfig
from ..errors import GrammarError, InvalidRequestError

__all__ = ["engine_config", "check_whitespace_pattern"]


def check_whitespace_pattern(pattern: Optional[str]) -> None:
    """Check ``constrained_json_whitespace_pattern`` (None: nothing to check).

    Raises:
        InvalidRequestError: ``field="constrained_json_whitespace_pattern"``, the message
            ``"constrained_json_whitespace_pattern: invalid regex: ..."`` when sglite's regex
            parser rejects the pattern.
    """
    if pattern is None:
        return
    from ..constrained.regex_parse import parse_regex  # the grammar package imports torch: only when set

    try:
        parse_regex(pattern)
    except GrammarError as e:
        name = "constrained_json_whitespace_pattern"
        raise InvalidRequestError(f"{name}: invalid regex: {e}", field=name) from None


def engine_config(**kwargs) -> EngineConfig:
    """:meth:`EngineConfig.from_kwargs` plus :func:`check_whitespace_pattern`.

    Raises:
        InvalidRequestError: an unknown option or a bad value, naming the field.
    """
    cfg = EngineConfig.from_kwargs(**kwargs)
    check_whitespace_pattern(cfg.constrained_json_whitespace_pattern)
    return cfg
