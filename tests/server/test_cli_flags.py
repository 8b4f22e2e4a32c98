"""The flags of ``sglite serve`` / ``generate``: help with defaults from the config docstrings,
SGLang's boolean forms, aliases, not-yet-supported features refused, validation before loading."""
import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from sglite import __version__
from sglite.cli import build_parser as cli_parsers
from sglite.config import EngineConfig
from sglite.flags import SHOWN_DEFAULTS, field_docs, first_sentence
from sglite.launch_server import build_parser, engine_kwargs, server_config
from sglite.server.settings import ServerConfig

LISTED = ("--tokenizer-path", "--chat-template", "--max-model-len", "--context-length", "--enable-metrics",
          "--version", "--enable-deterministic-inference", "--log-requests", "--disable-radix-cache",
          "--disable-jump-forward", "--tp-size", "--dp-size", "--quantization", "--kv-cache-dtype",
          "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps")


def _parsers():
    top, generate = cli_parsers()
    return {"serve": build_parser(), "generate": generate, "sglite": top}


def _actions(parser):
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._VersionAction,
                                                             argparse._SubParsersAction))]


@pytest.mark.parametrize("name", ["serve", "generate", "sglite"])
def test_every_flag_has_one_line_help_with_its_default(name):
    for a in _actions(_parsers()[name]):
        if not a.option_strings:
            assert a.help, a.dest  # positionals: help, no default to show
            continue
        assert a.help and "\n" not in a.help, a.option_strings
        assert "default" in a.help, (a.option_strings, a.help)


def test_listed_flags_exist():
    serve = set(build_parser()._option_string_actions)
    generate = set(_parsers()["generate"]._option_string_actions)
    for flag in LISTED:
        assert flag in serve, flag
        if flag not in ("--enable-metrics", "--log-requests", "--version", "--dp-size"):
            assert flag in generate, flag


def test_help_comes_from_the_config_docstrings():
    for cls in (EngineConfig, ServerConfig):
        docs = field_docs(cls)
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}, cls  # every field documented
    docs = field_docs(EngineConfig)
    actions = build_parser()._actions
    for f in dataclasses.fields(EngineConfig):
        a = next(x for x in actions if x.dest == f.name)
        sentence = first_sentence(docs[f.name]).rstrip(".").replace("%", "%%")
        assert a.help.replace("turn off: ", "").startswith(sentence), (f.name, a.help)
        shown = "off" if f.default is False else "on" if f.default is True else SHOWN_DEFAULTS.get(f.name, f.default)
        assert a.help.endswith(f"(default: {shown})"), (f.name, a.help)
    # a multi-line docstring entry is read whole (continuation lines joined)
    assert docs["constrained_json_whitespace_pattern"].endswith("allows one-line indentation.")


def test_booleans_read_as_sglang():
    p = build_parser()
    for a in p._actions:
        for opt in a.option_strings:
            assert not opt.startswith("--no-"), opt
    for f in dataclasses.fields(EngineConfig):
        if f.type not in (bool, "bool"):
            continue
        a = next(x for x in p._actions if x.dest == f.name)
        if f.default is False:
            assert isinstance(a, argparse._StoreTrueAction) and a.option_strings[0] == "--" + f.name.replace("_", "-")
        else:
            assert isinstance(a, argparse._StoreConstAction) and a.const is False
            assert all(o.startswith("--disable-") for o in a.option_strings)
    kw = engine_kwargs(p.parse_args(["--disable-radix-cache", "--disable-jump-forward",
                                     "--enable-deterministic-inference"]))
    assert kw == {"disable_radix_cache": True, "enable_jump_forward": False, "enable_deterministic_inference": True}
    assert engine_kwargs(p.parse_args(["--disable-regex-jump-forward"])) == {"enable_jump_forward": False}
    assert engine_kwargs(p.parse_args(["--disable-json-schema-strict"])) == {"json_schema_strict": False}
    cfg = server_config(p.parse_args(["--enable-metrics", "--log-requests"]))
    assert cfg.enable_metrics and cfg.log_requests
    assert not server_config(p.parse_args([])).enable_metrics


def test_aliases_and_new_options():
    p = build_parser()
    kw = engine_kwargs(p.parse_args(["--max-model-len", "1024", "--tokenizer-path", "/t", "--chat-template", "x"]))
    assert kw == {"context_length": 1024, "tokenizer_path": "/t", "chat_template": "x"}
    assert engine_kwargs(p.parse_args(["--context-length", "512"])) == {"context_length": 512}


def _exit(parser, argv, capsys):
    with pytest.raises(SystemExit) as ei:
        parser.parse_args(argv)
    return ei.value.code, capsys.readouterr()


@pytest.mark.parametrize("argv, words", [
    (["--kv-cache-dtype", "fp8_e5m2"], ["--kv-cache-dtype", "invalid choice", "int8"]),
    (["--speculative-algorithm", "LOOKAHEAD"], ["--speculative-algorithm", "invalid choice", "NGRAM", "EAGLE"]),
    (["--speculative-eagle-topk", "four"], ["--speculative-eagle-topk", "invalid int value"]),
    (["--speculative-foo", "3"], ["unrecognized flag --speculative-foo"]),
    (["--max-running-request", "3"], ["unrecognized flag --max-running-request", "--max-running-requests"]),
    (["--no-disable-radix-cache"], ["unrecognized flag --no-disable-radix-cache", "--disable-radix-cache"]),
    (["--no-enable-jump-forward"], ["unrecognized flag --no-enable-jump-forward"]),
    (["--max-model", "3"], ["unrecognized flag --max-model"]),  # no silent abbreviations
])
def test_unsupported_and_unknown_flags_fail_clearly(argv, words, capsys):
    code, out = _exit(build_parser(), argv, capsys)
    assert code == 2
    for w in words:
        assert w in out.err, out.err


def test_noop_values_of_unsupported_flags_are_accepted():
    args = build_parser().parse_args(["--dp-size", "1"])
    assert engine_kwargs(args) == {}


def test_tensor_parallel_flags():
    p = build_parser()
    argv = ["--tp-size", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000"]
    kw = engine_kwargs(p.parse_args(argv))
    assert kw == {"tp_size": 4, "nnodes": 2, "node_rank": 1, "dist_init_addr": "10.0.0.1:5000"}
    EngineConfig.from_kwargs(**kw)
    for bad, field in ((dict(tp_size=0), "tp_size"), (dict(tp_size=3, nnodes=2, dist_init_addr="h:1"), "nnodes"),
                       (dict(nnodes=2, tp_size=2), "dist_init_addr"), (dict(node_rank=1), "node_rank"),
                       (dict(dist_init_addr="nohost"), "dist_init_addr")):
        with pytest.raises(ValueError, match=field):
            EngineConfig.from_kwargs(**bad)


def test_kv_cache_dtype_flag_reaches_the_engine_config():
    args = build_parser().parse_args(["--kv-cache-dtype", "int4", "--kv-cache-quant-group-size", "64"])
    kw = engine_kwargs(args)
    assert kw == {"kv_cache_dtype": "int4", "kv_cache_quant_group_size": 64}
    cfg = EngineConfig(**kw)
    assert cfg.page_size == 64  # pages hold whole key groups


def test_version(capsys):
    code, out = _exit(build_parser(), ["--version"], capsys)
    assert code == 0 and __version__ in out.out
    code, out = _exit(_parsers()["sglite"], ["--version"], capsys)
    assert code == 0 and __version__ in out.out


# Runs the CLI in a fresh interpreter and reports the exit code and whether the engine module and
# torch were imported: a bad flag must fail before anything is loaded.
_PROBE = r"""
import json, sys
from sglite.cli import main
try:
    rc = main(json.loads(sys.argv[1]))
except SystemExit as e:
    rc = e.code
print(json.dumps({"rc": rc, "engine": "sglite.runtime.engine" in sys.modules, "torch": "torch" in sys.modules}))
"""


# the fast tier checks three flags (one subprocess each); the slow tier every one
@pytest.mark.parametrize("argv, flag", [
    (["generate", "hi", "--max-new-tokens", "-1"], "--max-new-tokens"),
    pytest.param(["generate", "hi", "--temperature", "-0.5"], "--temperature", marks=pytest.mark.slow),
    (["generate", "hi", "--regex", "[a-"], "--regex"),
    pytest.param(["generate", "hi", "--json-schema", "{not json"], "--json-schema", marks=pytest.mark.slow),
    pytest.param(["generate", "hi", "--max-running-requests", "0"], "--max-running-requests", marks=pytest.mark.slow),
    pytest.param(["generate", "hi", "--chat-template", "/no/such/template.jinja"], "--chat-template", marks=pytest.mark.slow),
    pytest.param(["generate", "hi", "--tokenizer-path", "/no/such/folder"], "--tokenizer-path", marks=pytest.mark.slow),
    pytest.param(["serve", "--max-model-len", "4"], "--max-model-len", marks=pytest.mark.slow),
    (["serve", "--port", "70000"], "--port"),
    pytest.param(["serve", "--page-size", "0"], "--page-size", marks=pytest.mark.slow),
    pytest.param(["serve", "--schedule-policy", "random"], "--schedule-policy", marks=pytest.mark.slow),
    pytest.param(["serve", "--constrained-json-whitespace-pattern", "(("], "--constrained-json-whitespace-pattern", marks=pytest.mark.slow),
    pytest.param(["generate", "hi", "--constrained-json-whitespace-pattern", "a(?>b)"], "--constrained-json-whitespace-pattern", marks=pytest.mark.slow),
])
def test_bad_values_fail_before_loading_naming_the_flag(argv, flag):
    p = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], capture_output=True, text=True,
                       timeout=120)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["rc"] == 2 and not res["engine"], (res, p.stderr)
    if flag not in ("--regex", "--constrained-json-whitespace-pattern"):  # checking a regex imports the grammar
        # code (torch), never the model
        assert not res["torch"], (res, p.stderr)
    assert flag in p.stderr.splitlines()[-1], p.stderr


def test_unsupported_combinations_fail_naming_the_option():
    """Quantized KV and speculative decoding are single-process features for now: with tensor
    parallelism or disaggregation they are refused before anything loads, naming the option."""
    for kw, field in ((dict(tp_size=2, kv_cache_dtype="int8"), "kv_cache_dtype"),
                      (dict(disaggregation_mode="decode", kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype"),
                      (dict(tp_size=3, speculative_algorithm="NGRAM"), "speculative_algorithm"),
                      (dict(disaggregation_mode="prefill", speculative_algorithm="NGRAM"), "speculative_algorithm")):
        with pytest.raises(ValueError, match=field):
            EngineConfig.from_kwargs(**kw)
