"""Architecture rules that must not erode."""

import ast
import subprocess
import sys
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "src" / "zerobubble"
SCHEDULE = LIBRARY / "schedule"
BUILDERS = SCHEDULE / "builders"
OUTSIDE = ("zerobubble_bench", "zerobubble_demo")
FAMILIES_PACKAGE = "zerobubble.schedule.builders"
HELPERS_PACKAGE = "zerobubble.schedule.builders.planning"


def test_schedule_layer_never_imports_torch():
    code = (
        "import sys, zerobubble.schedule, zerobubble.schedule.compare, zerobubble.schedule.paper\n"
        "import zerobubble.cli\n"
        "import zerobubble.schedule.builders as b\n"
        "for spec in b.REGISTRY.values():\n"
        "    spec.load()\n"
        "for extra in ('render', 'export', 'bounds'):\n"
        "    __import__('zerobubble.schedule.' + extra)\n"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_schedule_sources_do_not_mention_torch_imports():
    offenders = [
        str(path)
        for path in SCHEDULE.rglob("*.py")
        for line in path.read_text().splitlines()
        if line.strip().startswith(("import torch", "from torch"))
    ]
    assert offenders == []


def _outside_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, at module level) of each import of the demo or the benchmarks in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    inside_functions = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] in OUTSIDE:
                found.append((node.lineno, name, id(node) not in inside_functions))
    return found


def test_library_never_imports_the_demo_or_the_benchmarks():
    """Only the cli package reaches the demo and benchmarks, and only inside its command functions."""
    offenders = [
        f"{path.relative_to(LIBRARY)}:{line} imports {name}"
        for path in sorted(LIBRARY.rglob("*.py"))
        for line, name, top_level in _outside_imports(path)
        if path.relative_to(LIBRARY).parts[0] != "cli" or top_level
    ]
    assert offenders == []
    commands = sorted((LIBRARY / "cli").glob("*.py"))
    assert any(not top for path in commands for _, _, top in _outside_imports(path))  # the scan sees them


def test_importing_the_library_loads_neither_demo_nor_benchmarks():
    code = (
        "import sys, pkgutil, importlib, zerobubble\n"
        "for info in pkgutil.walk_packages(zerobubble.__path__, 'zerobubble.'):\n"
        "    if not info.name.endswith('__main__'):\n"
        "        importlib.import_module(info.name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('zerobubble_bench', 'zerobubble_demo')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_schedule_commands_load_neither_torch_nor_the_benchmarks():
    """The benchmarks (and torch) load only for a command line naming ``bench``."""
    code = (
        "import contextlib, io, sys\n"
        "from zerobubble.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['schedules']) == 0 and main(['simulate', '-p', '2', '-m', '4']) == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'zerobubble_bench')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _dotted(path: Path) -> str:
    """The dotted module name of a file under ``src/``."""
    parts = list(path.relative_to(LIBRARY.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _family_imports(source: str, module: str, package: bool) -> list[str]:
    """Modules of the builders package outside its ``planning`` helpers that ``source`` imports.

    Every import counts, inside functions too (a helper must not reach a family even lazily);
    ``module`` is the dotted name of ``source``, ``package`` whether it is an ``__init__``.
    """
    base = module.split(".") if package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = base[: len(base) - node.level + 1] if node.level else []
            names = [".".join(prefix + ([node.module] if node.module else []))]
        else:
            continue
        found += [
            name
            for name in names
            if (name == FAMILIES_PACKAGE or name.startswith(FAMILIES_PACKAGE + "."))
            and not (name == HELPERS_PACKAGE or name.startswith(HELPERS_PACKAGE + "."))
        ]
    return found


def test_planning_helpers_never_import_a_family_or_the_registry():
    """Families depend on the shared helpers (``builders/planning/``), never the reverse."""
    helpers = sorted((BUILDERS / "planning").rglob("*.py"))
    assert len(helpers) > 5
    offenders = [
        f"{path.relative_to(LIBRARY)} imports {name}"
        for path in helpers
        for name in _family_imports(path.read_text(), _dotted(path), path.name == "__init__.py")
    ]
    assert offenders == []


def test_the_family_import_finder_finds_one():
    """The guard can fail: relative, absolute and lazy imports of a family or the registry are found."""
    helper = f"{HELPERS_PACKAGE}.example"
    source = (
        "from .core import PlanState\n"
        "from . import v_rounds\n"
        "from ..zb_v import ZB_V_POLICIES\n"
        "import zerobubble.schedule.costs\n"
        "def f():\n"
        "    from .. import build_schedule\n"
        "    import zerobubble.schedule.builders.zb_auto\n"
    )
    assert _family_imports(source, helper, package=False) == [
        f"{FAMILIES_PACKAGE}.zb_v",
        FAMILIES_PACKAGE,
        f"{FAMILIES_PACKAGE}.zb_auto",
    ]
    package_source = "from .core import PlanState\nfrom .. import zb_v\n"  # in planning/__init__.py
    assert _family_imports(package_source, HELPERS_PACKAGE, package=True) == [FAMILIES_PACKAGE]


def test_builders_holds_the_registry_and_one_module_per_built_in_family():
    """A module directly in ``builders/`` is a family the registry names; helpers go in ``planning/``."""
    from zerobubble.schedule.builders import REGISTRY

    modules = {path.stem for path in BUILDERS.glob("*.py")} - {"__init__"}
    built_in = {spec.module for spec in REGISTRY.values() if spec.builder is None}
    assert modules == built_in
    assert sorted(
        path.name for path in BUILDERS.iterdir() if path.is_dir() and path.name != "__pycache__"
    ) == ["planning"]


def test_importing_the_planning_helpers_loads_no_family():
    code = (
        "import importlib, pkgutil, sys\n"
        f"import {HELPERS_PACKAGE} as helpers\n"
        "for info in pkgutil.iter_modules(helpers.__path__, helpers.__name__ + '.'):\n"
        "    importlib.import_module(info.name)\n"
        f"outside = [m for m in sys.modules if m.startswith('{FAMILIES_PACKAGE}.')]\n"
        f"print(sorted(m for m in outside if m.split('.')[3] != 'planning'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _imported_modules(path: Path, package: str | None = None) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import in ``path``; relative ones resolved against ``package``
    (the dotted package the file is in), when given."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level and package is not None:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            elif node.level:
                continue
            found.append((node.lineno, module, [alias.name for alias in node.names]))
    return found


def _package_of(path: Path) -> str | None:
    """The dotted package of a file under ``src/`` (None elsewhere)."""
    sources = LIBRARY.parent
    return ".".join(path.parent.relative_to(sources).parts) if path.is_relative_to(sources) else None


def test_nothing_outside_cli_imports_the_cli_but_its_entry_point():
    """The errors the CLI, the demo and the benchmarks share live in ``zerobubble.errors``; from the CLI
    only its entry point ``main`` is imported: by ``python -m zerobubble`` and by the benchmark scripts
    that stand for a ``zerobubble bench`` command."""
    root = LIBRARY.parents[1]
    files = [
        path
        for folder in ("src", "benchmarks", "examples")
        for path in sorted((root / folder).rglob("*.py"))
        if not path.is_relative_to(LIBRARY / "cli")
    ]
    entry_points = {LIBRARY / "__main__.py", *(root / "benchmarks").glob("*.py")}
    offenders = [
        f"{path.relative_to(root)}:{line} imports {names or module}"
        for path in files
        for line, module, names in _imported_modules(path, _package_of(path))
        if (
            (module == "zerobubble.cli" or module.startswith("zerobubble.cli."))
            and not (path in entry_points and module == "zerobubble.cli" and names == ["main"])
        )
        or (module == "zerobubble" and "cli" in names)
    ]
    assert offenders == []
    assert any(names == ["main"] for _, _, names in _imported_modules(LIBRARY / "__main__.py", "zerobubble"))


def test_the_errors_module_imports_nothing_and_holds_every_error_type():
    """One neutral errors module: torch-free, importing no other layer, every error class defined in it."""
    errors = LIBRARY / "errors.py"
    tree = ast.parse(errors.read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(n, ast.ImportFrom) and n.module in ("__future__", "typing") for n in top_level)
    defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    exceptions = {"Exception", "ValueError", "RuntimeError", "UserWarning", *defined}
    elsewhere = [
        f"{path.relative_to(LIBRARY.parent)}: {node.name}"
        for path in sorted(LIBRARY.parent.rglob("*.py"))
        if path != errors
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and any(isinstance(b, ast.Name) and b.id in exceptions for b in node.bases)
        and node.name != "Stuck"  # the builders' search control flow: never leaves a builder
    ]
    assert elsewhere == []


def test_library_tests_import_neither_the_benchmarks_nor_their_scripts():
    """The tests of ``zerobubble_bench`` and ``benchmarks/`` live in ``tests/bench/``; the library's tests
    take what they share with the benchmarks from the demo or a helper of their own."""
    tests = Path(__file__).resolve().parent
    offenders = [
        f"{path.relative_to(tests)}:{line} imports {module}"
        for path in sorted(tests.rglob("*.py"))
        if not path.is_relative_to(tests / "bench")
        for line, module, _ in _imported_modules(path)
        if module.split(".")[0] in ("zerobubble_bench", "benchmarks")
    ]
    assert offenders == []
    assert any(  # the scan sees the benchmarks' own tests
        module.startswith("zerobubble_bench")
        for path in (tests / "bench").glob("*.py")
        for _, module, _ in _imported_modules(path)
    )
