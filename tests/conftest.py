"""Suite-wide guards: nothing of ours may outlive a test or the session.

A test that leaves a child process (or a zombie) or a ``shml_`` segment owned by this process in
the shared-memory directory fails in its teardown; the session fixture checks the same at the end,
so a leak cannot hide between tests. multiprocessing's own helper processes (the resource
tracker and the fork server) are shared by every loader of the process and are not leaks.
"""

from __future__ import annotations

import gc
import os

import psutil
import pytest
from process_helpers import SHARED_HELPERS

SHM_DIR = "/dev/shm"


def _our_segments() -> set[str]:
    prefix = f"shml_{os.getpid()}_"
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def _stray_processes() -> list[psutil.Process]:
    strays = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            cmd = ""
        except psutil.AccessDenied:
            continue
        if not any(h in cmd for h in SHARED_HELPERS):
            strays.append(p)
    return strays


def _stray_children() -> list[str]:
    described = []
    for p in _stray_processes():
        try:
            described.append(f"pid {p.pid} ({p.status()}): {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return described


def _is_zombie(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _leaks() -> list[str]:
    gc.collect()
    found = [f"shared-memory segment {n}" for n in sorted(_our_segments())]
    strays = _stray_processes()
    found += [f"zombie child pid {p.pid} (exited, never joined)" for p in strays if _is_zombie(p)]
    if strays:
        # a process told to stop may need a moment to exit: wait for it, bounded, then judge
        psutil.wait_procs(strays, timeout=3)
    strays = _stray_children()
    found += [f"child process {s}" for s in strays]
    return found


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
    yield
    leaks = _leaks()
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
