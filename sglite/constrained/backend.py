"""GrammarBackend: compiles specs to :class:`CompiledGrammar` (cached, optionally on a thread pool)."""
from __future__ import annotations

import importlib
import json
from concurrent.futures import Future, ThreadPoolExecutor

from sglite.errors import GrammarError

from . import ast as A
from .compiled import CompiledGrammar
from .grammar import Automaton
from .grammar_cache import GrammarCache
from .protocols import GrammarBackendProtocol
from .regex_parse import parse_regex
from .tokenizer_info import TokenizerInfo

KINDS = ("regex", "json_schema", "json_object", "ebnf", "lark", "choices", "structural_tag")


def _choices_rules(spec) -> dict:
    if isinstance(spec, str) or not all(isinstance(c, str) for c in spec) or not spec:
        raise GrammarError("choices must be a non-empty list of strings")
    return {"root": A.alt(*[A.lit(c) for c in spec])}


def build_rules(kind: str, spec, whitespace_pattern: str | None, json_schema_strict: bool = True) -> tuple[dict, str]:
    """Front ends: spec → (rules, root). Raises GrammarError for unknown kinds or bad specs."""
    if kind == "regex":
        return {"root": parse_regex(spec)}, "root"
    if kind == "choices":
        return _choices_rules(spec), "root"
    if kind in ("json_schema", "json_object"):
        mod = importlib.import_module(".json_schema", __package__)
        schema = {"type": "object"} if kind == "json_object" else spec
        return mod.schema_to_rules(schema, whitespace_pattern=whitespace_pattern, strict=json_schema_strict), "root"
    if kind == "ebnf":
        return importlib.import_module(".ebnf", __package__).ebnf_to_rules(spec)
    if kind == "lark":
        return importlib.import_module(".lark_grammar", __package__).lark_to_rules(spec)
    if kind == "structural_tag":
        mod = importlib.import_module(".structural_tag", __package__)
        return mod.structural_tag_rules(spec, whitespace_pattern, json_schema_strict)
    raise GrammarError(f"unknown grammar kind {kind!r}; known: {', '.join(KINDS)}")


class GrammarBackend(GrammarBackendProtocol):
    """Compiles and caches grammars for one tokenizer.

    Args:
        tokenizer_info: the model's vocabulary (:class:`TokenizerInfo`).
        whitespace_pattern: regex for the whitespace JSON Schema grammars allow between tokens
            (default None: compact JSON, no whitespace; see :mod:`.json_schema`).
        json_schema_strict: JSON Schema objects / tuple arrays that do not say
            ``additionalProperties`` / ``items`` are closed (default True, XGrammar's default; see
            :func:`~sglite.constrained.json_schema.schema_to_rules`); False: the spec's open reading.
        max_cache: compiled grammars kept (LRU).
        max_workers: threads of the compile pool.
    """

    def __init__(self, tokenizer_info: TokenizerInfo, *, whitespace_pattern: str | None = None,
                 json_schema_strict: bool = True, max_cache: int = 256, max_workers: int = 2):
        self.info = tokenizer_info
        self.whitespace_pattern = whitespace_pattern
        self.json_schema_strict = json_schema_strict
        self._cache = GrammarCache(max_cache)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sglite-grammar")

    def compile(self, kind: str, spec) -> CompiledGrammar:
        """Compile ``spec`` of ``kind`` (cached by (kind, spec)). Raises GrammarError."""
        return self._cache.get_or_compile(kind, spec, lambda: self._compile(kind, spec))

    def _compile(self, kind: str, spec) -> CompiledGrammar:
        if kind == "json_schema" and isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        rules, root = build_rules(kind, spec, self.whitespace_pattern, self.json_schema_strict)
        return CompiledGrammar(Automaton(rules, root), self.info, kind, spec)

    def compile_async(self, kind: str, spec) -> Future:
        """Compile on the backend's thread pool; the future raises GrammarError on bad specs.

        The first mask is computed in the pool too, so the scheduler's first step is a lookup.
        """
        def work():
            compiled = self.compile(kind, spec)
            compiled.mask(compiled.initial_state)
            return compiled
        return self._pool.submit(work)

    def shutdown(self) -> None:
        """Stop the compile pool (pending compiles finish)."""
        self._pool.shutdown(wait=True)
