"""Every Python package of the source tree is listed in pyproject.toml (a wheel or a non-editable
install would otherwise leave it out while the editable dev install still finds it)."""
import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in cfg  # one source tree: every module lives under sglite/
    listed = set(cfg["packages"])
    found = set()
    for init in (ROOT / "sglite").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if "__pycache__" in rel.parts:
            continue
        found.add(".".join(rel.parts))
    missing = sorted(found - listed)
    assert not missing, f"packages missing from pyproject.toml [tool.setuptools] packages: {missing}"


def test_no_top_level_folder_shadows_an_installed_package():
    """Every importable module lives under ``sglite/``: the checkout root holds no Python package
    (a top-level ``kernels/`` once shadowed the Hugging Face ``kernels`` package that
    transformers >= 5.25 imports)."""
    shadows = [p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists() and p.name != "sglite"]
    assert not shadows, shadows


@pytest.mark.slow  # a subprocess importing transformers: ~3 s
def test_transformers_imports_from_the_checkout_root():
    """Run from the checkout root (``python -c``: the root is ``sys.path[0]``), nothing in the
    checkout may shadow the Hugging Face ``kernels`` package
    that transformers >= 5.25 imports (CI failed with "cannot import name 'CUDAProperties'")."""
    import subprocess
    import sys

    code = ("import sglite, importlib.util, importlib.metadata, transformers.activations\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "try:\n    importlib.metadata.version('kernels'); installed = True\n"
            "except importlib.metadata.PackageNotFoundError:\n    installed = False\n"
            "print(installed, spec.origin if spec else None)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    installed, origin = r.stdout.split()
    if installed == "True":  # the hub package wins over the checkout's folder
        assert not origin.startswith(str(ROOT) + "/kernels"), origin
