"""Workers log as the main process does, whatever their start method.

A forked worker inherits the ``shmloader`` logger's level and handlers; a spawned or forkserver
one starts a fresh interpreter, where the logger had logging's defaults (nothing shown). The
worker now gets the main process's level, and a stderr handler where the main process has a
handler that would show a ``shmloader`` record, so a record logged inside a worker is shown or
hidden the same way under every start method (docs/config.md, "Logging")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
APP = HERE / "log_worker_app.py"

# setup -> the records a worker's sample shows (under fork, which inherits the main process's logging)
EXPECTED = {
    "none": set(),
    "debug": {"debug", "warning"},
    "basic_info": {"warning"},
    "basic_error": set(),
}


def _shown_per_method(setup: str) -> dict[str, set[str]]:
    """Run the app; for each start method, which of its samples' records reached stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMLOADER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(APP), setup], capture_output=True, text=True, env=env,
                         timeout=150)
    assert run.returncode == 0, run.stderr
    shown: dict[str, set[str]] = {}
    current: set[str] = set()
    for line in run.stderr.splitlines():
        if line.startswith("== "):
            current = shown.setdefault(line[3:], set())
        for kind in ("debug", "warning"):
            if f"{kind} from sample" in line:
                current.add(kind)
    return shown


@pytest.mark.timeout(180)
@pytest.mark.parametrize("setup", sorted(EXPECTED))
def test_a_worker_logs_as_the_main_process_under_every_start_method(setup: str) -> None:
    shown = _shown_per_method(setup)
    assert shown == {m: EXPECTED[setup] for m in ("fork", "spawn", "forkserver")}
