"""The house rules, checked: imports point downward with no cycle (function-local imports
included, since they are how a cycle hides), models/ and sharding/ stand alone, files stay
small, and nothing points at files the repository does not have."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxlm", "models", "sharding")
MAX_LINES = 400


def _modules() -> dict:
    """{dotted module name: path} of every module in the installed packages."""
    out = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    name = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = os.path.join(folder, f)
    return out


def import_graph() -> dict:
    """{module: {project modules it imports anywhere in its file}}. `from a import b` counts as
    an import of a.b when that is a module (not of the package a), as Python resolves it."""
    mods = _modules()

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for mod, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                         else node.module for a in node.names]
            else:
                continue
            deps |= {r for r in map(resolve, names) if r and r != mod}
        graph[mod] = deps
    return graph


def cycles(graph: dict) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, f"import cycles: {found}"


def test_models_and_sharding_import_neither_jaxlm_nor_each_other():
    for mod, deps in import_graph().items():
        top = mod.split(".")[0]
        if top in ("models", "sharding"):
            bad = {d for d in deps if d.split(".")[0] != top}
            assert not bad, f"{mod} imports {sorted(bad)}"


def test_files_are_small():
    big = {m: n for m, p in _modules().items() if (n := len(open(p).read().splitlines())) > MAX_LINES}
    assert not big, f"over {MAX_LINES} lines (usually two concepts): {big}"


def test_no_reference_to_files_outside_the_repository():
    pattern = re.compile(r"shared/reference|ARCHITECTURE\.md|/work/")
    hits = []
    for top in PACKAGES + ("tests", "bench", "docs"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith((".py", ".md")) and f != "test_structure.py":
                    path = os.path.join(folder, f)
                    hits += [f"{os.path.relpath(path, ROOT)}:{i}" for i, line in
                             enumerate(open(path), 1) if pattern.search(line)]
    for f in ("train.py", "README.md"):
        hits += [f"{f}:{i}" for i, line in enumerate(open(os.path.join(ROOT, f)), 1)
                 if pattern.search(line)]
    assert not hits, hits
