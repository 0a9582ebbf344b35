"""DataLoader's argument checks, warnings, len() and immutability, compared with torch's own."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from engine_datasets import Range, Squares
from parity_helpers import stop_torch_workers

import shmloader

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402

import shmloader.torch  # noqa: E402  (after the skip: it imports torch)

BAD = [
    dict(num_workers=-1),
    dict(timeout=-1),
    dict(prefetch_factor=2),
    dict(num_workers=1, prefetch_factor=-1),
    dict(persistent_workers=True),
    dict(shuffle=True, sampler=[0, 1]),
    dict(batch_sampler=[[0, 1]], batch_size=2),
    dict(batch_sampler=[[0, 1]], shuffle=True),
    dict(batch_sampler=[[0, 1]], drop_last=True),
    dict(batch_size=None, drop_last=True),
    dict(num_workers=1, multiprocessing_context="nonsense"),
    dict(num_workers=1, multiprocessing_context=3.5),
    dict(multiprocessing_context="fork"),
]
BAD_ITERABLE = [dict(shuffle=True), dict(sampler=[0]), dict(batch_sampler=[[0]])]


def _raised(factory, dataset, kwargs):
    with pytest.raises(Exception) as info:
        factory(dataset, **kwargs)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("kwargs", BAD, ids=lambda k: ",".join(k))
def test_bad_arguments_raise_torchs_type_and_message(kwargs):
    ours = _raised(shmloader.DataLoader, Squares(8), kwargs)
    theirs = _raised(TorchDataLoader, Squares(8), kwargs)
    assert ours == theirs


@pytest.mark.parametrize("kwargs", BAD_ITERABLE, ids=lambda k: ",".join(k))
def test_iterable_dataset_restrictions_match_torch(kwargs):
    class TorchIterable(torch.utils.data.IterableDataset):  # torch's own class: ours must accept it
        def __iter__(self):
            return iter(range(4))

    ds = TorchIterable()
    assert _raised(shmloader.DataLoader, ds, kwargs) == _raised(TorchDataLoader, ds, kwargs)


def test_non_integer_num_workers_names_the_argument():
    with pytest.raises(TypeError, match=r"num_workers=.*'two'"):
        shmloader.DataLoader(Squares(4), num_workers="two")
    with pytest.raises(TypeError, match=r"num_workers=2\.0"):
        shmloader.DataLoader(Squares(4), num_workers=2.0)


def test_a_fractional_or_zero_prefetch_factor_is_refused_by_name_at_construction():
    """torch takes 1.5 and 0 and fails only when iterating (inside range(); an assertion); we say so at once."""
    with pytest.raises(TypeError, match=r"prefetch_factor should be an integer, but got prefetch_factor=1\.5"):
        shmloader.DataLoader(Squares(4), num_workers=1, prefetch_factor=1.5)
    with pytest.raises(ValueError, match=r"prefetch_factor must be greater than 0 .*prefetch_factor=0"):
        shmloader.DataLoader(Squares(4), num_workers=1, prefetch_factor=0)  # it hung: no task was ever sent
    loader = shmloader.DataLoader(Squares(4), num_workers=1, prefetch_factor=np.int64(3))  # torch takes it
    assert loader.prefetch_factor == 3
    loader.close()


def _raised_at_iter(cls, num_workers, attr, value):
    """The exception ``iter(loader)`` raises once ``loader.<attr> = value`` is set after construction."""
    loader = cls(Squares(4), batch_size=2, num_workers=num_workers)
    setattr(loader, attr, value)
    try:
        with pytest.raises(Exception) as info:
            iter(loader)
        return info.value
    finally:
        if hasattr(loader, "close"):
            loader.close()


@pytest.mark.timeout(60)
# torch's half-built iterator complains from __del__ (no ``_shutdown`` yet): torch's noise, not ours
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(("num_workers", "attr", "value"), [(0, "num_workers", 2), (2, "prefetch_factor", None),
                                                            (2, "prefetch_factor", 0), (2, "prefetch_factor", -1)])
def test_an_unusable_prefetch_factor_set_after_construction_raises_at_iter_as_torch(num_workers, attr, value):
    """torch checks prefetch_factor again when it iterates (TypeError for None, AssertionError for 0);
    the first next() used to wait forever, as no task was ever sent. Ours is of torch's type too."""
    theirs = _raised_at_iter(TorchDataLoader, num_workers, attr, value)
    ours = _raised_at_iter(shmloader.torch.DataLoader, num_workers, attr, value)
    assert isinstance(ours, type(theirs))
    shown = value if attr == "prefetch_factor" else None  # num_workers set later: prefetch_factor stayed None
    assert f"prefetch_factor={shown!r}" in str(ours) and "num_workers=2" in str(ours)
    assert isinstance(_raised_at_iter(shmloader.DataLoader, num_workers, attr, value), type(theirs))


@pytest.mark.timeout(60)
def test_a_fractional_prefetch_factor_set_after_construction_is_refused_by_name_at_iter():
    err = _raised_at_iter(shmloader.DataLoader, 2, "prefetch_factor", 1.5)
    assert isinstance(err, TypeError) and "prefetch_factor=1.5" in str(err)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), (1.5, TypeError)])
def test_a_num_workers_set_after_construction_is_checked_at_iter(value, error):
    """As the constructor checks it: a negative count used to start an iterator with no workers,
    whose first next() waited forever."""
    err = _raised_at_iter(shmloader.DataLoader, 0, "num_workers", value)
    assert isinstance(err, error) and "num_workers" in str(err)


@pytest.mark.timeout(60)
# torch's half-built iterator complains from __del__ (no ``_shutdown`` yet): torch's noise, not ours
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_negative_num_workers_set_after_construction_is_torch_s_assertion_at_iter():
    """torch's iterator asserts ``num_workers > 0`` (an AssertionError); ours was a ValueError only."""
    theirs = _raised_at_iter(TorchDataLoader, 0, "num_workers", -1)
    ours = _raised_at_iter(shmloader.DataLoader, 0, "num_workers", -1)
    assert isinstance(theirs, AssertionError)
    assert isinstance(ours, AssertionError) and isinstance(ours, ValueError)
    assert "num_workers=-1" in str(ours) and ours.name == "num_workers"


@pytest.mark.timeout(60)
def test_prefetch_factor_set_between_epochs_of_persistent_workers_is_checked():
    loader = shmloader.DataLoader(Squares(4), batch_size=2, num_workers=1, persistent_workers=True)
    try:
        assert len(list(loader)) == 2
        loader.prefetch_factor = 0
        with pytest.raises(AssertionError, match="prefetch_factor=0"):
            iter(loader)
        loader.prefetch_factor = 1
        assert len(list(loader)) == 2
    finally:
        loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [np.int64(1), np.int32(0), True, torch.tensor(1)])
def test_integer_like_num_workers_is_taken_as_torch_takes_it(num_workers):
    """torch checks only ``num_workers < 0``: a numpy integer from a config array works there."""
    want = [b.tolist() for b in TorchDataLoader([0, 1, 2, 3], batch_size=2, num_workers=num_workers)]
    loader = shmloader.torch.DataLoader([0, 1, 2, 3], batch_size=2, num_workers=num_workers)
    try:
        assert [b.tolist() for b in loader] == want and loader.num_workers == int(num_workers)
    finally:
        loader.close()


def test_a_bad_call_names_the_function_as_torchs_does():
    for args, kwargs in (((), {"foo": 1}), ((2, False, None, None, 0, None, False, False, 0, None, None, None, 2), {})):
        with pytest.raises(TypeError) as ours:
            shmloader.torch.DataLoader([1, 2, 3], *args, **kwargs)
        with pytest.raises(TypeError) as theirs:
            TorchDataLoader([1, 2, 3], *args, **kwargs)
        assert str(ours.value) == str(theirs.value)


class StopsAt2:
    """A map-style dataset whose ``__getitem__`` raises StopIteration at index 2 (a stray ``next()``)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        if i == 2:
            raise StopIteration
        return i


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stopiteration_from_a_map_dataset_ends_the_epoch_as_in_torch(num_workers):
    """torch re-raises it in the main process, where it ends the loop: no batch after it comes,
    and none is silently skipped (a worker used to take it for an iterable dataset's end)."""
    theirs = iter(TorchDataLoader(StopsAt2(), batch_size=1, num_workers=num_workers))
    try:
        want = [b.tolist() for b in theirs]
    finally:
        stop_torch_workers(theirs)  # collected later, its workers would each wait out a 5 s join
    assert want == [[0], [1]]
    loader = shmloader.torch.DataLoader(StopsAt2(), batch_size=1, num_workers=num_workers)
    try:
        assert [b.tolist() for b in loader] == want
    finally:
        loader.close()


@pytest.mark.parametrize("attr", ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
                                  "persistent_workers"])
def test_attributes_are_immutable_after_init(attr):
    dl = shmloader.DataLoader(Squares(4))
    with pytest.raises(ValueError, match=f"{attr} attribute should not be set after DataLoader is initialized"):
        setattr(dl, attr, 1)
    dl.num_workers = 0  # others stay settable, as in torch


@pytest.mark.parametrize("n,bs,drop", [(10, 3, False), (10, 3, True), (9, 3, False), (7, 1, False)])
def test_len_matches_torch_for_map_and_iterable(n, bs, drop):
    assert len(shmloader.DataLoader(Squares(n), batch_size=bs, drop_last=drop)) == \
        len(TorchDataLoader(Squares(n), batch_size=bs, drop_last=drop))

    class Sized(Range):
        def __len__(self):
            return self.end - self.start

    expect = n // bs if drop else math.ceil(n / bs)
    assert len(shmloader.DataLoader(Sized(0, n), batch_size=bs, drop_last=drop)) == expect


def test_iterable_len_warning_as_torch():
    class Liar(Range):
        def __len__(self):
            return 2

    dl = shmloader.DataLoader(Liar(0, 4), batch_size=None)
    assert len(dl) == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(dl) == [0, 1, 2, 3]
    assert any("was reported to be 2" in str(w.message) for w in caught)


def test_too_many_workers_warns_as_torch():
    with pytest.warns(UserWarning, match="This DataLoader will create 64 worker processes in total"):
        shmloader.DataLoader(Squares(4), num_workers=64)


def test_new_sampler_iteration_each_epoch_and_generator_drives_shuffle():
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    ours = shmloader.DataLoader(Squares(12), batch_size=4, shuffle=True, generator=g1)
    theirs = TorchDataLoader(Squares(12), batch_size=4, shuffle=True, generator=g2)
    for _ in range(3):
        assert [b["y"].tolist() for b in ours] == [b["y"].tolist() for b in theirs]


def test_batch_size_none_disables_auto_batching():
    got = list(shmloader.DataLoader(Squares(3), batch_size=None))
    assert [g["y"] for g in got] == [0, 1, 2]
    assert isinstance(got[0]["x"], np.ndarray) and got[0]["x"].shape == (8,)


@pytest.mark.timeout(60)
def test_max_slots_below_the_pipeline_is_refused_by_name(monkeypatch):
    """With fewer slots than tasks in flight plus the batch in use, the first next() could only
    raise RingExhausted blaming batches nobody held."""
    with pytest.raises(shmloader.ConfigError, match=r"^max_slots=4 is below the 5 slots 2 workers") as info:
        shmloader.DataLoader(Squares(8), batch_size=2, num_workers=2, max_slots=4)
    assert info.value.name == "max_slots" and info.value.value == 4
    loader = shmloader.DataLoader(np.arange(16.0).reshape(8, 2), batch_size=2, num_workers=2, max_slots=5)
    try:
        assert sum(1 for _ in loader) == 4  # the smallest ring that holds the pipeline loads
    finally:
        loader.close()
    monkeypatch.setenv("SHMLOADER_MAX_SLOTS", "3")
    with pytest.raises(shmloader.ConfigError, match=r"^SHMLOADER_MAX_SLOTS=3 is below the 5 slots"):
        shmloader.DataLoader(Squares(8), batch_size=2, num_workers=2)
    shmloader.DataLoader(Squares(8), batch_size=2).close()  # no workers, no pipeline: the limit is moot
