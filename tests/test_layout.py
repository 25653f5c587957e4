"""The package's shape: no import circles and no oversized modules (no model, no torch).

An import circle is files that import each other, directly or through others. Every `import` of a
cbrun module counts, wherever it is written: at the top, inside a function (a lazy import still ties
the two files together) or under `if TYPE_CHECKING:`. Imports are read with `ast`, nothing is
imported. `from cbrun.a import b` is an edge to the module `cbrun.a.b` when that is a module, else to
`cbrun.a`; a package's `__init__` is not counted as imported by its submodules (Python runs it
first, but that is not an import the file writes).

A package counts as one file too: its modules folded into one node, it must not import a module
outside it that imports it back (engine/grammar.py and the sample/ package did, each through a
different module of the other).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cbrun"
MAX_LINES = 400

# Known exceptions, each still true (the test fails when one is mended, so that it is taken off its list).
KNOWN_CIRCLES: set[frozenset[str]] = set()
KNOWN_LARGE: set[str] = set()
# package -> the modules it forms a circle with when folded into one node.
KNOWN_FOLDER_CIRCLES: dict[str, frozenset[str]] = {}


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


def folded(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The graph with `package` and every module under it as one node named `package`."""

    def node(module: str) -> str:
        return package if module == package or module.startswith(package + ".") else module

    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(node(module), set()).update(node(t) for t in targets if node(t) != node(module))
    return out


def folder_circles(graph: dict[str, set[str]]) -> dict[str, frozenset[str]]:
    """package -> the other modules of its circle, for every package that imports itself through others."""
    packages = {m.rpartition(".")[0] for m in graph if "." in m} - {"cbrun"}
    found = {}
    for package in sorted(packages):
        for component in circles(folded(graph, package)):
            if package in component:
                found[package] = frozenset(component - {package})
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


def test_the_folder_reader_finds_a_package_that_imports_itself_through_a_module():
    graph = {  # the old shape: grammar imported sample.kernels, sample.sampler imported grammar
        "cbrun.engine.grammar": {"cbrun.engine.sample.kernels"},
        "cbrun.engine.sample.sampler": {"cbrun.engine.grammar", "cbrun.engine.sample.kernels"},
        "cbrun.engine.sample.kernels": set(),
    }
    assert circles(graph) == []
    assert folder_circles(graph) == {"cbrun.engine.sample": frozenset({"cbrun.engine.grammar"})}
    graph["cbrun.engine.grammar"] = set()
    assert folder_circles(graph) == {}


def test_no_package_imports_itself_through_modules_outside_it():
    found = folder_circles(import_graph())
    new = {package: sorted(others) for package, others in found.items() if KNOWN_FOLDER_CIRCLES.get(package) != others}
    mended = sorted(set(KNOWN_FOLDER_CIRCLES) - set(found))
    assert not new, f"package import circles: {new}"
    assert not mended, f"no longer circles, take them off KNOWN_FOLDER_CIRCLES: {mended}"


def test_no_module_is_over_400_lines_outside_csrc():
    sizes = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")
    }
    large = {path for path, lines in sizes.items() if lines > MAX_LINES}
    assert not large - KNOWN_LARGE, {path: sizes[path] for path in large - KNOWN_LARGE}
    assert not KNOWN_LARGE - large, f"no longer over {MAX_LINES} lines, take them off KNOWN_LARGE"
