"""The suite without torch: torch is an optional extra (``shmloader[torch]``), so every test module
must collect where torch is missing, its torch-needing tests skipping rather than erroring.

A subprocess collects the whole suite with ``import torch`` failing as a missing package does
(``sys.modules['torch'] = None``, set by a one-line plugin before any test module is imported).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"


@pytest.mark.timeout(180)
def test_every_test_module_collects_without_torch(tmp_path: Path) -> None:
    (tmp_path / "hide_torch_plugin.py").write_text("import sys\nsys.modules['torch'] = None\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMLOADER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO), str(TESTS)])
    command = [sys.executable, "-m", "pytest", "-p", "hide_torch_plugin", "-p", "no:cacheprovider",
               "--collect-only", "-q", str(TESTS)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    errors = [line for line in result.stdout.splitlines() if line.startswith("ERROR ")]
    assert result.returncode == 0 and not errors, "\n".join(errors) or result.stdout[-3000:] + result.stderr
