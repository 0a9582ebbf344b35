"""SIGTERM to the training process while its workers are inside a sample (a scheduler's preemption).

At SIGTERM's default action nothing of the trainer runs: its workers die with it
(``PR_SET_PDEATHSIG``) and the resource tracker unlinks its segments (printing its own "There
appear to be N leaked shared_memory objects" warning as it does: docs/reliability.md). With a
handler that raises ``SystemExit`` (a common way to turn SIGTERM into a clean exit) the exception
leaves ``next()`` and the iterator shuts its workers down as for any exception in the caller's
loop: the exit code is the handler's, nothing is printed from our frames, and no worker or segment
remains. Under every start method; tests/test_adv3_ext_main_death.py has the default action under
the default method with idle workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from process_helpers import until

GONE_S = 2.0  # PR_SET_PDEATHSIG ends them at once; room for a loaded machine

JOB = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    import shmloader

    METHOD, MODE, BUSY = sys.argv[1], sys.argv[2], sys.argv[3]


    class Slow(shmloader.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            if i >= 8:  # mid-batch from here on: say so, then work for far longer than the test
                open(os.path.join(BUSY, str(os.getpid())), "w").close()
                time.sleep(120)
            return np.full(4, i, dtype=np.int64)


    def leave(signum, frame):
        raise SystemExit(143)


    if __name__ == "__main__":
        if MODE == "handler":
            signal.signal(signal.SIGTERM, leave)
        loader = shmloader.DataLoader(Slow(), batch_size=4, num_workers=2, multiprocessing_context=METHOD)
        it = iter(loader)
        first = [next(it), next(it)]
        deadline = time.monotonic() + 60
        while len(os.listdir(BUSY)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # until both workers are inside a slow sample
        print(" ".join(sorted(os.listdir(BUSY))), flush=True)
        next(it)  # waits for a batch while the workers are mid-sample; SIGTERM comes here
""")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["default", "handler"])
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_sigterm_mid_batch_leaves_no_worker_and_no_segment(method: str, mode: str, tmp_path: Path) -> None:
    script, busy = tmp_path / "job.py", tmp_path / "busy"
    script.write_text(JOB)
    busy.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), method, mode, str(busy)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    ours = lambda: [n for n in os.listdir("/dev/shm") if n.startswith(f"shml_{proc.pid}_")]  # noqa: E731
    workers: list[int] = []
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        workers = [int(p) for p in line.split()]
        assert len(workers) == 2, line
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=30)
        gone = until(lambda: not any(_alive(p) for p in workers), GONE_S)
        cleaned = until(lambda: ours() == [], 10.0)
    finally:  # whatever outlived the trainer in its session (workers, a fork server) goes now
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, err = proc.communicate(timeout=30)
        for name in ours():  # reported below, not left for the session's guard
            os.unlink(os.path.join("/dev/shm", name))
    assert code == (-signal.SIGTERM if mode == "default" else 143), err[-2000:]
    assert gone, f"workers {workers} outlived the trainer"
    assert cleaned, "segments of the trainer were left in /dev/shm"
    assert "Traceback" not in err and "/shmloader/" not in err, err[-2000:]
