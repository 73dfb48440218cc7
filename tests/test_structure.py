"""Guards on the shape of the code: module, function and module-docstring sizes, and import cycles.

A module over :data:`LIMITS` ``["module"]`` lines, a function over ``["function"]`` lines, a module
docstring over ``["docstring"]`` lines (counted with its quote lines, as it takes them in its file)
or a cycle among the modules' top-level imports fails here (and so fails CI), unless
``tests/structure_allowlist.txt`` names it with the size it may reach and the reason.  An entry that
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

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "src"
ALLOWLIST = Path(__file__).resolve().parent / "structure_allowlist.txt"
LIMITS = {"module": 600, "function": 60, "docstring": 25}
SCOPES = {
    "module": ("src", "tests", "benchmarks"),
    "docstring": ("src", "tests", "benchmarks"),
    "function": ("src",),
}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package) for every module under ``src/``."""
    found = {}
    for path in sorted(SOURCES.rglob("*.py")):
        parts = list(path.relative_to(SOURCES).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


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


def _imports(path: Path, name: str, package: bool, known: set[str]) -> set[str]:
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


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules, the first repeated at the end), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return list(error.args[1])
    return None


def test_the_modules_import_one_another_without_cycles():
    modules = _modules()
    graph = {name: _imports(path, name, package, set(modules)) for name, (path, package) in modules.items()}
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


PARAMETER_SCOPES = ("src/zerobubble/schedule", "src/zerobubble_bench")
"""Where a function or method takes at most :data:`MOST_PARAMETERS` parameters."""

MOST_PARAMETERS = 8
"""Not counting ``self``/``cls``; ``*args`` and ``**kwargs`` count one each."""

KEYWORD_APIS = {("build_schedule", None), ("compare_schedules", None), ("plan", "search.py")}
"""Public names whose keyword arguments are the API: exempt (``plan`` of ``modelplan/search.py`` only)."""


def test_functions_of_the_schedule_layer_and_the_benchmarks_take_few_parameters():
    over = []
    for top in PARAMETER_SCOPES:
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                args = node.args
                named = [
                    a
                    for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
                    if a.arg not in ("self", "cls")
                ]
                count = len(named) + (args.vararg is not None) + (args.kwarg is not None)
                exempt = (node.name, None) in KEYWORD_APIS or (node.name, path.name) in KEYWORD_APIS
                if count > MOST_PARAMETERS and not exempt:
                    over.append(f"{path.relative_to(ROOT)}::{node.name}: {count} parameters")
    assert not over, f"group them into a small record (at most {MOST_PARAMETERS}):\n" + "\n".join(over)
