"""Ctrl-C during ``python -m shmloader``: one short line on stderr and exit status 130, no traceback,
and nothing left behind (no process of the command's process group, no segment).

A terminal's Ctrl-C sends SIGINT to the whole foreground process group, so the tests start the
command in a session of its own and signal that group, workers and copy-limit processes included."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from process_helpers import until

from shmloader import __main__ as cli
from shmloader.cli import bench, doctor, interrupt

REPO = Path(__file__).resolve().parents[1]
COPY_LIMIT_FOREVER = """
import sys
import threading
from shmloader.cli.copylimit import measure_copy_limit
from shmloader.cli.workloads import WORKLOADS
try:
    measure_copy_limit(WORKLOADS["tiny"], 2, 10**12, "fork", shared=True)
except KeyboardInterrupt:
    print("main: interrupted", file=sys.stderr)
    sys.exit(130)
"""


def _interrupt(argv: list[str], shm: Path, children: int = 2) -> tuple[int, str, str]:
    """Run ``argv`` in a session of its own, Ctrl-C its process group once it runs ``children``
    processes (loader workers or copy-limit processes: it is inside its run); return the exit status,
    stdout and stderr once it has ended, after checking that nothing of it is left."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMLOADER_")}
    env.update(PYTHONPATH=str(REPO), SHMLOADER_SHM_DIR=str(shm))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env, cwd=shm.parent)  # fmt: skip
    try:
        assert until(lambda: len(_group(proc.pid)) > children or proc.poll() is not None, 60)
        assert proc.poll() is None, "finished before the interrupt: make the run longer"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert until(lambda: not _group(proc.pid), 10), _group(proc.pid)  # orphans take a moment to go
    assert os.listdir(shm) == []
    return proc.returncode, out, err


def _group(pgid: int) -> list[str]:
    """The live (not zombie) processes of process group ``pgid``, as ``ps`` lists them."""
    ps = subprocess.run(["ps", "-eo", "pgid=,stat=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines()
            if line.split()[:1] == [str(pgid)] and not line.split()[1].startswith("Z")]  # fmt: skip


@pytest.mark.timeout(90)
@pytest.mark.parametrize("args", [
    ["bench", "--no-torch", "--workloads", "tiny", "--workers", "2", "--batches", "100000000", "--repeat", "1",
     "--no-copy-limit"],
    ["bench", "--no-shmloader", "--workloads", "tiny", "--workers", "2", "--batches", "100000000",
     "--repeat", "1"],
    pytest.param(["bench", "--train", "--quick", "--steps", "100000", "--workers", "2"],
                 marks=pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                          reason="bench --train needs torch")),
], ids=["bench-shmloader", "bench-torch", "bench-train"])
def test_ctrl_c_ends_the_command_with_one_line_and_status_130(tmp_path: Path, args: list[str]) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    status, out, err = _interrupt([sys.executable, "-m", "shmloader", *args], shm)
    assert "Traceback" not in out + err, err[-3000:]
    assert status == 130, err[-3000:]
    assert err.rstrip().endswith("python -m shmloader: interrupted")


@pytest.mark.timeout(90)
def test_ctrl_c_during_the_copy_limit_leaves_no_process_and_no_child_traceback(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    status, _, err = _interrupt([sys.executable, "-c", COPY_LIMIT_FOREVER], shm)
    assert "Traceback" not in err, err[-3000:]
    assert (status, err.strip()) == (130, "main: interrupted")


def _raise_interrupt(*args: object, **kwargs: object) -> int:
    raise KeyboardInterrupt


@pytest.mark.parametrize("command", [["bench"], ["doctor"], ["config"]])
def test_every_command_turns_ctrl_c_into_status_130(command: list[str], monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(bench, "main", _raise_interrupt)
    monkeypatch.setattr(doctor, "run", _raise_interrupt)
    monkeypatch.setattr(cli, "_print_config", _raise_interrupt)
    assert cli.main(command) == 130
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "python -m shmloader: interrupted\n")


def _a_workers_death_in_the_cleanup(*args: object, **kwargs: object) -> int:
    """What torch's SIGCHLD handler does when a Ctrl-C sent to the process group also ended one of
    its workers: it raises RuntimeError in the cleanup that the KeyboardInterrupt set off."""
    try:
        raise KeyboardInterrupt
    finally:
        raise RuntimeError("DataLoader worker (pid 4242) exited unexpectedly with exit code 1.")


def test_an_error_the_ctrl_c_set_off_in_the_cleanup_is_still_one_line_and_130(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench, "main", _a_workers_death_in_the_cleanup)
    assert cli.main(["bench"]) == 130
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "python -m shmloader: interrupted\n")


def test_an_error_without_a_ctrl_c_behind_it_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(*args: object, **kwargs: object) -> int:
        raise RuntimeError("a real failure")

    monkeypatch.setattr(bench, "main", fails)
    with pytest.raises(RuntimeError, match="a real failure"):
        cli.main(["bench"])


def _frame_in(filename: str, name: str = "here") -> FrameType:
    """A live frame of a function ``name`` compiled as if from ``filename`` (its caller: this test)."""
    namespace: dict[str, Any] = {"sys": sys}
    exec(compile(f"def {name}(*args):\n    return sys._getframe()\n", filename, "exec"), namespace)
    frame: FrameType = namespace[name]()
    return frame


SHARER = os.path.join(os.path.dirname(os.__file__), "multiprocessing", "resource_sharer.py")


def _handler() -> Any:
    handler = signal.getsignal(signal.SIGINT)
    assert callable(handler) and handler is not signal.default_int_handler
    return handler


def test_where_raising_is_unsafe() -> None:
    assert interrupt.unsafe_to_raise(_frame_in(SHARER))
    assert interrupt.unsafe_to_raise(_frame_in(__file__, "__del__"))
    assert not interrupt.unsafe_to_raise(sys._getframe())


def test_ctrl_c_in_a_hand_over_is_raised_once_it_is_over() -> None:
    raised = False
    with interrupt.ctrl_c_handled():
        try:
            _handler()(signal.SIGINT, _frame_in(SHARER))  # deferred: retried RETRY_S later, by interrupt_main
            time.sleep(interrupt.RETRY_S * 50)
        except KeyboardInterrupt:
            raised = True
    assert raised and signal.getsignal(signal.SIGINT) is signal.default_int_handler


class _InterruptedWhileDeleted:
    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)
        time.sleep(interrupt.RETRY_S)  # the handler runs here, inside __del__


def test_ctrl_c_in_a_del_is_not_swallowed_but_raised_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    raised = False
    with interrupt.ctrl_c_handled():
        try:
            _InterruptedWhileDeleted()  # dropped at once: __del__ runs
            time.sleep(interrupt.RETRY_S * 50)
        except KeyboardInterrupt:
            raised = True
    assert raised and unraisable == []


class _Object:
    pass


def test_ctrl_c_a_finalizer_swallows_is_raised_again(monkeypatch: pytest.MonkeyPatch) -> None:
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)  # the hook ours passes the rest to

    def interrupted(_ref: object) -> None:
        raise KeyboardInterrupt  # as if Ctrl-C had landed in this weakref callback

    def failing(_ref: object) -> None:
        raise ValueError("not ours")

    raised = False
    with interrupt.ctrl_c_handled():
        try:
            for callback in (failing, interrupted):
                victim = _Object()
                ref = weakref.ref(victim, callback)
                del victim  # the callback runs now; Python hands what it raises to sys.unraisablehook
            time.sleep(interrupt.RETRY_S * 50)
        except KeyboardInterrupt:
            raised = True
    assert raised and ref() is None
    assert [type(u.exc_value) for u in unraisable] == [ValueError]
    assert sys.unraisablehook == unraisable.append  # restored


def test_a_shield_holds_ctrl_c_back_until_it_ends() -> None:
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupt.ctrl_c_handled():
            with interrupt.shielded():
                _handler()(signal.SIGINT, sys._getframe())
                done.append("closed")  # not cut short
    assert done == ["closed"]
    with interrupt.shielded():  # no handler of ours: nothing to hold back, nothing raised
        pass


def test_ctrl_c_elsewhere_is_raised_at_once_and_a_pending_retry_dies_with_the_block() -> None:
    with pytest.raises(KeyboardInterrupt):
        with interrupt.ctrl_c_handled():
            _handler()(signal.SIGINT, sys._getframe())
    with interrupt.ctrl_c_handled():
        _handler()(signal.SIGINT, _frame_in(SHARER))
    time.sleep(interrupt.RETRY_S * 5)  # the retry was cancelled: no KeyboardInterrupt arrives here
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _retry_timers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if isinstance(t, threading.Timer)]


def test_every_pending_retry_dies_with_the_block_not_only_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(interrupt, "RETRY_S", 60.0)  # both still pending when the block ends, however slow
    assert _retry_timers() == []
    with interrupt.ctrl_c_handled():
        for _ in range(2):  # two Ctrl-Cs in a hand-over: two retries pending at once
            _handler()(signal.SIGINT, _frame_in(SHARER))
        assert len(_retry_timers()) == 2
    assert _retry_timers() == []  # cancelled and joined: none fires into what runs after the block
