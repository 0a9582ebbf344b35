"""``python -m shmloader ... | head -1``: a reader that goes away ends the command quietly.

Before this test each command printed a ``BrokenPipeError`` traceback (``config --json``,
``doctor``, ``bench``) or Python's "Exception ignored ... BrokenPipeError" at exit (short outputs,
flushed only then) when its stdout was a pipe whose reader had gone. The commands now end with the
status a shell gives a command that SIGPIPE ended (141), with no traceback on stderr.

The reader is gone before the command starts (the read end closed in the test), so the first write
fails every time: no race with a reader that reads a little first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

COMMANDS = [
    ["config"],
    ["config", "--json"],
    ["doctor", "--workers", "1", "--prefetch-factor", "1", "--slot-bytes", "4KiB"],
    ["doctor", "--json", "--workers", "1", "--prefetch-factor", "1", "--slot-bytes", "4KiB"],
    ["bench", "--repeat", "1", "--workers", "0", "--no-torch", "--no-copy-limit", "--batches", "1",
     "--warmup", "1", "--workloads", "tiny"],
]
HELP = [["--help"], ["config", "--help"], ["bench", "--help"], ["bench", "--train", "--help"]]


def _run_into_a_closed_pipe(args: list[str]) -> subprocess.CompletedProcess[str]:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone: `| head -1` after its line
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMLOADER_")}
    try:
        return subprocess.run([sys.executable, "-m", "shmloader", *args], cwd=REPO, env=env,
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=50)
    finally:
        os.close(write_end)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_a_reader_that_went_away_ends_the_command_quietly_with_status_141(args: list[str]) -> None:
    result = _run_into_a_closed_pipe(args)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode == 141


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", HELP, ids=" ".join)
def test_help_into_a_closed_pipe_is_quiet(args: list[str]) -> None:
    result = _run_into_a_closed_pipe(args)
    # Python 3.11's argparse drops what it cannot write and exits 0; 3.10's raises BrokenPipeError,
    # which ends the command as any other write to a reader that went away does: 141, quietly
    assert (result.returncode, result.stderr) == (0 if sys.version_info >= (3, 11) else 141, "")
