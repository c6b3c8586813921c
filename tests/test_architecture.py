"""The module map holds: imports run one way, no cycle, and the lower layers stay free of Lightning."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_fastdata"
#: Modules only the top of the package may import: nothing below them may.
TOP = {"datamodule", "callbacks", "cli", "demo"}
#: Modules that must not import Lightning at all (they are usable and testable without it).
NO_LIGHTNING = {"store", "fill", "structure", "fingerprint", "augment", "keys", "_util", "placement", "loaders",
                "shared", "plan", "distributed", "ragged", "encode", "decode", "graphs", "host_memory"}
#: The data path's layers, top to bottom: a module may import only layers below its own.
LAYERS = ["datamodule", "loaders", "placement", "shared", "store", "fill", "structure"]


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(package modules imported, top-level third-party packages imported), type-checking-only imports included."""
    ours, theirs = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "lightning_fastdata":
                ours.update(a.name for a in node.names)
            elif node.module.startswith("lightning_fastdata."):
                ours.add(node.module.split(".")[1])
            else:
                theirs.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("lightning_fastdata."):
                    ours.add(a.name.split(".")[1])
                else:
                    theirs.add(a.name.split(".")[0])
    return ours & set(_modules()), theirs


def _graph() -> dict[str, set[str]]:
    return {name: _imports(path)[0] - {name} for name, path in _modules().items()}


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


@pytest.mark.parametrize("module", sorted(_modules()))
def test_lower_modules_do_not_import_the_top(module):
    if module in TOP:
        pytest.skip("a top module")
    upward = _graph()[module] & TOP
    assert not upward, f"{module} imports {sorted(upward)}: nothing below datamodule/callbacks/cli may"


@pytest.mark.parametrize("module", sorted(NO_LIGHTNING & set(_modules())))
def test_lower_layers_do_not_import_lightning(module):
    third_party = _imports(_modules()[module])[1]
    assert not third_party & {"lightning", "pytorch_lightning", "lightning_utilities"}, (
        f"{module} imports Lightning; it must work without it"
    )


def test_the_data_path_imports_one_way():
    graph = _graph()
    rank = {}
    for level, layer in enumerate(LAYERS):
        for name in (layer if isinstance(layer, tuple) else (layer,)):
            rank[name] = level
    for module, level in rank.items():
        for imported in graph.get(module, ()):
            if imported in rank:
                assert rank[imported] > level, f"{module} imports {imported}, which is not below it"
