"""An error reworded as it leaves a block frees the frames it passed through without the collector.

``limits_named`` (a worker or the iterator out of descriptors) and ``explain_enospc`` (a segment
that cannot be made) were ``contextlib.contextmanager`` generators. From Python 3.12 a new error
raised from such a generator makes a cycle (the generator's frame keeps the ``__exit__`` frame that
threw the old error into it, which holds that error, whose traceback holds the generator's frame):
every frame of the failed step and its locals lived until a collection, so a spawn worker's
stop-flag semaphore kept its name in /dev/shm (tests/test_iter_fd_limit.py failed on 3.12 and
3.13). On 3.10 and 3.11 these pass either way.
"""

from __future__ import annotations

import errno
import weakref
from collections.abc import Callable

import pytest
from test_leak_cycles import no_cyclic_gc

from shmloader.engine.start_limits import limits_named
from shmloader.errors import ShmSpaceError, TooManyOpenFiles
from shmloader.rewording import Rewording
from shmloader.transport import shm_space
from shmloader.transport.shm_space import explain_enospc


class _Held:
    """What a frame of the failed step holds (a worker's stop flag, in the loader)."""


def _failed_step(rewording: Rewording, make_error: Callable[[], BaseException]) -> tuple[type, bool, bool]:
    """Run a step that holds a ``_Held`` and raises ``make_error()`` inside ``rewording``; return the
    type raised, whether it was chained to the step's error, and whether the ``_Held`` is freed once
    the error is dropped."""
    held: list[weakref.ref[_Held]] = []

    def step() -> None:
        thing = _Held()
        held.append(weakref.ref(thing))
        with rewording:
            raise make_error()

    with no_cyclic_gc():
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - the type is what is checked
            raised, chained = type(exc), exc.__cause__ is not None
        freed = held[0]() is None  # before the collector runs again
    return raised, chained, freed


CASES = [
    pytest.param(lambda: limits_named(2, 0), lambda: OSError(errno.EMFILE, "Too many open files"), OSError,
                 id="worker-out-of-descriptors"),
    pytest.param(lambda: limits_named(2), lambda: OSError(errno.ENFILE, "Too many open files in system"), OSError,
                 id="iterator-out-of-descriptors"),
    pytest.param(lambda: explain_enospc("/dev/shm", 4096), lambda: OSError(errno.EMFILE, "Too many open files"),
                 TooManyOpenFiles, id="segment-out-of-descriptors"),
    pytest.param(lambda: explain_enospc("/dev/shm", 4096), lambda: OSError(errno.EFBIG, "File too large"), OSError,
                 id="segment-past-file-size"),
    pytest.param(lambda: explain_enospc("/nonexistent-shm-dir", 4096), lambda: OSError(errno.ENOENT, "No such file"),
                 FileNotFoundError, id="segment-directory-missing"),
]


@pytest.mark.parametrize(("rewording", "make_error", "expected"), CASES)
def test_a_reworded_error_frees_the_failed_steps_frames_without_the_collector(
        rewording: Callable[[], Rewording], make_error: Callable[[], BaseException],
        expected: type) -> None:
    raised, chained, freed = _failed_step(rewording(), make_error)
    assert (raised, chained) == (expected, True)  # reworded, from the step's own error
    assert freed, "a frame of the failed step outlived its reworded error: a reference cycle"


def test_a_segment_out_of_space_is_reworded_and_frees_its_frames(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_space, "shm_free_bytes", lambda shm_dir: 1024)
    raised, chained, freed = _failed_step(explain_enospc("/dev/shm", 4096),
                                          lambda: OSError(errno.ENOSPC, "No space left on device"))
    assert (raised, chained, freed) == (ShmSpaceError, True, True)


@pytest.mark.parametrize(("rewording", "make_error"), [
    (lambda: limits_named(2, 0), lambda: OSError(errno.EBADF, "Bad file descriptor")),  # not a limit
    (lambda: limits_named(2), lambda: OSError(errno.EAGAIN, "Resource temporarily unavailable")),  # not a descriptor
    (lambda: limits_named(2, 0), lambda: TooManyOpenFiles(errno.EMFILE, "explained where it was raised")),
    (lambda: explain_enospc("/dev/shm", 4096), lambda: OSError(errno.EBADF, "Bad file descriptor")),
    (lambda: explain_enospc("/dev/shm", 4096), lambda: KeyError("not an OSError")),
    (lambda: limits_named(2, 0), lambda: KeyboardInterrupt()),
], ids=["other-oserror", "iterator-not-descriptors", "explained-already", "segment-other-oserror", "not-oserror",
        "ctrl-c"])
def test_an_error_not_reworded_goes_on_as_it_is(rewording: Callable[[], Rewording],
                                                make_error: Callable[[], BaseException]) -> None:
    error = make_error()
    with pytest.raises(type(error)) as info:
        with rewording():
            raise error
    assert info.value is error and error.__cause__ is None
