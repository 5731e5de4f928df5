"""The package's folders are its layers: a module imports only from its own layer or one below.

``kvdoc/core`` (the decoder and its caches) imports nothing but the standard library, torch and
``kvdoc.core``, so an engineer can copy the folder alone.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvdoc"
LAYERS = ("core", "interop", "serving", "measure", "parallel", "proofs", "teach")
"""Bottom to top; the package's ``__init__``, ``__main__`` and ``cli`` sit above them all."""
TOP = ("__init__.py", "__main__.py", "cli.py")
"""The modules outside the layer folders."""
CORE_THIRD_PARTY = {"torch"}


def imported_modules(source: str, module: str) -> list[str]:
    """Absolute names of every module ``source`` (the module ``module``) imports, at any depth."""
    package = module.rsplit(".", 1)[0]
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.append(base)
            # `from kvdoc.proofs import grid` imports the module kvdoc.proofs.grid
            names += [f"{base}.{alias.name}" for alias in node.names if base.startswith("kvdoc")]
    return names


def layer_of(name: str) -> str | None:
    """The layer folder a ``kvdoc`` module name lies in; ``"top"`` for the package itself."""
    parts = name.split(".")
    if parts[0] != "kvdoc":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "top"


def violations(source: str, module: str) -> list[str]:
    """Imports of ``module`` that reach above its layer (or, in core, outside torch)."""
    own = layer_of(module)
    rank = LAYERS.index(own)
    found = []
    for name in imported_modules(source, module):
        layer = layer_of(name)
        if layer is None:
            top = name.split(".")[0]
            if own == "core" and top not in CORE_THIRD_PARTY and top not in sys.stdlib_module_names:
                found.append(f"{module} imports {name}: "
                             "core needs only torch and the standard library")
        elif layer == "top" or LAYERS.index(layer) > rank:
            found.append(f"{module} ({own}) imports {name} ({layer})")
    return found


def package_modules() -> list[tuple[str, Path]]:
    return [(".".join(("kvdoc", *p.relative_to(PACKAGE).with_suffix("").parts)), p)
            for p in sorted(PACKAGE.rglob("*.py"))]


def test_every_module_lives_in_a_layer():
    loose = [name for name, path in package_modules()
             if path.parent == PACKAGE and path.name not in TOP]
    assert not loose, f"modules outside a layer folder: {loose}"
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYERS)


@pytest.mark.parametrize(("module", "path"), [m for m in package_modules()
                                              if layer_of(m[0]) != "top"], ids=lambda x: str(x))
def test_no_layer_imports_one_above_it(module: str, path: Path):
    assert violations(path.read_text(), module) == []


@pytest.mark.parametrize(("source", "module"), [
    ("from kvdoc.proofs.compare import TOLERANCE", "kvdoc.serving.batching"),
    ("def f():\n    from ..teach import toy", "kvdoc.measure.bench"),
    ("from kvdoc import Decoder", "kvdoc.core.fast"),
    ("import numpy", "kvdoc.core.model"),
    ("from kvdoc.proofs import grid", "kvdoc.measure.bench"),
])
def test_the_layer_rule_can_fail(source: str, module: str):
    assert violations(source, module)


def test_the_layer_rule_allows_the_layers_below():
    source = "from .cache import KVCache\nfrom kvdoc.core.model import Decoder\nimport torch"
    assert violations(source, "kvdoc.core.fast") == []
    assert violations("from ..core import model\nfrom ..interop.hf_config import gpt2_config",
                      "kvdoc.proofs.grid") == []


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (module -> the modules it imports): each strongly
    connected set of more than one module, or a module that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            ring = []
            while not ring or ring[-1] != node:
                ring.append(stack.pop())
            if len(ring) > 1 or node in graph.get(node, ()):
                found.append(sorted(ring))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    """No module imports, at any depth (a deferred import in a function too), a module that
    imports it back: a circle of two modules in one layer passes the layer rule (the last one
    was core/model.py <-> core/window.py)."""
    modules = dict(package_modules())
    graph = {name: {m for m in imported_modules(path.read_text(), name)
                    if m in modules and m != name and not m.endswith("__init__")}
             for name, path in modules.items()}
    assert circles(graph) == []


def test_the_circle_check_can_fail():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"], ["e"]]
    assert circles({"a": {"b"}, "b": set()}) == []
