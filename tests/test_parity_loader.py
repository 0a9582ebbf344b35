"""torch parity of the whole loader: ``shmloader.torch.DataLoader`` yields exactly the batches
torch's ``DataLoader`` yields — same order, container types, dtypes, shapes and values — for
map-style and iterable datasets, every sample type, batch sizes None/1/3/7, drop_last, seeded
shuffling, explicit torch samplers, and worker processes under fork and spawn."""

from __future__ import annotations

import collections
import multiprocessing
import random
from typing import Any

import numpy as np
import pytest
from parity_helpers import assert_same_structure

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402

import shmloader  # noqa: E402
from shmloader.torch import DataLoader  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

Point = collections.namedtuple("Point", ["x", "y"])
N_SAMPLES = 23  # odd, so batches of 3 and 7 leave a partial last batch


def make_sample(kind: str, i: int) -> Any:
    """Sample ``i`` of a dataset of ``kind``: deterministic, distinct per index."""
    if kind == "array_f32":
        return np.arange(4, dtype=np.float32) + i
    if kind == "array_u8_2d":
        return np.full((2, 3), i, dtype=np.uint8)
    if kind == "np_scalar":
        return np.float64(i) / 3
    if kind == "int":
        return i
    if kind == "float":
        return i / 7
    if kind == "bool":
        return i % 2 == 0
    if kind == "str":
        return f"s{i}"
    if kind == "bytes":
        return bytes([i])
    if kind == "dict":
        return {"image": np.full(3, i, np.int16), "label": i, "name": f"n{i}"}
    if kind == "nested_dict":
        return {"a": {"b": np.float32(i), "c": [i, i + 1]}, "d": (i / 2, "t")}
    if kind == "list":
        return [i, np.ones(2) * i, "x"]
    if kind == "tuple":
        return (np.arange(3) * i, i)
    if kind == "namedtuple":
        return Point(np.int64(i), torch.full((2,), float(i)))
    if kind == "tensor":
        return torch.arange(6, dtype=torch.float32).view(2, 3) + i
    if kind == "tensor_bf16":
        return (torch.arange(4, dtype=torch.float32) + i).to(torch.bfloat16)
    raise ValueError(kind)


KINDS = [
    "array_f32", "array_u8_2d", "np_scalar", "int", "float", "bool", "str", "bytes", "dict",
    "nested_dict", "list", "tuple", "namedtuple", "tensor", "tensor_bf16",
]


class MapDataset(tdata.Dataset):
    def __init__(self, kind: str, n: int = N_SAMPLES) -> None:
        self.kind = kind
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return make_sample(self.kind, int(i))


def worker_info(which: str) -> Any:
    """torch's get_worker_info() (what migrated code calls), or whichever loader's is set."""
    info: Any = tdata.get_worker_info()  # torch's WorkerInfo, or ours below
    if which == "either" and info is None:
        info = shmloader.get_worker_info()
    return info


class IterDataset(tdata.IterableDataset):
    """Shards itself through get_worker_info(), as torch's documentation shows.

    ``info="torch"`` calls torch's get_worker_info() as migrated code does; ``info="either"``
    also accepts shmloader's, which isolates the loader's iterable order from that question.
    """

    def __init__(self, kind: str, n: int = N_SAMPLES, info: str = "torch") -> None:
        self.kind = kind
        self.n = n
        self.info = info

    def __iter__(self) -> Any:
        info = worker_info(self.info)
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return (make_sample(self.kind, i) for i in range(start, self.n, step))


class RandomDataset(tdata.Dataset):
    """Draws from torch's, numpy's and Python's global RNGs, and says which worker drew."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        return {
            "worker": worker_info("either").id,
            "torch": torch.randint(0, 2**31 - 1, (2,)),
            "numpy": np.random.randint(0, 2**31 - 1, size=2),
            "random": random.random(),
        }


def assert_same_batches(make_theirs: Any, make_ours: Any, check_len: bool = True) -> None:
    theirs, ours = make_theirs(), make_ours()
    if check_len:
        assert len(ours) == len(theirs)
    assert_same_structure(list(ours), list(theirs), path="batches")


def both(dataset: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Factories of torch's loader and ours with the same arguments; each call builds afresh."""
    return (lambda: tdata.DataLoader(dataset, **kwargs)), (lambda: DataLoader(dataset, **kwargs))


BATCHING = [(None, False), (1, False), (3, False), (3, True), (7, False), (7, True)]


@pytest.mark.parametrize(("batch_size", "drop_last"), BATCHING)
@pytest.mark.parametrize("kind", KINDS)
def test_map_style_in_process(kind: str, batch_size: int | None, drop_last: bool) -> None:
    theirs, ours = both(MapDataset(kind), batch_size=batch_size, drop_last=drop_last)
    assert_same_batches(theirs, ours)


@pytest.mark.parametrize(("batch_size", "drop_last"), BATCHING)
@pytest.mark.parametrize("kind", ["array_f32", "dict", "tuple", "namedtuple", "tensor_bf16", "str"])
def test_iterable_in_process(kind: str, batch_size: int | None, drop_last: bool) -> None:
    theirs, ours = both(IterDataset(kind), batch_size=batch_size, drop_last=drop_last)
    assert_same_batches(theirs, ours, check_len=False)


@pytest.mark.parametrize("batch_size", [None, 1, 3, 7])
@pytest.mark.parametrize("kind", ["array_f32", "dict", "namedtuple"])
def test_shuffle_with_seeded_generator(kind: str, batch_size: int | None) -> None:
    theirs = lambda: tdata.DataLoader(  # noqa: E731
        MapDataset(kind), batch_size=batch_size, shuffle=True,
        generator=torch.Generator().manual_seed(7),
    )
    ours = lambda: DataLoader(  # noqa: E731
        MapDataset(kind), batch_size=batch_size, shuffle=True,
        generator=torch.Generator().manual_seed(7),
    )
    assert_same_batches(theirs, ours)


def test_shuffle_epochs_continue_the_same_generator() -> None:
    theirs = tdata.DataLoader(MapDataset("int"), batch_size=4, shuffle=True,
                              generator=torch.Generator().manual_seed(3))
    ours = DataLoader(MapDataset("int"), batch_size=4, shuffle=True,
                      generator=torch.Generator().manual_seed(3))
    for _epoch in range(3):
        assert_same_structure(list(ours), list(theirs), path="epoch")


def _samplers() -> dict[str, Any]:
    """name -> factory of (sampler kwargs) using torch's own samplers, each seeded afresh."""
    def gen() -> Any:
        return torch.Generator().manual_seed(11)

    ds = MapDataset("dict")
    return {
        "sequential": lambda: {"sampler": tdata.SequentialSampler(ds), "batch_size": 4},
        "random": lambda: {"sampler": tdata.RandomSampler(ds, generator=gen()), "batch_size": 3},
        "random_replacement": lambda: {
            "sampler": tdata.RandomSampler(ds, replacement=True, num_samples=10, generator=gen()),
            "batch_size": 3,
        },
        "subset_random": lambda: {
            "sampler": tdata.SubsetRandomSampler([1, 5, 7, 9, 20], generator=gen()),
            "batch_size": 2,
        },
        "weighted": lambda: {
            "sampler": tdata.WeightedRandomSampler([0.1, 0.5, 2.0] * 7, 9, generator=gen()),
            "batch_size": 4, "drop_last": True,
        },
        "batch_sampler": lambda: {
            "batch_sampler": tdata.BatchSampler(tdata.RandomSampler(ds, generator=gen()), 5, False),
        },
        "list_batch_sampler": lambda: {"batch_sampler": [[3, 1], [0, 22, 5], [7]]},
        "sampler_batch_none": lambda: {"sampler": [4, 2, 2, 9], "batch_size": None},
    }


@pytest.mark.parametrize("name", sorted(_samplers()))
def test_explicit_torch_samplers(name: str) -> None:
    factory = _samplers()[name]
    ds = MapDataset("dict")
    assert_same_batches(lambda: tdata.DataLoader(ds, **factory()),
                        lambda: DataLoader(ds, **factory()))


def _start_methods() -> list[str]:
    return [m for m in ("fork", "spawn") if m in multiprocessing.get_all_start_methods()]


# The worker count (how tasks and shards interleave) is crossed with every dataset kind under fork;
# spawn (the dataset and its class travel to a fresh interpreter, which imports torch: 3-5 s a worker,
# twice, torch's and ours) runs each kind once, with two workers, so that the shards still interleave.
WORKER_CASES = [
    (method, workers, dataset)
    for method in _start_methods()
    for workers in ((1, 2, 3) if method == "fork" else (2,))
    for dataset in ("map", "iterable", "iterable_any_info")
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("method", "num_workers", "dataset_kind"), WORKER_CASES)
def test_workers_yield_torchs_batches(method: str, num_workers: int, dataset_kind: str) -> None:
    iterable = dataset_kind != "map"
    dataset = {
        "map": MapDataset("dict"),
        "iterable": IterDataset("dict"),
        "iterable_any_info": IterDataset("dict", info="either"),
    }[dataset_kind]
    kwargs = {"batch_size": 3, "num_workers": num_workers, "multiprocessing_context": method}
    theirs, ours = both(dataset, **kwargs)
    assert_same_batches(theirs, ours, check_len=not iterable)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["namedtuple", "tensor_bf16", "nested_dict", "list"])
@pytest.mark.parametrize("batch_size", [None, 7])
def test_workers_carry_every_sample_type(kind: str, batch_size: int | None) -> None:
    method = _start_methods()[0]
    theirs, ours = both(MapDataset(kind), batch_size=batch_size, num_workers=2,
                        drop_last=batch_size is not None, multiprocessing_context=method)
    assert_same_batches(theirs, ours)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_array_batches_from_a_batch_sampler(num_workers: int) -> None:
    """A bucketing batch sampler that yields index arrays (``np.array_split``): every batch after
    the first is read as it is, never compared with anything (an array's ``==`` is element-wise)."""
    method = _start_methods()[0]
    kwargs: dict[str, Any] = {"num_workers": num_workers}
    if num_workers:
        kwargs["multiprocessing_context"] = method
    ds = MapDataset("array_f32")

    def torch_loader() -> Any:  # a batch sampler of ndarrays, on purpose: torch's stubs ask for lists
        return tdata.DataLoader(ds, batch_sampler=np.array_split(np.arange(10), 3), **kwargs)  # type: ignore[arg-type]

    assert_same_batches(torch_loader, lambda: DataLoader(ds, batch_sampler=np.array_split(np.arange(10), 3), **kwargs))


@pytest.mark.timeout(60)
def test_workers_shuffle_with_seeded_generator() -> None:
    def make(loader_cls: Any) -> Any:
        return lambda: loader_cls(MapDataset("tuple"), batch_size=4, shuffle=True, num_workers=2,
                                  generator=torch.Generator().manual_seed(5),
                                  multiprocessing_context=_start_methods()[0])

    assert_same_batches(make(tdata.DataLoader), make(DataLoader))


@pytest.mark.timeout(60)
def test_worker_random_streams_match_torch() -> None:
    """Each worker draws the same torch, numpy and random values as torch's worker of that id.

    Compared per worker, in the order each worker ran its tasks: which worker runs which task is
    the dispatcher's choice, but a worker's random streams depend only on how it was seeded.
    """
    def streams(loader_cls: Any) -> dict[int, list[tuple[Any, ...]]]:
        loader = loader_cls(RandomDataset(), batch_size=2, num_workers=2,
                            generator=torch.Generator().manual_seed(1),
                            multiprocessing_context=_start_methods()[0])
        per_worker: dict[int, list[tuple[Any, ...]]] = collections.defaultdict(list)
        for batch in loader:
            for j, wid in enumerate(batch["worker"].tolist()):
                per_worker[wid].append((batch["torch"][j].tolist(), batch["numpy"][j].tolist(),
                                        batch["random"][j].item()))
        return per_worker

    theirs, ours = streams(tdata.DataLoader), streams(DataLoader)
    assert sorted(ours) == sorted(theirs) == [0, 1]
    for wid in theirs:
        common = min(len(theirs[wid]), len(ours[wid]))
        assert common >= 4, f"worker {wid} ran too few samples to compare"
        assert ours[wid][:common] == theirs[wid][:common], f"worker {wid}'s random draws differ"


class SeesIndexBatch(tdata.Dataset):
    """Reports the type of the batch of indices its ``__getitems__`` receives, and refuses index 6."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"i": int(i), "got": "one index"}

    def __getitems__(self, idx: Any) -> list[dict[str, Any]]:
        if 6 in [int(i) for i in idx]:
            raise ValueError("sample 6 is bad")
        return [{"i": int(i), "got": type(idx).__name__} for i in idx]


INDEX_BATCHES = {  # what a batch sampler may yield; torch hands each to __getitems__ as it is
    "tensor": lambda: [torch.tensor([5, 1, 3]), torch.tensor([0, 7])],
    "tuple": lambda: [(5, 1, 3), (0, 7)],
    "range": lambda: [range(2, 5), range(0, 2)],
    "ndarray": lambda: [np.array([5, 1, 3])],
}


def _seen(loader: Any) -> list[tuple[list[int], list[str]]]:
    try:
        return [(b["i"].tolist(), b["got"]) for b in loader]
    finally:
        if hasattr(loader, "close"):
            loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(INDEX_BATCHES))
def test_a_batch_samplers_batch_reaches_the_dataset_unchanged(kind: str) -> None:
    """With workers as without: a tensor of indices stays a tensor (``__getitems__`` may gather with
    it), a tuple a tuple, a range a range, an ndarray an ndarray. It used to arrive as a list."""
    method = _start_methods()[0]
    theirs = _seen(tdata.DataLoader(SeesIndexBatch(), batch_sampler=INDEX_BATCHES[kind](), num_workers=2,
                                    multiprocessing_context=method))
    assert {g for _, got in theirs for g in got} == {type(INDEX_BATCHES[kind]()[0]).__name__}
    for num_workers in (0, 2):
        ours = DataLoader(SeesIndexBatch(), batch_sampler=INDEX_BATCHES[kind](), num_workers=num_workers,
                          multiprocessing_context=method if num_workers else None)
        assert _seen(ours) == theirs, f"num_workers={num_workers}"


@pytest.mark.timeout(60)
def test_a_worker_error_names_a_tensor_batchs_indices_as_numbers() -> None:
    loader = DataLoader(SeesIndexBatch(), batch_sampler=[torch.tensor([5, 6, 7, 2])], num_workers=1)
    try:
        with pytest.raises(ValueError, match=r"task 0, sample indices \[5\.\.7, 2\]\)") as info:
            next(iter(loader))
        assert "sample 6 is bad" in str(info.value)
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_a_tensor_view_batch_sends_its_own_indices_not_its_whole_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.randperm(n).split(b)``: each batch is a view of one n-element storage, which pickle
    writes whole. A task carries a copy of the view alone (still a tensor, as torch's worker gets)."""
    from shmloader.engine import send

    big = torch.arange(1 << 20) % N_SAMPLES  # 8 MiB of int64
    sizes: list[int] = []
    real = send.task_frame

    def measured(*args: Any) -> bytes:
        frame = real(*args)
        sizes.append(len(frame))
        return frame

    monkeypatch.setattr(send, "task_frame", measured)
    ds = MapDataset("int")
    assert_same_batches(lambda: tdata.DataLoader(ds, batch_sampler=list(big[:20].split(4)), num_workers=2),
                        lambda: DataLoader(ds, batch_sampler=list(big[:20].split(4)), num_workers=2))
    assert sizes and max(sizes) < 4096, f"task frames of {max(sizes)} bytes for 4 indices"
