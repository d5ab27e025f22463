"""No import cycles among the modules of quantmla/ and baselines/.

The graph is read from the source with ``ast`` (nothing is imported): an edge ``a -> b`` for each
``import b`` / ``from b import x`` in ``a`` (``from p import m`` is an edge to ``p.m`` where that
is a module, relative imports resolved against ``a``'s package). Importing ``p.q.m`` also runs
``p`` and ``p.q``: those are edges too, except to ``a``'s own packages (a package's ``__init__``
runs before its modules anyway). Imports at a module's top level (including under ``if``/``try``)
and imports inside functions are two graphs; neither may have a cycle, nor the two together.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("quantmla", "baselines")


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of :data:`PACKAGES`."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _packages(name: str, mods: dict[str, Path]) -> list[str]:
    """The packages above module ``name`` (its own package first)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in mods]


def _targets(node: ast.stmt, name: str, mods: dict[str, Path]) -> list[str]:
    """The project modules an ``import`` statement in module ``name`` runs."""
    is_pkg = mods[name].name == "__init__.py"
    found = []
    if isinstance(node, ast.Import):
        found = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = name.split(".") if is_pkg else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            src = ".".join(base + ([node.module] if node.module else []))
        else:
            src = node.module or ""
        found = [src] + [f"{src}.{a.name}" for a in node.names if f"{src}.{a.name}" in mods]
    out = []
    own = {name, *_packages(name, mods)}
    for t in found:
        parts = t.split(".")
        for i in range(1, len(parts) + 1):  # the module and every package above it
            m = ".".join(parts[:i])
            if m in mods and m not in own:
                out.append(m)
    return out


def graphs() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module-level, function-level) import graphs of the project's modules."""
    mods = modules()
    top = {m: set() for m in mods}
    inner = {m: set() for m in mods}

    def visit(node, name, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                (inner if in_function else top)[name].update(_targets(child, name, mods))
            fn = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            visit(child, name, in_function or fn)

    for name, path in mods.items():
        visit(ast.parse(path.read_text(), str(path)), name, False)
    return top, inner


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself),
    each as a sorted list (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _say(found: list[list[str]], graph: dict[str, set[str]]) -> str:
    lines = []
    for comp in found:
        edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
        lines.append(f"cycle among {', '.join(comp)}: " + "; ".join(edges))
    return "\n".join(lines)


def test_the_graph_sees_the_packages_and_resolves_relative_imports(tmp_path):
    """The walk finds the modules it must (a package, a subpackage's module), and an import cycle
    written into a throwaway package is found, with its edges, through a relative import."""
    top, inner = graphs()
    assert {"quantmla", "quantmla.kernels", "quantmla.kernels.reference", "baselines.rtn"} <= set(top)
    assert "quantmla.kernels.layout" in top["quantmla.kernels.reference"]
    assert "quantmla.kernels" not in top["quantmla.kernels.reference"]  # its own package is not an edge
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(g) == [["a", "b", "c"], ["e"]]
    assert "a -> b" in _say(cycles(g), g)
    mods = {"p": tmp_path / "p/__init__.py", "p.x": tmp_path / "p/x.py", "p.y": tmp_path / "p/y.py"}
    tree = ast.parse("from . import y\nfrom .y import f\n")
    assert {t for n in tree.body for t in _targets(n, "p.x", mods)} == {"p.y"}


def test_module_level_imports_have_no_cycle():
    top, _ = graphs()
    found = cycles(top)
    assert not found, _say(found, top)


def test_function_level_imports_close_no_cycle_either():
    """Imports inside functions run later, but a cycle through one is still two modules that need each
    other: none, counting module-level and function-level imports together."""
    top, inner = graphs()
    both = {m: top[m] | inner[m] for m in top}
    found = cycles(both)
    assert not found, _say(found, both)
