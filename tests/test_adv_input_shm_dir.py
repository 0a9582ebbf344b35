"""Hostile shared-memory directories, as ``SHMLOADER_SHM_DIR`` or ``shm_dir=``.

The loader refuses, when it is built and naming the variable or the argument, what it could not
use the same way in every process: not a directory, not writable (and searchable) by this user, a
relative path (it would move with each process's working directory, and the sweep with it), an
empty value. A disk-backed directory works (the segments are written back to disk): ``doctor``
warns about it, the loader does not refuse it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader import config_fields
from shmloader.config import resolve_config
from shmloader.errors import ConfigError, ShmSpaceError

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("raw", ["relative_dir", "./relative_dir", "relative_dir/../relative_dir"])
def test_a_relative_directory_is_refused_naming_the_variable(raw: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "relative_dir").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^SHMLOADER_SHM_DIR={raw!r} is a relative path") as exc:
        resolve_config({}, {"SHMLOADER_SHM_DIR": raw})
    assert exc.value.name == "SHMLOADER_SHM_DIR"
    assert str(tmp_path / "relative_dir") in str(exc.value)  # what it resolves to here, to copy


def test_a_relative_shm_dir_argument_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "d").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^shm_dir=PosixPath\('d'\) is a relative path") as exc:
        resolve_config({"shm_dir": Path("d")}, {})
    assert exc.value.name == "shm_dir"


def test_a_directory_this_user_cannot_write_is_refused(tmp_path: Path) -> None:
    """Refused at construction, not at the first segment (as root, /proc: see
    test_adv_input_shm_dir_probe.py)."""
    locked = str(tmp_path / "locked") if os.geteuid() != 0 else "/proc"
    if locked != "/proc":
        os.mkdir(locked, mode=0o500)
    for explicit, env, name in (({}, {"SHMLOADER_SHM_DIR": locked}, "SHMLOADER_SHM_DIR"),
                                ({"shm_dir": Path(locked)}, {}, "shm_dir")):
        with pytest.raises(ConfigError, match=r"is not writable by this user") as exc:
            resolve_config(explicit, env)
        assert exc.value.name == name and locked in str(exc.value)


@pytest.mark.parametrize("raw", ["", "   ", "\t"])
def test_an_empty_directory_is_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"^SHMLOADER_SHM_DIR=.* is empty"):
        resolve_config({}, {"SHMLOADER_SHM_DIR": raw})
    with pytest.raises(ConfigError, match=r"^shm_dir=.* is empty"):
        resolve_config({"shm_dir": raw}, {})


def test_a_path_with_a_nul_byte_is_refused_naming_it() -> None:
    """os.path.isdir() says False for it; os.access() would raise a bare ValueError."""
    with pytest.raises(ConfigError, match=r"^shm_dir=.* is not an existing directory"):
        resolve_config({"shm_dir": "/dev/\0shm"}, {})


def test_an_absolute_writable_directory_is_kept_as_given(tmp_path: Path) -> None:
    assert resolve_config({}, {"SHMLOADER_SHM_DIR": str(tmp_path)}).shm_dir == str(tmp_path)
    assert resolve_config({"shm_dir": tmp_path}, {}).shm_dir == str(tmp_path)


@pytest.mark.timeout(60)
def test_doctor_names_a_relative_directory_as_a_problem(tmp_path: Path) -> None:
    (tmp_path / "rel").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMLOADER_")}
    proc = subprocess.run([sys.executable, "-m", "shmloader", "doctor", "--workers", "1", "--slot-bytes", "4KiB"],
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO), "SHMLOADER_SHM_DIR": "rel"},
                          capture_output=True, text=True, timeout=50)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "SHMLOADER_SHM_DIR='rel' is a relative path" in proc.stdout


@pytest.mark.timeout(60)
def test_a_given_slot_size_too_large_for_the_directory_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMLOADER_SLOT_BYTES", str(10**23))
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(np.zeros((8, 2)), batch_size=2, num_workers=1)
    with pytest.raises(ShmSpaceError, match=r"slots of 10{23} bytes \(slot_bytes=, SHMLOADER_SLOT_BYTES\)"):
        iter(loader)
    loader.close()
