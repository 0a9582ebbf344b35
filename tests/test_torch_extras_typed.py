"""The torch flavour's extra options are declared attributes, typed as its ``__init__`` takes them.

``shmloader.torch.DataLoader`` keeps each shmloader option as an attribute (Lightning and
accelerate re-instantiate the loader from its attributes). Set by name in ``__init__``, they were
unknown to a type checker: a user's ``loader.slot_bytes`` was a mypy error in a typed package.
"""

from __future__ import annotations

import inspect

import pytest

torch_loader = pytest.importorskip("shmloader.torch.loader")


def test_every_extra_option_is_a_declared_attribute_of_its_parameters_type() -> None:
    hints = inspect.get_annotations(torch_loader.DataLoader)
    params = inspect.signature(torch_loader._ShmDataLoader.__init__).parameters
    assert set(torch_loader.EXTRA_OPTIONS) <= set(hints)
    for name in torch_loader.EXTRA_OPTIONS:
        assert hints[name] == params[name].annotation, name
