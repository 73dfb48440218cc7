"""The public names: ``__all__`` of the packages that import some of them lazily is what ``dir()`` shows,
and every name in it imports."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module_name", ["zerobubble", "zerobubble.runtime"])
def test_every_public_name_is_in_dir_and_importable(module_name):
    module = importlib.import_module(module_name)
    listed = dir(module)
    missing = [name for name in module.__all__ if name not in listed]
    assert not missing, f"dir({module_name}) lacks {missing}"
    for name in module.__all__:
        assert getattr(module, name) is not None
        namespace: dict[str, object] = {}
        exec(f"from {module_name} import {name}", namespace)
        assert namespace[name] is getattr(module, name)


def test_dir_of_the_package_lists_the_lazy_names_without_importing_torch():
    code = (
        "import sys, zerobubble\n"
        "names = dir(zerobubble)\n"
        "print(all(n in names for n in ('Pipeline', 'VocabParallelHead', 'VocabParallelEmbedding')), "
        "'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True", "False"]
