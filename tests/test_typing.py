"""The package and its tests type-check with mypy, pinned to the oldest supported Python (pyproject [tool.mypy])."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("mypy")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mypy(*paths: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", *paths], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.timeout(300)
def test_mypy_finds_no_errors():
    run = _mypy("shmloader")
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.timeout(300)
def test_mypy_finds_no_errors_in_the_tests() -> None:
    """The tests, and the scripts the docs' figures come from, as well (a few seconds more: the
    package's run leaves its cache for this one)."""
    run = _mypy("shmloader", "tests", "benchmarks", "stress")
    assert run.returncode == 0, run.stdout + run.stderr
