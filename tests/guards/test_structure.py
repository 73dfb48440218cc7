"""Guards on the shape of the code: module, function and module-docstring sizes, and import cycles.

A module over :data:`LIMITS` ``["module"]`` lines, a function over ``["function"]`` lines, a module
docstring over ``["docstring"]`` lines (counted with its quote lines, as it takes them in its file)
or a cycle among the modules' top-level imports fails here (and so fails CI), unless
``tests/guards/structure_allowlist.txt`` names it with the size it may reach and the reason.  An entry that
is no longer needed fails too, so the list only shrinks.  :data:`SCOPES` says where each limit holds:
the module and docstring limits in ``src/``, ``tests/`` and ``benchmarks/`` alike, the function limit
in ``src/`` only (a test or a benchmark may spell out a long scenario in one place); the cycle check
reads ``src/``.  Imports inside functions and under ``if TYPE_CHECKING:`` do not count: those are the
ways to break a cycle.  A function of the schedule layer or the benchmarks takes at most
:data:`MOST_PARAMETERS` parameters, bar the keyword APIs of :data:`KEYWORD_APIS`.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

from _source_graph import import_graph

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "src"
ALLOWLIST = Path(__file__).resolve().parent / "structure_allowlist.txt"
LIMITS = {"module": 600, "function": 60, "docstring": 25}
SCOPES = {
    "module": ("src", "tests", "benchmarks"),
    "docstring": ("src", "tests", "benchmarks"),
    "function": ("src",),
}


def _docstring_lines(tree: ast.Module) -> int:
    """The lines a module's docstring takes in its file, its quote lines included (0 without one)."""
    first = tree.body[0] if tree.body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
        return 0
    if not isinstance(first.value.value, str):
        return 0
    assert first.end_lineno is not None
    return first.end_lineno - first.lineno + 1


def _function_lines(tree: ast.Module, where: str) -> dict[str, int]:
    """``path::name -> lines`` of every function and method, the longest where a name repeats."""
    sizes: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            name = f"{where}::{node.name}"
            sizes[name] = max(sizes.get(name, 0), node.end_lineno - node.lineno + 1)
    return sizes


def _measured(top: str) -> dict[tuple[str, str], int]:
    """``(kind, where) -> lines`` of every kind :data:`SCOPES` applies to ``top`` (a folder of ROOT)."""
    sizes = {}
    for path in sorted((ROOT / top).rglob("*.py")):
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        tree = ast.parse(text)
        sizes[("module", where)] = len(text.splitlines())
        sizes[("docstring", where)] = _docstring_lines(tree)
        sizes.update({("function", name): size for name, size in _function_lines(tree, where).items()})
    return {(kind, where): size for (kind, where), size in sizes.items() if top in SCOPES[kind]}


def _sizes() -> dict[tuple[str, str], int]:
    """``(kind, where) -> lines`` of everything over its limit (``where``: path, or path::function)."""
    over = {}
    for top in sorted({top for tops in SCOPES.values() for top in tops}):
        over.update({key: size for key, size in _measured(top).items() if size > LIMITS[key[0]]})
    return over


def _allowed() -> dict[tuple[str, str], tuple[int, str]]:
    """The allow-list: ``kind where limit  # reason`` a line."""
    allowed = {}
    for number, line in enumerate(ALLOWLIST.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        entry, _, reason = line.partition("#")
        fields = entry.split()
        assert len(fields) == 3 and fields[0] in LIMITS and fields[2].isdigit() and reason.strip(), (
            f"{ALLOWLIST.name}:{number}: write 'kind where limit  # reason', kind one of {list(LIMITS)}"
        )
        allowed[(fields[0], fields[1])] = (int(fields[2]), reason.strip())
    return allowed


def test_modules_functions_and_docstrings_stay_within_their_limits():
    allowed = _allowed()
    problems = []
    for (kind, where), size in sorted(_sizes().items()):
        limit = allowed.get((kind, where), (LIMITS[kind], ""))[0]
        if size > limit:
            problems.append(f"{kind} {where}: {size} lines, over {limit}")
    assert not problems, "split by responsibility (docs/architecture.md):\n" + "\n".join(problems)


def test_every_allowance_is_still_needed():
    sizes = _sizes()
    stale = [f"{kind} {where}" for kind, where in _allowed() if (kind, where) not in sizes]
    assert not stale, f"remove from {ALLOWLIST.name} (now within the limit): {stale}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules, the first repeated at the end), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return list(error.args[1])
    return None


def test_the_modules_import_one_another_without_cycles():
    graph = import_graph()
    cycle = _cycle(graph)
    assert cycle is None, f"an import cycle (import inside the function that needs it): {' -> '.join(cycle)}"


def test_a_docstring_is_counted_with_its_quote_lines():
    """The guard measures what the file shows: three text lines between quote lines take five."""
    assert _docstring_lines(ast.parse('"""One.\n\nTwo.\n"""\n\nx = 1\n')) == 4
    assert _docstring_lines(ast.parse('"""\nOne.\nTwo.\nThree.\n"""\n')) == 5
    assert _docstring_lines(ast.parse('"""One line."""\n')) == 1
    assert _docstring_lines(ast.parse("x = 1\n")) == 0


def test_the_cycle_finder_finds_a_cycle():
    """The guard can fail: a three-module ring is found, a chain is not."""
    ring = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    cycle = _cycle(ring)
    assert cycle is not None and cycle[0] == cycle[-1] and sorted(set(cycle)) == ["a", "b", "c"]
    assert _cycle({"x": {"y"}, "y": set()}) is None


# -- the tests mirror the sources ------------------------------------------------------------------------

TESTS = ROOT / "tests"
TEST_ROOTS = {"bench": "zerobubble_bench", "demo": "zerobubble_demo"}
"""Test folders that mirror a package of their own; every other folder mirrors ``src/zerobubble/``."""
SHARED_TEST_FOLDERS = {"helpers", "guards"}
"""The rank workers and model cases the tests share, and the guards on the repository as a whole."""


def _mirrored_source(folder: Path) -> Path:
    """The package or module of ``src/`` a test folder mirrors: ``tests/runtime/vocab`` mirrors
    ``src/zerobubble/runtime/vocab``."""
    first, *rest = folder.relative_to(TESTS).parts
    base = SOURCES / TEST_ROOTS[first] if first in TEST_ROOTS else SOURCES / "zerobubble" / first
    return base.joinpath(*rest)


def _rooms() -> list[Path]:
    """Every package of ``src/zerobubble/`` (a room of the library) below the top one."""
    top = SOURCES / "zerobubble"
    return sorted(init.parent for init in top.rglob("__init__.py") if init.parent != top)


def test_every_test_folder_mirrors_a_room_of_the_sources():
    folders = [path for path in TESTS.rglob("*") if path.is_dir() and path.name != "__pycache__"]
    stray = [
        str(folder.relative_to(TESTS))
        for folder in folders
        if folder.relative_to(TESTS).parts[0] not in SHARED_TEST_FOLDERS
        and not _mirrored_source(folder).is_dir()
        and not _mirrored_source(folder).with_suffix(".py").is_file()
    ]
    assert stray == [], f"test folders naming no package or module of src/: {stray}"
    loose = [path.name for path in TESTS.glob("*.py") if path.name != "conftest.py"]
    assert loose == [], f"tests outside a folder of their room: {loose}"


def test_every_room_of_the_sources_has_its_test_folder():
    missing = [
        str(room.relative_to(SOURCES))
        for room in _rooms()
        if not any((TESTS / room.relative_to(SOURCES / "zerobubble")).glob("test_*.py"))
    ]
    assert missing == [], f"rooms of src/zerobubble without tests in the mirrored folder: {missing}"


def test_the_helpers_are_the_only_shared_test_modules():
    """A test file imports helpers from ``tests/helpers/``, never another test file."""
    offenders = [
        f"{path.relative_to(TESTS)} imports {module}"
        for path in sorted(TESTS.rglob("test_*.py"))
        for module in _top_level_imports(path)
        if module.startswith("test_") and module != path.stem
    ]
    assert offenders == []


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return {name.split(".")[0] for name in names}


# -- parameters: the request and the grid travel as records ----------------------------------------------

MOST_PARAMETERS = 8
"""Not counting ``self``/``cls``; ``*args`` and ``**kwargs`` count one each."""

KEYWORD_APIS = {
    ("zerobubble/runtime/pipeline.py", "__init__"),  # Pipeline(layers, *, ...): the request's fields
    ("zerobubble/runtime/construct/profile.py", "profile_layers"),  # a public module's function
    ("zerobubble/runtime/optim/post_validation.py", "__init__"),  # zerobubble.runtime.optim.PostValidator
    ("zerobubble/schedule/builders/__init__.py", "build_schedule"),  # zerobubble.build_schedule
    ("zerobubble/schedule/compare.py", "compare_schedules"),  # a public module's function
    ("zerobubble/schedule/modelplan/search.py", "plan"),  # zerobubble.schedule.modelplan.plan
}
"""The public names whose keyword arguments are the API: the only functions in ``src/`` over the limit."""


def _parameter_count(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = function.args
    count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
    count += bool(args.vararg) + bool(args.kwarg)
    return count - bool(args.args and args.args[0].arg in ("self", "cls"))


def test_no_function_takes_more_than_eight_parameters_but_the_keyword_apis():
    """Options travel as one record (the Pipeline's request, the grid, a planner's settings), not as
    loose parameters; an exemption no longer needed fails too, so the list only shrinks."""
    over = {
        (path.relative_to(SOURCES).as_posix(), node.name)
        for path in sorted(SOURCES.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and _parameter_count(node) > MOST_PARAMETERS
    }
    assert over == KEYWORD_APIS
