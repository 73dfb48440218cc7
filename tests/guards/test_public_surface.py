"""The public surface: the demo, the benchmarks and the examples use only the library's public modules.

:data:`PUBLIC_MODULES` is the list ``docs/architecture.md`` ("The errors, and the public surface")
documents — the test checks that the two agree.  In a public module the public names are those of its
``__all__``.  Every module under ``src/zerobubble_demo``, ``src/zerobubble_bench``, ``benchmarks/`` and
``examples/`` is parsed (nothing is imported) and fails on an import of any other ``zerobubble`` module,
of a name outside a public module's ``__all__``, or of a private ``_name`` from any of the project's
packages (relative imports inside one package are its own business).  ``zerobubble.cli`` is not a
library module: only its entry point ``main`` may be imported, by the ``benchmarks/*.py`` scripts that
stand for a ``zerobubble bench`` command.  :data:`INTERNAL_PROBES` names the scripts that time an
internal mechanism itself, with the internal modules each may reach and why; an entry no longer needed
fails, so the list only shrinks.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "src"
SCANNED = ("src/zerobubble_demo", "src/zerobubble_bench", "benchmarks", "examples")
PACKAGES = ("zerobubble", "zerobubble_bench", "zerobubble_demo")

PUBLIC_MODULES = (
    "zerobubble",
    "zerobubble.errors",
    "zerobubble.hf",
    "zerobubble.schedule",
    "zerobubble.schedule.compare",
    "zerobubble.schedule.modelplan",
    "zerobubble.schedule.paper",
    "zerobubble.schedule.partition",
    "zerobubble.schedule.vocab",
    "zerobubble.runtime",
    "zerobubble.runtime.launch",
    "zerobubble.runtime.observe.memory",
    "zerobubble.runtime.parallel.mesh",
    "zerobubble.runtime.optim",
    "zerobubble.runtime.construct.profile",
    "zerobubble.runtime.observe.recorder",
    "zerobubble.runtime.optim.rollback",
    "zerobubble.runtime.observe.trace",
    "zerobubble.runtime.vocab.layers",
    "zerobubble.runtime.wgrad",
)
"""The library's public modules, as ``docs/architecture.md`` lists them."""

ENTRY_POINT = ("zerobubble.cli", "main")
"""The one name outside ``cli/`` may import from it: the command line itself."""

INTERNAL_PROBES: dict[str, tuple[tuple[str, ...], str]] = {
    "benchmarks/call_check.py": (
        ("zerobubble.runtime.parallel.consistency",),
        "times the per-call check's exchange itself (CallSignature, batch_signature)",
    ),
    "benchmarks/executor_loop.py": (
        (
            "zerobubble.runtime.execute.executor",
            "zerobubble.runtime.failures",
            "zerobubble.runtime.parallel.data_parallel",
            "zerobubble.schedule.lowering",
        ),
        "times the dispatch loop of a hand-built Executor following a lowered program, no Pipeline",
    ),
    "benchmarks/wait_latency.py": (
        ("zerobubble.runtime.failures",),
        "times PeerMonitor.wait, every runtime wait, against a bare wait()",
    ),
    "benchmarks/split_guard.py": (
        ("zerobubble.runtime.construct.staging",),
        "times the split guard's check on a hand-built stage module",
    ),
    "benchmarks/_wgrad_kernels.py": (
        ("zerobubble.runtime.wgrad",),
        "wgrad_overhead's kernels section: times the split's closed-form rules one by one",
    ),
    "benchmarks/_wgrad_generic.py": (
        ("zerobubble.runtime.wgrad",),
        "wgrad_overhead's generic section: times the store, routed calls, frontier and generic split",
    ),
    "benchmarks/_wgrad_hooks.py": (
        ("zerobubble.runtime.wgrad",),
        "wgrad_overhead's hooks section: times the split's hook paths on the W store",
    ),
    "benchmarks/zb_random_settings.py": (
        ("zerobubble.schedule.builders",),
        "runs the authors' eight ZB-1p/2p greedy variants, which exist only inside the zb builders",
    ),
    "benchmarks/zb_v_random_settings.py": (
        ("zerobubble.schedule.builders",),
        "runs the authors' four ZB-V variants, which exist only inside the zb-v builders",
    ),
}


def _module_file(module: str) -> Path:
    path = SOURCES.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _public_names(module: str) -> set[str]:
    """The literal ``__all__`` of ``module``, read from its source."""
    tree = ast.parse(_module_file(module).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"public module {module} has no literal __all__")


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every absolute import in ``path`` (``names`` empty for ``import m``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return found


def _problem(where: str, module: str, names: list[str]) -> str | None:
    """Why importing ``names`` from ``module`` in ``where`` reaches past the public surface, or None."""
    if module.split(".")[0] not in PACKAGES:
        return None
    private = [name for name in [*module.split("."), *names] if name.startswith("_")]
    if private:
        return f"private {private}"
    if module.split(".")[0] != "zerobubble":
        return None  # the demo's and the benchmarks' own public names
    if module == ENTRY_POINT[0] or module.startswith(ENTRY_POINT[0] + "."):
        script = where.startswith("benchmarks/")
        return None if script and module == ENTRY_POINT[0] and names == [ENTRY_POINT[1]] else "zerobubble.cli"
    if module not in PUBLIC_MODULES:
        return f"internal module {module}"
    outside = [n for n in names if n not in _public_names(module) and f"{module}.{n}" not in PUBLIC_MODULES]
    return f"{module}: {outside} not in its __all__" if outside else None


def _reaches() -> dict[str, list[tuple[int, str, str]]]:
    """Per scanned file: ``(line, module, problem)`` of each import past the public surface."""
    found: dict[str, list[tuple[int, str, str]]] = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            for line, module, names in _imports(path):
                problem = _problem(where, module, names)
                if problem is not None:
                    found.setdefault(where, []).append((line, module, problem))
    return found


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def _allowed(where: str, module: str) -> bool:
    return _within(module, INTERNAL_PROBES.get(where, ((), ""))[0])


def test_the_demo_the_benchmarks_and_the_examples_use_only_public_modules():
    offenders = [
        f"{where}:{line}: {problem}"
        for where, reaches in _reaches().items()
        for line, module, problem in reaches
        if not _allowed(where, module)
    ]
    assert offenders == [], "\n".join(offenders)


def test_every_internal_probe_is_still_needed():
    reaches = _reaches()
    stale = [
        f"{where}: {prefix}"
        for where, (prefixes, _) in INTERNAL_PROBES.items()
        for prefix in prefixes
        if not any(_within(module, (prefix,)) for _, module, _ in reaches.get(where, []))
    ]
    assert stale == [], "drop these from INTERNAL_PROBES: " + ", ".join(stale)


def test_the_scan_sees_an_internal_reach():
    assert _problem("src/zerobubble_bench/x.py", "zerobubble.runtime.execute.executor", ["Executor"])
    assert _problem("src/zerobubble_bench/x.py", "zerobubble.runtime.launch", ["free_port"])
    assert _problem("src/zerobubble_bench/x.py", "zerobubble_bench.wgrad", ["_split"])
    assert _problem("src/zerobubble_bench/x.py", "zerobubble.cli", ["main"])
    assert _problem("benchmarks/x.py", "zerobubble.cli", ["UsageError"])
    assert _problem("benchmarks/x.py", "zerobubble.cli", ["main"]) is None
    assert _problem("benchmarks/x.py", "zerobubble.runtime", ["wgrad"]) is None  # a public submodule


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_imports(module):
    imported = importlib.import_module(module)
    missing = [name for name in sorted(_public_names(module)) if not hasattr(imported, name)]
    assert missing == [], f"{module}.__all__ names what it lacks"


def test_the_architecture_doc_lists_the_public_modules():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The errors, and the public surface", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\* `(zerobubble[\w.]*)` —", section, flags=re.MULTILINE)
    assert documented == list(PUBLIC_MODULES)
