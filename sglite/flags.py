"""Command-line flags generated from config dataclasses, with SGLang's spelling.

One source for names, types, defaults and help: the fields of :class:`sglite.config.EngineConfig`
(and of any other config dataclass passed to :func:`add_config_args`, e.g. the server's
``ServerConfig``) and the ``Attributes:`` / ``Args:`` section of their docstrings. A base-floor
module: it imports nothing of sglite but the config. A field ``max_running_requests`` becomes ``--max-running-requests`` with the
first sentence of its docstring entry and its default as help. Booleans read as SGLang's: a
field that defaults to False is a ``store_true`` flag (``--disable-radix-cache``); one that
defaults to True is switched off by its ``--disable-…`` form (``enable_jump_forward`` ->
``--disable-jump-forward``, SGLang's older ``--disable-regex-jump-forward`` too). There are no
``--no-…`` forms.

Flags of features that arrive with later issues (:data:`UNSUPPORTED`) are known, so that using them
fails with "… is not supported yet" instead of being silently accepted; their default values
(``--tp-size 1``) are accepted as no-ops.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
from typing import Any, Iterable, Optional, Sequence

from .config import (DTYPES, GRAMMAR_BACKENDS, KV_CACHE_DTYPES, LORA_DTYPES, SCHEDULE_POLICIES,
                     SPECULATIVE_ALGORITHMS, SPECULATIVE_VERIFY, EngineConfig)

CHOICES = {"dtype": DTYPES, "schedule_policy": SCHEDULE_POLICIES, "grammar_backend": GRAMMAR_BACKENDS,
           "kv_cache_dtype": KV_CACHE_DTYPES, "lora_dtype": LORA_DTYPES,
           "cpu_decode_gemv": ("auto", "cpp", "fp16", "off"), "device": None,
           "log_level": ("debug", "info", "warning", "error", "critical"),
           "speculative_algorithm": SPECULATIVE_ALGORITHMS, "speculative_verify": SPECULATIVE_VERIFY}
# Defaults resolved at start-up, shown in --help as what they become rather than "None".
SHOWN_DEFAULTS = {"num_threads": "the fastest measured at start-up for batch-1 decode (cached per machine and model), "
                                  "else CPU cores - 1"}
# Values matched case-insensitively (``--speculative-algorithm ngram``).
NORMALIZE = {"speculative_algorithm": str.upper}
# Extra spellings people type (SGLang's or vLLM's names of the same option).
ALIASES = {"context_length": ("--max-model-len",)}
# List-valued fields (``--lora-paths a=/x b=/y``).
NARGS = {"lora_paths": "+"}
# Default-True booleans: the flags that switch them off (SGLang's names where it has one).
DISABLE_FLAGS = {"enable_jump_forward": ("--disable-jump-forward", "--disable-regex-jump-forward"),
                 "json_schema_strict": ("--disable-json-schema-strict",)}


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A flag of a feature sglite does not have yet: ``accepted`` values are no-ops, others fail."""

    flag: str
    feature: str
    accepted: tuple = ()
    type: Any = str


UNSUPPORTED: tuple = ()
UNSUPPORTED_PREFIXES: dict = {}


def flag_name(field: str) -> str:
    """``max_running_requests`` -> ``--max-running-requests``."""
    return "--" + field.replace("_", "-")


def field_docs(cls) -> dict[str, str]:
    """``{field: description}`` from the ``Attributes:`` or ``Args:`` section of ``cls.__doc__``
    (Google style: ``name: text`` lines, continuation lines indented deeper), one line each,
    RST double backquotes removed."""
    lines = (cls.__doc__ or "").expandtabs().splitlines()
    docs: dict[str, list[str]] = {}
    start = next((i for i, ln in enumerate(lines) if ln.strip() in ("Attributes:", "Args:")), None)
    if start is None:
        return {}
    entry_indent, current = None, None
    for ln in lines[start + 1:]:
        if not ln.strip():
            continue
        indent = len(ln) - len(ln.lstrip())
        m = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(\([^)]*\))?:\s*(.*)$", ln)
        if entry_indent is None and m:
            entry_indent = indent
        if entry_indent is not None and indent < entry_indent:
            break  # the section ended
        if m and indent == entry_indent:
            current = m.group(1)
            docs[current] = [m.group(3)]
        elif current is not None:
            docs[current].append(ln.strip())
    return {k: " ".join(" ".join(v).replace("``", "").split()) for k, v in docs.items()}


def first_sentence(text: str) -> str:
    """Text up to the first ``". "`` outside parentheses (the whole text when there is none)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "." and depth <= 0 and (i + 1 == len(text) or text[i + 1] == " "):
            return text[: i + 1]
    return text


def help_text(doc: Optional[str], default: Any) -> str:
    """One line of help: the first sentence of ``doc`` and ``(default: ...)``, %-escaped for argparse."""
    if not doc:
        raise ValueError("every config field needs a docstring entry (the flag help is read from it)")
    shown = "off" if default is False else "on" if default is True else default
    return f"{first_sentence(doc).rstrip('.')} (default: {shown})".replace("%", "%%")


def _scalar_type(annotation) -> type:
    a = str(annotation)
    return int if "int" in a else float if "float" in a else bool if "bool" in a else str


class _RejectUnsupported(argparse.Action):
    """Accepts the no-op values of an :class:`Unsupported` flag; anything else is an error."""

    def __init__(self, option_strings, dest, spec: Unsupported, **kw):
        self.spec = spec
        super().__init__(option_strings, dest, type=spec.type, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if values not in self.spec.accepted:
            only = f" (only {', '.join(map(str, self.spec.accepted))})" if self.spec.accepted else ""
            raise argparse.ArgumentError(self, f"{self.spec.feature} is not supported yet{only}; got {values!r}")


class FlagParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose error for an unknown flag is clear: a flag of a feature that
    is not there yet says so, a typo gets the closest known flags."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("usage", "%(prog)s [options]  (all flags: --help)")
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):  # noqa: D401 - argparse's signature
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            known = set(self._option_string_actions)
            for a in self._actions:  # sub-commands' flags too (their unknown flags land here)
                if isinstance(a, argparse._SubParsersAction):
                    for sp in a.choices.values():
                        known |= set(sp._option_string_actions)
            self.error(unknown_flags_message(extras, known))
        return ns


def unknown_flags_message(extras: Sequence[str], known: Iterable[str]) -> str:
    """The error text for arguments argparse did not recognize."""
    known = sorted(k for k in known if k.startswith("--"))
    parts = []
    prev_flag = False
    for x in extras:
        name = x.split("=", 1)[0]
        if not name.startswith("-"):
            if not prev_flag:  # a value right after an unknown flag is that flag's value
                parts.append(f"unexpected argument {x!r}")
            prev_flag = False
            continue
        prev_flag = "=" not in x
        feature = next((f for p, f in UNSUPPORTED_PREFIXES.items() if name.startswith(p)), None)
        if feature:
            parts.append(f"{name}: {feature} is not supported yet")
            continue
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        parts.append(f"unrecognized flag {name}{hint}")
    return "; ".join(parts) + " (see --help)"


def add_config_args(parser, cls, skip: Iterable[str] = (), title: Optional[str] = None,
                    defaults_none: bool = True):
    """Add one flag per field of the dataclass ``cls`` to ``parser`` (or to a new argument
    group titled ``title``). Flags default to None ("not given": the dataclass default applies)
    unless ``defaults_none`` is False. Returns the field names added.

    Raises:
        ValueError: a field without a docstring entry, or a default-True boolean with no
            ``--disable-…`` spelling (both are bugs of the config class, caught by the tests).
    """
    docs = field_docs(cls)
    target = parser.add_argument_group(title) if title else parser
    added = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.name not in docs:
            raise ValueError(f"{cls.__name__}.{f.name}: no docstring entry (the flag help is read from it)")
        typ = _scalar_type(f.type)
        default = f.default
        hlp = help_text(docs[f.name], SHOWN_DEFAULTS.get(f.name, default))
        flags = (flag_name(f.name),) + ALIASES.get(f.name, ())
        if typ is bool:
            if default is True:
                off = DISABLE_FLAGS.get(f.name) or (
                    ("--disable-" + f.name[len("enable_"):].replace("_", "-"),) if f.name.startswith("enable_")
                    else None)
                if off is None:
                    raise ValueError(f"{cls.__name__}.{f.name}: a default-True boolean needs a --disable-... name")
                target.add_argument(*off, dest=f.name, action="store_const", const=False,
                                    default=None if defaults_none else True, help=f"turn off: {hlp}")
            else:
                target.add_argument(*flags, dest=f.name, action="store_true",
                                    default=None if defaults_none else False, help=hlp)
        else:
            target.add_argument(*flags, dest=f.name, type=NORMALIZE.get(f.name, typ), default=None if defaults_none else default,
                                choices=CHOICES.get(f.name), help=hlp, metavar=f.name.upper(), nargs=NARGS.get(f.name))
        added.append(f.name)
    return added


def add_engine_args(parser, title: str = "engine (sglite.EngineConfig)") -> argparse.ArgumentParser:
    """Add every :class:`EngineConfig` flag (default None = not given) and the not-yet-supported
    feature flags to ``parser``."""
    add_config_args(parser, EngineConfig, title=title)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    g = parser.add_argument_group("not supported yet (accepted only with their no-op value)")
    for spec in UNSUPPORTED:
        if spec.flag[2:].replace("-", "_") in fields:
            continue  # the feature arrived: its config field owns the flag
        dflt = spec.accepted[0] if spec.accepted else None
        g.add_argument(spec.flag, action=_RejectUnsupported, spec=spec, default=None,
                       dest="unsupported_" + spec.flag[2:].replace("-", "_"), metavar="VALUE",
                       help=f"{spec.feature}: not supported yet (default: {dflt})")
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments given on the command line (flags left out are absent)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def flag_for_field(parser: argparse.ArgumentParser, field: Optional[str]) -> Optional[str]:
    """The flag of ``parser`` that sets ``field`` (every spelling: ``--context-length/--max-model-len``),
    or None."""
    if not field:
        return None
    for a in parser._actions:
        if a.dest == field and a.option_strings:
            return "/".join(a.option_strings)
    return None


def config_error(parser: argparse.ArgumentParser, exc: ValueError) -> str:
    """``exc`` (an ``InvalidRequestError`` naming a config field) worded with the flag's name:
    ``"--max-running-requests: must be >= 1, got 0"``."""
    field = getattr(exc, "field", None)
    msg = str(exc)
    flag = flag_for_field(parser, field)
    if flag and field:
        msg = msg.replace(f"sampling_params.{field}", field)
        if msg.startswith(field + ":") or msg.startswith(field + "="):
            msg = flag + msg[len(field):]
        elif field in msg:
            msg = msg.replace(field, flag, 1)
        else:
            msg = f"{flag}: {msg}"
    return msg


def fail(parser: argparse.ArgumentParser, exc: ValueError) -> None:
    """Exit with argparse's usage error (status 2) carrying :func:`config_error`."""
    parser.print_usage(sys.stderr)
    parser.exit(2, f"{parser.prog}: error: {config_error(parser, exc)}\n")
