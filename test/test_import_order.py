"""Imports between the packages of python/sglang/srt point one way (docs/architecture.md,
"Packages and import directions").

Every `sglang.srt` import of every module (at module level, inside functions, under
TYPE_CHECKING) is read from the AST and mapped to the package it names: a package imports
only packages on a lower row of LAYERS, so the package graph has no circle.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
SRT = REPO / "python" / "sglang" / "srt"
ARCHITECTURE = REPO / "docs" / "architecture.md"

# Top to bottom; a package imports only packages of rows below its own.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("entrypoints",),
    ("managers",),
    ("speculative",),
    ("model_executor",),
    ("model_loader",),
    ("models",),
    ("layers",),
    ("batch",),
    ("sampling", "mem_cache"),
    ("kernels", "distributed"),
    ("configs", "server_args", "metrics"),
    ("utils",),
)
ROW = {package: row for row, packages in enumerate(LAYERS) for package in packages}

# (importing package, imported package) -> "file:line imported.module" of each such import
Edges = dict[tuple[str, str], list[str]]


def module_name(path: Path, srt: Path) -> str:
    parts = path.relative_to(srt).with_suffix("").parts
    return ".".join(("sglang", "srt") + (parts[:-1] if parts[-1] == "__init__" else parts))


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import anywhere in the tree; `from X import a`
    yields X.a too (a may be a module)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative to the module's package
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def package_of(module: str) -> Optional[str]:
    """The srt package a module belongs to (its first name under sglang.srt), or None."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["sglang", "srt"] and len(parts) > 2 else None


def srt_packages(srt: Path) -> set[str]:
    return {p.name for p in srt.iterdir() if (p / "__init__.py").exists()} | {
        p.stem for p in srt.glob("*.py") if p.stem != "__init__"
    }


def package_edges(srt: Path) -> Edges:
    packages = srt_packages(srt)
    edges: Edges = defaultdict(list)
    for path in sorted(srt.rglob("*.py")):
        module = module_name(path, srt)
        source = package_of(module)
        tree = ast.parse(path.read_text(), str(path))
        for line, imported in imported_modules(tree, module, path.name == "__init__.py"):
            target = package_of(imported)
            if source is not None and target in packages and target != source:
                edges[source, target].append(f"{path.relative_to(srt.parent.parent)}:{line} {imported}")
    return dict(edges)


def upward_imports(edges: Edges) -> list[str]:
    """Imports of a package on the importer's row or above it."""
    return [
        f"{source} -> {target}: {where}"
        for (source, target), wheres in sorted(edges.items())
        if ROW[target] <= ROW[source]
        for where in wheres
    ]


def package_circles(edges: Edges) -> list[list[str]]:
    """Every strongly connected group of more than one package (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def documented_layers(text: str) -> tuple[tuple[str, ...], ...]:
    """The package rows of the architecture document's package table, top to bottom."""
    section = text.split("## Packages and import directions", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return tuple(tuple(re.findall(r"`(\w+)`", cell)) for cell in rows)


# ---------------------------------------------------------------------- the tree as it is
def test_every_package_has_a_row():
    assert srt_packages(SRT) == set(ROW), "place each package of python/sglang/srt in LAYERS and the document"


def test_the_document_lists_the_rows_of_layers():
    assert documented_layers(ARCHITECTURE.read_text()) == LAYERS


def test_no_package_imports_its_row_or_above():
    assert upward_imports(package_edges(SRT)) == []


def test_no_circle_between_packages():
    assert package_circles(package_edges(SRT)) == []


# ---------------------------------------------------------------------- the scanner itself
def _write(root: Path, files: dict[str, str]) -> Path:
    srt = root / "sglang" / "srt"
    for name, text in files.items():
        path = srt / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return srt


def test_imports_in_functions_type_checking_and_relative_forms_count(tmp_path):
    srt = _write(
        tmp_path,
        {
            "layers/__init__.py": "",
            "layers/a.py": "def f():\n    from sglang.srt.model_executor.runner import R\n",
            "layers/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import sglang.srt.managers.x\n",
            "layers/c.py": "from sglang.srt import speculative\nfrom ..batch import forward\nfrom . import a\n",
            "model_executor/__init__.py": "",
            "model_executor/runner.py": "from sglang.srt.layers.a import f\n",
            "managers/__init__.py": "",
            "speculative/__init__.py": "",
            "batch/__init__.py": "",
            "utils.py": "import os\n",
        },
    )
    edges = package_edges(srt)
    assert set(edges) == {
        ("layers", "model_executor"),
        ("layers", "managers"),
        ("layers", "speculative"),
        ("layers", "batch"),
        ("model_executor", "layers"),
    }
    assert edges["layers", "model_executor"] == ["sglang/srt/layers/a.py:2 sglang.srt.model_executor.runner.R"]
    assert [line.split(": ")[0] for line in upward_imports(edges)] == [
        "layers -> managers",
        "layers -> model_executor",
        "layers -> speculative",
    ]
    assert package_circles(edges) == [["layers", "model_executor"]]
