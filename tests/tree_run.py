"""Running a launcher (torchrun, Lightning, accelerate) whose processes must not outlive the test.

``subprocess.run(timeout=...)`` kills only the process it started: torchrun starts each rank in a
session of its own, so a rank that a timeout (or pytest-timeout) leaves behind waits for its peers
forever, holds a CPU and trips the suite's leak guard in a later test. :func:`run_tree` kills the
launcher and every process below it, found while they are still its descendants."""

from __future__ import annotations

import subprocess
from typing import Any

import psutil


def run_tree(argv: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)``, but
    when it times out or is interrupted (pytest-timeout raises in the waiting thread) every
    descendant of the launched process is killed with it before the error goes on."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_tree(proc.pid)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it; wait until each is gone (or reaped elsewhere)."""
    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)
