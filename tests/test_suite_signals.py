"""The suite passes when it is started with SIGINT ignored (a background job of a script, nohup):
its Ctrl-C tests get Python's Ctrl-C all the same (conftest.pytest_configure)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# one test that Ctrl-C's the suite's own process, one that Ctrl-C's a command line it starts
CHOSEN = ["tests/test_cli_interrupt.py::test_a_shield_holds_ctrl_c_back_until_it_ends",
          "tests/test_cli_interrupt.py::test_ctrl_c_ends_the_command_with_one_line_and_status_130[bench-shmloader]"]


def _ignore_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.timeout(180)
def test_the_ctrl_c_tests_pass_in_a_run_started_with_sigint_ignored() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMLOADER_")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CHOSEN],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=170,
                          preexec_fn=_ignore_ctrl_c)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "2 passed" in proc.stdout, proc.stdout[-3000:]
