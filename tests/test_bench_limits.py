"""The benchmark's copy limit and ring copy limit (shmloader/cli/copylimit.py): the processes
that stack batches and nothing else, and how their rates reach the report and the JSON document."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
from typing import Any

import numpy as np
import pytest
from bench_helpers import DOCUMENT_KEYS
from bench_helpers import rounds as _rounds

from shmloader.cli import bench, copylimit
from shmloader.cli.copylimit import measure_copy_limit, ring_buffers_per_process
from shmloader.cli.measure import count_children
from shmloader.cli.records import CopyLimitRun, Measurement, summarize_loaders
from shmloader.cli.report import format_copy_limits, format_results, to_json_document
from shmloader.cli.workloads import WORKLOADS
from shmloader.transport import preflight
from shmloader.transport.segment import Segment


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_copy_limit_stacks_batches_in_n_processes_and_leaves_none(start_method: str) -> None:
    run = measure_copy_limit(WORKLOADS["image"], processes=2, batches=5, start_method=start_method,
                             round_index=3)  # fmt: skip
    assert run.error is None and run.ok
    assert (run.workload, run.processes, run.round_index) == ("image", 2, 3)
    assert run.batches == 6  # 5 rounded up so that both processes stack 3
    assert run.seconds > 0 and run.batches_per_s > 0
    assert count_children() == 0


def test_ring_buffers_per_process_is_each_workers_share_of_the_ring_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [ring_buffers_per_process(n) for n in range(1, 9)] == \
        [math.ceil(preflight.ring_slots(n, 2) / n) for n in range(1, 9)]  # fmt: skip
    assert [ring_buffers_per_process(n) for n in (1, 2, 4)] == [4, 3, 3]  # 4/1, 6/2, 10/4 slots
    monkeypatch.setattr(preflight, "CONSUMER_SLOTS", 6)  # ring_slots' rule, not a copy of it
    assert ring_buffers_per_process(2) == 5  # ceil((2 * 2 + 6) / 2)


def test_stack_loop_writes_every_buffer_before_the_barrier_then_rotates(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[Any] = []

    class Barrier:
        def wait(self, timeout: float) -> None:
            events.append("barrier")

    monkeypatch.setattr(copylimit, "_stack_once", lambda columns, batch: events.append(id(batch)))
    recv, send = multiprocessing.Pipe(duplex=False)
    copylimit._stack_loop(WORKLOADS["tiny"], 7, 3, Barrier(), send)
    start, end = recv.recv()
    recv.close()
    touched, timed = events[:3], events[4:]
    assert len(set(touched)) == 3 and events[3] == "barrier" and end >= start
    assert timed == [touched[k % 3] for k in range(7)]  # each write goes to the buffer written 3 ago


@pytest.mark.timeout(120)
def test_ring_copy_limit_runs_in_the_same_processes_and_leaves_none() -> None:
    run = measure_copy_limit(WORKLOADS["image"], processes=2, batches=5, start_method="fork", buffers=3)
    assert run.error is None and run.ok and run.batches == 6 and run.batches_per_s > 0
    assert run.buffers_per_process == 3 and run.to_dict()["buffers_per_process"] == 3
    assert count_children() == 0


def test_stack_loop_shared_writes_into_unlinked_segments_of_the_directory(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[Any] = []
    create = copylimit.Segment.create

    def recorded(shm_dir: str, size_bytes: int, **kwargs: Any) -> Any:
        made.append((shm_dir, create(shm_dir, size_bytes, **kwargs)))
        return made[-1][1]

    batches: list[Any] = []
    monkeypatch.setattr(copylimit.Segment, "create", recorded)
    monkeypatch.setattr(copylimit, "_stack_once", lambda columns, batch: batches.append(batch))

    class Barrier:
        def wait(self, timeout: float) -> None:
            pass

    recv, send = multiprocessing.Pipe(duplex=False)
    copylimit._stack_loop(WORKLOADS["tiny"], 2, 3, Barrier(), send, str(tmp_path))
    recv.close()
    assert [d for d, _ in made] == [str(tmp_path)] * 3 and list(tmp_path.iterdir()) == []  # unlinked at once
    for (_, segment), batch in zip(made, batches):  # every field of a batch lies in its segment
        base = memoryview(segment.buf)
        for array in batch:
            assert np.shares_memory(array, np.frombuffer(base, dtype=np.uint8))
            assert array.__array_interface__["data"][0] % 64 == 0
        base.release()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_shared_ring_copy_limit_runs_and_leaves_no_segment(start_method: str, tmp_path: Any) -> None:
    run = measure_copy_limit(WORKLOADS["image"], processes=2, batches=5, start_method=start_method, buffers=3,
                             shared=True, shm_dir=str(tmp_path))  # fmt: skip
    assert run.error is None and run.ok and run.batches_per_s > 0
    assert run.memory == "shared" and run.to_dict()["memory"] == "shared"
    assert list(tmp_path.iterdir()) == [] and count_children() == 0


def _limit(seconds: float, buffers: int = 1, error: str | None = None, round_index: int = 0) -> CopyLimitRun:
    return CopyLimitRun("tiny", 2, 4608, 100, seconds, round_index, error, buffers)


def test_shmloader_rows_are_fractions_of_both_limits() -> None:
    results = _rounds("shmloader", [1.0]) + _rounds("torch", [2.0])  # 100 and 50 batches/s
    copy, ring = [_limit(0.5)], [_limit(0.8, buffers=3)]  # 200 and 125 batches/s
    shm, torch_summary = summarize_loaders(results, copy, ring)
    assert shm.copy_limit_fraction == pytest.approx(0.5) and shm.ring_limit_fraction == pytest.approx(0.8)
    assert torch_summary.ring_limit_fraction is None
    lines = format_results(results, copy, ring).splitlines()
    assert lines[0].endswith("of copy limit  of ring limit")
    shm_row = next(line for line in lines if line.startswith("tiny") and "shmloader" in line)
    assert shm_row.split()[-2:] == ["50%", "80%"]
    assert "of ring limit: the same over the ring copy limit's" in "\n".join(lines)
    assert "of ring limit" not in format_results(results, copy)


def test_copy_limit_table_states_buffers_per_process_and_a_failing_ring_limit() -> None:
    text = format_copy_limits([_limit(0.5)], [_limit(0.8, buffers=3)])
    rows = [line.split() for line in text.splitlines() if line.startswith("tiny")]
    assert [row[:5] for row in rows] == [["tiny", "copy", "2", "1", "200.0"], ["tiny", "ring", "2", "3", "125.0"]]
    assert "ceil(ring_slots(N, prefetch_factor=2) / N)" in text
    failed = format_copy_limits([_limit(0.5)], [_limit(0.0, 3, "RuntimeError: ring exploded")])
    assert ["tiny", "ring", "2", "3", "failed"] in [line.split()[:5] for line in failed.splitlines()]
    assert "problems:\n  tiny ring limit round 1: RuntimeError: ring exploded" in failed


def test_json_document_carries_the_ring_limit_beside_the_copy_limit() -> None:
    results = _rounds("shmloader", [1.0])
    doc = to_json_document({}, results, [_limit(0.5)], ring_limits=[_limit(0.8, buffers=3)])
    assert set(doc) == DOCUMENT_KEYS
    (copy_run,) = doc["copy_limit"]["runs"]
    assert copy_run["buffers_per_process"] == 1 and copy_run["batches_per_s"] == pytest.approx(200)
    ring = doc["ring_copy_limit"]
    assert ring["prefetch_factor"] == 2 and [r["buffers_per_process"] for r in ring["runs"]] == [3]
    (ring_summary,) = ring["summaries"]
    assert ring_summary["buffers_per_process"] == 3 and ring_summary["batches_per_s"]["median"] == pytest.approx(125)
    (shm,) = doc["summaries"]
    assert shm["copy_limit_fraction"] == pytest.approx(0.5) and shm["ring_limit_fraction"] == pytest.approx(0.8)


def _stub_loaders(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every loader measurement becomes 20 batches in 1 s, so that only the limits run for real."""

    def fake_measure(name: str, workload: Any, num_workers: int, opts: Any, r: int, position: int) -> Measurement:
        return Measurement(workload.name, num_workers, name, workload.batch_size, workload.batch_bytes, 20,
                           1.0, 0.01, 0, None, 0.01, r, position)  # fmt: skip

    monkeypatch.setattr(bench, "measure", fake_measure)


@pytest.mark.timeout(120)
def test_a_failing_ring_limit_is_reported_like_a_failing_copy_limit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stub_loaders(monkeypatch)
    real = copylimit._run_processes

    def ring_fails(workload: Any, processes: int, per_process: int, start_method: str, buffers: int,
                   shm_dir: str | None) -> Any:  # fmt: skip
        if buffers > 1:
            raise RuntimeError("ring exploded")
        return real(workload, processes, per_process, start_method, buffers, shm_dir)

    monkeypatch.setattr(copylimit, "_run_processes", ring_fails)
    rc = bench.main(["--workloads", "tiny", "--batches", "5", "--workers", "1", "--no-torch", "--json",
                     "--repeat", "1"])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 1 and count_children() == 0
    doc = json.loads(out)
    assert [r["error"] for r in doc["copy_limit"]["runs"]] == [None]
    (ring_run,) = doc["ring_copy_limit"]["runs"]
    assert ring_run["error"] == "RuntimeError: ring exploded" and ring_run["buffers_per_process"] == 4
    assert ring_run["memory"] == "shared" and doc["copy_limit"]["runs"][0]["memory"] == "private"
    (ring,) = doc["ring_copy_limit"]["summaries"]
    assert ring["failed_rounds"] == 1 and ring["batches_per_s"] is None
    (shm,) = doc["summaries"]
    assert shm["copy_limit_fraction"] > 0 and shm["ring_limit_fraction"] is None
    assert "tiny ring limit round 1: RuntimeError: ring exploded" in err


@pytest.mark.parametrize(("flags", "buffers"), [((), [(1, False), (4, True)] * 2), (("--no-copy-limit",), [])])
def test_each_round_measures_both_limits_unless_no_copy_limit(
    flags: tuple[str, ...], buffers: list[tuple[int, bool]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stub_loaders(monkeypatch)
    calls: list[tuple[int, bool]] = []  # (buffers, shared): the ring limit's in shared memory, the copy limit's not

    def fake_limit(workload: Any, processes: int, batches: int, start_method: str, round_index: int = 0,
                   buffers: int = 1, shared: bool = False) -> CopyLimitRun:  # fmt: skip
        calls.append((buffers, shared))
        return CopyLimitRun(workload.name, processes, workload.batch_bytes, 10, 0.1, round_index, None, buffers)

    monkeypatch.setattr(bench, "measure_copy_limit", fake_limit)
    rc = bench.main(["--workloads", "tiny", "--workers", "1", "--no-torch", "--json", "--repeat", "2", *flags])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert rc == 0 and calls == buffers
    assert [r["buffers_per_process"] for r in doc["ring_copy_limit"]["runs"]] == [b for b, _ in buffers[1::2]]
    assert len(doc["copy_limit"]["runs"]) == len(buffers) // 2
    assert ("of ring limit" in err) == bool(buffers)


def _killed_before_unlink(self: Any) -> None:
    """A copy-limit process killed between a segment's creation and its unlink (a Ctrl-C's SIGKILL
    from the main process, or the OOM killer): the segment's name stays in the directory."""
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_process_killed_before_it_unlinks_its_segment_leaves_no_segment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setattr(Segment, "unlink", _killed_before_unlink)  # inherited by the forked process
    run = measure_copy_limit(WORKLOADS["tiny"], processes=1, batches=5, start_method="fork", buffers=2,
                             shared=True, shm_dir=str(tmp_path))  # fmt: skip
    assert run.error is not None and "exited with code -9" in run.error
    assert list(tmp_path.iterdir()) == [] and count_children() == 0
