"""The fork server killed from outside, under the 'forkserver' start method.

The fork server is a helper process of the trainer's that forks every worker; CPython starts a new
one when a start finds it gone. Its workers are its children and die with it (``PR_SET_PDEATHSIG``;
torch's workers, which watch their parent, exit too), and their exit status, which the fork server
reports, is lost with it: multiprocessing says exit code 255. The loader said just that ("exited
unexpectedly with exit code 255"), as if the worker had chosen the code; it now names the fork
server and says the status is unknown. Under the restart policy the workers are replaced by a new
fork server's, and every batch comes once; a fresh loader works. torch 2.13 in the same run
(persistent workers, the fork server killed between epochs): "DataLoader worker (pid(s) ...)
exited unexpectedly" at the next epoch.

Each case runs in a fresh interpreter, whose fork server is its own: the suite's is never touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="pidfd_open: Linux")

SCRIPT = textwrap.dedent("""
    import os, select, signal, sys
    from multiprocessing import forkserver
    import numpy as np
    import shmloader
    from shmloader.errors import WorkerDied

    WHEN, POLICY = sys.argv[1], sys.argv[2]


    def kill_fork_server(pid):
        fd = os.pidfd_open(pid)
        os.kill(pid, signal.SIGKILL)
        select.select([fd], [], [], 30)  # readable once it has died; CPython reaps it at the next start
        os.close(fd)


    class Rows(shmloader.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            if i == 9 and WHEN == "mid-epoch" and not os.path.exists(sys.argv[3]):
                open(sys.argv[3], "w").close()
                kill_fork_server(os.getppid())  # this worker's parent: it dies with it
            return np.full(4, i, dtype=np.int64)


    def rows(batches):
        return [int(r) for b in batches for r in b[:, 0]]


    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, multiprocessing_context="forkserver",
                                  persistent_workers=True, on_worker_death=POLICY)
    try:
        first = rows(loader)
        if WHEN == "between-epochs":
            kill_fork_server(forkserver._forkserver._forkserver_pid)
        got = rows(loader)
        print("delivered", first == list(range(32)) and got == list(range(32)), flush=True)
    except WorkerDied as exc:
        print("raised", repr(str(exc)), flush=True)
    loader.close()
    fresh = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, multiprocessing_context="forkserver")
    print("fresh", rows(fresh) == list(range(32)), flush=True)
""")


def _run(when: str, policy: str, marker: str) -> tuple[list[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, when, policy, marker], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=100)
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"shml_{proc.pid}_")]
    for name in left:  # reported here, not left for the session's guard
        os.unlink(os.path.join("/dev/shm", name))
    assert proc.returncode == 0, out + err[-2000:]
    assert left == [], left
    return out.splitlines(), err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["between-epochs", "mid-epoch"])
def test_a_worker_lost_with_its_fork_server_names_it(when: str, tmp_path: os.PathLike[str]) -> None:
    lines, err = _run(when, "raise", os.path.join(tmp_path, "fired"))
    assert lines[-1] == "fresh True", lines
    said = lines[0]
    assert said.startswith("raised ") and "DataLoader worker (pid " in said, lines
    assert "exited unexpectedly" in said and "its exit status is unknown" in said, said
    assert "the fork server (pid " in said and "that started it is gone" in said, said


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["between-epochs", "mid-epoch"])
def test_workers_lost_with_their_fork_server_are_replaced(when: str, tmp_path: os.PathLike[str]) -> None:
    lines, err = _run(when, "restart", os.path.join(tmp_path, "fired"))
    assert lines == ["delivered True", "fresh True"], (lines, err[-2000:])


ORPHAN = textwrap.dedent("""
    import os, sys, time
    from shmloader.worker import lineage

    main = os.getpid()
    r, w = os.pipe()
    server = os.fork()  # stands for the fork server: a child of the main process
    if server == 0:
        server_pid = os.getpid()
        worker = os.fork()
        if worker == 0:
            os.close(r)
            if sys.argv[1] == "orphaned":  # its fork server died before the worker asked for its death signal
                deadline = time.monotonic() + 20
                while os.getppid() == server_pid and time.monotonic() < deadline:
                    time.sleep(0.01)  # the kernel reparents it once the server has exited
            lineage.watch_parent(main, True)
            os.write(w, b"went on")
            os._exit(0)
        if sys.argv[1] == "orphaned":
            os._exit(0)
        os.waitpid(worker, 0)
        os._exit(0)
    os.close(w)
    said = b""
    while chunk := os.read(r, 100):
        said += chunk
    os.waitpid(server, 0)
    print(said.decode() or "exited")
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "expected"), [("orphaned", "exited"), ("served", "went on")])
def test_a_worker_whose_fork_server_died_before_it_watched_exits(case: str, expected: str) -> None:
    """A fork server killed while a worker starts (between its fork and the worker's
    ``PR_SET_PDEATHSIG``) left that worker running, reparented, unseen by ``close()``: it went on to
    load the dataset and run ``worker_init_fn`` after the loader had reported it dead and shut down.
    The worker now checks, once the death signal is asked for, that its parent is the main process
    or a child of it (the fork server), and exits otherwise."""
    proc = subprocess.run([sys.executable, "-c", ORPHAN, case], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == expected, proc.stdout + proc.stderr[-2000:]


FORKED_CHILD = textwrap.dedent("""
    import multiprocessing as mp, os, sys
    import numpy as np
    import shmloader

    def noop():
        pass

    if __name__ == "__main__":
        first = mp.get_context("forkserver").Process(target=noop)
        first.start(); first.join()  # this process starts the fork server
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                data = [np.full(3, i) for i in range(8)]
                loader = shmloader.DataLoader(data, batch_size=2, num_workers=2, multiprocessing_context="forkserver")
                got = [int(r) for b in loader for r in b[:, 0]]
                loader.close()
                print("child", got, flush=True)
                code = 0 if got == list(range(8)) else 1
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush(); sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        loader = shmloader.DataLoader([np.full(3, i) for i in range(4)], batch_size=2, num_workers=1,
                                      multiprocessing_context="forkserver")
        print("parent", [int(r) for b in loader for r in b[:, 0]], flush=True)
        loader.close()
""")


@pytest.mark.timeout(120)
def test_a_process_forked_from_the_fork_servers_starter_gets_a_fork_server_of_its_own(tmp_path) -> None:
    """multiprocessing's fork server belongs to the process that started it: in a process forked
    from that one, CPython's start raised ``ChildProcessError: [Errno 10] No child processes`` from
    deep inside (it waits on the parent's server as if its own), so no forkserver loader could start
    there (torch's neither). The loader now forgets the parent's server there, and a new one, the
    child's own, starts its workers; the parent's server keeps serving the parent."""
    script = tmp_path / "forked_child.py"
    script.write_text(FORKED_CHILD)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert "child [0, 1, 2, 3, 4, 5, 6, 7]" in proc.stdout, out
    assert "child exit 0" in proc.stdout and "parent [0, 1, 2, 3]" in proc.stdout, out
    assert "ChildProcessError" not in out and "Traceback" not in out, out
