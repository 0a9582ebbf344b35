"""What a loader keeps open: one descriptor per shared-memory slot, however many batches the user
holds (each held batch keeps its slot), as torch keeps one per held tensor's storage; none left by
an ``iter(loader)`` that failed; and a clear error, not a bare ``OSError``, at the process's limit
of open files."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import shmloader
from shmloader.transport.segment import Segment
from shmloader.transport.shm_space import explain_enospc


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Rows:
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(4, i, np.float32)


class FailingSampler:
    def __len__(self) -> int:
        return 16

    def __iter__(self):  # noqa: ANN204
        raise RuntimeError("the sampler failed to start")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_an_iter_whose_sampler_fails_leaves_no_descriptor(persistent):
    loader = shmloader.DataLoader(Rows(), batch_size=4, sampler=FailingSampler(), num_workers=2,
                                  persistent_workers=persistent)
    with pytest.raises(RuntimeError, match="failed to start"):
        iter(loader)
    gc.collect()
    before = _fds()
    for _ in range(20):
        with pytest.raises(RuntimeError, match="failed to start"):
            iter(loader)
    loader.close()
    gc.collect()
    assert _fds() == before


@pytest.mark.timeout(60)
def test_a_segment_keeps_one_descriptor_and_its_owners_lock(tmp_path):
    import fcntl

    before = _fds()
    segs = [Segment.create(str(tmp_path), 1 << 16) for _ in range(4)]
    grown = Segment.create(str(tmp_path), 1 << 16, reserve=False)
    while not grown.reserve(1 << 14):  # a growing slot, reserved a part at a time
        pass
    segs.append(grown)
    try:
        assert _fds() - before == len(segs)  # the mapping's own descriptor: no second one
        for seg in segs:  # the owner's lock holds: a sweeper cannot take the file
            fd = os.open(seg.path, os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
    finally:
        for seg in segs:
            seg.unlink()
            seg.close()
    assert _fds() == before


def test_running_out_of_descriptors_is_a_clear_error():
    with pytest.raises(OSError) as info:
        with explain_enospc("/dev/shm", 4096):
            raise OSError(errno.EMFILE, "Too many open files", "/dev/shm/shml_1_ab")
    assert info.value.errno == errno.EMFILE
    text = str(info.value)
    assert "ulimit -n" in text and "one descriptor" in text and "hold" in text, text


_HOLD_ALL = textwrap.dedent(r'''
    import os, resource, warnings
    warnings.simplefilter("ignore")
    import numpy as np
    import shmloader
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    class Rows:
        def __len__(self): return 4 * int(os.environ["HOLD"])
        def __getitem__(self, i): return np.full(256, i, dtype=np.float32)

    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2)
    held = []
    try:
        for b in loader:
            held.append(b)
    except OSError as exc:
        print("FAILED", len(held), exc)
        raise SystemExit(3)
    assert [int(b[0, 0]) for b in held] == list(range(0, len(Rows()), 4))
    print("HELD", len(held))
''')


@pytest.mark.timeout(120)
def test_the_batches_a_user_holds_cost_one_descriptor_each():
    """With a limit of 256 open files, holding 200 batches fits (it did not at two per batch);
    holding 400 cannot, and says why."""
    env = dict(os.environ, HOLD="200")
    out = subprocess.run([sys.executable, "-c", _HOLD_ALL], capture_output=True, text=True, timeout=110, env=env)
    assert out.returncode == 0 and "HELD 200" in out.stdout, out.stdout + out.stderr[-2000:]
    env["HOLD"] = "400"
    out = subprocess.run([sys.executable, "-c", _HOLD_ALL], capture_output=True, text=True, timeout=110, env=env)
    assert out.returncode == 3, out.stdout + out.stderr[-2000:]
    assert "ulimit -n" in out.stdout, out.stdout


@pytest.mark.parametrize("after", ["flock", "fstat"])
def test_a_ctrl_c_as_create_takes_the_owners_lock_leaves_no_file_and_no_descriptor(tmp_path, monkeypatch, after):
    """A Ctrl-C is raised right after a system call returns: here, the lock's, or the check that
    the locked file is still the one at the path."""
    import fcntl

    real = {"flock": fcntl.flock, "fstat": os.fstat}[after]
    module = fcntl if after == "flock" else os

    fired: list[bool] = []

    def interrupted(*args):  # noqa: ANN002, ANN202
        out = real(*args)
        if not fired:  # once: the cleanup's own calls then run
            fired.append(True)
            raise KeyboardInterrupt
        return out

    before = _fds()
    monkeypatch.setattr(module, after, interrupted)
    with pytest.raises(KeyboardInterrupt):
        Segment.create(str(tmp_path), 4096)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [] and _fds() == before
