"""The launcher runs of the framework tests leave no process behind when they time out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from tree_run import run_tree

# a launcher whose child starts a session of its own (as torchrun's ranks do), then waits forever
LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
child.wait()
"""


@pytest.mark.timeout(60)
def test_a_timed_out_launcher_leaves_no_process_even_in_another_session(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_tree([sys.executable, "-c", LAUNCHER, str(pid_file)], timeout=15)
    assert pid_file.exists(), "the launcher did not start its child within 15 s: make the timeout longer"
    child = int(pid_file.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(60)
def test_a_finished_launcher_gives_its_output_and_status() -> None:
    run = run_tree([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout=30)
    assert (run.returncode, run.stdout) == (3, "out\n")
