"""accelerate with ``shmloader.torch.DataLoader`` (issue 14): ``Accelerator.prepare`` recognises it (it is a
torch DataLoader) and shards it; ``shmloader.torch.accelerate`` keeps the wrapper accelerate builds on
shmloader's workers and slots — on one process and on two CPU processes — with the shards, order and
``GradientState.end_of_dataloader`` that torch's loader gets."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")
from accelerate.data_loader import DataLoaderShard  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from framework_helpers import Indexed, batch_record  # noqa: E402
from torch.utils import data as tdata  # noqa: E402
from tree_run import run_tree  # noqa: E402

import shmloader  # noqa: E402
import shmloader.torch as st  # noqa: E402
import shmloader.torch.accelerate as sta  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]
HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    """accelerate keeps process-wide singletons; each test starts and ends without them."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _epoch(accelerator: Any, prepared: Any) -> list[dict[str, Any]]:
    return [{**batch_record(b), "end": accelerator.gradient_state.end_of_dataloader} for b in prepared]


def _shm_loader(n: int = 10, **kwargs: Any) -> st.DataLoader:
    return st.DataLoader(Indexed(n), batch_size=3, shuffle=True, num_workers=2, slot_bytes=1 << 16, **kwargs)


def test_the_accelerator_keeps_its_wrapper_on_shmloader_with_torchs_order_and_end_flag() -> None:
    set_seed(11)
    plain = accelerate.Accelerator()
    torchs = _epoch(plain, plain.prepare(tdata.DataLoader(Indexed(10), batch_size=3, shuffle=True, num_workers=2)))
    set_seed(11)
    accelerator = sta.Accelerator()
    prepared = accelerator.prepare(_shm_loader())
    assert type(prepared) is DataLoaderShard and type(prepared.base_dataloader) is st.DataLoader
    assert prepared.base_dataloader.slot_bytes == 1 << 16  # shmloader's options survive the rebuild
    ours = _epoch(accelerator, prepared)
    assert [b["index"] for b in ours] == [b["index"] for b in torchs]
    assert [b["end"] for b in ours] == [False] * (len(ours) - 1) + [True] == [b["end"] for b in torchs]
    assert all(b["shm_worker"] and b["in_slot"] and os.getpid() not in b["pids"] for b in ours)
    assert not any(b["in_slot"] for b in torchs)


def test_plain_prepare_loads_with_torch_and_the_prepare_function_fixes_it() -> None:
    accelerator = accelerate.Accelerator()
    unadopted = accelerator.prepare(_shm_loader())
    assert type(unadopted.base_dataloader) is tdata.DataLoader  # what docs/frameworks.md warns about
    model = torch.nn.Linear(2, 1)
    prepared_model, prepared = sta.prepare(accelerator, model, _shm_loader())
    assert isinstance(prepared_model, torch.nn.Module) and type(prepared.base_dataloader) is st.DataLoader
    assert all(b["shm_worker"] and b["in_slot"] for b in _epoch(accelerator, prepared))
    assert sta.prepare(accelerator, model) is not None  # one object in, one object out


def test_skip_first_batches_stays_on_shmloader() -> None:
    accelerator = sta.Accelerator()
    prepared = accelerator.prepare(_shm_loader(n=12))
    full = [b["index"] for b in _epoch(accelerator, prepared)]
    skipped = accelerator.skip_first_batches(prepared, num_batches=2)
    assert type(skipped.base_dataloader) is st.DataLoader and skipped.base_dataloader.slot_bytes == 1 << 16
    rest = _epoch(accelerator, skipped)
    assert len(rest) == len(full) - 2 and all(b["shm_worker"] and b["in_slot"] for b in rest)
    bare = sta.skip_first_batches(_shm_loader(n=12), num_batches=1)  # an unprepared loader stays unwrapped
    assert type(bare) is st.DataLoader and len(bare) == 3
    with pytest.raises(ValueError, match="num_batches should be a non-negative integer, but got num_batches=-1"):
        sta.skip_first_batches(prepared, num_batches=-1)


class Stream(tdata.IterableDataset):
    """10 samples of :class:`Indexed`'s shape, sharded over shmloader's workers by ``get_worker_info()``."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = shmloader.get_worker_info()
        for i in range(0 if info is None else info.id, 10, 1 if info is None else info.num_workers):
            yield Indexed(10)[i]


def test_the_dispatcher_of_an_iterable_dataset_is_kept_on_shmloader_too() -> None:
    accelerator = sta.Accelerator(dataloader_config=accelerate.DataLoaderConfiguration(dispatch_batches=True))
    prepared = accelerator.prepare(st.DataLoader(Stream(), batch_size=3, num_workers=2))
    assert type(prepared).__name__ == "DataLoaderDispatcher" and type(prepared.base_dataloader) is st.DataLoader
    batches = _epoch(accelerator, prepared)  # the dispatcher re-assembles batches, so not slot views
    assert sorted(i for b in batches for i in b["index"]) == list(range(10))
    assert all(b["shm_worker"] for b in batches) and [b["end"] for b in batches][-2:] == [False, True]


def test_torch_loaders_are_left_alone_and_stateful_loading_is_refused() -> None:
    accelerator = sta.Accelerator()
    theirs = accelerator.prepare(tdata.DataLoader(Indexed(4), batch_size=2))
    assert type(theirs.base_dataloader) is tdata.DataLoader
    given = _shm_loader()
    torch_made = accelerate.Accelerator().prepare(given)
    torch_made.use_stateful_dataloader = True  # as DataLoaderConfiguration(use_stateful_dataloader=True) sets
    with pytest.raises(ValueError, match="use_stateful_dataloader=True"):
        sta.adopt(torch_made, given)


@pytest.mark.timeout(240)
def test_two_cpu_processes_get_torchs_shards_from_shmloader_workers(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    run = run_tree([sys.executable, str(HERE / "accelerate_app.py"), str(tmp_path)], timeout=220, env=env,
                   cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]

    shards = []
    for process in range(2):
        record = json.loads((tmp_path / f"process{process}.json").read_text())
        ours, torchs = record["shmloader"], record["torch"]
        assert record["num_processes"] == 2
        assert [b["index"] for b in ours] == [b["index"] for b in torchs]  # torch's shard, torch's order
        assert [b["end"] for b in ours] == [False] * (len(ours) - 1) + [True]
        assert all(b["inner"] == "shmloader.torch.loader" for b in ours)
        assert all(b["shm_worker"] and b["in_slot"] and record["pid"] not in b["pids"] for b in ours)
        shards.append({i for b in ours for i in b["index"]})
    assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == set(range(16))
