"""The public surface is exactly ``__all__``, and importing shmloader imports neither torch nor cupy."""

from __future__ import annotations

import subprocess
import sys

import pytest

import shmloader

EXPECTED = {
    "ArrayDataset", "BatchSampler", "ChainDataset", "ConcatDataset", "ConfigError", "DataLoader", "Dataset",
    "DescriptorError", "DistributedSampler", "IterableDataset", "LoaderClosed", "LoaderError", "PluginError", "PoisonTask",
    "RandomSampler", "RestartBudgetExceeded", "RingExhausted", "Sampler", "SequentialSampler", "ShmSpaceError", "ShmloaderWarning",
    "StackDataset", "StateError", "Subset", "SubsetRandomSampler", "TensorDataset", "TooManyOpenFiles",
    "WeightedRandomSampler",
    "WorkerDied", "WorkerHung", "WorkerInfo", "WorkerTimeout", "default_collate", "default_convert",
    "get_worker_info", "hookimpl", "random_split", "to_device", "__version__",
}


def test_all_is_exactly_the_public_surface():
    assert set(shmloader.__all__) == EXPECTED
    for name in shmloader.__all__:
        assert getattr(shmloader, name) is not None


def test_runtime_errors_subclass_what_torch_users_catch():
    for cls in (shmloader.WorkerDied, shmloader.WorkerTimeout, shmloader.PoisonTask, shmloader.WorkerHung,
                shmloader.RestartBudgetExceeded, shmloader.ShmSpaceError, shmloader.TooManyOpenFiles):
        assert issubclass(cls, RuntimeError)
    assert issubclass(shmloader.TooManyOpenFiles, OSError)  # its errno, as the OSError it was
    assert issubclass(shmloader.ConfigError, ValueError) and issubclass(shmloader.StateError, ValueError)


@pytest.mark.timeout(60)
def test_import_does_not_import_torch_or_cupy():
    code = "import sys, shmloader; print('torch' in sys.modules, 'cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_torch_flavour_exports_torch_collate_and_convert():
    torch = pytest.importorskip("torch")
    import numpy as np

    from shmloader.torch import default_collate, default_convert

    assert isinstance(default_convert(np.zeros(2)), torch.Tensor)  # as torch's default_convert
    assert torch.equal(default_collate([np.ones(2), np.ones(2)]), torch.ones(2, 2, dtype=torch.float64))


def test_every_error_class_is_in_the_errors_page():
    """docs/errors.md shows each error a user can meet: in the tree, and in the table with when it
    is raised and what to do."""
    import inspect
    from pathlib import Path

    from shmloader import errors
    from shmloader.collate import CollateShapeError

    page = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
    tree = page.split("```")[1]
    table_names = {line.split("`")[1] for line in page.splitlines() if line.startswith("| `")}
    classes = {name for name, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == errors.__name__
               and not name.startswith("_")} | {CollateShapeError.__name__}
    assert not {c for c in classes if c not in tree} - {"CollateShapeError"}, "missing from the tree"
    assert not classes - {"LoaderError"} - table_names, "missing from the table"
