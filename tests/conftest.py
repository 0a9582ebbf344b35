"""Suite-wide guards: nothing of ours may outlive a test or the session.

A test that leaves a child process (or a zombie) or a ``shml_`` segment owned by this process in
the shared-memory directory fails in its teardown; the session fixture checks the same at the end,
so a leak cannot hide between tests. What counts as left behind, and how long a process on its
way out is given, is leak_guard.py's. multiprocessing's own helper processes (the resource
tracker and the fork server) are shared by every loader of the process and are not leaks.
"""

from __future__ import annotations

import gc
import signal

import pytest
from leak_guard import SHM_DIR, all_segments, dead_owners_since
from leak_guard import leaks as _leaks


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C is Python's in the suite, as in a terminal, however the run was started. A shell runs
    a background job (``cmd &`` in a script, nohup) with SIGINT ignored, and an ignored signal stays
    ignored in every process started from it: the tests that send SIGINT to the suite, or to the
    command lines and workers they start, then waited for an interrupt that never came
    (tests/test_suite_signals.py). A handler, unlike SIG_IGN, is reset to the default by ``exec``."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def no_leak_per_test():
    # Collect what earlier tests left, then freeze what is still alive (the modules, torch's ~180,000
    # objects, the session's own): the collection in this test's check then visits only what the
    # test made, where a full one costs ~0.1 s. What the test made is collected as before; a frozen
    # object is still freed when its last reference goes.
    gc.collect()
    gc.freeze()
    yield
    leaks = _leaks()
    if leaks:
        pytest.fail("test left behind:\n  " + "\n  ".join(leaks), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def no_leak_in_session():
    before = all_segments()
    yield
    leaks = _leaks() + [f"shared-memory segment {n} of a process that died" for n in dead_owners_since(before)]
    if leaks:
        pytest.fail("the test session left behind:\n  " + "\n  ".join(leaks), pytrace=False)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    """The loader's pin backend is the fake one (SHMLOADER_PIN_BACKEND=fake); returns that backend."""
    from shmloader.gpu import pinning
    from shmloader.gpu.fake import FakeBackend

    backend = FakeBackend()
    make_backend = pinning.make_backend
    monkeypatch.setenv(pinning.ENV_BACKEND, "fake")
    monkeypatch.setattr(pinning, "make_backend", lambda name: backend if name == "fake" else make_backend(name))
    return backend


@pytest.fixture
def ring():
    """A slot ring in /dev/shm, closed after the test (the transport and codec tests drive it by hand)."""
    from shmloader.transport.ring import Ring

    r = Ring(SHM_DIR)
    yield r
    r.close()
