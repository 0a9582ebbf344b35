"""Short runs of stress/combos.py, and of the stress scripts under forkserver.

Each script runs in its own process and must end with one ``PASS ...`` line and exit 0 (the helper
of tests/test_stress.py). Under forkserver, multiprocessing's fork server is a child of the script
that lives as long as the script: the scripts' leftover check used to count it as a process left
behind after ``close()``, so every forkserver run ended in ``FAIL``.
"""

from __future__ import annotations

import re

import pytest

from test_stress import run


@pytest.mark.timeout(120)
def test_combos_short() -> None:
    """Random options and faults, loader after loader: every epoch's batches exactly once."""
    last, _ = run("combos.py", "--seconds", "8", "--seed", "1", timeout_s=110)
    lives = int(re.search(r"combos: (\d+) loaders", last).group(1))  # type: ignore[union-attr]
    assert lives >= 2 and "batches exactly once" in last


@pytest.mark.timeout(120)
def test_kill_workers_under_forkserver_passes() -> None:
    last, _ = run("kill_workers.py", "--kills", "6", "--seconds", "60", "--method", "forkserver", timeout_s=110)
    assert "forkserver" in last and "0 lost, 0 duplicated" in last
