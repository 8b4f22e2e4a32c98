"""Lark grammars from the network: ``%import`` only from lark's bundled ``common`` grammar; a
relative import never reads the server's files; every failure is a GrammarError (HTTP 400)."""
import os

import pytest

from sglite.constrained.lark_grammar import lark_to_rules
from sglite.errors import GrammarError


def test_common_import_still_works():
    rules, start = lark_to_rules("start: NUMBER\n%import common.NUMBER\n")
    assert start in rules and "t:NUMBER" in rules


@pytest.mark.parametrize("stmt", ["%import .secret.SECRET", "%import secret.SECRET", "%import .secret (SECRET)",
                                  "%import lark.SECRET"])
def test_other_imports_are_refused_without_reading_files(tmp_path, stmt):
    (tmp_path / "secret.lark").write_text('SECRET: "hunter2"\n')
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(GrammarError, match="only lark's bundled 'common' grammar"):
            lark_to_rules(f"start: SECRET\n{stmt}\n")
    finally:
        os.chdir(cwd)


def test_missing_import_is_a_grammar_error_without_a_path(tmp_path):
    with pytest.raises(GrammarError) as e:
        lark_to_rules("start: NOPE\n%import .does_not_exist.NOPE\n")
    assert str(tmp_path) not in str(e.value) and "/" not in str(e.value)


@pytest.mark.parametrize("text", ["start: (", "start: a\na: b", "%ignore", "start: /[/",
                                  "start: SECRET\n%import ..secret.SECRET"])
def test_malformed_grammars_are_grammar_errors(text):
    with pytest.raises(GrammarError):
        lark_to_rules(text)
