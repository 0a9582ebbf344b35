"""Ctrl-C under ``python -m shmloader`` is the main process's to act on, not its forked children's.

A terminal's Ctrl-C reaches the whole process group, torch's DataLoader workers included. A forked
child inherits the command line's SIGINT handler; raising KeyboardInterrupt there can cut a worker
short between taking a lock shared with the main process and releasing it (torch's worker checks
its ``done_event`` every batch, under the event's lock), after which the worker, and the main
process shutting the loader down, wait on that lock forever. So the inherited handler does nothing
in a child: the main process ends its loaders, which end their workers."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shmloader.cli import interrupt

REPO = Path(__file__).resolve().parents[1]
INTERRUPTED = 3


def _raise_ctrl_c_here() -> None:
    """A forked child: exit :data:`INTERRUPTED` where SIGINT raises KeyboardInterrupt, else 0."""
    try:
        signal.raise_signal(signal.SIGINT)  # the handler runs before raise_signal returns
    except KeyboardInterrupt:
        os._exit(INTERRUPTED)
    os._exit(0)


@pytest.mark.timeout(60)
def test_a_child_forked_under_the_handler_leaves_ctrl_c_to_the_main_process() -> None:
    with interrupt.ctrl_c_handled():
        child = multiprocessing.get_context("fork").Process(target=_raise_ctrl_c_here)
        child.start()
        child.join(30)
    assert child.exitcode == 0
    assert not interrupt.unsafe_to_raise(sys._getframe())  # the main process itself is untouched
    with pytest.raises(KeyboardInterrupt):
        with interrupt.ctrl_c_handled():
            signal.raise_signal(signal.SIGINT)


# A torch worker that the process group's Ctrl-C reaches while it holds its done_event's lock (as
# it does inside every ``done_event.is_set()``): the moment that hung the benchmark's torch loader.
TORCH_WORKER_INTERRUPTED = """
import signal, sys
import torch
from torch.utils.data import DataLoader, Dataset
from shmloader.cli.interrupt import ctrl_c_handled

def done_event():
    frame = sys._getframe()
    while frame is not None and frame.f_code.co_name != "_worker_loop":
        frame = frame.f_back
    return None if frame is None else frame.f_locals.get("done_event")

class Interrupted(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        event = done_event() if i == 0 else None
        if event is not None:
            event._cond.acquire()  # as in Event.is_set(): `with self._cond:` has taken the lock
        if i == 0:
            signal.raise_signal(signal.SIGINT)  # the Ctrl-C lands in the worker now
        if event is not None:
            event._cond.release()
        return torch.full((2,), float(i))

with ctrl_c_handled():
    it = iter(DataLoader(Interrupted(), batch_size=4, num_workers=1, multiprocessing_context="fork"))
    print([b[:, 0].tolist() for b in it], flush=True)
    del it
print("ended", flush=True)
"""


@pytest.mark.timeout(120)
def test_ctrl_c_in_a_torch_worker_holding_its_done_event_lock_hangs_nothing(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMLOADER_")}
    env.update(PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(TORCH_WORKER_INTERRUPTED)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env, cwd=tmp_path)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert (proc.returncode, out) == (0, "[[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]\nended\n"), err[-3000:]
    assert "Traceback" not in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_the_benchs_torch_workers_ignore_ctrl_c(method: str) -> None:
    """Under spawn or forkserver torch's workers start with Python's own SIGINT handler, not ours,
    so the bench gives torch's loader a ``worker_init_fn`` that ignores SIGINT in its workers: the
    same lock cannot be cut short there (the main process ends them)."""
    pytest.importorskip("torch")
    from shmloader.cli import measure
    from shmloader.cli.options import parse_args

    opts = parse_args(["--workloads", "tiny", "--workers", "2", "--start-method", method])
    loader = measure.make_loader("torch", opts.workloads[0], 2, opts)
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert loader.worker_init_fn is not None, "torch's workers keep Python's SIGINT handler"
        loader.worker_init_fn(0)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
