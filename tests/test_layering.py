"""Layers point one way: the package's import graph (top-level and function-local imports) has no
cycle, library code never imports benchmarks, test helpers or experiment configs, and no import of
the project's own modules is wrapped in ``except ImportError``."""

import ast
import pathlib

# may import anything of the package; nothing of the library may import them
NOT_LIBRARY = ("pallasite.benchmarks", "pallasite.testing", "pallasite.configs")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _target(name: str, modules) -> str:
    """The module an imported dotted name lives in (``a.b.c`` -> ``a.b`` when c is not a module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _imports(path: pathlib.Path):
    """(imported module, line, guarded by except ImportError) for every import statement, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            names = set()
            for h in node.handlers:
                t = h.type
                elts = t.elts if isinstance(t, ast.Tuple) else [t]
                names |= {e.id for e in elts if isinstance(e, ast.Name)}
            if names & {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"} or \
                    any(h.type is None for h in node.handlers):
                for stmt in node.body:
                    guarded |= {id(n) for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno, id(node) in guarded
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                yield f"{node.module}.{a.name}", node.lineno, id(node) in guarded


def _graph(modules):
    edges, guarded = {}, []
    for mod, path in modules.items():
        deps = edges.setdefault(mod, {})
        for name, line, is_guarded in _imports(path):
            if not name.startswith("pallasite"):
                continue
            tgt = _target(name, modules)
            if tgt and tgt != mod:
                deps.setdefault(tgt, line)
                if is_guarded:
                    guarded.append(f"{path.relative_to(ROOT)}:{line} imports {tgt} inside a try/except ImportError")
    return edges, guarded


def _cycles(edges) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_was_parsed(package_modules):
    edges, _ = _graph(package_modules)
    assert len(package_modules) > 60 and "pallasite.models.transformer" in package_modules
    assert "pallasite.models.attention" in edges["pallasite.models.transformer"]
    # function-local imports count: api.load imports the GGUF importer inside the function
    assert "pallasite.models.gguf" in edges["pallasite.api"]


def test_no_import_cycles(package_modules):
    edges, _ = _graph(package_modules)
    cycles = _cycles(edges)
    assert not cycles, "import cycles (edges include function-local imports):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_library_never_imports_benchmarks_test_helpers_or_configs(package_modules):
    edges, _ = _graph(package_modules)
    bad = []
    for mod, deps in edges.items():
        if mod.startswith(NOT_LIBRARY):
            continue
        for dep, line in deps.items():
            if dep.startswith(NOT_LIBRARY) or dep.startswith("pallasite.tests"):
                bad.append(f"{package_modules[mod].relative_to(ROOT)}:{line} imports {dep}")
    for mod, deps in edges.items():  # experiment configs are data: they may use the library, not drivers
        if mod.startswith("pallasite.configs"):
            bad += [f"{package_modules[mod].relative_to(ROOT)}:{line} imports {dep}" for dep, line in deps.items()
                    if dep.startswith(("pallasite.benchmarks", "pallasite.testing"))]
    assert not bad, "\n".join(bad)


def test_no_project_import_is_guarded_by_except_import_error(package_modules):
    _, guarded = _graph(package_modules)
    assert not guarded, "\n".join(guarded)


def test_the_checks_can_fail(tmp_path):
    """Negative controls on a synthetic graph: a cycle and a guarded import are found."""
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    p = tmp_path / "m.py"
    p.write_text("def f():\n    try:\n        import pallasite.models.moe\n    except ImportError:\n        pass\n")
    assert [g for *_, g in _imports(p)] == [True]
