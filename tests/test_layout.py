"""The package's shape: no import circles and no oversized modules (no model, no torch).

An import circle is files that import each other, directly or through others. Every `import` of a
cbrun module counts, wherever it is written: at the top, inside a function (a lazy import still ties
the two files together) or under `if TYPE_CHECKING:`. Imports are read with `ast`, nothing is
imported. `from cbrun.a import b` is an edge to the module `cbrun.a.b` when that is a module, else to
`cbrun.a`; a package's `__init__` is not counted as imported by its submodules (Python runs it
first, but that is not an import the file writes).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cbrun"
MAX_LINES = 400

# Known exceptions, each still true (the test fails when one is mended, so that it is taken off its list).
KNOWN_CIRCLES: set[frozenset[str]] = set()
KNOWN_LARGE: set[str] = set()


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """cbrun module -> the cbrun modules it imports (anywhere in the file)."""
    modules = _modules()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` packages up
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                module = known(target)
                if module is not None and module != name:
                    graph[name].add(module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_graph_reader_finds_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_through_others():
    found = {frozenset(component) for component in circles(import_graph())}
    new = [sorted(component) for component in found - KNOWN_CIRCLES]
    mended = [sorted(component) for component in KNOWN_CIRCLES - found]
    assert not new, f"import circles: {new}"
    assert not mended, f"no longer circles, take them off KNOWN_CIRCLES: {mended}"


def test_no_module_is_over_400_lines_outside_csrc():
    sizes = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")
    }
    large = {path for path, lines in sizes.items() if lines > MAX_LINES}
    assert not large - KNOWN_LARGE, {path: sizes[path] for path in large - KNOWN_LARGE}
    assert not KNOWN_LARGE - large, f"no longer over {MAX_LINES} lines, take them off KNOWN_LARGE"
