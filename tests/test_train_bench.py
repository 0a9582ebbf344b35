"""Tests of ``python -m shmloader bench --train``: its options, its parts, and one quick whole run.

The whole run starts a fresh interpreter on the CPU with ``--quick`` (the small CNN, tiny images)
and reads the JSON document on stdout. No test asserts on speed: only the structure of the output,
that every figure is positive, and that the fractions follow from the recorded rounds.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from shmloader.cli import bench, train  # noqa: E402
from shmloader.cli.train import TrainRun, format_train, summarize_feeds  # noqa: E402
from shmloader.cli.trainstep import (  # noqa: E402
    CLASSES,
    SyntheticImages,
    load_model,
    make_step,
    open_feed,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
FEEDS = ["torch", "shmloader", "ceiling"]


def _torchvision_usable() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent, or a CUDA wheel beside the CPU torch
        return False
    return True


# --- one whole run -------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_quick_run_on_cpu_reports_each_feed_and_its_fraction_of_the_ceiling() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "shmloader", "bench", "--train", "--quick", "--device", "cpu",
         "--repeat", "2", "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc) == {"header", "results", "summaries"}
    header = doc["header"]
    assert header["device"] == "cpu" and header["model"].startswith("small CNN")
    assert (header["batch_size"], header["steps"], header["repeat"]) == (8, 3, 2)
    assert header["pin_memory"] is False  # pinning means nothing without a GPU
    # Every feed once per round, the order rotating by round.
    assert [(r["round_index"], r["feed"]) for r in doc["results"]] == [
        (0, "torch"), (0, "shmloader"), (0, "ceiling"), (1, "shmloader"), (1, "ceiling"), (1, "torch")]
    for r in doc["results"]:
        assert r["error"] is None and r["leftover_children"] == 0
        assert r["seconds"] > 0 and r["images_per_s"] == pytest.approx(3 * 8 / r["seconds"])
    summaries = {s["feed"]: s for s in doc["summaries"]}
    assert list(summaries) == FEEDS
    ceiling = summaries["ceiling"]["images_per_s"]["median"]
    for s in summaries.values():
        rate = s["images_per_s"]
        assert rate["n"] == 2 and 0 < rate["low"] <= rate["median"] <= rate["high"]
        assert s["fraction_of_ceiling"] == pytest.approx(rate["median"] / ceiling)
    assert summaries["ceiling"]["fraction_of_ceiling"] == 1.0
    for label in ("torch DataLoader", "shmloader.torch.DataLoader + to_device", "ceiling"):
        assert label in proc.stderr  # the table went to stderr
    assert "of ceiling" in proc.stderr


# --- options -------------------------------------------------------------------------------------


def test_defaults_follow_the_device_and_quick() -> None:
    cpu = train.parse_args(["--device", "cpu"])
    assert (cpu.device, cpu.batch_size, cpu.image_size, cpu.warmup, cpu.repeat) == ("cpu", 32, 64, 3, 3)
    assert cpu.model == "auto" and cpu.workers >= 1
    quick = train.parse_args(["--device", "cpu", "--quick"])
    assert (quick.batch_size, quick.image_size, quick.steps, quick.repeat, quick.model) == (8, 32, 3, 1, "small")
    mixed = train.parse_args(["--device", "cpu", "--quick", "--batch-size", "4", "--workers", "0"])
    assert (mixed.batch_size, mixed.workers, mixed.image_size) == (4, 0, 32)  # flags beat --quick
    cuda = train.parse_args(["--device", "cuda"])
    assert (cuda.batch_size, cuda.image_size) == (256, 224)  # ResNet-18-size work on a GPU


@pytest.mark.parametrize(
    "argv",
    [["--batch-size", "0"], ["--steps", "x"], ["--workers", "-1"], ["--model", "vgg"],
     ["--start-method", "thread"], ["--device", "tpu:0"]],
)  # fmt: skip
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--train", *argv]) == 2
    assert capsys.readouterr().err.strip()


def test_cuda_without_cuda_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert train.main(["--device", "cuda", "--quick"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_resnet18_without_torchvision_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    if _torchvision_usable():
        pytest.skip("torchvision imports here")
    assert train.main(["--device", "cpu", "--model", "resnet18"]) == 2
    assert "--model resnet18 needs torchvision" in capsys.readouterr().err


def test_bench_hands_train_to_the_training_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("shmloader.cli.train")

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 7

    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "shmloader.cli.train", fake)
    monkeypatch.setattr("shmloader.cli.train", fake)
    assert bench.main(["--quick", "--train", "--steps", "2"]) == 7
    assert seen == [["--quick", "--steps", "2"]]


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--train", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--batch-size", "--image-size", "--steps", "--workers", "--quick"))


# --- parts ---------------------------------------------------------------------------------------


def test_dataset_samples_and_pickles_without_its_cache() -> None:
    dataset = SyntheticImages(length=20, image_size=16)
    images = {dataset[i][0].tobytes() for i in range(16)}
    image, label = dataset[19]
    assert image.shape == (16, 16, 3) and image.dtype == np.uint8 and image.flags.c_contiguous
    assert label == 19 % CLASSES and isinstance(label, np.int64)
    assert len(images) > 1
    payload = pickle.dumps(dataset)
    assert len(payload) < 1024
    copy = pickle.loads(payload)
    assert len(copy) == 20 and copy[0][0].shape == (16, 16, 3)
    with pytest.raises(IndexError):
        dataset[20]


@pytest.mark.parametrize("image_size", [1, 2])
def test_a_flipped_image_is_a_real_copy_whatever_its_size(image_size: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr("random.random", lambda: 0.0)  # every sample flipped
    dataset = SyntheticImages(length=4, image_size=image_size)
    image, _ = dataset[0]
    assert image.flags.c_contiguous and image.flags.owndata and min(image.strides) >= 0
    assert torch.from_numpy(image).shape == (image_size, image_size, 3)  # torch refuses negative strides
    np.testing.assert_array_equal(image, dataset._make_image(0)[:, ::-1])


def test_small_model_step_changes_the_weights() -> None:
    model, text = load_model("small")
    assert text == "small CNN"
    step = make_step(model, torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    images = torch.randint(0, 255, (4, 16, 16, 3), dtype=torch.uint8)
    step(images, torch.tensor([0, 1, 2, 3]))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("feed", FEEDS)
def test_each_feed_yields_one_epoch_of_batches_on_the_device(feed: str) -> None:
    dataset = SyntheticImages(length=3 * 4 + 2, image_size=8)  # drop_last: 3 batches
    batches, loader = open_feed(feed, dataset, batch_size=4, workers=1, start_method="fork",
                                device=torch.device("cpu"))  # fmt: skip
    try:
        got = list(batches)
    finally:
        del batches  # it holds the loader's workers
        if loader is not None and hasattr(loader, "close"):
            loader.close()
    assert len(got) == 3
    for images, labels in got:
        assert images.shape == (4, 8, 8, 3) and images.dtype == torch.uint8
        assert labels.shape == (4,) and labels.dtype == torch.int64


def test_summaries_and_table() -> None:
    def run(feed: str, r: int, seconds: float, error: str | None = None) -> TrainRun:
        return TrainRun(feed, r, batch_size=10, steps=10, seconds=seconds, error=error)

    runs = [run("torch", 0, 2.0), run("ceiling", 0, 1.0), run("torch", 1, 4.0), run("ceiling", 1, 1.0),
            run("shmloader", 0, 0.0, "RuntimeError: boom")]
    by_feed: dict[str, Any] = {s.feed: s for s in summarize_feeds(runs)}
    assert by_feed["torch"].images_per_s.median == pytest.approx(37.5)  # median of 50 and 25
    assert by_feed["torch"].fraction_of_ceiling == pytest.approx(0.375)
    assert by_feed["torch"].images_per_s.wide  # 25..50 around 37.5
    assert by_feed["shmloader"].images_per_s is None and by_feed["shmloader"].failed_rounds == 1
    text = format_train(runs)
    assert "37.5%" in text and "67% !" in text and "failed" in text and "RuntimeError: boom" in text
