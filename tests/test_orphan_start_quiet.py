"""A worker orphaned while it unpickles its start state exits quietly, its stop flag freed or not.

Under spawn and forkserver a worker's stop flag is a named semaphore (``worker/stop.py``), opened
by name as the worker unpickles its process object. Under forkserver the worker is the fork server's
child: a fork server killed while the worker is still unpickling (a dataset that goes with the
process object and is slow to load) leaves it running, reparented, while the loader sees it dead and
shuts it down, which frees its stop flag and so unlinks the semaphore's name. The orphan then failed
to open it, and CPython's bootstrap printed a bare ``FileNotFoundError`` traceback on the trainer's
stderr. Now a flag already freed reads as set: the worker runs no code of the user's and exits,
saying nothing.

Here the race is made deterministic: the dataset's ``__setstate__`` says on one FIFO that it runs
and waits on another; meanwhile the trainer kills the fork server, closes the loader, checks that
the semaphore is gone, and only then lets the unpickling go on. Each case runs in a fresh
interpreter, whose fork server is its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="pidfd_open: Linux")

SCRIPT = textwrap.dedent("""
    import gc, multiprocessing, os, select, signal, sys
    from multiprocessing import forkserver
    import numpy as np
    import shmloader

    FIFOS, INIT_MARK = sys.argv[1], sys.argv[2]
    WAIT_S = 30


    def readable(fd):
        return bool(select.select([fd], [], [], WAIT_S)[0])


    class Held(shmloader.Dataset):
        # its lock makes it go with the worker's process object, unpickled before the stop flag
        def __init__(self):
            self.lock = multiprocessing.get_context("forkserver").Lock()

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.full(2, i)

        def __getstate__(self):
            return {"lock": self.lock}

        def __setstate__(self, state):  # in the worker: say so, then wait for the trainer's word
            self.__dict__.update(state)
            said = os.open(os.path.join(FIFOS, "unpickling"), os.O_WRONLY | os.O_NONBLOCK)
            os.write(said, str(os.getpid()).encode())
            os.close(said)
            go = os.open(os.path.join(FIFOS, "go"), os.O_RDONLY | os.O_NONBLOCK)
            readable(go)
            os.close(go)


    def init(worker_id):
        open(INIT_MARK, "w").close()


    if __name__ == "__main__":
        # both FIFOs open before the worker starts: its opens never block, a trainer gone frees it
        unpickling = os.open(os.path.join(FIFOS, "unpickling"), os.O_RDONLY | os.O_NONBLOCK)
        go = os.open(os.path.join(FIFOS, "go"), os.O_RDWR)
        loader = shmloader.DataLoader(Held(), batch_size=2, num_workers=1, multiprocessing_context="forkserver",
                                      worker_init_fn=init)
        it = iter(loader)
        flag = "/dev/shm/sem." + it._pool.workers[0].stop._sem._semlock.name.lstrip("/")
        assert readable(unpickling), "the worker never unpickled its dataset"
        worker = os.pidfd_open(int(os.read(unpickling, 100)))
        server_pid = forkserver._forkserver._forkserver_pid
        server = os.pidfd_open(server_pid)
        os.kill(server_pid, signal.SIGKILL)
        print("fork server died", readable(server), flush=True)
        loader.close()
        del it
        gc.collect()
        print("stop flag freed", not os.path.exists(flag), flush=True)
        os.write(go, b"go")
        print("orphan exited", readable(worker), flush=True)
""")


@pytest.mark.timeout(120)
def test_a_worker_orphaned_while_unpickling_exits_quietly_once_its_stop_flag_is_freed(tmp_path: os.PathLike[str]) -> None:
    fifos = str(tmp_path)
    for name in ("unpickling", "go"):
        os.mkfifo(os.path.join(fifos, name))
    init_mark = os.path.join(fifos, "init ran")
    script = os.path.join(fifos, "trainer.py")  # a file: spawn-like starts find its classes by name
    with open(script, "w") as f:
        f.write(SCRIPT)
    proc = subprocess.Popen([sys.executable, script, fifos, init_mark], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=100)  # EOF once the orphan, which shares them, has exited too
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"shml_{proc.pid}_")]
    for name in left:  # reported here, not left for the session's guard
        os.unlink(os.path.join("/dev/shm", name))
    assert proc.returncode == 0, out + err[-3000:]
    assert out.splitlines() == ["fork server died True", "stop flag freed True", "orphan exited True"], \
        out + err[-3000:]
    assert "Traceback" not in err and "FileNotFoundError" not in err, err[-3000:]
    assert not os.path.exists(init_mark), "the orphan went on to run worker_init_fn"
    assert left == [], left
