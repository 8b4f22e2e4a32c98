"""The grammar of pythonic tool calls (``[get_weather(city="Paris"), get_time()]``), built from the
tools' parameter schemas, for constrained "auto" calls of ``--tool-call-parser pythonic``.

A structural tag (:mod:`sglite.constrained.structural_tag`) triggered by ``[<tool name>(`` (one
trigger per tool; the text before it stays free): then that tool's keyword arguments, ``)``, and
with ``parallel_tool_calls`` more calls ``, name(...)``, then ``]``. Each tool's arguments are its
schema's properties in declared order, ``name=value``, separated by ``", "``; required ones
always, optional ones may be left out. A value is a Python literal of the property's JSON type
(``string``: a double-quoted string; ``integer`` / ``number``; ``boolean``: ``True`` / ``False``;
``null``: ``None``; ``array``: a list; ``object``: a dict with string keys; an ``enum`` or
``const``: exactly its values; anything else: any literal). So a call under the grammar always
parses with :func:`sglite.server.tool_parsers.pythonic.parse_pythonic_calls` (``ast``), names one
of the tools and passes only its parameters; values are typed by their top-level JSON type (nested
constraints, string formats and bounds are not checked: a Python-literal grammar per JSON schema
is not built). A tool with ``additionalProperties`` or without properties takes none beyond them.

Calls written with spaces inside the opener (``[ get_weather (``) are free text to the grammar (the
parser still reads them, or returns them as content).
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

from .formats import _py_literal

# GBNF of Python literals (ast.literal_eval reads them; json.dumps-style strings)
_LITERALS = r'''
pystr ::= "\"" ( [^"\\\x00-\x1f] | "\\" ["\\bfnrt] | "\\u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] )* "\""
pyint ::= "-"? ( "0" | [1-9] [0-9]* )
pynum ::= pyint ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
pybool ::= "True" | "False"
pynone ::= "None"
pylist ::= "[" ( pyval ( ", " pyval )* )? "]"
pydict ::= "{" ( pystr ": " pyval ( ", " pystr ": " pyval )* )? "}"
pyval ::= pystr | pynum | pybool | pynone | pylist | pydict
'''
_BY_TYPE = {"string": "pystr", "integer": "pyint", "number": "pynum", "boolean": "pybool", "null": "pynone",
             "array": "pylist", "object": "pydict"}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _lit(text: str) -> str:
    """A GBNF string literal of ``text``."""
    return json.dumps(text, ensure_ascii=False)


def _value(schema: Any) -> str:
    """A GBNF expression of one property's values (see the module docstring)."""
    if not isinstance(schema, dict):
        return "pyval"
    if "const" in schema:
        return _lit(_py_literal(schema["const"]))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return "( " + " | ".join(_lit(_py_literal(v)) for v in schema["enum"]) + " )"
    t = schema.get("type")
    if isinstance(t, list):
        kinds = [_BY_TYPE[k] for k in t if k in _BY_TYPE]
        return "( " + " | ".join(kinds) + " )" if kinds and len(kinds) == len(t) else "pyval"
    return _BY_TYPE.get(t, "pyval")


def _args_rules(key: str, params: Any) -> Optional[list[str]]:
    """Rules ``<key>a0`` (arguments, none emitted yet) / ``<key>b<i>`` (after one), or None when a
    property name is not a Python identifier (such a tool cannot be called pythonically)."""
    props = params.get("properties") if isinstance(params, dict) else None
    props = props if isinstance(props, dict) else {}
    required = set(params.get("required") or []) if isinstance(params, dict) else set()
    items = list(props.items())
    if any(not _IDENT.match(name) for name, _ in items):
        return None
    n, rules = len(items), []
    for i, (name, sch) in enumerate(items):
        kv = f'{_lit(name + "=")} {_value(sch)}'
        a_next = f"{key}a{i + 1}" if i + 1 < n else None
        b_next = f"{key}b{i + 1}" if i + 1 < n else None
        tail_b = f" {b_next}" if b_next else ""
        if name in required:
            rules.append(f"{key}a{i} ::= {kv}{tail_b}")
            rules.append(f"{key}b{i} ::= \", \" {kv}{tail_b}")
        else:
            rules.append(f"{key}a{i} ::= ( {kv}{tail_b} )" + (f" | {a_next}" if a_next else ""))
            rules.append(f"{key}b{i} ::= ( \", \" {kv} )?{tail_b}")
    return rules


def pythonic_format(tools: list[dict], parallel: bool) -> Optional[dict]:
    """Structural-tag format of constrained "auto" pythonic calls (see the module docstring);
    None when no tool can be called pythonically (names or parameters that are not identifiers)."""
    rules, calls, ok = [_LITERALS.strip()], [], []
    for k, t in enumerate(tools):
        fn = t["function"]
        name = fn["name"]
        args = _args_rules(f"t{k}", fn.get("parameters") or {})
        if args is None or not _IDENT.match(name):
            continue
        rules += args
        params = fn.get("parameters") or {}
        needed = set(params.get("required") or []) & set(params.get("properties") or {})
        body = "" if not args else f"t{k}a0 " if needed else f"t{k}a0? "
        rules.append(f"t{k}args ::= {body}\")\"")
        calls.append(f"{_lit(name + '(')} t{k}args")
        ok.append((k, name))
    if not ok:
        return None
    rules.append("call ::= " + " | ".join(calls))
    tags = []
    for k, name in ok:
        more = ' ( ", " call )*' if parallel else ""
        grammar = "\n".join([f"root ::= t{k}args{more}", *rules])
        tags.append({"type": "tag", "begin": f"[{name}(", "content": {"type": "grammar", "grammar": grammar},
                     "end": "]"})
    return {"type": "triggered_tags", "triggers": [f"[{name}(" for _, name in ok], "tags": tags,
            "at_least_one": False, "stop_after_first": not parallel}
