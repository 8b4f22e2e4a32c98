"""SamplingParams: the per-request sampling and stopping options, validated.

The dict form (``to_dict`` / ``from_dict``) is also the wire format of the native HTTP API
(SGLang's ``sampling_params`` keys). No torch here.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import regex as _regex  # the stop regexes' module (runtime/detokenizer.py); `regex` is a field here

from .errors import InvalidRequestError

_CONSTRAINT_KEYS = ("regex", "json_schema", "ebnf", "lark", "structural_tag")


@dataclass
class SamplingParams:
    """Sampling and stopping options of one request (SGLang's names).

    Lengths are in tokens. ``temperature == 0`` means greedy. ``top_k == -1`` disables top-k.
    ``stop`` strings are trimmed from the output unless ``no_stop_trim``. At most one of
    ``regex``, ``json_schema``, ``ebnf``, ``lark``, ``structural_tag`` may be set (``structural_tag``:
    SGLang's / XGrammar's structural tag, JSON text or a dict; see
    :mod:`sglite.constrained.structural_tag`).

    Raises:
        InvalidRequestError (a ``ValueError``) from :meth:`validate` / :meth:`from_dict`,
        naming the field and the limit.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    stop_regex: Optional[list[str]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: Optional[str] = None
    json_schema: Optional[Any] = None  # str (JSON text) or dict
    ebnf: Optional[str] = None
    lark: Optional[str] = None
    structural_tag: Optional[Any] = None  # str (JSON text) or dict
    n: int = 1
    sampling_seed: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None

    # ------------------------------------------------------------------ validation
    def validate(self, vocab_size: Optional[int] = None) -> "SamplingParams":
        """Check every field; normalise ``stop`` to a list. Returns self.

        Raises:
            InvalidRequestError: naming the field and the allowed range.
        """
        def bad(name: str, msg: str):
            raise InvalidRequestError(f"sampling_params.{name}: {msg}", field=name)

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        if isinstance(self.stop_token_ids, int) and not isinstance(self.stop_token_ids, bool):
            self.stop_token_ids = [self.stop_token_ids]
        for name in ("stop", "stop_regex", "stop_token_ids"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (list, tuple)):
                bad(name, f"must be a list (or a single value), got {type(v).__name__}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be true or false, got {getattr(self, name)!r}")
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(name, f"must be an integer, got {v!r}")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")
        if self.max_new_tokens > 1 << 30:
            bad("max_new_tokens", f"must be <= {1 << 30}, got {self.max_new_tokens}")
        if self.max_new_tokens < 0:
            bad("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            bad("min_new_tokens", f"must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", f"must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1 or self.top_k > 1 << 30:
            bad("top_k", f"must be -1 (disabled) or in [1, {1 << 30}], got {self.top_k}")
        if self.temperature > 1000:
            bad("temperature", f"must be <= 1000, got {self.temperature}")
        if not (0 <= self.min_p <= 1):
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not (-2 <= getattr(self, name) <= 2):
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not (0.01 <= self.repetition_penalty <= 2):
            bad("repetition_penalty", f"must be in [0.01, 2], got {self.repetition_penalty}")
        if not (1 <= self.n <= 128):
            bad("n", f"must be in [1, 128], got {self.n}")
        for s in self.stop or []:
            if not isinstance(s, str):
                bad("stop", f"entries must be strings, got {s!r}")
            if s == "":
                bad("stop", "stop strings must not be empty")
        for s in self.stop_regex or []:
            if not isinstance(s, str) or s == "":
                bad("stop_regex", f"entries must be non-empty strings, got {s!r}")
            try:  # the module the detokenizer searches with (runtime/detokenizer.py)
                _regex.compile(s)
            except (_regex.error, RecursionError, OverflowError) as e:
                bad("stop_regex", f"invalid regex {s!r}: {e}")
        for t in self.stop_token_ids or []:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size and t >= vocab_size):
                bad("stop_token_ids", f"entries must be token ids in [0, {vocab_size}), got {t!r}")
        if self.sampling_seed is not None and (isinstance(self.sampling_seed, bool) or not isinstance(self.sampling_seed, int)
                                               or not -2**63 <= self.sampling_seed < 2**64):
            bad("sampling_seed", f"must be a 64-bit integer, got {self.sampling_seed!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must be a mapping token_id -> bias")
            fixed = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    bad("logit_bias", f"keys must be token ids, got {k!r}")
                if tid < 0 or (vocab_size and tid >= vocab_size):
                    bad("logit_bias", f"token id {tid} outside [0, {vocab_size})")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (-100 <= v <= 100):
                    bad("logit_bias", f"bias for token {tid} must be a number in [-100, 100], got {v!r}")
                fixed[tid] = float(v)
            self.logit_bias = fixed
        set_constraints = [k for k in _CONSTRAINT_KEYS if getattr(self, k) is not None]
        if len(set_constraints) > 1:
            bad(set_constraints[1], f"only one constraint may be set, got {', '.join(set_constraints)}")
        if self.regex is not None:
            if not isinstance(self.regex, str):
                bad("regex", "must be a string")
            try:
                re.compile(self.regex)
            except (re.error, RecursionError, OverflowError) as e:
                bad("regex", f"invalid regex: {str(e)[:200] or type(e).__name__}")
        return self

    @property
    def constraint(self) -> Optional[tuple[str, Any]]:
        """``(kind, spec)`` of the grammar constraint, or None."""
        for k in _CONSTRAINT_KEYS:
            v = getattr(self, k)
            if v is not None:
                return k, v
        return None

    # ------------------------------------------------------------------ wire format
    def to_dict(self) -> dict:
        """Plain-dict form (only non-default fields)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, d: Optional[dict], vocab_size: Optional[int] = None) -> "SamplingParams":
        """Build and validate from a dict. Unknown keys raise InvalidRequestError naming them."""
        if d is None:
            d = {}
        if isinstance(d, SamplingParams):
            return dataclasses.replace(d).validate(vocab_size)
        if not isinstance(d, dict):
            raise InvalidRequestError("sampling_params must be a dict", field="sampling_params")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequestError(
                f"sampling_params: unknown key(s) {unknown}; known keys: {sorted(known)}", field=unknown[0])
        kw = {k: v for k, v in d.items() if v is not None}  # None means "the default" for every key
        return cls(**kw).validate(vocab_size)
