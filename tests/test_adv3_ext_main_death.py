"""The training process killed from outside mid-epoch (SIGKILL, the OOM killer; SIGTERM at its
default action, a scheduler's preemption): nothing of its loader outlives it for long.

Each job is a child process in a session of its own that starts a loader, takes one batch, prints
its workers' pids and then waits on its stdin with the epoch under way. Checked: its workers exit
by themselves within a bound; its segments are unlinked by the resource tracker, or, where nothing
unlinks them (a ``shm_dir`` of the job's, which the tracker does not know; the tracker killed with
the job's whole process group), removed by the sweep of the next loader that starts, while the
segments of a second job that lives and shares the directory are never touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from process_helpers import until

from shmloader import DataLoader
from shmloader.transport.sweep import sweep_segments_of

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
SHM_DIR = "/dev/shm"
GONE_S = 2.0  # PR_SET_PDEATHSIG ends them at once; the bound leaves room for a loaded machine

JOB = textwrap.dedent("""
    import sys
    import psutil
    import adv3_ext_datasets as ds
    from shmloader import DataLoader
    kw = {"shm_dir": sys.argv[1]} if len(sys.argv) > 1 else {}
    loader = DataLoader(ds.Pids(64), batch_size=2, num_workers=2, **kw)
    it = iter(loader)
    next(it)
    me = psutil.Process()
    print(" ".join(str(p.pid) for p in me.children() if "resource_tracker" not in " ".join(p.cmdline())), flush=True)
    sys.stdin.read()  # the epoch under way until the test ends the job
""")


class Job:
    """One training process of ``JOB``: its pid, its workers' pids, and its segment directory."""

    def __init__(self, tmp_path: Path, shm_dir: str | None) -> None:
        script = tmp_path / "job.py"
        script.write_text(JOB)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS_DIR]))
        self.directory = shm_dir or SHM_DIR
        self.proc = subprocess.Popen([sys.executable, str(script), *([shm_dir] if shm_dir else [])], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        self.workers = [int(p) for p in line.split()]
        assert len(self.workers) == 2, line + self.proc.stderr.read()  # type: ignore[union-attr]

    def segments(self) -> list[str]:
        return sorted(n for n in os.listdir(self.directory) if n.startswith(f"shml_{self.proc.pid}_"))

    def end(self) -> None:
        """SIGKILL whatever is left of the job's process group, reap it, and remove its segments."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.communicate(timeout=30)
        until(lambda: not any(_alive(p) for p in self.workers), 10.0)
        sweep_segments_of(self.directory, {self.proc.pid})


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        job.end()


def _start(jobs: list[Job], tmp_path: Path, name: str, shm_dir: str | None) -> Job:
    (tmp_path / name).mkdir()
    job = Job(tmp_path / name, shm_dir)
    jobs.append(job)
    return job


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["shm_dir", "process_group"])
def test_a_killed_jobs_segments_are_swept_by_the_next_loader_and_a_live_jobs_kept(tmp_path: Path, jobs: list[Job],
                                                                                  where: str) -> None:
    shm_dir = None
    if where == "shm_dir":  # segments there are plain files: no resource tracker unlinks them
        (tmp_path / "shm").mkdir()
        shm_dir = str(tmp_path / "shm")
    killed, live = _start(jobs, tmp_path, "killed", shm_dir), _start(jobs, tmp_path, "live", shm_dir)
    assert killed.segments() and live.segments()
    kept = live.segments()
    if where == "shm_dir":
        os.kill(killed.proc.pid, signal.SIGKILL)
    else:  # the job with its resource tracker, as a scheduler kills a job's process group
        os.killpg(killed.proc.pid, signal.SIGKILL)
    killed.proc.wait(timeout=10)
    assert until(lambda: not any(_alive(p) for p in killed.workers), GONE_S), "the killed job's workers live on"
    assert killed.segments(), "nothing but the sweep removes these (no tracker)"
    kw = {"shm_dir": shm_dir} if shm_dir else {}
    assert len(list(DataLoader(list(range(8)), batch_size=2, num_workers=1, **kw))) == 4  # sweeps as it starts
    assert killed.segments() == []
    assert set(kept) <= set(live.segments())  # a live job's segments are never touched
    assert live.proc.poll() is None and all(_alive(p) for p in live.workers)


@pytest.mark.timeout(120)
def test_sigterm_at_its_default_action_leaves_no_worker_and_no_segment(tmp_path: Path, jobs: list[Job]) -> None:
    job = _start(jobs, tmp_path, "job", None)
    assert job.segments()
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.proc.wait(timeout=10) == -signal.SIGTERM
    assert until(lambda: not any(_alive(p) for p in job.workers), GONE_S), "the job's workers live on"
    assert until(lambda: job.segments() == [], 10.0), "the resource tracker left the segments"
