"""Architecture rules that must not erode."""

import ast
import subprocess
import sys
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "src" / "zerobubble"
SCHEDULE = LIBRARY / "schedule"
OUTSIDE = ("zerobubble_bench", "zerobubble_demo")


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
