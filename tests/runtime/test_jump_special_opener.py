"""Jump-forward never spells out a special-token opener (issue 34): the grammar's text of such a
token is NUL + its text (:mod:`sglite.constrained.tokenizer_info`); encoding that string would give
other tokens, so the forced string is cut before the NUL and the model samples the token itself.
Oracle: the tokens jump-forward appends for forced strings with and without the mark."""
from sglite.constrained.tokenizer_info import special_trigger
from sglite.runtime.output import OutputProcessor


class _Tok:
    eos_token_ids = frozenset()

    def encode(self, s: str) -> list[int]:
        return [ord(c) for c in s]  # one token per character


class _Grammar:
    """Forces ``forced``; accepts any token; every token is the text of one character."""

    def __init__(self, forced: str):
        self.forced = forced

    def find_jump_forward_string(self) -> str:
        return self.forced

    def fork(self):
        return self

    def accept_token(self, t: int) -> bool:
        return True

    def forces_token_text(self, t: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False


def test_forced_string_is_cut_before_a_special_opener():
    out = OutputProcessor(_Tok())
    mark = special_trigger("<|python_tag|>")
    assert out.jump_tokens(_Grammar(mark + '{"name": ')) == []
    assert out.jump_tokens(_Grammar("; " + mark + "{")) == [ord(";"), ord(" ")]
    assert out.jump_tokens(_Grammar('{"a": ')) == [ord(c) for c in '{"a": ']
