"""Unit tests of shmloader.datasets: every class, its errors and torch's messages."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest

from shmloader.datasets import (
    ArrayDataset,
    ChainDataset,
    ConcatDataset,
    Dataset,
    IterableDataset,
    StackDataset,
    Subset,
    TensorDataset,
    is_iterable_dataset,
    random_split,
)


class Squares(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __getitem__(self, i: int) -> int:
        return i * i

    def __len__(self) -> int:
        return self.n


class Count(IterableDataset):
    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop

    def __iter__(self):
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


class Batched(Squares):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.batches: list[list[int]] = []

    def __getitems__(self, indices: list[int]) -> list[int]:
        self.batches.append(list(indices))
        return [self[i] for i in indices]


@pytest.fixture
def no_torch(monkeypatch):
    """Make the code under test see torch as not imported."""
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.utils.data", None)


def test_base_dataset_getitem_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="Subclasses of Dataset should implement"):
        Dataset()[0]


def test_iterable_dataset_without_iter_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        IterableDataset()


def test_dataset_add_makes_concat_and_iterable_add_makes_chain():
    both = Squares(2) + Squares(3)
    assert isinstance(both, ConcatDataset)
    assert [both[i] for i in range(len(both))] == [0, 1, 0, 1, 4]
    chained = Count(0, 2) + Count(5, 7)
    assert isinstance(chained, ChainDataset)
    assert list(chained) == [0, 1, 5, 6]
    assert len(chained) == 4


def test_is_iterable_dataset():
    assert is_iterable_dataset(Count(0, 1))
    assert is_iterable_dataset(ChainDataset([]))
    assert not is_iterable_dataset(Squares(1))
    assert not is_iterable_dataset([1, 2])


def test_torch_datasets_are_ours_too():
    torch = pytest.importorskip("torch")
    from torch.utils import data as tud

    class TorchStream(tud.IterableDataset):
        def __iter__(self):
            return iter([1])

    stream = TorchStream()
    tensors = tud.TensorDataset(torch.zeros(3))
    assert is_iterable_dataset(stream)
    assert isinstance(stream, IterableDataset) and isinstance(stream, Dataset)
    assert isinstance(tensors, Dataset)
    assert not isinstance(tensors, IterableDataset)
    assert not isinstance(stream, ChainDataset)  # the claim is the base class's only
    assert issubclass(tud.IterableDataset, IterableDataset)
    with pytest.raises(AssertionError, match="ConcatDataset does not support IterableDataset"):
        ConcatDataset([Squares(1), stream])
    assert list(ChainDataset([stream, Count(7, 8)])) == [1, 7]


def test_torch_classes_not_claimed_without_torch(no_torch):
    class Lookalike:
        pass

    assert not isinstance(Lookalike(), Dataset)


def test_array_dataset_numpy_rows_and_len():
    x = np.arange(12).reshape(6, 2)
    y = np.arange(6) * 10
    ds = ArrayDataset(x, y)
    assert len(ds) == 6
    row_x, row_y = ds[4]
    assert row_x.tolist() == [8, 9] and row_y == 40
    assert ds[-1][1] == 50
    assert ds.tensors is ds.arrays
    assert TensorDataset is ArrayDataset


def test_array_dataset_converts_lists():
    ds = ArrayDataset([1, 2, 3])
    assert isinstance(ds.arrays[0], np.ndarray)
    assert ds[2] == (3,)


def test_array_dataset_size_mismatch_is_torchs_error():
    with pytest.raises(AssertionError, match="Size mismatch between tensors"):
        ArrayDataset(np.zeros(3), np.zeros(4))


@pytest.mark.parametrize(
    "arrays, message",
    [((), "at least one array"), ((np.float64(1.0),), "at least one dimension")],
)
def test_array_dataset_rejects_no_array_and_scalars(arrays, message):
    with pytest.raises(ValueError, match=message):
        ArrayDataset(*arrays)


def test_array_dataset_torch_tensors():
    torch = pytest.importorskip("torch")
    ds = ArrayDataset(torch.arange(5), torch.ones(5, 3))
    a, b = ds[2]
    assert isinstance(a, torch.Tensor) and int(a) == 2 and tuple(b.shape) == (3,)
    assert len(ds) == 5


def test_stack_dataset_tuple_dict_and_getitems():
    tuple_ds = StackDataset(Squares(3), Batched(3))
    assert tuple_ds[2] == (4, 4)
    assert tuple_ds.__getitems__([0, 2]) == [(0, 0), (4, 4)]
    batched = Batched(3)
    dict_ds = StackDataset(a=Squares(3), b=batched)
    assert dict_ds[1] == {"a": 1, "b": 1}
    assert dict_ds.__getitems__([2, 1]) == [{"a": 4, "b": 4}, {"a": 1, "b": 1}]
    assert batched.batches == [[2, 1]]
    assert len(dict_ds) == 3


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((), {}, "At least one dataset should be passed"),
        ((Squares(1),), {"b": Squares(1)}, "both types are given"),
        ((Squares(1), Squares(2)), {}, "Size mismatch between datasets"),
    ],
)
def test_stack_dataset_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        StackDataset(*args, **kwargs)


def test_stack_dataset_nested_getitems_size_mismatch():
    class Short(Squares):
        def __getitems__(self, indices):
            return []

    with pytest.raises(ValueError, match="Expected 2, got 0"):
        StackDataset(Short(3)).__getitems__([0, 1])


def test_concat_dataset_indices_and_cumulative_sizes():
    ds = ConcatDataset([Squares(2), Squares(0), Squares(3)])
    assert ds.cumulative_sizes == [2, 2, 5]
    assert len(ds) == 5
    assert [ds[i] for i in range(5)] == [0, 1, 0, 1, 4]
    assert ds[-1] == 4 and ds[-5] == 0
    assert ConcatDataset.cumsum([[1], [1, 2]]) == [1, 3]


def test_concat_dataset_errors():
    with pytest.raises(AssertionError, match="datasets should not be an empty iterable"):
        ConcatDataset([])
    with pytest.raises(AssertionError, match="ConcatDataset does not support IterableDataset"):
        ConcatDataset([Squares(1), Count(0, 1)])
    with pytest.raises(ValueError, match="absolute value of index should not exceed"):
        ConcatDataset([Squares(2)])[-3]
    with pytest.raises(IndexError):
        ConcatDataset([[1, 2]])[2]


def test_chain_dataset_rejects_map_style():
    chain = ChainDataset([Count(0, 1), Squares(2)])
    with pytest.raises(AssertionError, match="ChainDataset only supports IterableDataset"):
        list(chain)
    with pytest.raises(AssertionError, match="ChainDataset only supports IterableDataset"):
        len(chain)


def test_subset_getitem_getitems_and_list_index():
    parent = Batched(10)
    sub = Subset(parent, [9, 3, 5])
    assert len(sub) == 3
    assert sub[0] == 81 and sub[-1] == 25
    assert sub.__getitems__([1, 2]) == [9, 25]
    assert parent.batches == [[3, 5]]
    listy = Subset(np.arange(10) * 2, [1, 4])
    assert listy[[0, 1]].tolist() == [2, 8]
    assert listy.__getitems__([1]) == [8]


def test_subset_subclass_must_override_getitems():
    class Doubled(Subset):
        def __getitem__(self, idx):
            return 2 * super().__getitem__(idx)

    with pytest.raises(NotImplementedError, match="overrides __getitem__ but not __getitems__"):
        Doubled(Squares(3), [0])

    class Complete(Doubled):
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    assert Complete(Squares(3), [2]).__getitems__([0]) == [8]


def _flatten(parts):
    return [i for part in parts for i in part.indices]


def test_random_split_lengths_partition_dataset():
    parts = random_split(Squares(10), [3, 7], generator=np.random.default_rng(0))
    assert [len(p) for p in parts] == [3, 7]
    assert sorted(_flatten(parts)) == list(range(10))
    assert all(isinstance(p, Subset) for p in parts)


def test_random_split_int_seed_is_reproducible():
    first = _flatten(random_split(Squares(20), [0.5, 0.5], generator=5))
    assert first == _flatten(random_split(Squares(20), [0.5, 0.5], generator=5))
    assert first != list(range(20))


def test_random_split_fractions_round_robin_remainder():
    parts = random_split(Squares(10), [0.33, 0.33, 0.34], generator=1)
    # floor gives 3, 3, 3; the remainder 1 goes to the first split.
    assert [len(p) for p in parts] == [4, 3, 3]
    parts = random_split(Squares(11), [0.25, 0.25, 0.25, 0.25], generator=1)
    assert [len(p) for p in parts] == [3, 3, 3, 2]


def test_random_split_warns_on_empty_split():
    with pytest.warns(UserWarning, match="Length of split at index 1 is 0"):
        parts = random_split(Squares(2), [0.9, 0.1], generator=0)
    assert [len(p) for p in parts] == [2, 0]


def test_random_split_no_warning_for_nonempty_splits():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        random_split(Squares(4), [0.5, 0.5], generator=0)


def test_random_split_errors():
    with pytest.raises(ValueError, match="Sum of input lengths does not equal the length"):
        random_split(Squares(10), [3, 3])
    with pytest.raises(ValueError, match="Fraction at index 0 is not between 0 and 1"):
        random_split(Squares(10), [-0.5, 1.5])
    with pytest.raises(TypeError, match="generator must be None, an int seed"):
        random_split(Squares(2), [1, 1], generator="seed")


def test_random_split_none_without_torch_uses_fresh_entropy(no_torch):
    parts = random_split(Squares(50), [25, 25])
    assert sorted(_flatten(parts)) == list(range(50))


@pytest.mark.timeout(60)
def test_importing_datasets_and_samplers_does_not_import_torch():
    code = (
        "import sys, shmloader.datasets, shmloader.samplers, shmloader._generators;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
