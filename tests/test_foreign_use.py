"""An iterator is used only by the process that made it, and a batch the main process cannot
rebuild is a data error that names its task.

- A process forked off the training process (``os.fork()`` by a library, a debugger, a
  ``multiprocessing`` child under fork) inherits the live iterator: its ``next()`` and
  ``iter(loader)`` are refused with an error naming both processes, so the child never takes the
  parent's batches, writes to its workers or makes segments of its own that nobody unlinks.
- A batch that pickles in its worker but whose objects do not unpickle in the main process raises
  an error of the same kind that names the worker, its pid, the task and its sample indices, and
  the loader goes on with the next batch, as it does after an error in ``__getitem__``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from shmloader import DataLoader, get_worker_info


class Full:
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(4, i)


def _in_child(fn) -> str:  # noqa: ANN001 - a callable run in a forked child
    """Run ``fn`` in a forked child; what it raised (type and message), or ``returned``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            fn()
            out = "returned"
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = f"{type(exc).__name__}: {exc}"
        os.write(w, out.encode()[:4000])
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_a_forked_child_may_not_use_the_parents_iterator(persistent):
    loader = DataLoader(Full(), batch_size=2, num_workers=2, timeout=20, persistent_workers=persistent,
                        multiprocessing_context="fork")
    try:
        it = iter(loader)
        got = [int(next(it)[0, 0])]
        said = _in_child(lambda: next(it))
        assert said.startswith("LoaderError: next() on a loader iterator made by process "), said
        assert f"made by process {os.getpid()}" in said
        if persistent:  # iter(loader) in the child would reset the parent's iterator
            said = _in_child(lambda: iter(loader))
            assert said.startswith("LoaderError: iter(loader) on a loader iterator made by process "), said
        got += [int(b[0, 0]) for b in it]  # the parent's batches are all still there, once each
    finally:
        loader.close()
    assert got == list(range(0, 16, 2))
    # nothing of a child's: its segments would carry its pid (the leak guard checks the parent's)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("shml_") and f"_{os.getpid()}_" not in n
                and _dead_pid(n)]


def _dead_pid(name: str) -> bool:
    """A ``shml_<pid>_...`` segment whose creating process no longer exists."""
    try:
        os.kill(int(name.split("_")[1]), 0)
    except (ValueError, IndexError):
        return False
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _rebuild(i: int) -> Unpicklable:
    if get_worker_info() is None and i == 6:  # in the main process only
        raise ValueError("cannot rebuild sample 6 here")
    return Unpicklable(i)


class Unpicklable:
    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self):  # noqa: ANN204 - pickle's protocol
        return (_rebuild, (self.i,))


class WithObjects:
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[np.ndarray, Unpicklable]:
        return np.full(3, i), Unpicklable(i)


def _collate(samples: list) -> tuple[np.ndarray, list]:
    return np.stack([s[0] for s in samples]), [s[1] for s in samples]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_batch_that_does_not_rebuild_here_names_its_task_and_the_loader_goes_on(method):
    loader = DataLoader(WithObjects(), batch_size=2, num_workers=2, collate_fn=_collate,
                        multiprocessing_context=method)
    got, errors = [], []
    try:
        it = iter(loader)
        while True:
            try:
                x, objs = next(it)
            except StopIteration:
                break
            except ValueError as exc:  # the same kind as the original
                errors.append(exc)
                continue
            got.append(x[:, 0].tolist())
            assert [o.i for o in objs] == x[:, 0].tolist()
    finally:
        loader.close()
    assert got == [[0, 1], [2, 3], [4, 5], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert len(errors) == 1
    msg = str(errors[0])
    assert "task 3 (sample indices [6..7]) from DataLoader worker process 1 (pid " in msg, msg
    assert "cannot rebuild sample 6 here" in msg and isinstance(errors[0].__cause__, ValueError)
