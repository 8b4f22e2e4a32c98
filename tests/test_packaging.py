"""Every Python package of the source tree is listed in pyproject.toml (a wheel or a non-editable
install would otherwise leave it out while the editable dev install still finds it)."""
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for name, folder in cfg["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join([name, *rel.parts]))
    missing = sorted(found - listed)
    assert not missing, f"packages missing from pyproject.toml [tool.setuptools] packages: {missing}"


def test_checkout_root_is_demoted_behind_installed_packages():
    from sglite import _demote_checkout_root

    path = [str(ROOT), "/opt/site-packages", "/x", str(ROOT) + "/"]
    _demote_checkout_root(path)
    # kept once, last: the checkout's other modules stay importable, installed packages win
    assert path == ["/opt/site-packages", "/x", str(ROOT)]
    other = ["/opt/site-packages", "/x"]
    _demote_checkout_root(other)
    assert other == ["/opt/site-packages", "/x"]


def test_transformers_imports_from_the_checkout_root():
    """Run from the checkout root (``python -c``: the root is ``sys.path[0]``), the top-level
    ``kernels/`` folder (``sglite.kernels``) must not shadow the Hugging Face ``kernels`` package
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
        assert origin != str(ROOT / "kernels" / "__init__.py"), origin
