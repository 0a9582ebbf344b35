"""Run as a script by tests/test_log_workers.py: logs from inside workers, per start method.

``python tests/log_worker_app.py SETUP`` configures logging in the main process as ``SETUP`` says
(see ``SETUPS``), then iterates a two-sample loader with one worker under fork, spawn and
forkserver in turn. The dataset logs a DEBUG and a WARNING record through a child of the
``shmloader`` logger from inside the worker; before each start method's run the script writes
``== METHOD`` to stderr, so the test can tell which run showed which record.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import shmloader
from shmloader.log import apply_log_level

METHODS = ("fork", "spawn", "forkserver")


class Talking(shmloader.Dataset):
    """Each sample logs one DEBUG and one WARNING record, from whichever process fetches it."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        log = logging.getLogger("shmloader.log_worker_app")
        log.debug("debug from sample %d", index)
        log.warning("warning from sample %d", index)
        return index


def configure(setup: str) -> None:
    """The main process's logging: what an application may have done before building a loader."""
    if setup == "debug":  # SHMLOADER_LOG_LEVEL=DEBUG's way: our own stderr handler
        apply_log_level("DEBUG")
    elif setup == "basic_info":  # the application's root handler; shmloader inherits INFO
        logging.basicConfig(level=logging.INFO)
    elif setup == "basic_error":  # a root handler, but shmloader is told to keep quiet
        logging.basicConfig(level=logging.DEBUG)
        logging.getLogger("shmloader").setLevel(logging.ERROR)
    else:
        assert setup == "none", setup


def main(setup: str) -> None:
    configure(setup)
    for method in METHODS:
        print(f"== {method}", file=sys.stderr, flush=True)
        loader: shmloader.DataLoader[Any]
        with shmloader.DataLoader(Talking(), batch_size=2, num_workers=1, multiprocessing_context=method) as loader:
            assert [b.tolist() for b in loader] == [[0, 1]]


if __name__ == "__main__":
    main(sys.argv[1])
