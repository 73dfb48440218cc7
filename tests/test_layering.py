"""Architecture rules that must not erode."""

import subprocess
import sys
from pathlib import Path

SCHEDULE = Path(__file__).resolve().parents[1] / "src" / "zerobubble" / "schedule"


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
