"""The package type-checks with mypy, pinned to the oldest supported Python (pyproject [tool.mypy])."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("mypy")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_mypy_finds_no_errors():
    run = subprocess.run([sys.executable, "-m", "mypy", "shmloader"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
