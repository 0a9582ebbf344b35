"""A ``shmloader_pin_backend`` answer that is not a pin backend is a ``PluginError`` naming the plugin.

Before this test a plugin that answered with something else (a bool, a number, a backend class
instead of an instance) was taken as the loader's backend, and ``iter(loader)`` failed deep
inside with ``AttributeError: 'int' object has no attribute 'device_pinned'``, naming neither the
plugin nor the hook. The answer is now checked where the backend is chosen, as a
``shmloader_collate_rules`` result is, and the iterator that was starting leaves nothing behind.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.errors import PluginError
from shmloader.gpu.fake import FakeBackend


class Answers:
    """Answers ``shmloader_pin_backend`` with ``answer``."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def shmloader_pin_backend(self, device: str) -> Any:
        return self.answer


class Passes:
    def shmloader_pin_backend(self) -> None:
        return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("answer", [42, True, FakeBackend], ids=["int", "bool", "a class"])
def test_an_answer_that_is_not_a_backend_names_the_plugin_and_the_hook(answer: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "no accelerator" warning where there is none
        loader: shmloader.DataLoader[Any] = shmloader.DataLoader(np.arange(8), batch_size=2, num_workers=2,
                                                                 pin_memory=True, plugins=[Passes(), Answers(answer)])
        with loader, pytest.raises(PluginError) as caught:
            iter(loader)
    assert (caught.value.plugin, caught.value.hook) == ("Answers", "shmloader_pin_backend")
    assert "must return a pin backend" in str(caught.value)
