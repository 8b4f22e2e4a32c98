"""JSON Schema coverage of sglite's grammar backend on the JSON Schema Test Suite and the maskbench
sample (evaluation data lives outside the product, in ``../shared/data``; never copied in).

An instance is fed as its compact serialization with object keys in the schema's declared order
(sglite emits properties in schema order; data keys not declared keep their order, after the
declared ones), byte by byte, and must end in an accepting state.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from sglite.errors import GrammarError

BYTE_VOCAB = [bytes([b]) for b in range(256)] + [None]  # id 256 = EOS


def byte_backend(json_schema_strict: bool = False):
    """A GrammarBackend over a 256-token byte vocabulary (EOS = 256). JSON Schemas read as the
    specification does by default (what conformance suites measure), strictly with ``True``."""
    from sglite.constrained import GrammarBackend, TokenizerInfo

    return GrammarBackend(TokenizerInfo(list(BYTE_VOCAB), {256}), json_schema_strict=json_schema_strict)


def canonical_instance(schema, inst, root=None, depth=0):
    """``inst`` with object keys reordered to ``schema``'s declared property order (recursive)."""
    root = schema if root is None else root
    if depth > 50 or not isinstance(schema, dict):
        return inst
    if "$ref" in schema and isinstance(schema["$ref"], str) and schema["$ref"].startswith("#"):
        target = root
        for part in [p for p in schema["$ref"][1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return canonical_instance(target, inst, root, depth + 1)
    if isinstance(inst, dict):
        props = dict(schema.get("properties") or {})
        for sub in schema.get("allOf", []):  # merged in order: base, then each subschema
            if isinstance(sub, dict):
                for k, v in (sub.get("properties") or {}).items():
                    props.setdefault(k, v)
        order = [k for k in props if k in inst] + [k for k in schema.get("required", []) if k in inst and k not in props]
        order += [k for k in inst if k not in order]
        return {k: canonical_instance(props.get(k, {}), inst[k], root, depth + 1) for k in order}
    if isinstance(inst, list):
        prefix = schema.get("prefixItems") or (schema.get("items") if isinstance(schema.get("items"), list) else [])
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        return [canonical_instance(prefix[i] if i < len(prefix) else items, x, root, depth + 1)
                for i, x in enumerate(inst)]
    return inst


def accepts(compiled, data: bytes) -> bool:
    """Whether the compiled grammar accepts exactly ``data`` (bytes fed one token each)."""
    m = compiled.matcher()
    return all(m.accept_token(b) for b in data) and m.accept_token(256)


def encode(schema, inst) -> bytes:
    return json.dumps(canonical_instance(schema, inst), ensure_ascii=False, separators=(",", ":")).encode()


def check_schema(backend, schema, tests) -> tuple[str, list]:
    """("unsupported"|"ok"|"fail", [(description, valid, accepted) for wrong answers])."""
    try:
        g = backend.compile("json_schema", schema)
    except GrammarError:
        return "unsupported", []
    except RecursionError:
        return "unsupported", []
    wrong = []
    for t in tests:
        got = accepts(g, encode(schema, t["data"]))
        if got != bool(t["valid"]):
            wrong.append((t.get("description", ""), t["valid"], got))
    return ("fail" if wrong else "ok"), wrong


def suite_results(folder: Path, backend=None) -> dict:
    """Per keyword file: Counter of groups ok/fail/unsupported and instance pass/total counts."""
    backend = backend or byte_backend()
    out = {}
    for f in sorted(list(folder.glob("*.json")) + list(folder.glob("format/*.json"))):
        c = Counter()
        for group in json.loads(f.read_text()):
            status, wrong = check_schema(backend, group["schema"], group["tests"])
            c[status] += 1
            if status != "unsupported":
                c["instances"] += len(group["tests"])
                c["instances_ok"] += len(group["tests"]) - len(wrong)
        out[str(f.relative_to(folder))] = c
    return out


def maskbench_results(path: Path, backend=None) -> Counter:
    """Counts of ok / fail / unsupported schemas on the maskbench sample (jsonl)."""
    backend = backend or byte_backend()
    c = Counter()
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        status, _ = check_schema(backend, rec["schema"], rec["tests"])
        c[status] += 1
    return c
