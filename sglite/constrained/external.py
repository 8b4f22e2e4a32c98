"""Optional third-party grammar backends behind sglite's interface, for comparison only
(``grammar_backend="llguidance"`` or ``"xgrammar"``; the ``bench`` extra installs them).

The backends, their compiled grammars and their matchers subclass the Protocols of
:mod:`sglite.constrained.protocols` (:class:`GrammarBackendProtocol`, :class:`CompiledGrammarProtocol`,
:class:`GrammarMatcherProtocol`), the same seam sglite's own backend implements; the shared contract
suite (``tests/constrained/test_grammar_protocol.py``) runs over them when they are installed. Kinds: regex,
json_schema, json_object, ebnf (GBNF), lark, choices. Grammar errors raise
:class:`~sglite.errors.GrammarError`. ``rollback`` counts the tokens accepted, so rolling back more
than that raises ValueError as sglite's matcher does (the libraries' own limits differ).
"""
from __future__ import annotations

import importlib.util
import json
from sglite.errors import GrammarError

from .grammar_cache import GrammarCache
from .protocols import CompiledGrammarProtocol, GrammarBackendProtocol, GrammarMatcherProtocol
from .tokenizer_info import decode_utf8_prefix

EXTERNAL = ("llguidance", "xgrammar")


def make_backend(name: str, hf_tokenizer, vocab_size: int, eos_token_ids):
    """The backend called ``name`` for a Hugging Face (fast) tokenizer.

    Raises:
        ValueError: unknown name, or the package is not installed (names the pip package).
    """
    if name not in EXTERNAL:
        raise ValueError(f"grammar_backend: unknown backend {name!r}; known: sglite, {', '.join(EXTERNAL)}")
    if importlib.util.find_spec(name) is None:
        raise ValueError(f"grammar_backend={name!r} needs the {name!r} package: pip install {name} "
                         "(or the sglite[bench] extra)")
    cls = LLGuidanceBackend if name == "llguidance" else XGrammarBackend
    return cls(hf_tokenizer, vocab_size, sorted(set(int(t) for t in eos_token_ids)))


class _Cached(GrammarBackendProtocol):
    """Caching and ``compile_async`` shared by the external backends (subclasses define ``_compile``)."""

    def __init__(self, max_cache: int = 256):
        self._cache = GrammarCache(max_cache)

    def compile(self, kind: str, spec):
        """Compile (cached by kind and spec). Raises GrammarError."""
        return self._cache.get_or_compile(kind, spec, lambda: self._compile(kind, spec))

    def compile_async(self, kind: str, spec):
        """Compile at once in the caller's thread; the future holds the result or the GrammarError."""
        from concurrent.futures import Future

        fut: Future = Future()
        try:
            fut.set_result(self.compile(kind, spec))
        except Exception as e:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(e)
        return fut

    def shutdown(self) -> None:
        """Nothing to release (no threads of our own)."""


# ---------------------------------------------------------------------------------- llguidance
class LLGuidanceBackend(_Cached):
    """llguidance (Microsoft guidance's Rust matcher) behind sglite's backend interface."""

    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list):
        super().__init__()
        import llguidance.hf

        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)

    def _compile(self, kind, spec):
        import llguidance

        try:
            if kind == "json_schema":
                grm = llguidance.LLMatcher.grammar_from_json_schema(spec if isinstance(spec, str) else json.dumps(spec))
            elif kind == "json_object":
                grm = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
            elif kind == "regex":
                grm = llguidance.LLMatcher.grammar_from_regex(spec)
            elif kind in ("ebnf", "lark"):
                grm = llguidance.grammar_from("gbnf" if kind == "ebnf" else "lark", spec)
            elif kind == "choices":
                grm = llguidance.grammar_from("choice", json.dumps(list(spec)))
            else:
                raise GrammarError(f"llguidance backend: unknown grammar kind {kind!r}")
            err = llguidance.LLMatcher.validate_grammar(grm, self.tokenizer)
        except (ValueError, RuntimeError, TypeError) as e:
            raise GrammarError(f"llguidance: {e}") from None
        if err:
            raise GrammarError(f"llguidance: {err}")
        return _LLGCompiled(self, grm)


class _LLGCompiled(CompiledGrammarProtocol):
    def __init__(self, backend, grammar: str):
        self.backend, self.grammar = backend, grammar

    def matcher(self):
        import llguidance

        return LLGuidanceMatcher(llguidance.LLMatcher(self.backend.tokenizer, self.grammar, log_level=0),
                                 frozenset(self.backend.eos_token_ids))


class _ExternalMatcher(GrammarMatcherProtocol):
    """Shared part of the adapters: the answers these libraries cannot give cheaply, and the count
    of accepted tokens that bounds ``rollback``. Subclasses set ``self.m`` and ``self.n``."""

    def _check_rollback(self, num_tokens) -> int:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"rollback: num_tokens must be an integer >= 0, got {num_tokens!r}")
        if num_tokens > self.n:
            raise ValueError(f"rollback: num_tokens ({num_tokens}) exceeds the {self.n} tokens accepted")
        return num_tokens

    def forces_token_text(self, token_id: int) -> bool:
        """Always False: jump-forward leaves the boundary token to the model."""
        return False

    def mask_is_cached(self) -> bool:
        """Always False: the scheduler computes these masks on its mask thread, during the forward."""
        return False


class LLGuidanceMatcher(_ExternalMatcher):
    """Per-request llguidance matcher with sglite's GrammarMatcher methods.

    An accepted EOS is recorded here, not consumed by llguidance (whose rollback does not count
    it), so ``rollback`` undoes EOS like any other token, as sglite's matcher does.
    """

    def __init__(self, m, eos: frozenset, n: int = 0, eos_accepted: bool = False):
        self.m, self.eos, self.n, self.eos_accepted = m, eos, n, eos_accepted

    def fill_next_token_bitmask(self, bitmask, row: int = 0) -> None:
        """Write the mask into ``bitmask[row]`` (int32 [B, ceil(V/32)], CPU); zeros once EOS is accepted."""
        if self.eos_accepted:
            bitmask[row].zero_()
            return
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.m, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        t = int(token_id)
        if self.eos_accepted:
            return False
        if t in self.eos:
            if not self.m.is_accepting() or self.m.is_error():
                return False
            self.eos_accepted = True
            self.n += 1
            return True
        if self.m.is_stopped() or self.m.validate_tokens([t]) != 1:
            return False
        ok = bool(self.m.consume_token(t))
        self.n += ok
        return ok

    def is_terminated(self) -> bool:
        return self.eos_accepted or bool(self.m.is_stopped())

    def find_jump_forward_string(self) -> str:
        if self.eos_accepted:
            return ""
        data = self.m.compute_ff_bytes()
        return decode_utf8_prefix(data)

    def rollback(self, num_tokens: int) -> None:
        k = self._check_rollback(num_tokens)
        if k and self.eos_accepted:
            self.eos_accepted, self.n, k = False, self.n - 1, k - 1
        if k:
            self.m.rollback(k)
            self.n -= k

    def fork(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self.m.deep_copy(), self.eos, self.n, self.eos_accepted)


# ---------------------------------------------------------------------------------- xgrammar
class XGrammarBackend(_Cached):
    """XGrammar (MLC) behind sglite's backend interface."""

    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list):
        super().__init__()
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        self.compiler = xgr.GrammarCompiler(info)

    def _compile(self, kind, spec):
        c = self.compiler
        try:
            if kind == "json_schema":
                g = c.compile_json_schema(spec if isinstance(spec, str) else json.dumps(spec))
            elif kind == "json_object":
                g = c.compile_builtin_json_grammar()
            elif kind == "regex":
                g = c.compile_regex(spec)
            elif kind == "ebnf":
                g = c.compile_grammar(spec)
            elif kind == "lark":
                g = c.compile_lark(spec) if hasattr(c, "compile_lark") else None
                if g is None:
                    raise GrammarError("xgrammar backend: this xgrammar has no lark support")
            elif kind == "choices":
                alts = " | ".join(json.dumps(x) for x in spec)
                g = c.compile_grammar(f"root ::= {alts}")
            else:
                raise GrammarError(f"xgrammar backend: unknown grammar kind {kind!r}")
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
            raise GrammarError(f"xgrammar: {e}") from None
        return _XGCompiled(self.xgr, g)


class _XGCompiled(CompiledGrammarProtocol):
    def __init__(self, xgr, compiled):
        self.xgr, self.compiled = xgr, compiled

    def matcher(self):
        return XGrammarMatcher(self.xgr.GrammarMatcher(self.compiled))


class XGrammarMatcher(_ExternalMatcher):
    """Per-request XGrammar matcher with sglite's GrammarMatcher methods."""

    def __init__(self, m, n: int = 0):
        self.m, self.n = m, n

    def fill_next_token_bitmask(self, bitmask, row: int = 0) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        ok = bool(self.m.accept_token(int(token_id)))
        self.n += ok
        return ok

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def find_jump_forward_string(self) -> str:
        return self.m.find_jump_forward_string()

    def rollback(self, num_tokens: int) -> None:
        if self._check_rollback(num_tokens):
            self.m.rollback(num_tokens)
            self.n -= num_tokens

    def fork(self) -> "XGrammarMatcher":
        return XGrammarMatcher(self.m.fork(), self.n)
