"""stress/_common.leftovers and _combos_kill.live_workers: a worker is one, whatever its command line.

The defect: a child counted as multiprocessing's fork server when its command line held the word
"forkserver" (and as the resource tracker for "resource_tracker"). A fork worker keeps the
script's command line, which names the start methods (``combos.py --methods fork,forkserver``), so
every fork worker left after ``close()`` in such a run passed for a helper and no leak was
reported, and combos.py's killer never picked a fork worker to kill. Only the helpers' own
modules (``multiprocessing.forkserver``, ...) make a helper (``_common.is_helper``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_docs_commands import load_script


@pytest.mark.timeout(60)
@pytest.mark.parametrize("word", ["fork,spawn,forkserver", "resource_tracker"])
def test_a_child_whose_command_line_names_a_helper_is_still_a_leftover(word: str) -> None:
    common = load_script("stress/_common.py")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "--methods", word],
                             stdin=subprocess.PIPE)
    try:
        assert any(line.startswith(f"process {child.pid} ") for line in common.leftovers())
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)


@pytest.mark.timeout(60)
def test_the_killer_counts_a_child_whose_command_line_names_the_fork_server() -> None:
    kill = load_script("stress/_combos_kill.py")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "--methods", "fork,forkserver"],
                             stdin=subprocess.PIPE)
    try:
        assert child.pid in kill.live_workers()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
