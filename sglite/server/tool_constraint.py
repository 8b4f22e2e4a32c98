"""The constraint of a chat request with tools, response_format and reasoning: one grammar per turn.

* ``tool_choice`` ``"auto"`` (constrained unless ``--disable-tool-call-constraint``): free text,
  and from the family's tool-call opener on, ``{"name": <one of the tools>, <args key>: <that
  tool's parameters schema>}`` in the family's shape, then its closer; then free text again (or
  the end of the output, with ``parallel_tool_calls: false``). A structural tag
  (:mod:`sglite.constrained.structural_tag`, XGrammar's "triggered tags"), so a call that does
  not parse cannot be generated, while text stays free.
* ``"auto"`` with ``response_format`` (or ``regex`` / ``ebnf``): the output is either tool calls
  (nothing else around them) or text following the schema: the ``or`` of the two.
* a forced tool (``"required"`` or named): one or more calls and nothing else, in the family's
  own markup (:func:`forced_format`: its opener, text or special token, then the calls), else
  (pythonic, or a backend without structural tags) as bare JSON (a ``json_schema`` of
  ``{"name", "arguments"}``).
* a forced tool with ``response_format``: the call decides the turn, so
  the call's schema is the constraint and the format (which applies to a text answer, which a
  forced turn cannot have) is dropped. OpenAI accepts the pair; the OpenAI Agents SDK sends it for
  every agent with an ``output_type``.
* with a reasoning parser (``qwen3``, ``deepseek-r1``: end marker ``</think>``), whatever
  constraint the request has applies only after the marker: the thinking is free text (SGLang's
  and vLLM's behaviour). Not when the prompt already ends with the marker (thinking switched off
  by the template, e.g. ``enable_thinking: false``).

With ``--grammar-backend xgrammar|llguidance`` (comparison adapters without structural tags)
"auto" stays free and grammars are not gated. Families whose opener is a special token (llama3's
``<|python_tag|>``, mistral's ``[TOOL_CALLS]``, granite's ``<|tool_call|>``) trigger on the token
id (:func:`grammar_opener`: the grammar's vocabulary gives those tokens the bytes NUL + their text,
:data:`~sglite.constrained.tokenizer_info.TRIGGER_SPECIAL_TOKENS`); the server then keeps special
tokens in the output text, so the parsers see the opener. Their forced calls begin with the
same token (NUL is the openers' alone in such a vocabulary, so the grammar cannot spell one out of
text tokens, and jump-forward stops before it: the model samples the token). Pythonic "auto"
calls are triggered by ``[<tool name>(`` and follow a grammar of Python literals built from the
tool schemas (:mod:`sglite.server.tool_parsers.pythonic_grammar`); with the request's own
constraint too, they are left free.
"""
from __future__ import annotations

import json
from typing import Optional

from ..constrained.structural_tag import constraint_format, reasoning_gated
from ..constrained.tokenizer_info import TRIGGER_SPECIAL_TOKENS, special_trigger
from .tool_calls import ToolPlan
from .tool_parsers.formats import ToolCallFormat, get_format
from .tool_parsers.pythonic_grammar import pythonic_format

REASONING_END = {"qwen3": "</think>", "deepseek-r1": "</think>"}  # SGLang's --reasoning-parser names
_GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


def reasoning_end_marker(reasoning_parser: Optional[str]) -> Optional[str]:
    """The end-of-reasoning marker of a ``--reasoning-parser`` name (None: no parser).

    Raises:
        ValueError: an unknown parser name (the message lists the known ones).
    """
    if reasoning_parser is None:
        return None
    if reasoning_parser not in REASONING_END:
        raise ValueError(f"reasoning_parser: unknown parser {reasoning_parser!r}; known: {sorted(REASONING_END)}")
    return REASONING_END[reasoning_parser]


def _call_tag(fn: dict, fmt: ToolCallFormat, begin: str = "", end: str = "") -> dict:
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    head = '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "' + fmt.args_key + '": '
    return {"type": "tag", "begin": begin + head, "content": {"type": "json_schema", "json_schema": params},
            "end": "}" + end}


def _sections(tools: list[dict], fmt: ToolCallFormat, parallel: bool,
              opener: Optional[str] = None) -> Optional[list[dict]]:
    """Tags, each a whole tool-call section beginning with the opener (None: not constrainable).
    ``opener``: the opener as the grammar sees it (default ``fmt.opener``; a special token's is
    :func:`grammar_opener`'s)."""
    fns = [t["function"] for t in tools]
    opener = fmt.opener if opener is None else opener
    if fmt.shape == "pythonic" or not opener:
        return None
    if fmt.per_call:
        return [_call_tag(fn, fmt, opener + fmt.pad, fmt.pad + fmt.closer) for fn in fns]
    inner = {"type": "tags_with_separator", "tags": [_call_tag(fn, fmt) for fn in fns],
             "separator": fmt.separator if fmt.shape == "json_object" else ", ",
             "at_least_one": True, "stop_after_first": not parallel}
    if fmt.shape == "json_list":
        return [{"type": "tag", "begin": opener + "[", "content": inner, "end": "]" + fmt.closer}]
    return [{"type": "tag", "begin": opener, "content": inner, "end": fmt.closer}]


def auto_tools_format(tools: list[dict], fmt: ToolCallFormat, parallel: bool,
                      opener: Optional[str] = None) -> Optional[dict]:
    """Structural-tag format of "auto": free text with constrained calls after the opener
    (``opener``: as the grammar sees it, see :func:`grammar_opener`)."""
    tags = _sections(tools, fmt, parallel, opener)
    if tags is None:
        return None
    trigger = (fmt.opener if opener is None else opener).rstrip()
    return {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
            "at_least_one": False, "stop_after_first": not parallel}


def calls_only_format(tools: list[dict], fmt: ToolCallFormat, parallel: bool,
                      opener: Optional[str] = None) -> Optional[dict]:
    """Structural-tag format of one or more calls and nothing else (the tool side of a union)."""
    tags = _sections(tools, fmt, parallel, opener)
    if tags is None:
        return None
    sep = fmt.separator if fmt.per_call else ""
    return {"type": "tags_with_separator", "tags": tags, "separator": sep, "at_least_one": True,
            "stop_after_first": not parallel or not fmt.per_call}


def opener_is_text(engine, opener: str) -> bool:
    """False when ``opener`` is a special token of the engine's tokenizer (a grammar cannot
    produce it); True when it is text or the tokenizer is unknown."""
    hf = getattr(getattr(engine, "tokenizer", None), "hf", None)
    added = getattr(hf, "added_tokens_decoder", None) or {}
    want = opener.strip()
    return not any(getattr(t, "content", None) == want and getattr(t, "special", False) for t in added.values())


def grammar_opener(engine, fmt: ToolCallFormat) -> Optional[str]:
    """The family's opener as a constrained "auto" grammar sees it: the text itself, or for a
    special-token opener (llama3's ``<|python_tag|>``, mistral's ``[TOOL_CALLS]``, granite's
    ``<|tool_call|>``) its :func:`~sglite.constrained.tokenizer_info.special_trigger` form, which
    matches the token id (then what the format writes after it, e.g. mistral's space). None:
    nothing to trigger on (pythonic has no opener)."""
    if not fmt.opener:
        return None
    if engine is None or opener_is_text(engine, fmt.opener):
        return fmt.opener
    token = fmt.opener.strip()
    if token not in TRIGGER_SPECIAL_TOKENS:
        return None
    return special_trigger(token) + fmt.opener[fmt.opener.index(token) + len(token):]


def structural_tags_supported(engine) -> bool:
    """Whether the engine's grammar backend compiles structural tags (sglite's own does; the
    llguidance / xgrammar comparison adapters do not): without, "auto" stays unconstrained and
    grammars are not gated by reasoning."""
    backend = getattr(getattr(engine, "config", None), "grammar_backend", "sglite")
    return backend == "sglite" or not isinstance(backend, str)


def forced_format(plan: ToolPlan, fmt: ToolCallFormat, engine=None) -> Optional[dict]:
    """Structural-tag format of a forced turn written in the family's own markup (e.g. hermes'
    ``<tool_call>\\n{...}\\n</tool_call>``): only the plan's tools (a named choice: that one),
    one call, or several with ``parallel_tool_calls``. This is what the chat template renders for
    the assistant's calls on the next turn, so that turn's prompt extends this one's prompt and
    output token for token (the radix cache hits). A special-token opener (llama3's
    ``<|python_tag|>``, mistral's ``[TOOL_CALLS]``, granite's ``<|tool_call|>``) is asked for by
    its :func:`grammar_opener` form, so the turn begins with the token id itself, as the model
    writes it natively. None where the family has no opener (pythonic), the opener is a special
    token the grammar's vocabulary cannot trigger on, or the grammar backend has no structural
    tags: then the call is forced as bare JSON (``plan.schema``)."""
    if engine is not None and not structural_tags_supported(engine):
        return None
    opener = grammar_opener(engine, fmt)
    if opener is None:
        return None
    return calls_only_format(plan.tools, fmt, plan.parallel, opener)


def apply_constraint(sp: dict, rename: dict, plan: ToolPlan, *, constrain_auto: bool = True,
                     fmt: Optional[ToolCallFormat] = None, engine=None, reasoning_end: Optional[str] = None,
                     prompt: str = "") -> None:
    """Set the turn's grammar in the engine sampling params ``sp`` (in place; ``rename`` gets the
    request field that GrammarErrors are blamed on). See the module docstring for the rules."""
    fmt = fmt or get_format(None)
    if engine is not None and not structural_tags_supported(engine):
        constrain_auto, reasoning_end = False, None
    if plan.mode == "forced":
        for k in _GRAMMAR_KEYS:
            sp.pop(k, None)
        own = forced_format(plan, fmt, engine)
        if own is not None:
            sp["structural_tag"] = json.dumps({"type": "structural_tag", "format": own})
            rename["structural_tag"] = rename["grammar"] = "tools"
        else:
            sp["json_schema"] = json.dumps(plan.schema)
            rename["json_schema"] = rename["grammar"] = "tools"
    elif plan.mode == "auto" and constrain_auto and fmt.shape == "pythonic":
        if not any(k in sp for k in _GRAMMAR_KEYS):  # with the request's own constraint: left free
            tag = pythonic_format(plan.tools, plan.parallel)
            if tag is not None:
                sp["structural_tag"] = json.dumps({"type": "structural_tag", "format": tag})
                rename["structural_tag"] = rename["grammar"] = "tools"
    elif plan.mode == "auto" and constrain_auto and grammar_opener(engine, fmt) is not None:
        opener = grammar_opener(engine, fmt)
        own = next((k for k in _GRAMMAR_KEYS if k in sp), None)
        if own is None:
            tag = auto_tools_format(plan.tools, fmt, plan.parallel, opener)
        else:
            calls = calls_only_format(plan.tools, fmt, plan.parallel, opener)
            tag = None if calls is None else {"type": "or", "elements": [calls, constraint_format(own, sp[own])]}
            if tag is not None:
                del sp[own]
        if tag is not None:
            sp["structural_tag"] = json.dumps({"type": "structural_tag", "format": tag})
            rename["structural_tag"] = rename["grammar"] = "tools"
    if reasoning_end and not prompt.rstrip().endswith(reasoning_end):
        own = next((k for k in _GRAMMAR_KEYS if k in sp), None)
        if own is not None:
            was = rename.get(own, own)
            sp["structural_tag"] = json.dumps(reasoning_gated(reasoning_end, constraint_format(own, sp.pop(own))))
            rename["structural_tag"] = rename["grammar"] = was
