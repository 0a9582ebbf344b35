"""A shared-memory directory is refused at construction when a file cannot be made in it.

The defect: the check was ``os.access(dir, W_OK | X_OK)``, which says yes to root for any directory
(``/proc`` included), so a loader built fine and failed at its first segment, far from the setting.
Now the check creates (exclusively) and removes a probe file, named like a segment of this process
so that a probe left by a killed process is swept like a segment; once per directory per process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from shmloader import config_fields
from shmloader.config import resolve_config
from shmloader.errors import ConfigError
from shmloader.transport.segment import PREFIX


def _unwritable_dir(tmp_path: Path) -> str:
    """A directory where creating a file fails for this user: /proc as root, else a 0o500 one."""
    if os.geteuid() == 0:
        if not os.path.isdir("/proc/self"):
            pytest.skip("root without /proc: no directory here refuses root a file")
        return "/proc"
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return str(locked)


@pytest.fixture(autouse=True)
def _fresh_probes() -> None:
    getattr(config_fields, "_PROBED", set()).clear()  # each test probes for itself


def test_a_directory_where_no_file_can_be_made_is_refused_naming_the_variable(tmp_path: Path) -> None:
    target = _unwritable_dir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^SHMLOADER_SHM_DIR={target!r} is not writable by this user") as exc:
        resolve_config({}, {"SHMLOADER_SHM_DIR": target})
    assert exc.value.name == "SHMLOADER_SHM_DIR"


def test_a_directory_where_no_file_can_be_made_is_refused_naming_the_argument(tmp_path: Path) -> None:
    target = _unwritable_dir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^shm_dir={target!r} is not writable by this user") as exc:
        resolve_config({"shm_dir": target}, {})
    assert exc.value.name == "shm_dir"
    assert os.strerror(2) in str(exc.value) or os.strerror(13) in str(exc.value)  # the system's reason


def _record_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path ``config_fields`` opens from now on (the probe's ``os.open``), in order."""
    opened: list[str] = []
    real_open = os.open

    def noted_open(path: str, *args: Any) -> int:
        opened.append(path)
        return real_open(path, *args)

    monkeypatch.setattr(config_fields.os, "open", noted_open)
    return opened


def test_the_probe_leaves_nothing_and_runs_once_per_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened = _record_opens(monkeypatch)
    for _ in range(3):
        assert resolve_config({"shm_dir": tmp_path}, {}).shm_dir == str(tmp_path)
    assert len(opened) == 1 and os.path.basename(opened[0]).startswith(f"{PREFIX}{os.getpid()}_")
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(30)
def test_a_forked_child_probes_for_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's probe says nothing of the child (its user or namespace may differ)."""
    resolve_config({"shm_dir": tmp_path}, {})
    opened = _record_opens(monkeypatch)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if it probed once, named as its own
        code = 1
        try:
            resolve_config({"shm_dir": tmp_path}, {})
            code = 0 if [f"{PREFIX}{os.getpid()}_" in p for p in opened] == [True] else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and opened == []


@pytest.mark.skipif(os.geteuid() != 0, reason="os.access says yes to /proc only for root")
def test_doctor_says_a_directory_where_no_file_can_be_made_is_not_writable() -> None:
    """doctor's shm-dir check makes a file too: ``os.access`` said yes to root for /proc, and the
    finding then blamed the free space ("enlarge it") instead."""
    from shmloader.cli import doctor

    found = doctor.check_shm_dir("/proc", doctor.RingPlan(workers=2, prefetch_factor=2, slot_bytes=4096))
    assert [f.status for f in found] == [doctor.PROBLEM]
    assert "/proc is not writable by this user" in found[0].message
