"""Every flag of every `sglite bench *` sub-command has one line of help that names its default."""
import argparse
import importlib

import pytest

from sglite.cli import BENCHES, main as cli_main


def _parsers():
    for name, module in BENCHES.items():
        yield name, importlib.import_module(module).build_parser()


def _expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text exactly as ``--help`` prints it (defaults and %(...)s expanded)."""
    return parser._get_formatter()._expand_help(action)


@pytest.mark.parametrize("name", list(BENCHES))
def test_every_flag_has_help_naming_its_default(name):
    parser = dict(_parsers())[name]
    flags = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert len(flags) >= 5, f"{name}: expected a real parser, got {len(flags)} flags"
    for action in flags:
        flag = action.option_strings[0]
        text = _expanded_help(parser, action)
        assert text.strip(), f"sglite bench {name} {flag}: no help"
        assert "\n" not in text, f"sglite bench {name} {flag}: help is more than one line"
        assert "(default: None)" not in text, f"sglite bench {name} {flag}: says default None"
        default = action.default
        if default is None or isinstance(default, bool):
            continue   # an optional value or an on/off flag: no default to name
        shown = "none" if default == "" else str(default)
        assert f"default: {shown}" in text or "%(default)" in (action.help or ""), (
            f"sglite bench {name} {flag}: help {text!r} does not name its default {default!r}")


def test_startup_is_a_bench_subcommand_and_help_shows_defaults(capsys):
    assert "startup" in BENCHES
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "startup", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--repeats REPEATS" in out and "(default: 3)" in out and "--max-total-tokens" in out


def test_dataset_name_is_an_alias_of_dataset():
    from sglite.bench import serving

    p = serving.build_parser()
    assert p.parse_args(["--dataset-name", "json"]).dataset == "json"
    assert p.parse_args(["--dataset", "multi-turn"]).dataset == "multi-turn"


@pytest.mark.parametrize("group, names", [("bench", list(BENCHES)), ("eval", ["perplexity"])])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_group_help_lists_every_subcommand_with_a_description(capsys, group, names, flag):
    from sglite.cli import BENCH_DESCRIPTIONS, EVAL_DESCRIPTIONS, EVALS

    descriptions = {"bench": BENCH_DESCRIPTIONS, "eval": EVAL_DESCRIPTIONS}[group]
    assert set(descriptions) == set({"bench": BENCHES, "eval": EVALS}[group])   # none left undescribed
    assert cli_main([group, flag]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: sglite {group} ") and err == ""
    for name in names:
        assert f"  {name}" in out and descriptions[name] in out


@pytest.mark.parametrize("group", ["bench", "eval"])
def test_unknown_or_missing_subcommand_is_named_on_stderr(capsys, group):
    assert cli_main([group, "foo"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"unknown {group} command 'foo'" in err and f"usage: sglite {group} " in err
    assert cli_main([group]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"a {group} command is required" in err and "commands:" in err


@pytest.mark.parametrize("argv,flag", [
    (["serving", "--request-rate", "-1"], "--request-rate"),
    (["serving", "--request-rate", "nan"], "--request-rate"),
    (["serving", "--max-concurrency", "0"], "--max-concurrency"),
    (["serving", "--input-len", "0"], "--input-len"),
    (["offline", "--num-requests", "-1"], "--num-requests"),
    (["offline", "--repeats", "0"], "--repeats"),
    (["offline", "--parts", "nope"], "--parts"),
    (["offline", "--min-len", "10", "--max-len", "5"], "--min-len"),
    (["offline", "--profile-steps", "-1"], "--profile-steps"),
])
def test_odd_bench_flags_are_argparse_errors_before_any_work(argv, flag, capsys):
    """A breaker's report: these ended in a ValueError traceback (some after loading the model)."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and flag in err and "Traceback" not in err
