"""The training benchmark's parts: a synthetic image dataset, the model, one training step, three feeds.

Owns what ``python -m shmloader bench --train`` trains and how each feed delivers batches to the
device. Runs in the benchmark's main process; :class:`SyntheticImages` also runs, pickled, in
loader workers (fork, spawn or forkserver), which is why it lives at module level and rebuilds its
cache after unpickling. torch is imported when a function here is called, not on import.

The three feeds of the same training step:

- ``torch``: ``torch.utils.data.DataLoader`` (``pin_memory=True`` on a CUDA device), each batch
  moved with ``.to(device, non_blocking=True)``, as torch's docs advise;
- ``shmloader``: ``shmloader.torch.DataLoader`` with the same arguments, through
  ``shmloader.to_device`` (the next batch is copied while the model works on this one);
- ``ceiling``: the same kind of batches, collated once and already on the device, cycled: the
  rate of the step alone, which no loader can beat.

Promises: both loaders get identical arguments and the same dataset; a feed yields exactly
``warmup + steps`` batches of ``(images uint8[N,H,W,3], labels int64[N])`` on the device.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np

__all__ = ["CLASSES", "SyntheticImages", "load_model", "make_step", "open_feed", "FEEDS"]

CLASSES = 1000  # ImageNet-sized classifier head
FEEDS = ("torch", "shmloader", "ceiling")
_DISTINCT_IMAGES = 8  # cached images a dataset cycles through
_CEILING_BATCHES = 4  # distinct batches the ceiling cycles through


class SyntheticImages:
    """``length`` samples ``(uint8[size, size, 3] image, int64 label)``, flipped at random.

    The images are a few cached arrays (built on first use in each process, never pickled); the
    random horizontal flip (Python's ``random``, which both loaders seed per worker) copies the
    image, as a real augmentation does.
    """

    def __init__(self, length: int, image_size: int) -> None:
        if length < 0 or image_size < 1:
            raise ValueError(f"need length >= 0 and image_size >= 1, got {length} and {image_size}")
        self.length = length
        self.image_size = image_size
        self._cache: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int64]:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for a dataset of {self.length}")
        if self._cache is None:
            self._cache = [self._make_image(k) for k in range(_DISTINCT_IMAGES)]
        image = self._cache[index % _DISTINCT_IMAGES]
        if random.random() < 0.5:
            # a real copy: ascontiguousarray hands back the negative-stride view itself when the
            # flipped axis has length 1 (numpy calls it contiguous), and torch refuses those
            image = image[:, ::-1].copy()
        return image, np.int64(index % CLASSES)

    def __getstate__(self) -> dict[str, Any]:
        return {"length": self.length, "image_size": self.image_size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.length = state["length"]
        self.image_size = state["image_size"]
        self._cache = None

    def _make_image(self, k: int) -> np.ndarray:
        count = self.image_size * self.image_size * 3
        values = (np.arange(count, dtype=np.int64) * 7 + k) % 251
        return values.astype(np.uint8).reshape(self.image_size, self.image_size, 3)


def load_model(choice: str) -> tuple[Any, str]:
    """The model and its description: torchvision's ResNet-18 when asked for or, with ``auto``,
    when torchvision imports; else :func:`small_cnn`. Raises ImportError for ``resnet18`` without
    a working torchvision."""
    if choice in ("auto", "resnet18"):
        try:
            from torchvision.models import resnet18
        except Exception as exc:  # a CUDA torchvision wheel beside a CPU torch fails at import
            if choice == "resnet18":
                raise ImportError(f"--model resnet18 needs torchvision: {type(exc).__name__}: {exc}") from exc
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            return small_cnn(), f"small CNN (torchvision not usable: {reason})"
        return resnet18(num_classes=CLASSES), "torchvision ResNet-18"
    return small_cnn(), "small CNN"


def small_cnn() -> Any:
    """Three strided conv + batch-norm + ReLU blocks, global pooling, a linear head."""
    from torch import nn

    blocks: list[Any] = []
    for c_in, c_out in ((3, 32), (32, 64), (64, 128)):
        blocks += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c_out),
                   nn.ReLU(inplace=True)]  # fmt: skip
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, CLASSES))


def make_step(model: Any, device: Any) -> Callable[[Any, Any], None]:
    """One SGD step on a batch already on ``device``: uint8 NHWC -> float NCHW, forward, loss,
    backward, update (bfloat16 autocast and channels-last on CUDA)."""
    import torch
    import torch.nn.functional as F

    cuda = device.type == "cuda"
    model.to(device, memory_format=torch.channels_last if cuda else torch.contiguous_format)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(images: Any, labels: Any) -> None:
        x = images.permute(0, 3, 1, 2).float().div_(255)  # NHWC memory: channels-last already
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(model(x), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def open_feed(feed: str, dataset: SyntheticImages, batch_size: int, workers: int,
              start_method: str, device: Any) -> tuple[Iterator[Any], Any]:  # fmt: skip
    """An iterator of ``(images, labels)`` on ``device`` for one epoch, and the loader to close."""
    if feed == "ceiling":
        return _ceiling(dataset, batch_size, device), None
    kwargs: dict[str, Any] = {"batch_size": batch_size, "shuffle": True, "drop_last": True,
                              "num_workers": workers, "pin_memory": device.type == "cuda"}  # fmt: skip
    if workers > 0:
        kwargs.update(persistent_workers=True, multiprocessing_context=start_method)
    if feed == "torch":
        from torch.utils.data import DataLoader

        loader: Any = DataLoader(cast(Any, dataset), **kwargs)  # a map-style dataset by duck typing
        return _move_each(loader, device), loader
    if feed == "shmloader":
        import shmloader
        import shmloader.torch

        loader = shmloader.torch.DataLoader(dataset, **kwargs)
        return iter(shmloader.to_device(loader, str(device))), loader
    raise ValueError(f"unknown feed {feed!r}; expected one of {', '.join(FEEDS)}")


def _move_each(loader: Any, device: Any) -> Iterator[Any]:
    for images, labels in loader:
        yield images.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def _ceiling(dataset: SyntheticImages, batch_size: int, device: Any) -> Iterator[Any]:
    from torch.utils.data import default_collate

    count = min(_CEILING_BATCHES, len(dataset) // batch_size)
    batches = []
    for k in range(count):
        images, labels = default_collate([dataset[i] for i in range(k * batch_size, (k + 1) * batch_size)])
        batches.append((images.to(device), labels.to(device)))
    return itertools.islice(itertools.cycle(batches), len(dataset) // batch_size)
