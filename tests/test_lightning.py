"""Lightning with ``shmloader.torch.DataLoader`` (issue 14): ``fit``, ``validate`` and ``predict`` see exactly
the batches torch's loader gives in the same script (so Lightning's checks no longer ``iter()``-probe
it and consume the first shuffle), a prediction writer gets the same ``batch_indices``, and a 2-process
DDP run on CPU (gloo) gives each rank its own DistributedSampler shard — while every batch is made by
shmloader workers and lives in a shmloader slot."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
try:
    import lightning.pytorch  # noqa: F401
except ImportError as exc:
    pytest.skip(f"lightning is not installed ({exc})", allow_module_level=True)
except RuntimeError as exc:  # e.g. a CUDA torchvision wheel beside CPU torch breaks torchmetrics' import
    pytest.skip(f"lightning is installed but fails to import: {exc} (a torchvision build that does not match "
                "torch, imported through torchmetrics, raises this)", allow_module_level=True)

from tree_run import run_tree  # noqa: E402
from lightning_app import (  # noqa: E402
    PREDICT_SAMPLES,
    SEED,
    TRAIN_SAMPLES,
    Data,
    IndexWriter,
    Recorder,
    trainer,
)
from lightning_app import L as lightning  # type: ignore[no-redef]  # noqa: E402  # lightning.pytorch
from torch.utils import data as tdata  # noqa: E402

import shmloader.torch as st  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's few-workers / no-logger hints
              pytest.mark.filterwarnings("ignore:.*LeafSpec")]  # lightning 2.6 vs torch 2.13
HERE = Path(__file__).parent


def _stages(loader_cls: type, root: Path) -> tuple[dict[str, list[dict[str, Any]]], list[list[int]], Any]:
    """fit (2 epochs, with sanity validation), validate and predict, each on a fresh seed."""
    model, writer = Recorder(), IndexWriter()
    lightning.seed_everything(SEED)
    trainer(str(root), max_epochs=2).fit(model, datamodule=Data(loader_cls))
    lightning.seed_everything(SEED)
    trainer(str(root)).validate(model, datamodule=Data(loader_cls))
    lightning.seed_everything(SEED)
    predicting = trainer(str(root), callbacks=[writer])
    predicting.predict(model, datamodule=Data(loader_cls), return_predictions=False)
    return model.seen, writer.batch_indices, predicting.predict_dataloaders


def _indices(batches: list[dict[str, Any]]) -> list[list[int]]:
    return [b["index"] for b in batches]


@pytest.mark.timeout(240)
def test_fit_validate_predict_see_torchs_batches_from_shmloader_workers(tmp_path: Path) -> None:
    ours, our_writer, our_predict_loader = _stages(st.DataLoader, tmp_path / "shmloader")
    torchs, torch_writer, _ = _stages(tdata.DataLoader, tmp_path / "torch")

    assert len(ours["train"]) == 2 * 3  # 2 epochs of 12 samples in batches of 4
    for stage in ("train", "validate", "predict"):
        assert _indices(ours[stage]) == _indices(torchs[stage]), stage
        assert all(b["shm_worker"] and b["in_slot"] for b in ours[stage]), stage
        assert not any(b["in_slot"] for b in torchs[stage]), stage  # the check tells the two apart
        assert all(os.getpid() not in b["pids"] for b in ours[stage]), stage
    epoch_1 = [i for b in ours["train"][:3] for i in b["index"]]
    assert sorted(epoch_1) == list(range(TRAIN_SAMPLES)) and epoch_1 != list(range(TRAIN_SAMPLES))

    # Lightning re-instantiated our loader with its index-tracking batch sampler, as it does torch's
    assert type(our_predict_loader) is st.DataLoader
    assert type(our_predict_loader.batch_sampler).__name__ == "_IndexBatchSamplerWrapper"
    assert our_writer == torch_writer == _indices(ours["predict"])
    assert sorted(i for b in our_writer for i in b) == list(range(PREDICT_SAMPLES))


@pytest.mark.timeout(120)
def test_lightnings_own_reinstantiation_of_a_loader_made_outside_the_hooks() -> None:
    from framework_helpers import Indexed, batch_record
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader

    ds = Indexed(TRAIN_SAMPLES)
    loader = st.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, slot_bytes=1 << 20)
    sampler: tdata.distributed.DistributedSampler[int] = tdata.distributed.DistributedSampler(
        ds, num_replicas=2, rank=1, shuffle=True, seed=SEED)
    # _update_dataloader is typed to give torch's DataLoader; it gives the loader's own class (ours)
    rebuilt: Any = _update_dataloader(loader, sampler)  # read back from public attributes: no saved args here
    assert type(rebuilt) is st.DataLoader and rebuilt.sampler is sampler and rebuilt.slot_bytes == 1 << 20
    records = [batch_record(b) for b in rebuilt]
    assert [i for r in records for i in r["index"]] == list(sampler)
    assert all(r["shm_worker"] and r["in_slot"] for r in records)
    predicting: Any = _update_dataloader(loader, tdata.SequentialSampler(ds), mode=RunningStage.PREDICTING)
    assert type(predicting.batch_sampler).__name__ == "_IndexBatchSamplerWrapper"
    assert [b["index"].tolist() for b in predicting] == predicting.batch_sampler.seen_batch_indices
    for made in (loader, rebuilt, predicting):
        made.close()


@pytest.mark.timeout(300)
def test_ddp_on_two_cpu_processes_gives_each_rank_its_own_shard(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's hostname-based interface choice is flaky on CI runners
    run = run_tree([sys.executable, str(HERE / "lightning_app.py"), str(tmp_path)], timeout=280, env=env,
                   cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]

    shards = []
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["world_size"] == 2 and record["loader"] == "shmloader.torch.loader.DataLoader"
        assert record["sampler"] == "DistributedSampler"
        got = [i for b in record["batches"] for i in b["index"]]
        # exactly the shard Lightning gives torch's loader: DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED)
        # a range in the dataset's place (only its length counts): torch's stubs want a Dataset
        expected: tdata.distributed.DistributedSampler[int] = tdata.distributed.DistributedSampler(
            range(TRAIN_SAMPLES), num_replicas=2, rank=rank, shuffle=True, seed=SEED)  # type: ignore[arg-type]
        assert got == list(expected)
        assert all(b["shm_worker"] and b["in_slot"] and record["pid"] not in b["pids"] for b in record["batches"])
        shards.append(set(got))
    assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == set(range(TRAIN_SAMPLES))
