"""The package's layers, kept by a tool rather than by memory: import-linter checks the contracts in
pyproject.toml (no module imports from a layer above its own; `|` siblings stay independent), and
the import graph it builds (grimp, imports inside functions included) has no cycle anywhere,
within a layer or a subpackage either. docs/design.md, "Layers"."""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent


def cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    modules = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    order, low, stack, on_stack, found, counter = {}, {}, [], set(), [], 0
    for root in modules:
        if root in order:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        order[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in low or c in modules), None)
            if child is not None:
                if child not in order:
                    order[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], order[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == order[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def lint(config: Path) -> int:
    from importlinter.cli import lint_imports

    return lint_imports(config_filename=str(config), no_cache=True, no_logo=True)


def test_the_import_contracts_hold(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert lint(ROOT / "pyproject.toml") == 0


def test_the_linter_fails_a_contract_the_package_breaks(tmp_path, monkeypatch, capsys):
    """The check above could not pass by checking nothing: the CLI imports errors, so a contract
    putting errors above the CLI is broken."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "inverted.toml").write_text('[tool.importlinter]\nroot_package = "specdec"\n[[tool.importlinter.contracts]]\n'
                                            'name = "inverted"\ntype = "layers"\ncontainers = ["specdec"]\nlayers = ["errors", "cli"]\n')
    assert lint(tmp_path / "inverted.toml") != 0 and "specdec.cli" in capsys.readouterr().out


def test_no_module_imports_itself_round_a_circle():
    graph = grimp.build_graph("specdec", cache_dir=None)
    assert cycles(graph, "specdec") == []


@pytest.mark.parametrize("edges, expected", [
    ({"p.a": ["p.b"], "p.b": ["p.c"], "p.c": []}, []),
    ({"p.a": ["p.b"], "p.b": ["p.a"], "p.c": ["p.a"]}, [["p.a", "p.b"]]),
    ({"p.a": ["p.b"], "p.b": ["p.c"], "p.c": ["p.a"], "p.d": ["p.d"]}, [["p.a", "p.b", "p.c"]]),
])
def test_the_cycle_finder_finds_cycles(edges, expected):
    """The check above could not pass by finding nothing: on made-up graphs it finds what is there."""
    graph = grimp.ImportGraph()
    for module in ["p", *edges]:
        graph.add_module(module)
    for importer, imported in ((a, b) for a, bs in edges.items() for b in bs if a != b):
        graph.add_import(importer=importer, imported=imported)
    assert cycles(graph, "p") == expected
