"""``load_state_dict`` while an iterator of the loader is live: that iterator is closed.

Loading restores the sampler, dataset and generator states every iterator of the loader draws
from, so an iterator made before could not go on with its own epoch: ``load_state_dict`` closes
every live iterator (persistent or not, with or without workers), whose next ``next()`` raises
``LoaderClosed``, and the next ``iter(loader)`` resumes the loaded state exactly
(docs/resume.md, "Notes").
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import shmloader
from shmloader.errors import LoaderClosed

DATA = np.arange(46.0).reshape(23, 2)


def _loader(num_workers: int, persistent: bool = False) -> shmloader.DataLoader:
    return shmloader.DataLoader(DATA, batch_size=3, shuffle=True, generator=5, num_workers=num_workers,
                                persistent_workers=persistent)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_loading_closes_the_live_iterator_and_resumes_the_loaded_state(num_workers: int, persistent: bool) -> None:
    reference = _loader(0)
    uninterrupted = [b.tolist() for b in reference]
    saving = _loader(0)
    it = iter(saving)
    before = [next(it).tolist() for _ in range(3)]
    state = json.loads(json.dumps(saving.state_dict()))
    loader = _loader(num_workers, persistent)
    try:
        live = iter(loader)
        next(live)
        loader.load_state_dict(state)
        with pytest.raises(LoaderClosed, match="stopped by close"):
            next(live)
        assert before + [b.tolist() for b in loader] == uninterrupted
    finally:
        loader.close()
