"""The distribution's three packages: the SDK (``branchbox``, httpx only), the CLI
(``branchbox_cli``, the ``cli`` extra) and the benchmarks (``branchbox_bench``, public SDK only)."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

PYTHON_DIR = Path(__file__).resolve().parents[1]
CLI_ONLY = ("typer", "click", "rich", "pygments", "markdown_it", "shellingham")


def test_importing_the_sdk_pulls_in_no_cli_library() -> None:
    code = "import sys, branchbox\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:]))))"
    r = subprocess.run([sys.executable, "-c", code, *CLI_ONLY], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.strip() == ""


def test_sdk_requires_httpx_only_and_the_cli_extra_brings_typer_and_rich() -> None:
    requires = importlib.metadata.requires("branchbox") or []
    base = sorted(r.split(">")[0].split(";")[0].strip() for r in requires if "extra ==" not in r)
    cli = sorted(r.split(">")[0].strip() for r in requires if 'extra == "cli"' in r)
    assert base == ["httpx"] and cli == ["rich", "typer"], requires
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "branchbox"}
    assert scripts == {"branchbox": "branchbox_cli:main"}


@pytest.mark.parametrize("missing", ["typer", "rich"])
def test_the_command_without_its_extra_says_how_to_add_it(tmp_path: Path, missing: str) -> None:
    # A package of that name that fails to import stands for one that is not installed.
    (tmp_path / missing).mkdir()
    (tmp_path / missing / "__init__.py").write_text("raise ModuleNotFoundError('no %s here', name=%r)\n" % (missing, missing))
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "branchbox_cli", "sandbox", "ls"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == "error: the branchbox command line needs %s (the cli extra): pip install 'branchbox[cli]'\n" % missing


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.lineno, node.module, alias.name


@pytest.mark.parametrize("path", sorted((PYTHON_DIR / "branchbox_bench").glob("*.py")), ids=lambda p: p.name)
def test_benchmarks_use_the_public_sdk_only(path: Path) -> None:
    private = []
    for lineno, module, name in _imports(path):
        parts = module.split(".") + ([name] if name else [])
        if parts[0] == "branchbox" and any(p.startswith("_") for p in parts[1:]):
            private.append("%s:%d %s" % (path.name, lineno, ".".join(parts)))
    tree = ast.parse(path.read_text())
    private += [
        "%s:%d .%s" % (path.name, n.lineno, n.attr)
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr in ("_http", "_info", "_sbx", "_core", "_transport")
    ]
    assert not private, "private SDK internals used (make them public in the SDK instead): %s" % private


def test_the_sdk_package_holds_the_sdk_only() -> None:
    names = sorted(p.name for p in (PYTHON_DIR / "branchbox").glob("*.py"))
    assert not [n for n in names if n.startswith(("cli", "bench", "_session_server"))], names
