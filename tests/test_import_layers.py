"""One direction of imports: every import of the project's own modules, eager or inside a function,
runs down the layer order of ``docs/README.md``, and no set of modules imports itself round.

The layers, bottom first (a module may import its own layer and the ones below):

    dit_mcore.errors -> kernels, energon_data -> dit_mcore.diffusion -> dit_mcore.models
    -> dit_mcore.parallel -> dit_mcore.training -> dit_mcore.generate, dit_mcore.convert, dit_mcore.plan
    -> dit_mcore.evaluate, dit_mcore.plot, dit_mcore.analysis -> recipes

(``kernels/`` and ``recipes/`` install as ``dit_mcore.kernels`` and ``dit_mcore.recipes``.)

The imports are read from the source (``ast``), so an import hidden in a function counts as much as
one at the top. ``from package import name`` is an edge to the submodule when ``name`` is one, else
to the package's ``__init__``; a parent package initialised on the way is not an edge.
"""
from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"dit_mcore": "dit_mcore", "energon_data": "energon_data",  # folder -> installed name (setup.py)
           "kernels": "dit_mcore.kernels", "recipes": "dit_mcore.recipes"}

LAYERS = (
    ("dit_mcore", "dit_mcore.errors"),
    ("dit_mcore.kernels", "energon_data"),
    ("dit_mcore.diffusion",),
    ("dit_mcore.models",),
    ("dit_mcore.parallel",),
    ("dit_mcore.training",),
    ("dit_mcore.generate", "dit_mcore.convert", "dit_mcore.plan"),
    ("dit_mcore.evaluate", "dit_mcore.plot", "dit_mcore.analysis"),  # (evaluation and analysis generate)
    ("dit_mcore.recipes",),
)

# The upward imports still to be turned round (issue 39), each "importer -> imported". The test fails
# on any other upward import and on an entry here that no longer exists, so this list only shrinks.
KNOWN_UPWARD: set[str] = set()


def module_files() -> dict[str, Path]:
    found = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(modules: dict[str, Path]) -> set[tuple[str, str]]:
    """``(importer, imported)`` for every import of a project module anywhere in a module's source."""
    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = set()
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                if target.split(".")[0] in FOLDERS and (imported := owner(target)) not in (None, name):
                    edges.add((name, imported))
    return edges


def layer(module: str) -> int:
    best = max(((len(prefix), rank) for rank, prefixes in enumerate(LAYERS) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} is in no layer: add its package to LAYERS"
    return best[1]


def circles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph = collections.defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                found.append(sorted(component + [v]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_runs_up_the_layers():
    edges = imports(module_files())
    upward = {f"{a} -> {b}" for a, b in edges if layer(b) > layer(a)}
    new, gone = sorted(upward - KNOWN_UPWARD), sorted(KNOWN_UPWARD - upward)
    assert not new, "imports that run up the layer order (see this file's docstring):\n  " + "\n  ".join(new)
    assert not gone, "turned round, so take them off KNOWN_UPWARD:\n  " + "\n  ".join(gone)


def test_no_modules_import_each_other_round():
    found = circles(imports(module_files()))
    assert not found, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_a_lazy_upward_import_and_a_circle(tmp_path):
    """The checker itself: an import inside a function counts, and two modules importing each other
    (one of them lazily) make a circle."""
    pkg = tmp_path / "dit_mcore"
    (pkg / "models").mkdir(parents=True)
    (pkg / "training").mkdir()
    for init in (pkg / "__init__.py", pkg / "models" / "__init__.py", pkg / "training" / "__init__.py"):
        init.write_text("")
    (pkg / "models" / "a.py").write_text("def f():\n    from dit_mcore.training import b\n")
    (pkg / "training" / "b.py").write_text("from dit_mcore.models.a import f\n")
    modules = {"dit_mcore.models.a": pkg / "models" / "a.py", "dit_mcore.training.b": pkg / "training" / "b.py",
               "dit_mcore.models": pkg / "models" / "__init__.py", "dit_mcore.training": pkg / "training" / "__init__.py"}
    edges = imports(modules)
    assert edges == {("dit_mcore.models.a", "dit_mcore.training.b"), ("dit_mcore.training.b", "dit_mcore.models.a")}
    assert [f"{a} -> {b}" for a, b in edges if layer(b) > layer(a)] == ["dit_mcore.models.a -> dit_mcore.training.b"]
    assert circles(edges) == [["dit_mcore.models.a", "dit_mcore.training.b"]]
