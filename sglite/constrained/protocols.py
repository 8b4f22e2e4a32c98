"""Typed seams of constrained decoding: what the runtime may call on a grammar backend, a compiled
grammar and a per-request matcher.

The runtime (``engine_requests`` builds matchers, ``sampler`` fills masks, ``scheduler`` asks
``mask_is_cached``, ``output`` accepts tokens and jumps forward) only calls the members below, so any
backend that implements them plugs in: sglite's own (:class:`~sglite.constrained.backend.GrammarBackend`
→ :class:`~sglite.constrained.compiled.CompiledGrammar` →
:class:`~sglite.constrained.matcher.GrammarMatcher`) and the llguidance / xgrammar adapters
(:mod:`sglite.constrained.external`) subclass these Protocols explicitly, and
``tests/constrained/test_grammar_protocol.py`` runs one contract suite over every backend installed.

All three are ``runtime_checkable`` (``isinstance`` checks that the members exist, not their
signatures; the contract suite compares signatures with :func:`inspect.signature`).

Bitmask layout everywhere: int32 ``[B, ceil(V / 32)]`` on the CPU, bit ``t % 32`` of word
``t // 32`` of a row set ⇔ token ``t`` allowed (the layout of xgrammar and llguidance too).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = ["CompiledGrammarProtocol", "GrammarBackendProtocol", "GrammarMatcherProtocol", "protocol_members"]


@runtime_checkable
class GrammarMatcherProtocol(Protocol):
    """One request's position in a compiled grammar (cheap to create and fork).

    Contract (checked for every backend by the shared suite):

    * ``fill_next_token_bitmask`` allows exactly the tokens whose bytes keep the text a prefix
      of some sentence of the grammar, plus the EOS ids exactly when the text so far is a
      complete sentence; after termination the row is all zeros. It never mutates the matcher.
    * ``accept_token`` of a token the mask forbids returns False and changes nothing.
    * ``fork`` gives an independent copy: advancing one never changes the other's mask.
    * Threads: the scheduler may fill masks on its mask thread while the step thread runs the
      forward; it never calls a mutating method (``accept_token``, ``rollback``) on the same
      matcher at the same time. A compiled grammar is shared by many matchers and threads.
    * ``rollback(n)`` undoes the last ``n`` accepted tokens (``0 <= n <=`` tokens accepted since
      the start), so ``accept_token`` × k then ``rollback(k)`` restores the mask exactly. This is
      what speculative decoding needs to drop rejected draft tokens.
    """

    __slots__ = ()

    def fill_next_token_bitmask(self, bitmask: "torch.Tensor", row: int = 0) -> None:
        """Write the allowed-token mask into ``bitmask[row]`` (int32 [B, ceil(V/32)], CPU)."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (and no change) when the grammar forbids it.

        Accepting an EOS id (allowed only in an accepting state) terminates the matcher.
        """
        ...

    def is_terminated(self) -> bool:
        """Nothing can follow: EOS was accepted (or, for sglite's matcher, the text is complete
        and nothing but EOS may follow)."""
        ...

    def find_jump_forward_string(self) -> str:
        """The text every continuation must start with ("" if none), whole UTF-8 characters only.
        Never mutates the matcher."""
        ...

    def forces_token_text(self, token_id: int) -> bool:
        """Whether every token allowed next is a byte prefix of ``token_id``'s text, so
        jump-forward may append ``token_id`` itself (False is always a safe answer)."""
        ...

    def mask_is_cached(self) -> bool:
        """Whether filling the mask now is a cache lookup (False is always a safe answer: the
        scheduler then computes the masks on its mask thread, during the forward)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens.

        Raises:
            ValueError: ``num_tokens < 0`` or more than the tokens accepted so far.
        """
        ...

    def fork(self) -> "GrammarMatcherProtocol":
        """An independent matcher at the same position (shares the compiled grammar)."""
        ...


@runtime_checkable
class CompiledGrammarProtocol(Protocol):
    """A grammar compiled for one tokenizer; shared by every request using the same spec."""

    __slots__ = ()

    def matcher(self) -> GrammarMatcherProtocol:
        """A fresh matcher at the start state."""
        ...


@runtime_checkable
class GrammarBackendProtocol(Protocol):
    """Compiles constraint specs for one tokenizer (``config.grammar_backend`` picks one).

    Kinds: ``regex`` (str), ``json_schema`` (dict or JSON text), ``json_object`` (ignored spec),
    ``ebnf`` (GBNF text), ``lark`` (text), ``choices`` (non-empty list of str), ``structural_tag``
    (dict or JSON text; sglite's own backend only).
    """

    __slots__ = ()

    def compile(self, kind: str, spec: Any) -> CompiledGrammarProtocol:
        """Compile ``spec`` of ``kind`` (cached: the same (kind, spec) gives the same object).

        Raises:
            GrammarError: unknown kind, invalid spec, or a construct the backend cannot compile.
        """
        ...

    def compile_async(self, kind: str, spec: Any) -> Future:
        """``compile`` off the caller's thread (or at once); the future raises GrammarError."""
        ...

    def shutdown(self) -> None:
        """Release the backend's threads (pending compiles finish)."""
        ...


def protocol_members(proto: type) -> list[str]:
    """Names of the methods ``proto`` declares (in declaration order), for signature checks."""
    return [k for k, v in vars(proto).items() if callable(v) and not k.startswith("_")]
