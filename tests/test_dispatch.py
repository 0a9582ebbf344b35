"""Which worker runs which task (the ``dispatch`` option, shmloader/engine/send.py and dispatch.py).

``round_robin`` (the default) is torch's assignment: task t of an epoch goes to worker
t % num_workers, so a dataset that draws random numbers in ``__getitem__`` gives exactly torch's
batches, whatever the timing; ``least_loaded`` follows the load and is reproducible only with
``task_seeding=True``. The datasets here have uneven costs (a busy loop on some indices), so a
timing-dependent assignment would show.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import warnings
from typing import Any

import numpy as np
import pytest
from parity_helpers import assert_same_structure

import shmloader
from shmloader.engine.dispatch import Dispatcher
from shmloader.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

FORK = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def busy(i: int) -> int:
    """Uneven cost: every 5th sample computes for a while (no sleeping)."""
    total = 0
    if i % 5 == 0:
        for k in range(150_000):
            total += k * k % 7
    return total


class _Busy:
    """n samples of uneven cost (``busy``); a subclass says what sample i is (``sample``)."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        i = int(i)
        busy(i)
        return self.sample(i)

    def sample(self, i: int) -> Any:
        raise NotImplementedError


class Augmented(_Busy):
    """Sample i: (i, random.random(), np.random.rand(), torch.rand(1)), as random augmentation draws.

    Unpickling it imports torch, as a dataset whose module imports torch at the top would.
    ``LazyTorchAugmented`` is the case where it is not: the torch flavour's workers import and seed
    torch anyway, as torch's own workers always have it.
    """

    def __setstate__(self, state: dict[str, Any]) -> None:
        import torch  # noqa: F401

        self.__dict__.update(state)

    def sample(self, i: int) -> Any:
        import torch

        return i, random.random(), float(np.random.rand()), torch.rand(1)


class LazyTorchAugmented(Augmented):
    """``Augmented`` from a module that imports torch only inside ``__getitem__``."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class NumpyAugmented(_Busy):
    """Sample i: [i, a draw of random, a draw of numpy's global RNG]; no torch needed."""

    def sample(self, i: int) -> np.ndarray:
        return np.array([i, random.random(), np.random.rand()])


class WhoRan(_Busy):
    """Sample i: [i, the id of the worker that fetched it]."""

    def __init__(self, n: int = 30) -> None:
        super().__init__(n)

    def sample(self, i: int) -> np.ndarray:
        info = shmloader.get_worker_info()
        return np.array([i, -1 if info is None else info.id])


def run_epochs(loader: Any, epochs: int = 2) -> list[list[Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 3 workers on a 2-core machine warn, as torch's do
        out = [list(loader) for _ in range(epochs)]
    if hasattr(loader, "close"):
        loader.close()
    return out


# -- torch parity ---------------------------------------------------------------------------------

PARITY_CASES = [(FORK, w, p) for w in (2, 3) for p in (True, False)] + [("spawn", 2, True)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method, workers, persistent", PARITY_CASES)
def test_random_augmentation_batches_equal_torch(method: str, workers: int, persistent: bool) -> None:
    torch = pytest.importorskip("torch")
    from shmloader.torch import DataLoader

    def make(cls: Any) -> Any:
        return cls(Augmented(), batch_size=4, shuffle=True, num_workers=workers,
                   generator=torch.Generator().manual_seed(3 + workers), persistent_workers=persistent,
                   multiprocessing_context=method)

    theirs = run_epochs(make(torch.utils.data.DataLoader))
    ours = run_epochs(make(DataLoader))
    assert [len(e) for e in ours] == [10, 10]
    assert_same_structure(ours, theirs, path="epochs")


@pytest.mark.timeout(180)
def test_spawned_worker_seeds_torch_imported_later() -> None:
    torch = pytest.importorskip("torch")
    from shmloader.torch import DataLoader

    def make(cls: Any) -> Any:
        return cls(LazyTorchAugmented(8), batch_size=4, num_workers=1, multiprocessing_context="spawn",
                   generator=torch.Generator().manual_seed(1))

    assert_same_structure(run_epochs(make(DataLoader), 1), run_epochs(make(torch.utils.data.DataLoader), 1))


# -- the assignment itself ------------------------------------------------------------------------


def assert_round_robin(epoch: list[np.ndarray], workers: int, first_task: int = 0) -> None:
    for j, batch in enumerate(epoch):
        ids = np.asarray(batch)[:, 1].tolist()
        assert ids == [(first_task + j) % workers] * len(ids), f"task {first_task + j} ran on {ids}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [2, 3])
def test_task_t_runs_on_worker_t_mod_n_every_epoch(workers: int) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(WhoRan(), batch_size=3, shuffle=True, generator=5,
                                                             num_workers=workers, persistent_workers=True,
                                                             multiprocessing_context=FORK)
    for epoch in run_epochs(loader):
        assert len(epoch) == 10
        assert_round_robin(epoch, workers)


@pytest.mark.timeout(120)
def test_a_resumed_epoch_keeps_the_task_numbers_assignment() -> None:
    def make() -> shmloader.DataLoader:
        return shmloader.DataLoader(WhoRan(), batch_size=3, num_workers=3, multiprocessing_context=FORK)

    loader = make()
    it = iter(loader)
    before = [next(it) for _ in range(4)]
    state = json.loads(json.dumps(loader.state_dict()))
    it.close()
    resumed = make()
    resumed.load_state_dict(state)
    [after] = run_epochs(resumed, epochs=1)
    assert_round_robin(before, 3)
    assert_round_robin(after, 3, first_task=4)
    samples = [int(i) for b in before + after for i in np.asarray(b)[:, 0]]
    assert samples == list(range(30))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [2, 3])
def test_out_of_order_round_robin_delivers_every_batch_once(workers: int) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(WhoRan(61), batch_size=3, shuffle=True, generator=9,
                                                             num_workers=workers, in_order=False,
                                                             persistent_workers=True, multiprocessing_context=FORK)
    for epoch in run_epochs(loader):
        samples = sorted(int(i) for b in epoch for i in np.asarray(b)[:, 0])
        assert samples == list(range(61))
        assert len(epoch) == 21


@pytest.mark.timeout(120)
def test_least_loaded_with_task_seeding_is_reproducible_run_to_run() -> None:
    def run() -> list[list[Any]]:
        loader: shmloader.DataLoader[Any] = shmloader.DataLoader(NumpyAugmented(), batch_size=4, shuffle=True,
                                                                 generator=21, num_workers=3, dispatch="least_loaded",
                                                                 task_seeding=True, persistent_workers=True,
                                                                 multiprocessing_context=FORK)
        assert loader._config.dispatch == "least_loaded"
        return [[np.asarray(b).tolist() for b in epoch] for epoch in run_epochs(loader)]

    first, second = run(), run()
    assert first == second
    assert first[0] != first[1]  # the second epoch draws afresh
    assert sorted(int(row[0]) for b in first[0] for row in b) == list(range(40))


# -- the dispatcher's choice, without processes --------------------------------------------------


def test_in_order_round_robin_waits_for_the_tasks_own_worker() -> None:
    d = Dispatcher(3, 2, mode="round_robin", in_order=True)
    held, exhausted = [2, 0, 1], [False] * 3
    assert d.pick(0, held, exhausted) is None  # task 0 is worker 0's, which is full: wait, do not reassign
    assert d.pick(4, held, exhausted) == 1
    assert d.pick(5, held, exhausted) == 2


def test_out_of_order_round_robin_follows_torchs_cycle_passing_over_full_workers() -> None:
    d = Dispatcher(3, 2, mode="round_robin", in_order=False)
    held, exhausted = [2, 0, 1], [False] * 3
    assert [d.pick(t, held, exhausted) for t in range(2)] == [1, 2]
    held = [2, 2, 2]
    assert d.pick(2, held, exhausted) is None and d.cursor == 0  # every worker full: the cycle is back where it was


def test_least_loaded_picks_the_worker_with_fewest_outstanding() -> None:
    assert Dispatcher(3, 2, mode="least_loaded").pick(0, [2, 1, 0], [False] * 3) == 2
    assert Dispatcher(2, 2, mode="least_loaded").pick(0, [2, 2], [False] * 2) is None


def test_iterable_datasets_are_dealt_round_robin_over_workers_with_data() -> None:
    d = Dispatcher(3, 2, iterable=True)
    assert [d.pick(t, [0, 0, 0], [False, True, False]) for t in range(3)] == [0, 2, 0]
    assert d.pick(3, [0, 0, 0], [True, True, True]) is None
    # torch's total (_try_put_index): prefetch x workers, less each task dealt after a share's end
    assert d.capacity([False, True, False]) == 6
    d.passed_over()
    assert d.capacity([False, True, False]) == 5 and d.capacity([True, True, True]) == 0
    d.reset()
    assert d.capacity([False, True, False]) == 6
    assert d.limit([False, True, False]) == 3 and d.limit([False] * 3) == 2  # shared among the workers left


def test_a_skipped_task_takes_its_turn_in_the_cycle() -> None:
    d = Dispatcher(3, 2, mode="round_robin", in_order=False)
    d.skip()
    assert d.pick(1, [0, 0, 0], [False] * 3) == 1  # as if task 0 had gone to worker 0
    d.reset()
    assert d.cursor == 0


# -- configuration --------------------------------------------------------------------------------


def test_default_is_round_robin() -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(WhoRan(), batch_size=3)
    assert loader._config.dispatch == "round_robin"
    assert loader._config.provenance["dispatch"] == "default"


def test_environment_variable_sets_it_and_an_argument_beats_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMLOADER_DISPATCH", "least_loaded")
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(WhoRan(), batch_size=3)
    assert loader._config.dispatch == "least_loaded"
    assert loader._config.provenance["dispatch"] == "environment"
    loader = shmloader.DataLoader(WhoRan(), batch_size=3, dispatch="round_robin")
    assert loader._config.dispatch == "round_robin"
    assert loader._config.provenance["dispatch"] == "argument"


def test_bad_environment_value_names_the_variable_and_the_accepted_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMLOADER_DISPATCH", "fastest")
    with pytest.raises(ConfigError) as info:
        shmloader.DataLoader(WhoRan(), batch_size=3)
    assert str(info.value) == ("SHMLOADER_DISPATCH='fastest' is not a dispatch policy "
                               "(expected one of round_robin, least_loaded)")
    assert info.value.name == "SHMLOADER_DISPATCH"
    # an explicit argument wins over a good value, but a bad one is a mistake all the same (docs/config.md)
    with pytest.raises(ConfigError, match="SHMLOADER_DISPATCH='fastest'"):
        shmloader.DataLoader(WhoRan(), batch_size=3, dispatch="least_loaded")
    monkeypatch.setenv("SHMLOADER_DISPATCH", "round_robin")
    assert shmloader.DataLoader(WhoRan(), batch_size=3, dispatch="least_loaded")._config.dispatch == "least_loaded"


def test_bad_argument_names_the_argument() -> None:
    with pytest.raises(ConfigError, match=r"^dispatch='fifo' is not a dispatch policy \(expected one of "
                                          r"round_robin, least_loaded\)") as info:
        shmloader.DataLoader(WhoRan(), batch_size=3, dispatch="fifo")
    assert info.value.name == "dispatch"


@pytest.mark.timeout(120)
def test_least_loaded_from_the_environment_delivers_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMLOADER_DISPATCH", "least_loaded")
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(WhoRan(), batch_size=3, num_workers=2,
                                                             multiprocessing_context=FORK)
    [epoch] = run_epochs(loader, epochs=1)
    assert [int(i) for b in epoch for i in np.asarray(b)[:, 0]] == list(range(30))


def test_a_task_keeps_its_own_copy_of_a_batch_that_could_change():
    from shmloader.engine.dispatch import task_indices

    listed, array = [3, 1], np.array([4, 2])
    kept = [task_indices(listed), task_indices(array)]
    assert [type(k) for k in kept] == [list, np.ndarray] and kept[0] is not listed and kept[1] is not array
    listed[0] = array[0] = 99  # refilled by its sampler: the tasks' copies do not move
    assert kept[0] == [3, 1] and kept[1].tolist() == [4, 2]
    fixed = (5, 6), range(2, 4)
    assert all(task_indices(b) is b for b in fixed)  # cannot change: kept as they are
    assert task_indices(i for i in (7, 8)) == [7, 8]  # one pass: a list, which can be sent again


def test_out_of_order_iterable_passes_over_full_and_exhausted_workers_as_torch_does() -> None:
    d = Dispatcher(3, 2, in_order=False, iterable=True)
    held, exhausted = [2, 0, 1], [False, False, False]
    assert [d.pick(t, held, exhausted) for t in range(2)] == [1, 2]  # worker 0 is full: passed over
    # worker 1's share ended: torch lets a worker take 3 (prefetch x 3 // 2 workers left)
    assert d.pick(2, [2, 2, 0], [False, True, False]) == 0
    assert d.pick(3, [3, 2, 0], [False, True, False]) == 2
    assert d.pick(3, [2, 2, 2], [False, False, False]) is None and d.cursor == 0  # all full: cycle unchanged



def test_a_worker_passed_over_keeps_its_per_task_seeds() -> None:
    """With in_order=False an iterable dataset's task numbers follow timing (a full worker is passed
    over), but per-task seeding numbers each worker's k-th task k * num_workers + w all the same."""
    d = Dispatcher(3, 2, in_order=False, iterable=True)
    held, seeds = [0, 0, 0], []

    def send(task: int) -> None:
        w = d.pick(task, held, [False] * 3)
        assert w is not None
        held[w] += 1
        seeds.append((task, w, d.deal(w)))

    for t in range(6):  # iter(): two tasks each, round-robin
        send(t)
    held[1] = held[2] = 0  # workers 1 and 2 answered both; worker 0 is slow: passed over
    for t in range(6, 10):
        send(t)
    held[0] = 1  # worker 0 answered one: its third task
    send(10)
    assert seeds[:6] == [(t, t % 3, t) for t in range(6)]
    assert seeds[6:] == [(6, 1, 7), (7, 2, 8), (8, 1, 10), (9, 2, 11), (10, 0, 6)]
