"""IR of the frontend DSL: the expressions a program appends to its state with ``s += expr``.

A program is a Python function over a state ``s``; each ``s += expr`` appends one expression.
Expressions are plain data: :class:`Text`, :class:`RoleBegin` / :class:`RoleEnd`, :class:`Gen`,
:class:`Select`, :class:`VarScopeBegin` / :class:`VarScopeEnd`, and :class:`ExprList` (a
concatenation, built with ``+``). While tracing, :class:`Argument` (an argument with no value)
and :class:`VarRef` (a variable produced by an earlier op) also appear.

Semantics follow SGLang's ``sglang/lang/ir.py`` (names, dtype regexes, defaults); see
``/work/shared/reference/sglang_compat.md`` part (a).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from sglite.errors import InvalidRequestError

# SGLang's dtype regexes (ir.py REGEX_*); the str one is deliberately narrow, as upstream.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

#: sampling keys a ``gen`` may override, in SGLang's wire names
SAMPLING_KEYS = (
    "max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature",
    "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "regex",
    "json_schema",
)
#: request-level (not sampling) keys a ``gen`` may override
# request-level keys beside the sampling params: the logprob options and the LoRA adapter (lora_path)
LOGPROB_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "lora_path")


class Expr:
    """Base of every DSL expression. ``a + b`` concatenates (strings become :class:`Text`)."""

    def __add__(self, other):
        return ExprList.of(self, other)

    def __radd__(self, other):
        return ExprList.of(other, self)


def to_expr(value) -> Expr:
    """Coerce ``value`` (str or Expr) to an Expr.

    Raises:
        InvalidRequestError: for None or any other type (SGLang raises on ``s += None`` too).
    """
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise InvalidRequestError(
        f"a program can only append str or DSL expressions, got {type(value).__name__}: {value!r}",
        field="expr")


@dataclass(eq=False)
class Text(Expr):
    """Constant text appended to the prompt."""

    value: str


@dataclass(eq=False)
class ExprList(Expr):
    """A flat concatenation of expressions, appended in order."""

    items: list = field(default_factory=list)

    @staticmethod
    def of(*parts) -> "ExprList":
        """Flatten ``parts`` (str, Expr, ExprList) into one ExprList."""
        items = []
        for p in parts:
            e = to_expr(p)
            items.extend(e.items if isinstance(e, ExprList) else [e])
        return ExprList(items)


@dataclass(eq=False)
class RoleBegin(Expr):
    """Opens a chat turn: appends the template's role prefix."""

    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    """Closes a chat turn: appends the role suffix and records a message."""

    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    """Starts capturing the text appended until the matching end into variable ``name``."""

    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    """Ends a variable scope (see :class:`VarScopeBegin`)."""

    name: str


@dataclass(eq=False)
class Gen(Expr):
    """A generation call.

    ``params`` holds only the sampling keys the call set (SGLang names, see
    :data:`SAMPLING_KEYS`); unset keys inherit the run's defaults. ``logprob`` holds the set
    :data:`LOGPROB_KEYS`. ``dtype`` is already folded into ``params['regex']`` and ``stop``.
    """

    name: Optional[str]
    params: dict = field(default_factory=dict)
    logprob: dict = field(default_factory=dict)
    dtype: Any = None


@dataclass(eq=False)
class Select(Expr):
    """Choose one of ``choices`` by scoring each one's token logprobs after the prefix.

    ``choices_method`` is a :class:`~sglite.frontend.choices.ChoicesMethod`. The chosen string
    is appended to the text; the variable (and its meta) is set only when ``name`` is given.
    ``lora_path`` names the LoRA adapter the choices are scored with (None: the run's).
    """

    name: Optional[str]
    choices: list
    choices_method: Any
    temperature: float = 0.0
    lora_path: Optional[str] = None


class Argument(Expr):
    """Placeholder for a program argument given no value while tracing.

    Formatting it into a Python string (f-string, ``str()``) would bake a fake value into the
    prompt, so it raises TypeError, as SGLang's ``SglArgument`` does; use ``"text" + arg``.
    """

    def __init__(self, name: str):
        self.name = name

    def __format__(self, spec):
        raise TypeError(f"argument {self.name!r} is a placeholder while tracing: concatenate it with "
                        f"'+' instead of formatting it into a Python string")

    __str__ = __format__

    def __repr__(self):
        return f"Argument({self.name!r})"


class VarRef(Expr):
    """A variable read while tracing: stands for the text an earlier gen/select/join produced.

    ``sources`` are the graph node ids that produce it (data-dependency edges start there).
    Comparisons with a VarRef are identity comparisons (the value is unknown while tracing).
    """

    def __init__(self, name: str, sources: tuple = ()):
        self.name = name
        self.sources = tuple(sources)

    def __format__(self, spec):
        raise TypeError(f"variable {self.name!r} has no value while tracing: concatenate it with '+' "
                        f"instead of formatting it into a Python string")

    __str__ = __format__

    def __repr__(self):
        return f"VarRef({self.name!r})"


def flatten(expr) -> list:
    """The primitive expressions of ``expr`` (str/Expr/ExprList), in order."""
    e = to_expr(expr)
    return list(e.items) if isinstance(e, ExprList) else [e]
