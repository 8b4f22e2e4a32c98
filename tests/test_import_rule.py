"""The import rule (docs/architecture.md, "Floors"): imports run down the floors, never up, and no
two top-level packages import each other, directly or through others. Read from the code's own
imports (an AST pass over ``sglite/``; imports under ``if TYPE_CHECKING:`` are for typing only and
are not counted; function-level imports are counted: a lazy import is still a dependency).

Floors, bottom to top:
  0 base         errors, config, sampling_params, logging_setup, flags, grammars (data)
  1 kernels      sglite.kernels
  2 constrained  sglite.constrained
  3 quant        sglite.quant (the library: algorithms and formats on tensors passed in)
    lora         sglite.lora (LoRA adapters: loading, device slots; beside quant, neither imports the other)
  4 runtime      sglite.runtime (runtime.parallel: tensor parallelism)
  5 server       sglite.server
  6 tools        router, bench, eval, frontend, cli, launch_server, kv_estimate, quantize, testing, testing_gguf, train_draft,
                 lang (SGLang's module path for the frontend's constants)
"""
from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "sglite"

FLOORS = {
    "errors": 0, "config": 0, "config_values": 0, "sampling_params": 0, "logging_setup": 0, "flags": 0, "grammars": 0,
    "kernels": 1,
    "constrained": 2,
    "quant": 3, "lora": 3,
    "runtime": 4,
    "server": 5,
    "router": 6, "bench": 6, "eval": 6, "frontend": 6, "cli": 6, "launch_server": 6, "kv_estimate": 6,
    "quantize": 6, "testing": 6, "testing_gguf": 6, "lang": 6, "train_draft": 6,
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports_of(path: pathlib.Path) -> set[str]:
    """Absolute names of the sglite modules (or packages) ``path`` imports."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "sglite")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "sglite":
                found.add(mod)
                found.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def unit_of(module: str) -> str | None:
    """The top-level unit (``sglite.<unit>``) a module belongs to; None for the package face."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def edges():
    """(importer module, imported module, importer unit, imported unit) for every import."""
    known = {module_name(p) for p in PKG.rglob("*.py")}
    for path in sorted(PKG.rglob("*.py")):
        me = module_name(path)
        if me == "sglite":  # the package face re-exports lazily
            continue
        for target in imports_of(path):
            while target not in known and "." in target:  # `from pkg import name`: the package
                target = target.rpartition(".")[0]
            if target == "sglite" or target not in known:
                continue
            yield me, target, unit_of(me), unit_of(target)


@pytest.fixture(scope="module")
def all_edges():
    """:func:`edges`, read once for the tests below (an AST pass over every module)."""
    return list(edges())


def test_every_unit_has_a_floor():
    units = {unit_of(module_name(p)) for p in PKG.rglob("*.py")} - {None}
    assert not units - set(FLOORS), f"top-level modules without a floor: {sorted(units - set(FLOORS))}"


def test_no_import_runs_up_a_floor(all_edges):
    up = sorted(f"{a} -> {b}" for a, b, ua, ub in all_edges if ua != ub and FLOORS[ub] > FLOORS[ua])
    assert not up, "imports that run up a floor:\n" + "\n".join(up)


def test_no_cycle_between_top_level_packages(all_edges):
    g = nx.DiGraph((ua, ub) for _, _, ua, ub in all_edges if ua != ub)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"cycles between top-level packages: {cycles}"


def test_no_cycle_inside_kernels(all_edges):
    g = nx.DiGraph((a, b) for a, b, ua, ub in all_edges if ua == ub == "kernels" and a != b
                   and a != "sglite.kernels" and b != "sglite.kernels")
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"import cycles inside sglite.kernels: {cycles}"


def test_no_product_module_over_450_lines():
    long = sorted(f"{p.relative_to(ROOT)} ({n})" for p in PKG.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > 450)
    assert not long, f"modules over 450 lines: {long}"
