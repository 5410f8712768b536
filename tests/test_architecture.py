"""The package's layers: no subpackage imports one that imports it back (even inside a function)."""

from __future__ import annotations

import ast
from pathlib import Path

import gpuaccel

ROOT = Path(gpuaccel.__file__).parent


def _imported_parts(path: Path) -> set[str]:
    """The gpuaccel subpackages (or top-level modules) a file imports, anywhere in it."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    package = parts[:-1] if path.name != "__init__.py" else parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - (node.level - 1)])
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            names = [target] if len(target) > 1 else [target + [alias.name] for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        found |= {n[1] for n in names if n[0] == "gpuaccel" and len(n) > 1}
    return found


def test_no_import_cycles_between_parts():
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts == ("__init__",):
            continue  # the package's front door imports the parts it offers
        part = parts[0]
        graph.setdefault(part, set()).update(_imported_parts(path) - {part})

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    cycles = sorted((a, b) for a, deps in graph.items() for b in deps if reaches(b, a))
    assert not cycles, f"import cycles between parts: {cycles}"
    assert "train" not in graph["deploy"] or "deploy" not in graph["train"]
    assert {"train", "deploy", "bench"}.isdisjoint(graph["tasks"] | graph["models"] | graph["data"])
