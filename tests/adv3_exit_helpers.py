"""Run a small script that ends while it holds loaders, and judge what its end left behind.

Owns the script runner and the verdict of the interpreter-exit tests (test_adv3_exit_*.py): the
script prints ``PIDS <pid> …`` (its children, listed before it ends), the runner waits for it
within a bound and reports its exit code, its stderr, the children still alive after a short
grace, and the ``shml_<pid>_`` files it left in the shared-memory directory. ``PRELUDE`` is
prepended to every script: the imports, a small array, ``print_children()`` and ``Slow`` (a
dataset whose samples from 16 on block for 30 s, so a worker is busy when the script ends) and
``iterate_in_a_daemon_thread(loader)`` (which lists the children itself, inside the first epoch).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import textwrap
import time
from typing import Any

import psutil
from process_helpers import until

import shmloader

SHM_DIR = "/dev/shm"
NOISE = ("Exception ignored", "Traceback", "leaked shared_memory", "resource_tracker")
CHILD_GRACE_S = 5.0  # a child on its way out after its parent ended; a leak waits it out

PRELUDE = textwrap.dedent("""
    import gc, os, sys, threading, time
    import numpy as np
    import psutil
    import shmloader

    DATA = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)

    def print_children():
        kids = psutil.Process().children(recursive=True)
        print("PIDS", *[p.pid for p in kids], flush=True)

    class Slow(shmloader.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            if i >= 16:
                time.sleep(30)
            return DATA[i]

    def iterate_in_a_daemon_thread(loader, while_open=print_children):
        \"\"\"Iterate ``loader``, epoch after epoch, in a daemon thread; return once a batch came.

        ``while_open()`` runs in that thread right after the first batch, while the first epoch's
        iterator (and its workers) is certainly live: listed from the main thread instead, the
        children could be those of the gap between two short epochs.
        \"\"\"
        started = threading.Event()

        def run():
            while True:
                for batch in loader:
                    if not started.is_set():
                        while_open()
                    started.set()

        threading.Thread(target=run, daemon=True).start()
        assert started.wait(30)
""")


@dataclasses.dataclass
class Ending:
    """What a script's end left: its exit code, seconds it ran, output, live children, segments."""

    returncode: int
    seconds: float
    stdout: str
    stderr: str
    children: list[int]
    alive: list[int]
    segments: list[str]

    def report(self) -> str:
        return (f"exit code {self.returncode} after {self.seconds:.1f} s; children {self.children}, alive "
                f"{self.alive}; segments {self.segments}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}")

    def noise(self) -> list[str]:
        """The words of ``NOISE`` found in stderr."""
        return [word for word in NOISE if word in self.stderr]


def run_script(body: str, tmp: pathlib.Path, timeout_s: float = 60.0, env: dict[str, str] | None = None,
               args: tuple[str, ...] = ()) -> Ending:
    """Run ``PRELUDE + body`` in a fresh interpreter (this tree's shmloader first on the path)."""
    path = tmp / "script.py"
    path.write_text(PRELUDE + textwrap.dedent(body), encoding="utf-8")
    tree = str(pathlib.Path(shmloader.__file__).parents[1])
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, full_env.get("PYTHONPATH")]))
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full_env, cwd=tmp)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n[the script did not end within {timeout_s} s: killed]"
    seconds = time.monotonic() - start
    children = [int(p) for line in out.splitlines() if line.startswith("PIDS") for p in line.split()[1:]]
    return Ending(proc.returncode, seconds, out, err, children, _alive_after(children), _segments_of(proc.pid))


def _alive_after(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running once ``CHILD_GRACE_S`` has passed (polled: they act on their own)."""
    until(lambda: not any(_running(p) for p in pids), CHILD_GRACE_S)
    return [p for p in pids if _running(p)]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _segments_of(pid: int) -> list[str]:
    prefix = f"shml_{pid}_"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


class InnerLoaderDataset:
    """Sample ``i`` is the rows ``4i .. 4i+3`` of ``np.arange(64)``, read through a DataLoader of its
    own with ``inner_workers`` workers, made and iterated inside ``__getitem__`` (so inside a worker
    of the outer loader)."""

    def __init__(self, inner_workers: int) -> None:
        self.inner_workers = inner_workers

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        import numpy as np

        rows = shmloader.ArrayDataset(np.arange(64, dtype=np.int64)[4 * i:4 * i + 4])
        inner: shmloader.DataLoader[Any] = shmloader.DataLoader(rows, batch_size=2, num_workers=self.inner_workers)
        return np.concatenate([x for (x,) in inner])
