"""``None`` passed for one of shmloader's own options means what leaving it out means.

The defect: the signature shows ``None`` as the default of every shmloader option (``slot_bytes``
... ``log_level``), yet ``DataLoader(ds, task_timeout_s=None)`` raised ``ConfigError:
task_timeout_s=None is not a number``: a wrapper that forwards its own ``None`` defaults, or code
that rebuilds a loader from ``inspect.signature`` defaults, broke. Now an explicit ``None`` is
unset: the ``SHMLOADER_*`` variable applies, else the default.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import shmloader
from shmloader.config_fields import FIELDS

TORCH_NAMES = set(inspect.signature(lambda dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                                    num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, timeout=0,
                                    worker_init_fn=None, multiprocessing_context=None, generator=None,
                                    prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                                    in_order=True: None).parameters)
OWN = [f for f in FIELDS if f.name not in TORCH_NAMES]


def test_every_own_option_shows_none_as_its_default() -> None:
    params = inspect.signature(shmloader.DataLoader.__init__).parameters
    assert OWN and all(params[f.name].default is None for f in OWN)


@pytest.mark.parametrize("name", [f.name for f in OWN])
def test_none_is_the_default(name: str) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(list(range(4)), **{name: None})
    field = next(f for f in OWN if f.name == name)
    assert getattr(loader._config, name) == field.default
    assert loader._config.provenance[name] == "default"


def test_none_leaves_the_variable_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMLOADER_MAX_RESTARTS", "5")
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(list(range(4)), max_restarts=None)
    assert loader._config.max_restarts == 5 and loader._config.provenance["max_restarts"] == "environment"


def test_a_loader_rebuilt_from_the_signatures_defaults() -> None:
    params = inspect.signature(shmloader.DataLoader.__init__).parameters
    defaults = {n: p.default for n, p in params.items() if n not in ("self", "dataset") and p.default is not p.empty}
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(list(range(4)), **defaults)
    assert list(loader) == [0, 1, 2, 3] or [int(b) for b in loader] == [0, 1, 2, 3]
