"""The project's source modules and the imports between them, read from the files (nothing is imported):
the import graph the structure and layering guards (tests/guards/) check."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCES = Path(__file__).resolve().parents[2] / "src"


def source_modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package) for every module under ``src/``."""
    found = {}
    for path in sorted(SOURCES.rglob("*.py")):
        parts = list(path.relative_to(SOURCES).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def module_imports(path: Path, name: str, package: bool, known: set[str]) -> set[str]:
    """The project modules ``name`` imports at its top level (not in functions or TYPE_CHECKING)."""
    base = name if package else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                test = node.test
                if (getattr(test, "id", None) or getattr(test, "attr", None)) != "TYPE_CHECKING":
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                parts = base.split(".")[: len(base.split(".")) - node.level + 1] if node.level else []
                module = ".".join(parts + ([node.module] if node.module else []))
                found.add(module)
                found.update(f"{module}.{alias.name}" for alias in node.names)

    visit(ast.parse(path.read_text()).body)
    return {module for module in found if module in known and module != name}


def import_graph() -> dict[str, set[str]]:
    """Each module of ``src/`` → the project modules it imports at its top level."""
    modules = source_modules()
    return {
        name: module_imports(path, name, package, set(modules)) for name, (path, package) in modules.items()
    }
