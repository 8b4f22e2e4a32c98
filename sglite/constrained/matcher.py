"""Per-request grammar matcher: cheap to create, fork and roll back (state history is a list)."""
from __future__ import annotations

import torch

from .compiled import CompiledGrammar
from .protocols import GrammarMatcherProtocol
from .tokenizer_info import decode_utf8_prefix


class GrammarMatcher(GrammarMatcherProtocol):
    """Tracks one request's position in a :class:`CompiledGrammar`.

    The history holds one ``(state, terminated)`` entry per accepted token (or forced string), so
    ``rollback`` is a list truncation. EOS ids are allowed exactly in accepting states; accepting
    one terminates the matcher (nothing is allowed afterwards).
    """

    __slots__ = ("compiled", "_history")

    def __init__(self, compiled: CompiledGrammar, history=None):
        self.compiled = compiled
        self._history = history if history is not None else [(compiled.initial_state, False)]

    @property
    def state(self):
        """Opaque current state (hashable)."""
        return self._history[-1][0]

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed-token mask into ``bitmask[row]``.

        Args:
            bitmask: int32 [B, ceil(V/32)]; bit ``t % 32`` of word ``t // 32`` set ⇔ token t allowed.
            row: batch row to fill. Never mutates the matcher.
        """
        state, terminated = self._history[-1]
        if terminated:
            bitmask[row].zero_()
            return
        bitmask[row].copy_(self.compiled.mask(state))

    def mask_is_cached(self) -> bool:
        """Whether ``fill_next_token_bitmask`` is a cache hit now (no vocabulary walk needed)."""
        state, terminated = self._history[-1]
        return terminated or self.compiled.has_mask(state)

    def accept_token(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (and no change) if the grammar does not allow it."""
        state, terminated = self._history[-1]
        if terminated:
            return False
        info = self.compiled.info
        token_id = int(token_id)
        if token_id in info.eos_token_ids:
            if not self.compiled.accepting(state):
                return False
            self._history.append((state, True))
            return True
        if not 0 <= token_id < info.vocab_size:
            return False
        data = info.token_bytes[token_id]
        if not data:
            return False
        nxt = self.compiled.step_bytes(state, data)
        if nxt is None:
            return False
        self._history.append((nxt, False))
        return True

    def accept_string(self, s: str | bytes) -> bool:
        """Advance over a string (e.g. a jump-forward string); one history entry. False if refused."""
        state, terminated = self._history[-1]
        data = s.encode("utf-8") if isinstance(s, str) else bytes(s)
        if terminated:
            return not data
        nxt = self.compiled.step_bytes(state, data)
        if nxt is None:
            return False
        self._history.append((nxt, False))
        return True

    def is_terminated(self) -> bool:
        """EOS accepted, or the input is complete and nothing but EOS may follow."""
        state, terminated = self._history[-1]
        return terminated or (self.compiled.accepting(state) and not self.compiled.live_bytes(state))

    def is_accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar."""
        state, terminated = self._history[-1]
        return terminated or self.compiled.accepting(state)

    def find_jump_forward_string(self) -> str:
        """The continuation the grammar forces from here ("" if none); whole UTF-8 characters only.

        Never mutates the matcher.
        """
        state, terminated = self._history[-1]
        if terminated:
            return ""
        data = self.compiled.forced_bytes(state)
        return decode_utf8_prefix(data)

    def forces_token_text(self, token_id: int) -> bool:
        """Whether every token the grammar allows next is a prefix of ``token_id``'s bytes.

        Then any continuation the model picks spells exactly those bytes first (perhaps in
        smaller pieces), so jump-forward may append ``token_id`` itself instead of leaving the
        boundary to the model. False when ``token_id`` is special or itself not allowed.
        Never mutates the matcher.
        """
        state, terminated = self._history[-1]
        return not terminated and self.compiled.forces_token_text(state, token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a forced string counts as one); a list
        truncation, O(num_tokens).

        Raises:
            ValueError: ``num_tokens`` is negative or more than :attr:`num_accepted`.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"rollback: num_tokens must be an integer >= 0, got {num_tokens!r}")
        if num_tokens > self.num_accepted:
            raise ValueError(f"rollback: num_tokens ({num_tokens}) exceeds the {self.num_accepted} "
                             f"tokens accepted")
        if num_tokens:
            del self._history[-num_tokens:]

    def fork(self) -> "GrammarMatcher":
        """An independent copy at the same position (shares the compiled grammar and caches)."""
        return GrammarMatcher(self.compiled, list(self._history))

    def reset(self) -> None:
        """Back to the start state."""
        del self._history[1:]

    @property
    def num_accepted(self) -> int:
        """History entries past the start (tokens and forced strings accepted)."""
        return len(self._history) - 1
