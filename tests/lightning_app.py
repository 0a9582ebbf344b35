"""The Lightning pieces test_lightning uses, and (run as a script) its 2-process DDP run.

``python tests/lightning_app.py OUT_DIR`` fits :class:`Recorder` for one epoch with
``Trainer(strategy="ddp", devices=2, accelerator="cpu")`` (gloo) on :class:`Data` made of
``shmloader.torch.DataLoader``; Lightning re-launches the script for rank 1. Each rank writes
``OUT_DIR/rank<N>.json``: the loader and sampler Lightning used and every training batch it saw.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from typing import Any

import lightning.pytorch as L
import torch
from framework_helpers import Indexed, batch_record
from lightning.pytorch.callbacks import BasePredictionWriter

SEED = 1234
TRAIN_SAMPLES, VAL_SAMPLES, PREDICT_SAMPLES = 12, 6, 7


class Recorder(L.LightningModule):
    """A one-layer model that records every batch it is given, per stage (``seen[stage]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: dict[str, list[dict[str, Any]]] = defaultdict(list)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.seen["train"].append(batch_record(batch))
        return self.layer(batch["x"]).sum()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.seen["validate"].append(batch_record(batch))

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.seen["predict"].append(batch_record(batch))
        return batch["index"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(L.LightningDataModule):
    """Shuffled training, sequential validation and prediction, each with ``num_workers=2``."""

    def __init__(self, loader_cls: type) -> None:
        super().__init__()
        self.loader_cls = loader_cls

    def train_dataloader(self) -> Any:
        return self.loader_cls(Indexed(TRAIN_SAMPLES), batch_size=4, shuffle=True, num_workers=2)

    def val_dataloader(self) -> Any:
        return self.loader_cls(Indexed(VAL_SAMPLES), batch_size=4, num_workers=2)

    def predict_dataloader(self) -> Any:
        return self.loader_cls(Indexed(PREDICT_SAMPLES), batch_size=3, num_workers=2)


class IndexWriter(BasePredictionWriter):
    """Keeps the ``batch_indices`` Lightning hands a prediction writer for each batch."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.batch_indices: list[list[int]] = []

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, batch_indices: Any, batch: Any,
                           batch_idx: int, dataloader_idx: int = 0) -> None:
        self.batch_indices.append([int(i) for i in batch_indices])


def trainer(root: str, **kwargs: Any) -> L.Trainer:
    """A quiet CPU Trainer writing under ``root``."""
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=root, **kwargs)


def _ddp_main(out_dir: str) -> None:
    import shmloader.torch as st

    L.seed_everything(SEED)
    model = Recorder()
    run = trainer(out_dir, strategy="ddp", devices=2, max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0)
    run.fit(model, datamodule=Data(st.DataLoader))
    loader = run.train_dataloader
    assert loader is not None
    record = {"rank": run.global_rank, "world_size": run.world_size, "pid": os.getpid(),
              "loader": f"{type(loader).__module__}.{type(loader).__qualname__}",
              "sampler": type(loader.sampler).__name__, "batches": model.seen["train"]}
    with open(os.path.join(out_dir, f"rank{run.global_rank}.json"), "w") as out:
        json.dump(record, out)


if __name__ == "__main__":
    _ddp_main(sys.argv[1])
