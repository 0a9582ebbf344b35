"""A worker's death never kills the training process through SIGPIPE.

Command-line programs often restore SIGPIPE's default action (``signal.signal(SIGPIPE, SIG_DFL)``)
so that ``prog | head`` ends quietly. With that action a write to a pipe nobody reads any more
kills the writer at once: before this test, the main process's next task write to a worker that
had just died (SIGKILL, OOM, a crash in native code) ended the whole training process with exit
code 141 and no message, restart policy or not. The main process now keeps every task pipe's read
end open while the worker's handle lives (as torch's queues keep theirs), so such a write lands in
the pipe and the death is seen through the worker's sentinel, as every other death is.

Each case runs in a fresh interpreter: the default action kills the process that meets it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import shmloader
    from shmloader.errors import WorkerDied

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    METHOD, POLICY = sys.argv[1], sys.argv[2]


    class Rows(shmloader.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return np.full(4, i, dtype=np.int64)


    loader = shmloader.DataLoader(Rows(), batch_size=2, num_workers=2, multiprocessing_context=METHOD,
                                  on_worker_death=POLICY)
    it = iter(loader)
    got = [next(it)]
    for w in it._pool.workers:  # both: every later task goes to a dead worker until it is replaced
        os.kill(w.pid, signal.SIGKILL)
        w.process.join()
    try:
        got += list(it)
    except WorkerDied as exc:
        print("raised", type(exc).__name__)
    else:
        print("delivered", sorted(int(b[0, 0]) for b in got) == list(range(0, 64, 2)))
    loader.close()
""")


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("method", "policy", "expected"), [
    ("fork", "restart", "delivered True"),
    ("fork", "raise", "raised WorkerDied"),
    ("spawn", "restart", "delivered True"),
])
def test_a_dead_worker_never_kills_a_main_process_with_sigpipe_at_its_default(method: str, policy: str,
                                                                               expected: str) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, method, policy], capture_output=True, text=True,
                          timeout=80)
    assert proc.returncode == 0, f"exit code {proc.returncode} (141: killed by SIGPIPE)\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip().splitlines()[-1] == expected, proc.stdout + proc.stderr[-2000:]
