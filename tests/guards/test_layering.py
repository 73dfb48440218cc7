"""Architecture rules that must not erode."""

import ast
import subprocess
import sys
from pathlib import Path

from _source_graph import import_graph

LIBRARY = Path(__file__).resolve().parents[2] / "src" / "zerobubble"
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


# -- the runtime's rooms (docs/architecture.md, "Rooms of the runtime") ------------------------------

RUNTIME = LIBRARY / "runtime"
RUNTIME_PACKAGE = "zerobubble.runtime"
MAX_DIRECT_MODULES = 6  # modules directly in runtime/, __init__ included
MAX_ROOM_MODULES = 12  # modules in one room, its __init__ included
BASE = "base"  # runtime/__init__ (PipelineError), tensors, failures, launch: import no room
FACADE = "pipeline"  # runtime/pipeline.py, the Pipeline: may import every room
#: room -> the rooms its modules may import at their top level; mirrors docs/architecture.md.
ROOMS_MAY_IMPORT = {
    BASE: set(),
    "wgrad": {BASE},
    "parallel": {BASE},
    "observe": {BASE, "parallel"},
    "execute": {BASE, "wgrad", "parallel", "observe"},
    "vocab": {BASE, "parallel", "execute"},
    "construct": {BASE, "wgrad", "parallel", "observe", "execute", "vocab"},
    "optim": {BASE, "parallel", "execute", "construct"},
    "state": {BASE, "parallel", "execute", "vocab"},
}


def _rooms() -> list[str]:
    return sorted(path.name for path in RUNTIME.iterdir() if (path / "__init__.py").is_file())


def _room_of(module: str) -> str | None:
    """The room of a runtime module (``zerobubble.runtime.<room>...``), or None outside the runtime."""
    if module != RUNTIME_PACKAGE and not module.startswith(RUNTIME_PACKAGE + "."):
        return None
    head = module.removeprefix(RUNTIME_PACKAGE).lstrip(".").split(".")[0]
    if head == FACADE:
        return FACADE
    return head if head and (RUNTIME / head / "__init__.py").is_file() else BASE


def _room_offences(graph: dict[str, set[str]]) -> list[str]:
    """Each import of ``graph`` (module -> modules it imports) against :data:`ROOMS_MAY_IMPORT`."""
    offences = []
    for module, imported in sorted(graph.items()):
        room = _room_of(module)
        if room is None or room == FACADE:
            continue
        for target in sorted(imported):
            other = _room_of(target)
            if other is not None and other != room and other not in ROOMS_MAY_IMPORT.get(room, set()):
                offences.append(f"{module} ({room}) imports {target} ({other})")
    return offences


def test_the_runtime_is_a_few_modules_and_rooms_of_a_dozen_at_most():
    direct = sorted(path.name for path in RUNTIME.glob("*.py"))
    assert len(direct) <= MAX_DIRECT_MODULES, f"runtime/ holds {direct}: move one into its room"
    for room in _rooms():
        modules = sorted(path.name for path in (RUNTIME / room).glob("*.py"))
        assert len(modules) <= MAX_ROOM_MODULES, f"runtime/{room}/ holds {len(modules)} modules: split it"
        assert not [p for p in (RUNTIME / room).iterdir() if (p / "__init__.py").is_file()], room
    assert set(_rooms()) == set(ROOMS_MAY_IMPORT) - {BASE}, "a room is missing from the direction table"


def test_runtime_rooms_import_one_way():
    """A room imports only the rooms below it (top-level imports, as the cycle check reads them)."""
    graph = import_graph()
    assert sum(1 for name in graph if _room_of(name) == "construct") > 5  # the scan sees the rooms
    assert _room_offences(graph) == []


def test_the_room_direction_check_finds_an_offence():
    """The guard can fail: a room reaching up (parallel -> construct) or the base reaching a room."""
    r = RUNTIME_PACKAGE
    graph = {
        "zerobubble.runtime.parallel.fsdp": {"zerobubble.runtime.construct.staging", "zerobubble.runtime"},
        "zerobubble.runtime.tensors": {"zerobubble.runtime.observe.memory"},
        "zerobubble.runtime.pipeline": {"zerobubble.runtime.state.checkpoint"},
        "zerobubble.runtime.construct.build": {"zerobubble.runtime.execute.executor"},
    }
    assert _room_offences(graph) == [
        f"{r}.parallel.fsdp (parallel) imports {r}.construct.staging (construct)",
        f"{r}.tensors (base) imports {r}.observe.memory (observe)",
    ]


def test_the_flat_runtime_paths_still_import_as_their_rooms_modules():
    """``zerobubble.runtime.<old>`` (before the rooms) is the same module object as its room's."""
    code = (
        "import importlib, sys\n"
        "from zerobubble.runtime import MOVED\n"
        "for old, new in MOVED.items():\n"
        "    module = importlib.import_module('zerobubble.runtime.' + old)\n"
        "    assert module is importlib.import_module('zerobubble.runtime.' + new), old\n"
        "    assert module.__spec__.name == 'zerobubble.runtime.' + new, old\n"
        "from zerobubble.runtime.trace import write_trace\n"
        "from zerobubble.runtime.vocab_layers import VocabParallelHead\n"
        "from zerobubble.runtime.optim import PostValidator\n"
        "print(len(MOVED))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(result.stdout) > 20
    from zerobubble.runtime import MOVED

    assert not [old for old in MOVED if (RUNTIME / f"{old}.py").exists() or (RUNTIME / old).is_dir()]


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
    tests = Path(__file__).resolve().parents[1]
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
