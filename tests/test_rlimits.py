"""The soft resource limits are read in one place and worded one way wherever a message names one.

``shmloader.rlimits`` reads a limit (unknown where the platform has none, unlimited at
RLIM_INFINITY); a worker that cannot start, a refused mlock, the doctor's memlock check and a
segment made without a free descriptor all name it in its words, with its remedy; the bench's
bound on workers reads the limits through it.
"""

from __future__ import annotations

import errno
import sys
from typing import Any

import pytest

resource = pytest.importorskip("resource")

from shmloader.cli import doctor, options  # noqa: E402
from shmloader.engine import start_limits  # noqa: E402
from shmloader.gpu import mlock  # noqa: E402
from shmloader.rlimits import soft_limit  # noqa: E402
from shmloader.transport.shm_space import explain_enospc  # noqa: E402


def _fake_limits(monkeypatch: pytest.MonkeyPatch, **soft: int) -> None:
    """``resource.getrlimit`` answers ``soft`` (name -> soft value, also the hard one) for those limits."""
    real = resource.getrlimit
    chosen = {getattr(resource, name): value for name, value in soft.items()}

    def getrlimit(which: int) -> tuple[int, int]:
        return (chosen[which], chosen[which]) if which in chosen else real(which)

    monkeypatch.setattr(resource, "getrlimit", getrlimit)


def test_a_limit_is_read_as_the_process_has_it() -> None:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limit = soft_limit("RLIMIT_NOFILE")
    assert limit.known and limit.value == (None if soft == resource.RLIM_INFINITY else soft)


def test_a_finite_limit_is_worded_with_the_command_that_shows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_limits(monkeypatch, RLIMIT_NOFILE=1024, RLIMIT_MEMLOCK=65536)
    assert soft_limit("RLIMIT_NOFILE").describe() == "soft limit RLIMIT_NOFILE = 1024; 'ulimit -n' shows it"
    assert soft_limit("RLIMIT_MEMLOCK").describe() == "soft limit RLIMIT_MEMLOCK = 65536 bytes; 'ulimit -l' shows it"
    assert soft_limit("RLIMIT_MEMLOCK").describe(doctor.format_bytes).endswith("= 64.0 KiB; 'ulimit -l' shows it")
    assert "resource.setrlimit(resource.RLIMIT_NOFILE" in soft_limit("RLIMIT_NOFILE").remedy()
    assert "ulimit -l unlimited" in soft_limit("RLIMIT_MEMLOCK").remedy()


def test_an_infinite_limit_is_unlimited(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_limits(monkeypatch, RLIMIT_NPROC=resource.RLIM_INFINITY)
    limit = soft_limit("RLIMIT_NPROC")
    assert limit.unlimited and limit.value is None
    assert "RLIMIT_NPROC = unlimited" in limit.describe()


def test_a_platform_without_resource_limits_reads_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "resource", None)  # import resource raises ImportError
    limit = soft_limit("RLIMIT_MEMLOCK")
    assert not limit.known and not limit.unlimited and limit.value is None
    assert "RLIMIT_MEMLOCK = unknown" in limit.describe()
    assert options.startable_workers() == sys.maxsize


def _start_failure() -> str:
    explained = start_limits.explain(OSError(errno.EMFILE, "Too many open files"), 2, 30)
    assert explained is not None
    return str(explained)


def _mlock_refusal() -> str:
    return mlock.memlock_limit_text()


def _doctor_memlock() -> str:
    finding = doctor.check_memlock(doctor.RingPlan(workers=2, prefetch_factor=2, slot_bytes=1 << 30), True)
    return f"{finding.message} {finding.remedy}"


def _descriptors_out() -> str:
    with pytest.raises(OSError) as info:
        with explain_enospc("/dev/shm", 4096):
            raise OSError(errno.EMFILE, "Too many open files", "/dev/shm/shml_1_ab")
    return str(info.value)


@pytest.mark.parametrize(("message", "name", "unit", "remedy"), [
    (_start_failure, "RLIMIT_NOFILE", None, True),
    (_mlock_refusal, "RLIMIT_MEMLOCK", None, True),
    (_doctor_memlock, "RLIMIT_MEMLOCK", doctor.format_bytes, True),
    (_descriptors_out, "RLIMIT_NOFILE", None, True),
])  # fmt: skip
def test_every_message_that_names_a_limit_words_it_alike(monkeypatch: pytest.MonkeyPatch, message: Any, name: str,
                                                         unit: Any, remedy: bool) -> None:
    _fake_limits(monkeypatch, **{name: 65536})
    text = message()
    assert soft_limit(name).describe(unit) in text, text  # type: ignore[arg-type]
    assert not remedy or soft_limit(name).remedy() in text, text  # type: ignore[arg-type]


def test_the_bench_bound_on_workers_reads_both_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_limits(monkeypatch, RLIMIT_NOFILE=resource.RLIM_INFINITY, RLIMIT_NPROC=3)
    assert options.startable_workers() == 3
    _fake_limits(monkeypatch, RLIMIT_NOFILE=resource.RLIM_INFINITY, RLIMIT_NPROC=resource.RLIM_INFINITY)
    assert options.startable_workers() == sys.maxsize
    room = options.open_descriptors() + 5 * options.FDS_PER_WORKER
    _fake_limits(monkeypatch, RLIMIT_NOFILE=room, RLIMIT_NPROC=resource.RLIM_INFINITY)
    assert options.startable_workers() in (5, 4)  # 4: a descriptor opened while listing them

