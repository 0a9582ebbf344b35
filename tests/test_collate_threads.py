"""shmloader.collate.threads: large stacks split over threads when num_workers=0 (issue 16).

Bit-identical results, the threshold below which no pool exists, errors as single-threaded, a
forked child's own pool, the ``collate_threads`` option, and workers that never use the pool."""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.collate import (
    CollateShapeError,
    collate,
    register_collate_rule,
    threads,
    unregister_collate_rule,
)
from shmloader.collate.helpers import join_all
from shmloader.collate.rules import stack_into, write_array
from shmloader.collate.threads import (
    SPLIT_MIN_BYTES,
    ThreadedStack,
    resolve_threads,
    stack_for,
)
from shmloader.config import resolve_config
from shmloader.errors import ConfigError

SAMPLE_SHAPE = (512, 512)  # float32: 1 MiB a sample
BIG_BATCH = max(2, -(-SPLIT_MIN_BYTES // (4 * 512 * 512)))  # samples in a batch of at least the threshold


class ArrayDataset:
    """Distinct float32 samples, each ``shape``, filled with its index."""

    def __init__(self, length: int, shape: tuple[int, ...] = SAMPLE_SHAPE) -> None:
        self.length, self.shape = length, shape

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return np.full(self.shape, index, np.float32)


def _helpers_alive() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("shmloader-collate"))


@pytest.fixture
def no_pool() -> None:
    """Start with no helper thread alive (stacks that earlier tests dropped may have left some)."""
    join_all()


@pytest.fixture
def chunks(monkeypatch) -> list[tuple[str, int]]:
    """Record each ``stack_into`` call of the threads module: (thread name, samples). A stack left
    to one thread is one call of the whole batch on the calling thread."""
    seen: list[tuple[str, int]] = []

    def recording(batch: Any, out: np.ndarray) -> np.ndarray:
        seen.append((threading.current_thread().name, len(batch)))
        return stack_into(batch, out)

    monkeypatch.setattr(threads, "stack_into", recording)
    return seen


# -- the same bits as one thread ---------------------------------------------------------------


def _samples(case: str) -> list[np.ndarray]:
    rng = np.random.default_rng(16)
    if case == "float32":
        return [rng.standard_normal((33, 17)).astype(np.float32) for _ in range(9)]
    if case == "uint8 image":
        return [rng.integers(0, 256, (24, 24, 3), dtype=np.uint8) for _ in range(8)]
    if case == "float64 with nan and -0":
        return [np.array([np.nan, -0.0, np.inf, i]) for i in range(7)]
    if case == "complex128":
        return [rng.standard_normal(5) + 1j * rng.standard_normal(5) for _ in range(6)]
    if case == "bool":
        return [rng.integers(0, 2, (4, 4)).astype(bool) for _ in range(5)]
    if case == "non-contiguous":  # transposed and strided views
        return [rng.standard_normal((12, 20))[::2, ::3].T for _ in range(8)]
    if case == "fortran order":
        return [np.asfortranarray(rng.standard_normal((6, 7))) for _ in range(5)]
    if case == "0-d":  # out is 1-d: np.stack, not the concatenate trick
        return [np.array(float(i)) for i in range(6)]
    if case == "fewer samples than threads":
        return [rng.standard_normal((8, 8)) for _ in range(2)]
    raise AssertionError(case)


CASES = ["float32", "uint8 image", "float64 with nan and -0", "complex128", "bool", "non-contiguous",
         "fortran order", "0-d", "fewer samples than threads"]


@pytest.mark.parametrize("case", CASES)
def test_threaded_stack_equals_the_single_threaded_one_bit_for_bit(case, chunks) -> None:
    batch = _samples(case)
    expected = np.empty((len(batch), *batch[0].shape), batch[0].dtype)
    stack_into(batch, expected)
    out = np.empty_like(expected)
    assert ThreadedStack(4, min_bytes=0)(batch, out) is out
    assert out.tobytes() == expected.tobytes()
    parts = min(4, len(batch))  # fewer samples than threads: one chunk each
    sizes = [len(batch) * (k + 1) // parts - len(batch) * k // parts for k in range(parts)]
    assert sorted(n for _, n in chunks) == sorted(sizes)


def test_collate_with_a_threaded_stack_equals_default_collate() -> None:
    rng = np.random.default_rng(3)
    batch = [{"image": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), "x": rng.standard_normal(4),
              "label": i, "mixed": np.arange(3, dtype=np.int32) if i % 2 else np.ones(3)} for i in range(7)]
    expected = collate(batch)
    got = collate(batch, stack=ThreadedStack(3, min_bytes=0))
    assert set(got) == set(expected)
    for key in expected:
        assert got[key].dtype == expected[key].dtype and got[key].tobytes() == expected[key].tobytes()


# -- the threshold -----------------------------------------------------------------------------


def test_below_the_threshold_no_pool_is_made(no_pool, chunks) -> None:
    stack = ThreadedStack(4)
    tiny = [np.ones(16, np.float32) for _ in range(64)]  # 4 KiB, the tiny workload
    assert collate(tiny, stack=stack).shape == (64, 16)
    image = [np.zeros((224, 224, 3), np.uint8) for _ in range(64)]  # 9.2 MiB, the image workload
    assert collate(image, stack=stack).shape == (64, 224, 224, 3)
    assert stack.pool.threads == [] and _helpers_alive() == [] and chunks == [("MainThread", 64)] * 2


def test_the_threshold_is_on_out_nbytes(no_pool, chunks) -> None:
    batch = [np.ones(100, np.uint8) for _ in range(4)]  # 400 bytes
    below, at = ThreadedStack(2, min_bytes=401), ThreadedStack(2, min_bytes=400)
    below(batch, np.empty((4, 100), np.uint8))
    assert below.pool.threads == [] and chunks == [("MainThread", 4)]
    at(batch, np.empty((4, 100), np.uint8))
    assert len(at.pool.threads) == 1 and sorted(n for _, n in chunks[1:]) == [2, 2]


def test_one_thread_or_one_sample_stays_on_the_calling_thread(no_pool, chunks) -> None:
    assert stack_for(1) is threads.stack_into and isinstance(stack_for(2), ThreadedStack)
    ThreadedStack(1, min_bytes=0)([np.ones(4)] * 4, np.empty((4, 4)))
    ThreadedStack(4, min_bytes=0)([np.ones(4)], np.empty((1, 4)))
    assert _helpers_alive() == [] and chunks == [("MainThread", 4), ("MainThread", 1)]


# -- errors as single-threaded -----------------------------------------------------------------


def _error(batch: list[np.ndarray], stack: Any) -> BaseException:
    with pytest.raises(BaseException) as info:
        collate(batch, stack=stack)
    return info.value


@pytest.mark.parametrize("bad", ["one sample, in the last chunk", "a whole chunk", "first length",
                                 "number of dimensions"])
def test_a_shape_mismatch_in_a_chunk_raises_what_one_thread_raises(bad) -> None:
    batch: list[np.ndarray] = [np.zeros((4, 5), np.float32) for _ in range(8)]
    if bad == "one sample, in the last chunk":
        batch[7] = np.zeros((4, 6), np.float32)
    elif bad == "a whole chunk":  # the chunk is consistent in itself, not with out
        batch[6:] = [np.zeros((4, 6), np.float32)] * 2
    elif bad == "first length":
        batch[5] = np.zeros((3, 5), np.float32)
    else:
        batch[6] = np.zeros((4, 5, 1), np.float32)
    single = _error(batch, None)
    threaded = _error(batch, ThreadedStack(4, min_bytes=0))
    assert type(threaded) is type(single) is CollateShapeError
    assert str(threaded) == str(single)
    assert (threaded.shapes, threaded.entries) == (single.shapes, single.entries)  # type: ignore[attr-defined]


def test_a_helper_chunk_exception_is_raised_unchanged(monkeypatch) -> None:
    boom = OSError("chunk failed")
    batch = [np.full(3, i) for i in range(6)]

    def failing_after_the_first(chunk: Any, out: np.ndarray) -> np.ndarray:
        if chunk[0][0] != 0:
            raise boom
        return stack_into(chunk, out)

    monkeypatch.setattr(threads, "stack_into", failing_after_the_first)
    with pytest.raises(OSError) as info:
        ThreadedStack(3, min_bytes=0)(batch, np.empty((6, 3), int))
    assert info.value is boom


# -- the pool: threads, fork -------------------------------------------------------------------


def test_pool_threads_are_named_daemons_of_this_process(no_pool) -> None:
    stack = ThreadedStack(3, min_bytes=0)
    stack([np.ones(8)] * 6, np.empty((6, 8)))
    pool = stack.pool
    assert pool.owner.here
    assert [t.name for t in pool.threads] == ["shmloader-collate-1", "shmloader-collate-2"]
    assert all(t.daemon and t.is_alive() for t in pool.threads)
    helpers = list(pool.threads)
    stack([np.ones(8)] * 2, np.empty((2, 8)))
    assert pool.threads == helpers  # the stack's own pool, grown only as needed
    stack.close()
    assert _helpers_alive() == [] and not any(t.is_alive() for t in helpers)


def _collate_in_forked_child(conn: Any, inherited: ThreadedStack, parent_pid: int) -> None:
    try:
        out = inherited([np.full(8, i) for i in range(4)], np.empty((4, 8), int))
        alive = _helpers_alive()
        inherited.close()
        loader: shmloader.DataLoader[Any] = shmloader.DataLoader(ArrayDataset(BIG_BATCH), batch_size=BIG_BATCH,
                                                                 collate_threads=2)
        (batch,) = list(loader)
        conn.send({
            "right": bool(np.array_equal(batch, np.stack([np.full(SAMPLE_SHAPE, i, np.float32)
                                                           for i in range(BIG_BATCH)])))
            and out[:, 0].tolist() == [0, 1, 2, 3],
            "own pool": inherited.pool.owner.pid == os.getpid() != parent_pid,
            "alive": alive,
            "after": _helpers_alive(),
        })
    except BaseException as exc:  # reported to the test, not lost in the child's stderr
        conn.send({"error": repr(exc)})
    finally:
        conn.close()


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # another's fork, on purpose
def test_a_forked_child_makes_its_own_pool_and_collates_big_batches() -> None:
    stack = ThreadedStack(2, min_bytes=0)
    stack([np.ones(8)] * 4, np.empty((4, 8)))  # the parent's helper runs as another's fork copies it
    parent_helpers = list(stack.pool.threads)
    assert stack.pool.owner.here and len(parent_helpers) == 1
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_collate_in_forked_child, args=(send, stack, os.getpid()))
    child.start()
    send.close()
    try:
        assert receive.poll(50), "the forked child did not answer in 50 s"
        report = receive.recv()
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join()
    assert report == {"right": True, "own pool": True, "alive": ["shmloader-collate-1"], "after": []}
    assert child.exitcode == 0
    assert stack.pool.owner.here and stack.pool.threads == parent_helpers  # the parent's, untouched
    stack.close()


# -- collate_threads: config, loader, iterator -------------------------------------------------


def test_collate_threads_from_the_environment_and_as_an_argument() -> None:
    config = resolve_config({}, {"SHMLOADER_COLLATE_THREADS": "3"})
    assert (config.collate_threads, config.provenance["collate_threads"]) == (3, "environment")
    config = resolve_config({"collate_threads": np.int64(1)}, {"SHMLOADER_COLLATE_THREADS": "3"})
    assert (config.collate_threads, config.provenance["collate_threads"]) == (1, "argument")
    assert type(config.collate_threads) is int
    assert resolve_config({}, {}).collate_threads == 0


@pytest.mark.parametrize("raw, what", [("-1", "is out of range"), ("two", "is not an integer"),
                                       ("1.5", "is not an integer"), (" ", "is empty")])
def test_a_bad_variable_names_the_variable(raw, what) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config({}, {"SHMLOADER_COLLATE_THREADS": raw})
    assert str(info.value).startswith(f"SHMLOADER_COLLATE_THREADS={raw!r} {what} (expected an integer from 0 to 256)")
    assert info.value.name == "SHMLOADER_COLLATE_THREADS"


@pytest.mark.parametrize("value, what", [(-1, "is out of range"), (1.5, "is not an integer"),
                                         ("2", "is not an integer"), (True, "is not an integer")])
def test_a_bad_argument_names_the_argument(value, what) -> None:
    message = f"collate_threads={value!r} {what} (expected an integer from 0 to 256)"
    for loader_class in (shmloader.DataLoader, pytest.importorskip("shmloader.torch").DataLoader):
        with pytest.raises(ConfigError) as info:
            loader_class(ArrayDataset(2), collate_threads=value)
        assert str(info.value) == message and info.value.name == "collate_threads"


def test_auto_is_at_most_four_usable_cpus() -> None:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    assert resolve_threads(0) == max(1, min(4, cpus))
    assert resolve_threads(3) == 3 and resolve_threads(1) == 1


def test_the_torch_flavour_takes_and_keeps_collate_threads(no_pool, chunks) -> None:
    torch_flavour = pytest.importorskip("shmloader.torch")
    loader = torch_flavour.DataLoader(ArrayDataset(BIG_BATCH), batch_size=BIG_BATCH, collate_threads=2)
    assert loader.collate_threads == 2
    assert torch_flavour.init_kwargs(loader)["collate_threads"] == 2
    (batch,) = list(loader)
    assert batch.shape == (BIG_BATCH, *SAMPLE_SHAPE) and float(batch[-1, 0, 0]) == BIG_BATCH - 1
    assert len(chunks) == 2  # torch mode's numpy arrays are split too


def test_num_workers_0_splits_big_batches_over_collate_threads(no_pool, chunks, monkeypatch) -> None:
    monkeypatch.setenv("SHMLOADER_COLLATE_THREADS", "2")
    it = iter(shmloader.DataLoader(ArrayDataset(BIG_BATCH), batch_size=BIG_BATCH))
    assert isinstance(it._stack, ThreadedStack) and it._stack.threads == 2  # type: ignore[attr-defined]
    batch = next(it)
    assert np.array_equal(batch[:, 0, 0], np.arange(BIG_BATCH, dtype=np.float32))
    assert len(chunks) == 2 and len(it._stack.pool.threads) == 1  # type: ignore[attr-defined]


def test_collate_threads_1_stays_single_threaded(no_pool, chunks) -> None:
    it = iter(shmloader.DataLoader(ArrayDataset(BIG_BATCH), batch_size=BIG_BATCH, collate_threads=1))
    assert it._stack is threads.stack_into  # type: ignore[attr-defined]
    batch = next(it)
    assert np.array_equal(batch[:, 0, 0], np.arange(BIG_BATCH, dtype=np.float32))
    assert _helpers_alive() == [] and chunks == [("MainThread", BIG_BATCH)]


class Probe:
    """A sample whose rule reports how its process stacks."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


class ProbeDataset(ArrayDataset):
    def __getitem__(self, index: int) -> Any:
        return Probe(super().__getitem__(index))


def _probe_rule(batch: Any, ctx: Any) -> Any:
    array = ctx.collate([p.array for p in batch], ".array")
    helpers = ctx.stack.pool.threads if isinstance(ctx.stack, ThreadedStack) else []
    flags = np.array([ctx.stack is stack_into, bool(helpers) and ctx.stack.pool.owner.here,
                      bool(_helpers_alive())])
    return {"array": array, "flags": write_array(flags, ctx)}


@pytest.mark.timeout(90)
def test_workers_stack_with_one_thread_and_never_use_the_pool(no_pool) -> None:
    register_collate_rule(Probe, _probe_rule)
    try:
        in_process = [batch["flags"].tolist() for batch in
                      shmloader.DataLoader(ProbeDataset(BIG_BATCH), batch_size=BIG_BATCH, collate_threads=2)]
        # the workers fork from a process whose helpers ran: they must not use them
        loader: shmloader.DataLoader[Any] = shmloader.DataLoader(ProbeDataset(2 * BIG_BATCH), batch_size=BIG_BATCH,
                                                                 num_workers=2, multiprocessing_context="fork",
                                                                 collate_threads=2)
        flags = [(batch["flags"].tolist(), float(batch["array"][-1, 0, 0])) for batch in loader]
    finally:
        unregister_collate_rule(Probe)
    assert flags == [([True, False, False], BIG_BATCH - 1.0), ([True, False, False], 2 * BIG_BATCH - 1.0)]
    assert in_process == [[False, True, True]]
