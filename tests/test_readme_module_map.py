"""The README's module map names every module of the package (one row each, or a shared row)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_has_a_row():
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    missing = []
    for pkg in ("sglite",):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if path.name == "__init__.py" and rel not in ("sglite/__init__.py", "sglite/kernels/__init__.py"):
                continue  # package re-exports
            named = f"`{rel}`" in readme or any(f"`{path.name}`" in r and f"`{path.parent.relative_to(ROOT).as_posix()}/" in r
                                                  for r in rows)
            if not named:
                missing.append(rel)
    assert not missing, f"README module map lacks rows for {missing}"
