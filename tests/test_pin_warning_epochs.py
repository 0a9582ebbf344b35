"""How often ``pin_memory=True`` without an accelerator warns, side by side with torch 2.13.

torch gives "'pin_memory' argument is set as true but no accelerator is found" in
``_BaseDataLoaderIter.__init__``, so at each iterator it makes: every ``iter(loader)``, but only the
first with ``persistent_workers=True`` (later epochs ``_reset`` the same iterator). Under
``warnings.simplefilter("always")`` both loaders give it as many times over three epochs, the numpy
flavour too (its words are torch's, docs/gpu.md). Under Python's default filter both show it once
per code location, so once.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402

import shmloader  # noqa: E402
import shmloader.torch as st  # noqa: E402
from shmloader.gpu import pinning  # noqa: E402

pytestmark = pytest.mark.skipif(torch.accelerator.is_available(), reason="torch sees an accelerator here: no warning")

EPOCHS = 3
OPTIONS: dict[str, dict[str, Any]] = {  # name -> the loader's options besides pin_memory=True
    "no workers": {},
    "workers": {"num_workers": 2},
    "persistent workers": {"num_workers": 2, "persistent_workers": True},
    "pin_memory_device": {"num_workers": 1, "pin_memory_device": "cpu"},
}


def _warnings_over_epochs(cls: type, dataset: Any, options: dict[str, Any],
                          action: Literal["always", "default"] = "always") -> list[str]:
    """The words of each pin warning ``EPOCHS`` epochs give under ``action``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        loader = cls(dataset, batch_size=2, pin_memory=True, **options)
        try:
            batches = sum(1 for _ in range(EPOCHS) for _batch in loader)
        finally:
            if isinstance(loader, shmloader.DataLoader):
                loader.close()
            elif loader._iterator is not None:
                loader._iterator._shutdown_workers()
    assert batches == 2 * EPOCHS
    return [str(w.message) for w in caught if str(w.message).startswith(("'pin_memory'", "pin_memory_device"))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(OPTIONS))
def test_no_accelerator_warns_at_each_iterator_as_torchs(case: str) -> None:
    options = OPTIONS[case]
    theirs = _warnings_over_epochs(tdata.DataLoader, tdata.TensorDataset(torch.arange(4.0)), options)
    expected = 1 if options.get("persistent_workers") else EPOCHS
    assert theirs.count(pinning.NO_ACCELERATOR) == expected, theirs  # what torch 2.13 does
    ours = _warnings_over_epochs(st.DataLoader, tdata.TensorDataset(torch.arange(4.0)), options)
    assert ours == theirs
    numpy_flavour = _warnings_over_epochs(shmloader.DataLoader, [np.float32(i) for i in range(4)], options)
    assert numpy_flavour == theirs


@pytest.mark.timeout(120)
def test_the_default_filter_shows_it_once_as_torchs() -> None:
    dataset = tdata.TensorDataset(torch.arange(4.0))
    for cls in (tdata.DataLoader, st.DataLoader):
        assert _warnings_over_epochs(cls, dataset, OPTIONS["workers"], "default") == [pinning.NO_ACCELERATOR], cls
