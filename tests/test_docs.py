"""The docs are real: their marked snippets run, the flag reference is generated, the references are complete.

Snippet convention: a ```python block whose first line is ``# doctest: tiny`` runs as written,
with ``sglite.Engine`` building its engine on a tiny random-weight model (the default model's
tokenizer and chat template; an explicit ``model_path`` is still honoured); ``# doctest: server``
runs against a live server of that model, whose URL replaces ``http://127.0.0.1:30000``. Other
python blocks are illustrations and are not run.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import re
import shlex

import pytest

import sglite

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOC_URL = "http://127.0.0.1:30000"
MARK = re.compile(r"^# doctest: (tiny|server)\s*$")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def fenced_blocks(path: pathlib.Path) -> list[tuple[str, int, str]]:
    """``(language, line number, code)`` of every fenced block of a Markdown file."""
    text = path.read_text(encoding="utf-8")
    return [(m.group(1), text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text)]


def runnable_snippets() -> list:
    out = []
    for path in sorted(DOCS.glob("*.md")):
        for lang, line, code in fenced_blocks(path):
            first = code.split("\n", 1)[0]
            m = MARK.match(first)
            if lang == "python" and m:
                out.append(pytest.param(m.group(1), code, id=f"{path.name}:{line}"))
    return out


SNIPPETS = runnable_snippets()


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- snippets
@pytest.fixture(scope="module")
def tiny_engine_class(tiny_model_dir):
    """``sglite.Engine`` with the tiny model and a small KV pool as defaults."""
    from sglite.runtime.engine import Engine

    class TinyEngine(Engine):
        def __init__(self, model_path=None, **kwargs):
            kwargs.setdefault("max_total_tokens", 4096)
            kwargs.setdefault("num_threads", 1)
            super().__init__(model_path or str(tiny_model_dir), **kwargs)

    return TinyEngine


@pytest.fixture(scope="module")
def tiny_server(tiny_engine_class):
    from sglite.server import ServerConfig
    from sglite.server.runner import ServerThread

    engine = tiny_engine_class()
    with ServerThread(engine, ServerConfig(port=0, enable_metrics=True)) as srv:  # as `--enable-metrics`
        yield srv
    engine.shutdown()


def test_the_dsl_guide_runs_its_main_examples():
    ids = [p.id for p in SNIPPETS if p.id.startswith("dsl.md:")]
    assert len(ids) >= 9, ids
    assert any(p.values[0] == "server" for p in SNIPPETS if p.id.startswith("dsl.md:"))
    assert any(p.id.startswith("http_api.md:") for p in SNIPPETS)


@pytest.mark.parametrize("kind,code", SNIPPETS)
def test_snippet_runs(kind, code, request, monkeypatch, capsys):
    import sglite.runtime.engine as engine_mod

    monkeypatch.setattr(engine_mod, "Engine", request.getfixturevalue("tiny_engine_class"))
    if kind == "server":
        code = code.replace(DOC_URL, request.getfixturevalue("tiny_server").url)
    try:
        exec(compile(code, request.node.callspec.id, "exec"), {"__name__": "__doc_snippet__"})
    finally:
        sglite.set_default_backend(None)
    capsys.readouterr()


# ----------------------------------------------------------------------------- flag reference
def test_server_flags_md_is_generated_from_the_live_parsers():
    gen = load_script("gen_flag_docs")
    committed = (DOCS / "server_flags.md").read_text(encoding="utf-8")
    assert committed == gen.render(), f"docs/server_flags.md is stale: regenerate it with `{gen.REGEN}`"


def test_flag_reference_lists_every_serve_flag():
    from sglite.launch_server import build_parser

    text = (DOCS / "server_flags.md").read_text(encoding="utf-8")
    flags = [s for a in build_parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    assert flags and all(f"`{f}`" in text for f in flags)


def _serve_parser():
    from sglite.launch_server import build_parser

    parser = build_parser()
    parser.exit_on_error = False
    return parser


def test_every_serve_command_in_the_docs_parses():
    """Each ``sglite serve ...`` / ``python -m sglite.launch_server ...`` line in a bash block parses."""
    parser = _serve_parser()
    seen = 0
    for path in sorted(DOCS.glob("*.md")):
        for lang, line, code in fenced_blocks(path):
            if lang not in ("bash", "sh", "console"):
                continue
            for cmd in code.replace("\\\n", " ").splitlines():
                cmd = cmd.split(" #", 1)[0].strip()
                for head in ("sglite serve", "python -m sglite.launch_server"):
                    if cmd.startswith(head):
                        args = shlex.split(cmd[len(head):])
                        try:
                            parser.parse_args(args)
                        except (argparse.ArgumentError, SystemExit) as e:
                            pytest.fail(f"{path.name}:{line}: `{cmd}` does not parse: {e}")
                        seen += 1
    assert seen >= 3


def test_coming_from_flags_exist():
    """Every ``--flag`` in the sglite column of docs/coming_from.md's "Server flags" table is a real serve flag."""
    parser = _serve_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    text = (DOCS / "coming_from.md").read_text(encoding="utf-8")
    checked = 0
    col, heading = None, ""
    for row in text.splitlines():
        if row.startswith("#"):
            heading = row.lstrip("#").strip()
        if not row.startswith("|") or heading != "Server flags":
            col = None
            continue
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if col is None:
            col = next((i for i, c in enumerate(cells) if c.lower() == "sglite"), -1)
            continue
        if col < 0 or col >= len(cells) or set(cells[col]) <= set("-: "):
            continue
        for flag in re.findall(r"`(--[a-z0-9-]+)", cells[col]):
            assert flag in known, f"coming_from.md names `{flag}` as an sglite flag; `sglite serve --help` lacks it"
            checked += 1
    assert checked >= 10


# ----------------------------------------------------------------------------- HTTP reference
def _http_doc() -> str:
    return (DOCS / "http_api.md").read_text(encoding="utf-8")


def test_http_api_documents_every_route():
    from sglite.server.app import create_app
    from sglite.server.testing import FakeEngine

    text = _http_doc()
    routes = set(create_app(FakeEngine()).openapi()["paths"])
    assert {"/generate", "/v1/chat/completions"} <= routes
    missing = sorted(p for p in routes if f"{p.replace('{model_id}', '{model}')}`" not in text)
    assert not missing, f"routes missing from docs/http_api.md: {missing}"


def test_http_api_documents_every_request_field():
    from sglite.sampling_params import SamplingParams
    from sglite.server import protocol

    text = _http_doc()
    models = [protocol.GenerateRequest, protocol.AbortRequest, protocol.ProfileRequest, protocol.CompletionRequest,
              protocol.ChatCompletionRequest, protocol.ChatMessage, protocol.ResponseFormat,
              protocol.StreamOptions, protocol.Tool, protocol.FunctionDef]
    missing = []
    for model in models:
        for name, field in model.model_fields.items():
            key = field.alias or name
            if f"`{key}`" not in text:
                missing.append(f"{model.__name__}.{key}")
    missing += [f"sampling_params.{f.name}" for f in dataclasses.fields(SamplingParams) if f"`{f.name}`" not in text]
    assert not missing, f"fields missing from docs/http_api.md: {missing}"


def test_docs_link_to_existing_files():
    for path in sorted(DOCS.glob("*.md")):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"
