"""``shmloader.torch.DataLoader`` is a real ``torch.utils.data.DataLoader`` (issue 14): isinstance, torch's
signature plus keyword-only extras, torch's attributes and default samplers, and the re-instantiation
contract Lightning relies on — while the batches still come from shmloader's workers and slots."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # the module's names in annotations; at run time the test skips without torch
    import torch
else:
    torch = pytest.importorskip("torch")
from framework_helpers import Indexed, batch_record, in_shmloader_slot  # noqa: E402
from torch.utils import data as tdata  # noqa: E402
from torch.utils.data.dataloader import _DatasetKind  # noqa: E402

import shmloader  # noqa: E402
import shmloader.torch as st  # noqa: E402
from shmloader.torch.loader import EXTRA_OPTIONS, TORCH_OPTIONS  # noqa: E402

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]


class Stream(tdata.IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(5))

    def __len__(self) -> int:
        return 5


def test_it_is_a_torch_dataloader_and_the_numpy_flavour_is_not() -> None:
    loader = st.DataLoader(Indexed(4), batch_size=2)
    assert isinstance(loader, tdata.DataLoader) and issubclass(st.DataLoader, tdata.DataLoader)
    assert not issubclass(shmloader.DataLoader, tdata.DataLoader)
    assert isinstance(loader, shmloader.DataLoader)


def test_the_attributes_torch_and_its_integrations_read_exist() -> None:
    loader = st.DataLoader(Indexed(4), batch_size=2, num_workers=1, multiprocessing_context="fork")
    assert loader._dataset_kind == _DatasetKind.Map
    assert st.DataLoader(Stream(), batch_size=2)._dataset_kind == _DatasetKind.Iterable
    assert loader._DataLoader__initialized is True  # torch's (same mangled name) immutability flag
    assert loader._DataLoader__multiprocessing_context is loader.multiprocessing_context
    assert loader.multiprocessing_context.get_start_method() == "fork"
    assert loader._iterator is None and loader._IterableDataset_len_called is None
    assert loader._auto_collation and loader._index_sampler is loader.batch_sampler
    assert callable(loader._get_iterator) and callable(loader.check_worker_number_rationality)
    with pytest.raises(ValueError, match="batch_size attribute should not be set after DataLoader is initialized"):
        loader.batch_size = 3


@pytest.mark.parametrize(("batch_size", "torch_fn"), [(2, "default_collate"), (None, "default_convert")])
def test_the_default_collate_fn_is_torchs_own_function(batch_size: int | None, torch_fn: str) -> None:
    """Code written for torch compares ``loader.collate_fn`` with torch's function (or calls it on
    samples of its own); the batches still come from the slots, collated by shmloader."""
    theirs = tdata.DataLoader(Indexed(4), batch_size=batch_size)
    ours = st.DataLoader(Indexed(4), batch_size=batch_size, num_workers=1)
    assert ours.collate_fn is theirs.collate_fn is getattr(tdata, torch_fn)
    batches = list(ours)
    assert [torch.as_tensor(b["index"]).tolist() for b in batches] == ([[0, 1], [2, 3]] if batch_size else [0, 1, 2, 3])
    assert all(bool(torch.as_tensor(b["shm_worker"]).all()) and in_shmloader_slot(b["x"]) for b in batches)


def test_the_signature_is_torchs_plus_keyword_only_extras() -> None:
    ours = list(inspect.signature(st.DataLoader).parameters.values())
    torchs = [p for p in inspect.signature(tdata.DataLoader.__init__).parameters.values() if p.name != "self"]
    assert [(p.name, p.kind, p.default) for p in ours[: len(torchs)]] == [(p.name, p.kind, p.default) for p in torchs]
    extras = ours[len(torchs):]
    assert extras and all(p.kind is p.KEYWORD_ONLY for p in extras)
    assert [p.name for p in extras] == list(EXTRA_OPTIONS) and tuple(p.name for p in torchs) == TORCH_OPTIONS
    assert "slot_bytes" in EXTRA_OPTIONS and "plugins" in EXTRA_OPTIONS


def test_default_samplers_are_torchs_own_classes() -> None:
    shuffled = st.DataLoader(Indexed(6), batch_size=2, shuffle=True)
    assert type(shuffled.sampler) is tdata.RandomSampler and type(shuffled.batch_sampler) is tdata.BatchSampler
    assert type(st.DataLoader(Indexed(6)).sampler) is tdata.SequentialSampler
    # an int seed is a shmloader extension torch's RandomSampler does not take: shmloader's draws it
    assert type(st.DataLoader(Indexed(6), shuffle=True, generator=3).sampler) is shmloader.RandomSampler


@pytest.mark.timeout(90)
def test_shuffled_epochs_match_torchs_with_workers() -> None:
    def epochs(loader_cls: type) -> list[list[int]]:
        torch.manual_seed(7)
        loader = loader_cls(Indexed(10), batch_size=3, shuffle=True, num_workers=2)
        return [[i for b in loader for i in b["index"].tolist()] for _ in range(2)]

    assert epochs(st.DataLoader) == epochs(tdata.DataLoader)


def _lightning_style_kwargs(loader: tdata.DataLoader, sampler: Any) -> dict[str, Any]:
    """What lightning.fabric.utilities.data._get_dataloader_init_args_and_kwargs reads from a loader
    made outside a ``*_dataloader`` hook: public attributes whose value is not the __init__ default."""
    attrs = {k: v for k, v in vars(loader).items() if not k.startswith("_")}
    attrs["multiprocessing_context"] = loader.multiprocessing_context
    params = inspect.signature(loader.__init__).parameters  # type: ignore[misc]  # as Lightning reads them
    kwargs = {k: v for k, v in attrs.items() if k in params and params[k].default is not v}
    kwargs["dataset"] = loader.dataset
    kwargs.update(sampler=sampler, shuffle=False, batch_sampler=None)
    return kwargs


@pytest.mark.timeout(90)
def test_lightning_style_reinstantiation_with_a_distributed_sampler() -> None:
    ds = Indexed(12)
    loader = st.DataLoader(ds, batch_size=3, shuffle=True, num_workers=2, slot_bytes=1 << 20, max_slots=8)
    shards = []
    for rank in range(2):
        sampler: tdata.distributed.DistributedSampler[int] = tdata.distributed.DistributedSampler(
            ds, num_replicas=2, rank=rank, shuffle=True, seed=5)
        rebuilt = type(loader)(**_lightning_style_kwargs(loader, sampler))
        assert type(rebuilt) is st.DataLoader and rebuilt.sampler is sampler
        assert type(rebuilt.batch_sampler) is tdata.BatchSampler and rebuilt.batch_sampler.sampler is sampler
        assert (rebuilt.slot_bytes, rebuilt.max_slots, rebuilt.num_workers) == (1 << 20, 8, 2)
        assert rebuilt._config.slot_bytes == 1 << 20  # the extra reached the engine, not only the attribute
        records = [batch_record(b) for b in rebuilt]
        got = [i for r in records for i in r["index"]]
        assert got == list(sampler)
        assert all(r["shm_worker"] and r["in_slot"] for r in records)
        shards.append(set(got))
        rebuilt.close()
    assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == set(range(12))
    loader.close()


def test_init_kwargs_reads_torch_loaders_back_as_torchs_init_needs_them() -> None:
    ds = Indexed(8)
    batches = tdata.BatchSampler(tdata.SequentialSampler(ds), 3, drop_last=False)
    from_torch = st.init_kwargs(tdata.DataLoader(ds, batch_sampler=batches))
    assert from_torch["batch_sampler"] is batches and "sampler" not in from_torch and "batch_size" not in from_torch
    rebuilt = st.DataLoader(**from_torch)
    assert [b["index"].tolist() for b in rebuilt] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    stream = st.init_kwargs(tdata.DataLoader(Stream(), batch_size=2, drop_last=True))
    assert (stream["batch_size"], stream["drop_last"]) == (2, True) and "sampler" not in stream
    assert [b.tolist() for b in st.DataLoader(**stream)] == [[0, 1], [2, 3]]
    ours = st.init_kwargs(st.DataLoader(ds, batch_size=4, slot_bytes=4096))
    assert ours["slot_bytes"] == 4096 and "max_slots" not in ours  # extras not passed stay unset
    with pytest.raises(TypeError, match="does not take: shufle"):
        st.init_kwargs(tdata.DataLoader(ds), shufle=True)


@pytest.mark.timeout(90)
def test_dropping_the_persistent_iterator_closes_it_as_torchs_shutdown_would() -> None:
    loader = st.DataLoader(Indexed(6), batch_size=2, num_workers=1, persistent_workers=True)
    iterator = iter(loader)
    assert next(iterator)["index"].tolist() == [0, 1]
    loader._iterator = None  # what Lightning does after _shutdown_workers() at the end of a loop
    assert iterator.closed
    assert [b["index"].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]  # a fresh iterator
    loader.close()


class RestartingBatches:
    """A batch sampler that is its own iterator and restarts on ``iter()``, like Lightning's
    ``_IndexBatchSamplerWrapper`` (which records the indices a prediction writer receives)."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches
        self.seen: list[list[int]] = []
        self._it: Any = None

    def __iter__(self) -> RestartingBatches:
        self.seen, self._it = [], iter(self.batches)
        return self

    def __next__(self) -> list[int]:
        batch = next(self._it)
        self.seen.append(batch)
        return batch

    def __len__(self) -> int:
        return len(self.batches)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_sampler_that_restarts_on_iter_is_iterated_once_per_epoch(num_workers: int) -> None:
    batches = [[0, 1, 2], [3, 4, 5], [6]]
    sampler = RestartingBatches(batches)
    loader = st.DataLoader(Indexed(7), batch_sampler=sampler, num_workers=num_workers)
    assert [b["index"].tolist() for b in loader] == batches and sampler.seen == batches


def test_it_is_subscriptable_like_torchs_generic_class() -> None:
    """``DataLoader[T]`` in a runtime-evaluated annotation must survive swapping torch's import for ours."""
    import typing

    assert typing.get_args(tdata.DataLoader[torch.Tensor]) == (torch.Tensor,)  # torch's class is generic
    alias = st.DataLoader[torch.Tensor]
    assert typing.get_origin(alias) is st.DataLoader and typing.get_args(alias) == (torch.Tensor,)
    loader = alias(Indexed(4), batch_size=2)
    assert type(loader) is st.DataLoader and [b["index"].tolist() for b in loader] == [[0, 1], [2, 3]]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("source", [tdata.DataLoader, st.DataLoader], ids=["torch", "shmloader"])
def test_init_kwargs_overriding_num_workers_gives_options_valid_for_it(source: type) -> None:
    """The worker-only options read from a loader with workers would make torch refuse (or fail to
    iterate) a rebuild with ``num_workers=0``; they fall back to torch's defaults unless overridden too."""
    loader = source(Indexed(6), batch_size=4, num_workers=2, persistent_workers=True, timeout=30,
                    multiprocessing_context="fork", prefetch_factor=3)
    try:
        kwargs = st.init_kwargs(loader, num_workers=0)
        assert [kwargs[k] for k in ("prefetch_factor", "persistent_workers", "multiprocessing_context", "timeout")] \
            == [None, False, None, 0]
        for cls in (tdata.DataLoader, st.DataLoader):  # valid for torch's own class as well as ours
            assert [b["index"].tolist() for b in cls(**kwargs)] == [[0, 1, 2, 3], [4, 5]]
        kept = st.init_kwargs(loader, num_workers=0, prefetch_factor=3)  # an explicit override stays
        assert kept["prefetch_factor"] == 3
        with pytest.raises(ValueError, match="prefetch_factor option could only be specified in multiprocessing"):
            tdata.DataLoader(**kept)
    finally:
        if hasattr(loader, "close"):
            loader.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("source", [tdata.DataLoader, st.DataLoader], ids=["torch", "shmloader"])
def test_init_kwargs_adding_workers_gives_torchs_defaults(source: type) -> None:
    kwargs = st.init_kwargs(source(Indexed(6), batch_size=4), num_workers=2)
    theirs, ours = tdata.DataLoader(**kwargs), st.DataLoader(**kwargs)
    try:
        for rebuilt in (theirs, ours):
            assert (rebuilt.prefetch_factor, rebuilt.persistent_workers, rebuilt.multiprocessing_context) == (2, False, None)
        assert [b["index"].tolist() for b in ours] == [b["index"].tolist() for b in theirs] == [[0, 1, 2, 3], [4, 5]]
    finally:
        ours.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_it_pickles_and_deep_copies_as_torchs_loader_does(how: str) -> None:
    """mp.spawn and Lightning's ddp_spawn pickle the loaders they are handed; the copy iterates
    the batches torch's copy does, keeps the extras and still rebuilds through init_kwargs."""
    import copy
    import pickle

    clone_of = {"pickle": lambda x: pickle.loads(pickle.dumps(x)), "deepcopy": copy.deepcopy}[how]

    def epochs(cls: type[Any], **extra: Any) -> list[list[list[int]]]:
        loader = cls(Indexed(10), batch_size=4, shuffle=True, num_workers=2,
                     generator=torch.Generator().manual_seed(3), **extra)
        clone = clone_of(loader)
        try:
            if cls is st.DataLoader:
                assert type(clone) is st.DataLoader and clone.slot_bytes == 1 << 20
                assert st.init_kwargs(clone)["slot_bytes"] == 1 << 20
            return [[b["index"].tolist() for b in clone], [b["index"].tolist() for b in loader]]
        finally:
            for each in (clone, loader):
                if hasattr(each, "close"):
                    each.close()

    assert epochs(st.DataLoader, slot_bytes=1 << 20) == epochs(tdata.DataLoader)
