"""Every name that scripts/ and examples/ import from cbrun exists.

Scripts run outside the test suite's imports (in child processes, or by hand), so a rename in the package
breaks them silently; mypy checks the package only. This reads their `from cbrun... import name` lines,
the lazy ones inside functions too, and resolves each name without running the script.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("examples/**/*.py")])


def _cbrun_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) for every `from cbrun... import name` in `path`."""
    pairs = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cbrun":
            pairs += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            pairs += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "cbrun"]
    return pairs


def _missing(module: str, name: str) -> str | None:
    try:
        imported = importlib.import_module(module)
    except ImportError as exc:
        return f"{module}: {exc}"
    if not name or hasattr(imported, name):
        return None
    try:
        importlib.import_module(f"{module}.{name}")  # `from package import submodule`
    except ImportError:
        return f"{module} has no {name}"
    return None


def test_the_reader_finds_lazy_imports(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("def f():\n    from cbrun.engine import Engine\n    from cbrun.nothing_here import x\n")
    found = _cbrun_imports(script)
    assert found == [("cbrun.engine", "Engine"), ("cbrun.nothing_here", "x")]
    assert _missing(*found[0]) is None and _missing(*found[1]) is not None


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cbrun_name_a_script_imports_exists(path):
    missing = [problem for module, name in _cbrun_imports(path) if (problem := _missing(module, name))]
    assert not missing, missing
