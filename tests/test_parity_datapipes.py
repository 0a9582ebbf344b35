"""torch parity for DataPipes given as the dataset: ``shmloader.torch.DataLoader`` treats an
``IterDataPipe`` or ``MapDataPipe`` as torch's DataLoader does — wrapped for serialization, its
shufflers switched by ``shuffle=``, seeded from the loader's generator each epoch, and sharded over
the workers (``sharding_filter``) — so each sample comes once, in torch's order."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")
datapipes = pytest.importorskip("torch.utils.data.datapipes")
from torch.utils import data as tdata  # noqa: E402
from torch.utils.data.datapipes.iter import IterableWrapper  # noqa: E402
from torch.utils.data.datapipes.map import SequenceWrapper  # noqa: E402

import shmloader.torch as st  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
              pytest.mark.filterwarnings("ignore:`shuffle=True` was set:UserWarning")]


def _pipe() -> Any:
    return IterableWrapper(range(20)).shuffle().sharding_filter()


def _epochs(loader_cls: type, dataset: Any, epochs: int = 2, **kwargs: Any) -> tuple[list[list[list[int]]], int]:
    """Each epoch's batches as lists, then a draw from torch's global RNG (what the loader left it)."""
    torch.manual_seed(0)
    loader = loader_cls(dataset, **kwargs)
    try:
        seen = [[batch.tolist() for batch in loader] for _ in range(epochs)]
    finally:
        if hasattr(loader, "close"):
            loader.close()
    return seen, int(torch.randint(0, 1 << 30, ()).item())


def _same_as_torch(make: Any, **kwargs: Any) -> list[list[list[int]]]:
    theirs = _epochs(tdata.DataLoader, make(), **kwargs)
    ours = _epochs(st.DataLoader, make(), **kwargs)
    assert ours == theirs
    return theirs[0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("num_workers", "context"), [(1, None), (2, None), (2, "spawn")])
def test_a_sharding_filter_splits_the_samples_over_the_workers(num_workers: int, context: str | None) -> None:
    # under spawn one epoch: the pipe's trip to a fresh interpreter is what that case adds, and each
    # epoch of each loader there starts two interpreters that import torch (3-5 s each)
    epochs = _same_as_torch(lambda: IterableWrapper(range(10)).sharding_filter(), batch_size=3,
                            num_workers=num_workers, multiprocessing_context=context,
                            epochs=1 if context == "spawn" else 2)
    assert all(sorted(i for batch in epoch for i in batch) == list(range(10)) for epoch in epochs)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_shuffle_switches_the_pipes_shufflers_seeded_as_torch_seeds_them(num_workers: int, persistent: bool) -> None:
    kwargs = {"batch_size": 4, "num_workers": num_workers, "persistent_workers": persistent}
    shuffled = _same_as_torch(_pipe, shuffle=True, **kwargs)
    assert shuffled[0] != shuffled[1]  # a new seed each epoch, in the workers too
    assert all(sorted(i for batch in epoch for i in batch) == list(range(20)) for epoch in shuffled)
    in_order = _same_as_torch(_pipe, shuffle=False, **kwargs)
    assert sorted(in_order[0]) == in_order[0]  # shuffle=False turns the pipe's shuffler off


@pytest.mark.timeout(60)
def test_the_seed_comes_from_the_loaders_generator() -> None:
    def run(loader_cls: type) -> list[list[int]]:
        loader = loader_cls(_pipe(), batch_size=5, shuffle=True, num_workers=2,
                            generator=torch.Generator().manual_seed(3))
        return [batch.tolist() for batch in loader]

    assert run(st.DataLoader) == run(tdata.DataLoader)


def test_the_pipe_is_wrapped_as_torch_wraps_it() -> None:
    for pipe in (IterableWrapper(range(4)), SequenceWrapper(list(range(4)))):
        assert type(st.DataLoader(pipe).dataset) is type(tdata.DataLoader(pipe).dataset)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a pipe given with shuffle left unspecified
        st.DataLoader(IterableWrapper(range(4)), batch_size=2)


@pytest.mark.timeout(60)
def test_a_map_pipe_loads_as_torchs() -> None:
    _same_as_torch(lambda: SequenceWrapper(list(range(10))), batch_size=3, shuffle=True, num_workers=2)
