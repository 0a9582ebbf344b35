"""Resumable iteration (shmloader/state.py): save anywhere in an epoch, continue in a new process.

The property under test: batches delivered before the save + batches delivered by a fresh loader
(in a NEW process, from the JSON state) == an uninterrupted epoch — for every save point, with
0..3 workers before and a different count after, shuffling, and per-task seeding of np.random.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.state import STATE_VERSION, StateError, TaskSet

N, BATCH = 23, 3  # 8 tasks per epoch, the last one partial
TASKS = -(-N // BATCH)
TESTS = str(Path(__file__).resolve().parent)


class Noisy(shmloader.Dataset):
    """Sample i is [i, a draw from numpy's global RNG]: equal across runs only under per-task seeding."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, np.random.randint(1 << 30)], dtype=np.int64)


class Stream(shmloader.IterableDataset):
    """An iterable dataset, sharded across workers, with per-task-seeded noise."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = shmloader.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(first, self.n, step):
            yield np.array([i, np.random.randint(1 << 30)], dtype=np.int64)


def make_loader(spec: dict[str, Any]) -> shmloader.DataLoader:
    """One loader configuration, built the same way in the saving and the resuming process."""
    workers = spec.get("workers", 0)
    kw: dict[str, Any] = {"batch_size": spec.get("batch_size", BATCH), "num_workers": workers,
                          "task_seeding": spec.get("task_seeding", True), "in_order": spec.get("in_order", True)}
    if workers:
        kw["multiprocessing_context"] = spec.get("context", "fork")
        kw["persistent_workers"] = spec.get("persistent", False)
    if spec.get("iterable"):
        return shmloader.DataLoader(Stream(spec.get("n", N)), generator=7, **kw)  # a fixed base seed
    gen = spec.get("gen", "int")
    if gen == "torch":
        import torch

        kw["generator"] = torch.Generator().manual_seed(11)
    elif gen == "none":
        import torch

        torch.manual_seed(spec.get("torch_seed", 13))
    else:
        kw["generator"] = 7
    return shmloader.DataLoader(Noisy(spec.get("n", N)), shuffle=True, **kw)


def batches(loader_or_iter: Any, limit: int | None = None) -> list[list[list[int]]]:
    out = []
    for batch in loader_or_iter:
        out.append(np.asarray(batch).tolist())
        if limit is not None and len(out) == limit:
            break
    return out


def epochs(spec: dict[str, Any], count: int = 1) -> list[list[list[list[int]]]]:
    with quiet():
        loader = make_loader(spec)
        result = [batches(loader) for _ in range(count)]
        loader.close()
    return result


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """3 workers on a 2-core machine warn, as torch does; that is not what these tests check."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def save_at(spec: dict[str, Any], k: int, full_epochs: int = 0) -> tuple[list[Any], dict[str, Any]]:
    """Run ``full_epochs`` epochs, then ``k`` batches of the next; return those k batches and the JSON state."""
    with quiet():
        loader = make_loader(spec)
        for _ in range(full_epochs):
            batches(loader)
        it = iter(loader)
        before = batches(it, k) if k else []
        state = json.loads(json.dumps(loader.state_dict()))
        assert state == json.loads(json.dumps(it.state_dict()))
        loader.close()
        del it
    return before, state


# -- the new process ---------------------------------------------------------------------------
def child_main() -> None:
    """In a fresh interpreter: for each case, a new loader loads the state and runs to the end."""
    cases = json.load(sys.stdin)
    out = []
    for case in cases:
        with quiet():
            loader = make_loader(case["spec"])
            loader.load_state_dict(case["state"])
            out.append([batches(loader) for _ in range(case.get("epochs", 1))])
            loader.close()
    json.dump(out, sys.stdout)


def resume_in_new_process(cases: list[dict[str, Any]]) -> list[Any]:
    code = f"import sys; sys.path.insert(0, {TESTS!r}); import test_resume; test_resume.child_main()"
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=150, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


# -- the sweep ---------------------------------------------------------------------------------
SAVE_POINTS = [0, 1, 4, TASKS - 1, TASKS]  # right after start, middle, right before the end, all delivered
WORKER_PAIRS = [(0, 2), (1, 3), (2, 0), (3, 1), (2, 2)]  # (before, after): mostly a different count


def test_per_task_seeding_makes_the_epoch_independent_of_num_workers() -> None:
    reference = epochs({"workers": 0})[0]
    assert len(reference) == TASKS and sorted(r[0] for b in reference for r in b) == list(range(N))
    for workers in (1, 2, 3):
        assert epochs({"workers": workers})[0] == reference


@pytest.mark.timeout(300)
def test_save_anywhere_resume_in_a_new_process_with_other_worker_counts() -> None:
    reference = epochs({"workers": 0})[0]
    saved, cases = [], []
    for before_w, after_w in WORKER_PAIRS:
        for k in SAVE_POINTS:
            before, state = save_at({"workers": before_w}, k)
            assert state["version"] == STATE_VERSION and state["in_progress"]
            assert state["delivered"] == ([[0, k]] if k else [])
            saved.append((before_w, after_w, k, before))
            cases.append({"spec": {"workers": after_w}, "state": state})
    for (before_w, after_w, k, before), (after,) in zip(saved, resume_in_new_process(cases)):
        assert before + after == reference, f"saved after {k} batches with {before_w} workers, resumed with {after_w}"


@pytest.mark.timeout(240)
def test_resume_continues_later_epochs_and_saves_between_epochs() -> None:
    reference = epochs({"workers": 2}, 3)
    assert reference[0] != reference[1]
    cases, expected = [], []
    for k in (2, TASKS - 1):
        before, state = save_at({"workers": 2}, k, full_epochs=1)
        assert state["epoch"] == 1
        cases.append({"spec": {"workers": 1}, "state": state, "epochs": 2})
        expected.append((before, [reference[1][k:], reference[2]]))
    _, boundary = save_at({"workers": 0}, 0, full_epochs=1)
    boundary_loader = make_loader({"workers": 0})
    batches(boundary_loader)  # an epoch finished: the state now stands at the start of the next
    between = json.loads(json.dumps(boundary_loader.state_dict()))
    assert between["epoch"] == 1 and not between["in_progress"] and between["delivered"] == []
    cases.append({"spec": {"workers": 2}, "state": between, "epochs": 2})
    expected.append(([], reference[1:]))
    for (before, after), got in zip(expected, resume_in_new_process(cases)):
        assert [before + got[0], *got[1:]] == [before + after[0], *after[1:]]
    assert boundary["in_progress"] and boundary["epoch"] == 1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("in_order_after", [False, True])
def test_in_order_false_resume_is_exact_by_delivered_task_set(in_order_after: bool) -> None:
    reference = epochs({"workers": 0})[0]
    task_of = {tuple(map(tuple, b)): t for t, b in enumerate(reference)}
    cases, befores = [], []
    for k in (1, 3, 5):
        before, state = save_at({"workers": 3, "in_order": False}, k)
        delivered = TaskSet.from_ranges(state["delivered"])
        assert sorted(task_of[tuple(map(tuple, b))] for b in before) == [t for t in range(TASKS) if t in delivered]
        befores.append(before)
        cases.append({"spec": {"workers": 2, "in_order": in_order_after}, "state": state})
    for before, (after,) in zip(befores, resume_in_new_process(cases)):
        assert sorted(before + after) == sorted(reference) and len(before + after) == TASKS
        if in_order_after:
            skipped = {task_of[tuple(map(tuple, b))] for b in before}
            assert after == [b for t, b in enumerate(reference) if t not in skipped]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_dataset_is_fast_forwarded(workers: int) -> None:
    spec = {"iterable": True, "workers": workers}
    reference = epochs(spec)[0]
    cases, befores = [], []
    for k in (0, 2, len(reference) - 1):
        before, state = save_at(spec, k)
        assert state["yielded"] == k and state["config"]["iterable"]
        befores.append(before)
        cases.append({"spec": spec, "state": state})
    for before, (after,) in zip(befores, resume_in_new_process(cases)):
        assert before + after == reference


@pytest.mark.timeout(120)
def test_spawn_and_persistent_workers_resume() -> None:
    reference = epochs({"workers": 2, "persistent": True}, 2)  # epoch 1 reuses epoch 0's base seed, as torch
    before, state = save_at({"workers": 2, "context": "spawn"}, 3)
    with quiet():
        loader = make_loader({"workers": 2, "persistent": True})
        batches(loader, 1)  # the live iterator is replaced: load_state_dict restarts the workers
        loader.load_state_dict(state)
        after = [batches(loader), batches(loader)]
        loader.close()
    assert before + after[0] == reference[0]
    assert after[1] == reference[1]


# -- torch random sources ------------------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("gen", ["torch", "none"])
def test_torch_generator_and_global_rng(gen: str) -> None:
    pytest.importorskip("torch")
    reference = epochs({"workers": 0, "gen": gen}, 2)
    assert sorted(r[0] for b in reference[0] for r in b) == list(range(N))
    cases, befores = [], []
    for k in (0, 3):
        before, state = save_at({"workers": 2, "gen": gen}, k)
        assert (state["random"]["torch_global"] is not None) and (bool(state["random"]["sources"]) == (gen == "torch"))
        befores.append(before)
        # the resuming process seeds torch differently: the state, not the caller's RNG, makes the order
        cases.append({"spec": {"workers": 1, "gen": gen, "torch_seed": 999}, "state": state, "epochs": 2})
    for before, got in zip(befores, resume_in_new_process(cases)):
        assert before + got[0] == reference[0]
        if gen == "torch":  # an explicit generator goes on as if never interrupted
            assert got[1] == reference[1]


def test_resuming_leaves_the_callers_global_torch_rng_alone() -> None:
    torch = pytest.importorskip("torch")
    reference = epochs({"workers": 0, "gen": "none"})[0]
    before, state = save_at({"workers": 0, "gen": "none"}, 2)
    loader = make_loader({"workers": 0, "gen": "none", "torch_seed": 5})
    loader.load_state_dict(state)
    caller = torch.get_rng_state()
    it = iter(loader)
    after = [np.asarray(next(it)).tolist()]
    assert torch.equal(torch.get_rng_state(), caller)
    assert before + after + batches(it) == reference


# -- samplers and datasets with their own state -------------------------------------------------
class CountingSampler(shmloader.Sampler):
    """A stateful sampler: each pass starts where the previous ended (its state is that offset)."""

    def __init__(self, n: int) -> None:
        self.n, self.offset = n, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        start, self.offset = self.offset, self.offset + 5
        return iter([(start + i) % self.n for i in range(self.n)])

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.offset = state["offset"]


class Scaled(Noisy):
    def __init__(self, n: int = N) -> None:
        super().__init__(n)
        self.scale = 1

    def __getitem__(self, i: int) -> np.ndarray:
        return super().__getitem__(i) * self.scale

    def state_dict(self) -> dict[str, int]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.scale = state["scale"]


def _stateful(workers: int) -> shmloader.DataLoader:
    return shmloader.DataLoader(Scaled(), batch_size=BATCH, sampler=CountingSampler(N), num_workers=workers,
                                task_seeding=True, **({"multiprocessing_context": "fork"} if workers else {}))


@pytest.mark.timeout(60)
def test_sampler_and_dataset_state_dicts_are_saved_at_epoch_start() -> None:
    loader = _stateful(0)
    batches(loader)
    loader.dataset.scale = 3
    it = iter(loader)
    before = batches(it, 2)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["objects"] == {"sampler": {"offset": 5}, "dataset": {"scale": 3}}
    rest = batches(it)
    resumed = _stateful(2)
    resumed.load_state_dict(state)
    assert resumed.dataset.scale == 3
    assert batches(resumed) == rest and before[0][0][0] == 3 * 5
    assert isinstance(resumed.sampler, CountingSampler) and isinstance(loader.sampler, CountingSampler)
    assert resumed.sampler.offset == loader.sampler.offset == 10


# -- what a state is, and what it refuses --------------------------------------------------------
def test_task_set_ranges_round_trip() -> None:
    tasks = TaskSet()
    for t in (0, 1, 5, 3, 2, 9, 10):
        tasks.add(t)
    assert tasks.to_ranges() == [[0, 4], [5, 6], [9, 11]] and len(tasks) == 7
    assert tasks.low == 4 and 4 not in tasks and 9 in tasks
    again = TaskSet.from_ranges(tasks.to_ranges())
    assert again.to_ranges() == tasks.to_ranges()
    with pytest.raises(StateError, match="sorted, disjoint"):
        TaskSet.from_ranges([[3, 5], [4, 6]])


def test_state_before_any_epoch_is_the_start_of_epoch_zero() -> None:
    loader = make_loader({"workers": 0})
    state = loader.state_dict()
    assert (state["epoch"], state["in_progress"], state["delivered"]) == (0, False, [])
    json.dumps(state)
    other = make_loader({"workers": 0})
    other.load_state_dict(state)
    assert batches(other) == epochs({"workers": 0})[0]


@pytest.mark.parametrize("change, field", [
    ({"batch_size": 4}, "batch_size"),
    ({"n": 24}, "dataset_len"),
    ({"task_seeding": False}, "task_seeding"),
])
def test_incompatible_configuration_prints_both_sides(change: dict[str, Any], field: str) -> None:
    _, state = save_at({"workers": 0}, 2)
    loader = make_loader({"workers": 0, **change})
    with pytest.raises(StateError) as info:
        loader.load_state_dict(state)
    text = str(info.value)
    assert f"{field}: saved {state['config'][field]!r}, this loader" in text
    assert "saved:       {" in text and "this loader: {" in text
    assert info.value.saved == state["config"] and info.value.current[field] != state["config"][field]


def test_drop_last_sampler_type_and_version_mismatches_are_refused() -> None:
    _, state = save_at({"workers": 0}, 2)
    with pytest.raises(StateError, match=r"(?s)drop_last: saved False, this loader True.*batches_per_epoch"):
        shmloader.DataLoader(Noisy(), batch_size=BATCH, shuffle=True, generator=7, drop_last=True,
                             task_seeding=True).load_state_dict(state)
    with pytest.raises(StateError, match="sampler: saved 'shmloader.samplers.RandomSampler', this loader "
                                         "'shmloader.samplers.SequentialSampler'"):
        shmloader.DataLoader(Noisy(), batch_size=BATCH, task_seeding=True).load_state_dict(state)
    with pytest.raises(StateError, match=f"state version 99 cannot be loaded: this shmloader reads version "
                                         f"{STATE_VERSION}"):
        make_loader({"workers": 0}).load_state_dict({**state, "version": 99})
    with pytest.raises(StateError, match="not a shmloader DataLoader state"):
        make_loader({"workers": 0}).load_state_dict({"epoch": 3})


def test_unserialisable_dataset_state_is_named() -> None:
    class Opaque(Noisy):
        def state_dict(self) -> dict[str, Any]:
            return {"blob": object()}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Opaque(), batch_size=BATCH)
    with pytest.raises(StateError, match="not JSON-serialisable"):
        loader.state_dict()
