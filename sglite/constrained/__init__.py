"""Constrained decoding: regex, JSON Schema, EBNF and lark grammars as byte-level automata.

Public API (DESIGN §5): :class:`TokenizerInfo`, :class:`GrammarBackend`, :class:`CompiledGrammar`,
:class:`GrammarMatcher`, and the seams every backend (ours, llguidance, xgrammar) implements:
:class:`GrammarBackendProtocol`, :class:`CompiledGrammarProtocol`, :class:`GrammarMatcherProtocol`
(:mod:`.protocols`). Imports nothing from sglite but :mod:`sglite.errors`.
"""
from .backend import KINDS, GrammarBackend
from .compiled import CompiledGrammar
from .matcher import GrammarMatcher
from .protocols import CompiledGrammarProtocol, GrammarBackendProtocol, GrammarMatcherProtocol
from .tokenizer_info import TokenizerInfo

__all__ = ["KINDS", "CompiledGrammar", "CompiledGrammarProtocol", "GrammarBackend", "GrammarBackendProtocol",
           "GrammarMatcher", "GrammarMatcherProtocol", "TokenizerInfo"]
