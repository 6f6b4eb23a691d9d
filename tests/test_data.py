"""Datasets and loaders: digits, synthetic, CIFAR (fake, on disk), ImageNet (fake folder), seeded loaders."""

from __future__ import annotations

import pickle
import urllib.error
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torchvision import transforms as T
from torchvision.datasets import utils as tv_utils

from adaloss.errors import ConfigError
from adaloss.runner.data import DATASET_NAMES, DatasetInfo, build_datasets, make_loader

DIGITS = {"name": "digits", "num_classes": 10, "image_size": 32, "test_fraction": 0.2, "split_seed": 0}
SYNTH = {
    "name": "synthetic",
    "num_classes": 4,
    "image_size": 16,
    "train_size": 64,
    "test_size": 32,
    "seed": 7,
}
CIFAR_MEAN, CIFAR_STD = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]


def cifar_cfg(name: str = "cifar10", **kw: object) -> dict:
    cfg = {"name": name, "num_classes": 10 if name == "cifar10" else 100, "image_size": 32}
    cfg |= {"download": False, "mean": CIFAR_MEAN, "std": CIFAR_STD, "augment": True}
    return cfg | kw


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> list:
    """Record (and refuse) any download attempt torchvision would make."""
    calls: list = []

    def refuse(*args: object, **kwargs: object) -> None:
        calls.append((args, kwargs))
        raise urllib.error.URLError("network disabled in tests")

    monkeypatch.setattr(tv_utils, "download_url", refuse)
    monkeypatch.setattr("torchvision.datasets.cifar.download_and_extract_archive", refuse)
    return calls


@pytest.fixture(scope="module")
def digits() -> tuple:
    return build_datasets(DIGITS, "unused")


# ---------------------------------------------------------------------------------------------- digits


def test_digits_sizes_and_shapes(digits: tuple) -> None:
    train, test, info = digits
    assert info == DatasetInfo("digits", 10, 32, 3, 1437, 360)
    assert info.input_shape == (3, 32, 32)
    assert (len(train), len(test)) == (1437, 360)
    x, y = train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert isinstance(y, int) and 0 <= y < 10
    torch.testing.assert_close(x[0], x[2])  # gray replicated to 3 channels


def test_digits_normalized_with_train_statistics(digits: tuple) -> None:
    train, test, _ = digits
    xs = train.images
    assert xs.mean(dim=(0, 2, 3)).abs().max() < 1e-4
    assert (xs.std(dim=(0, 2, 3)) - 1).abs().max() < 1e-3
    # The test split is normalized with the train statistics, so it is close to, not exactly, standard.
    assert test.images.mean().abs() < 0.1 and (test.images.std() - 1).abs() < 0.1


def test_digits_split_is_stratified_and_disjoint(digits: tuple) -> None:
    train, test, _ = digits
    from sklearn.datasets import load_digits

    totals = Counter(load_digits().target.tolist())
    test_counts = Counter(test.targets.tolist())
    train_counts = Counter(train.targets.tolist())
    for c in range(10):
        assert abs(test_counts[c] - 0.2 * totals[c]) <= 1
        assert train_counts[c] + test_counts[c] == totals[c]
    # No test image appears in the train split.
    train_rows = {tuple(r) for r in train.images[:, 0, ::4, ::4].flatten(1).round(decimals=4).tolist()}
    test_rows = [tuple(r) for r in test.images[:, 0, ::4, ::4].flatten(1).round(decimals=4).tolist()]
    assert sum(r in train_rows for r in test_rows) < 5  # the raw data has a few exact duplicates


def test_digits_split_is_deterministic_and_seeded(digits: tuple) -> None:
    train, test, _ = digits
    train2, test2, _ = build_datasets(OmegaConf.create(DIGITS), "unused")
    assert torch.equal(train.images, train2.images) and torch.equal(test.targets, test2.targets)
    train3, _, _ = build_datasets(DIGITS | {"split_seed": 1}, "unused")
    assert not torch.equal(train.targets, train3.targets)


def test_digits_augmentation_translates_without_flip(digits: tuple) -> None:
    plain, _, _ = digits
    train, _, _ = build_datasets(DIGITS | {"augment": True}, "unused")
    assert train.images.shape == (1437, 3, 36, 36)
    background = train.images[0, :, 0, 0]
    padded = train.images[5]
    torch.testing.assert_close(padded[:, 2:34, 2:34], plain.images[5])
    torch.manual_seed(0)
    crops = [train[5][0] for _ in range(40)]
    offsets = set()
    for crop in crops:
        assert crop.shape == (3, 32, 32)
        match = [
            (i, j) for i in range(5) for j in range(5) if torch.equal(padded[:, i : i + 32, j : j + 32], crop)
        ]
        assert match, "an augmented sample must be a translated window of the padded image"
        offsets.add(match[0])
    assert len(offsets) > 5
    # The padding is the normalized background (a blank pixel), the same value as the image's blank corner.
    torch.testing.assert_close(background, plain.images[:, :, 0, 0].min(dim=0).values)


def test_digits_bad_fields() -> None:
    with pytest.raises(ConfigError, match="test_fraction"):
        build_datasets(DIGITS | {"test_fraction": 1.5}, "unused")
    with pytest.raises(ConfigError, match="num_classes"):
        build_datasets(DIGITS | {"num_classes": 3}, "unused")


# ------------------------------------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_and_learnable() -> None:
    train, test, info = build_datasets(SYNTH, "unused")
    assert info == DatasetInfo("synthetic", 4, 16, 3, 64, 32)
    train2, test2, _ = build_datasets(OmegaConf.create(SYNTH), "unused")
    assert torch.equal(train.images, train2.images) and torch.equal(test.targets, test2.targets)
    other, _, _ = build_datasets(SYNTH | {"seed": 8}, "unused")
    assert not torch.equal(train.images, other.images)
    assert Counter(train.targets.tolist()) == {c: 16 for c in range(4)}
    # Nearest class mean from the train split classifies the test split: the signal is there.
    means = torch.stack([train.images[train.targets == c].mean(0).flatten() for c in range(4)])
    pred = torch.cdist(test.images.flatten(1), means).argmin(1)
    assert (pred == test.targets).float().mean() > 0.9


# ----------------------------------------------------------------------------------------------- CIFAR


def write_fake_cifar10(root: Path, per_batch: int = 4, n_test: int = 6) -> np.ndarray:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    first = None
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = n_test if name == "test_batch" else per_batch
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        first = data if name == "test_batch" else first
        with open(folder / name, "wb") as fh:
            pickle.dump({"data": data, "labels": [int(v) for v in rng.integers(0, 10, n)]}, fh)
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, fh)
    return first


def test_cifar_missing_data_error_names_path_and_remedies(tmp_path: Path, no_network: list) -> None:
    with pytest.raises(ConfigError) as info:
        build_datasets(cifar_cfg(), tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert str(tmp_path.resolve()) in message and "cifar-10-batches-py/" in message
    assert "put the dataset there" in message and "dataset.download=true" in message
    assert no_network == []

    with pytest.raises(ConfigError, match="cifar-100-python/"):
        build_datasets(cifar_cfg("cifar100"), tmp_path)
    assert no_network == []


def test_cifar_incomplete_data_is_reported(tmp_path: Path) -> None:
    write_fake_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(ConfigError, match="incomplete.*data_batch_3"):
        build_datasets(cifar_cfg(), tmp_path)


def test_cifar_failed_download_is_a_config_error(tmp_path: Path, no_network: list) -> None:
    with pytest.raises(ConfigError, match="could not download CIFAR-10"):
        build_datasets(cifar_cfg(download=True), tmp_path)
    assert len(no_network) == 1  # download=true is the only way to reach the network


def test_fake_cifar10_loads_with_the_he_et_al_transforms(tmp_path: Path, no_network: list) -> None:
    test_data = write_fake_cifar10(tmp_path)
    train, test, info = build_datasets(cifar_cfg(), str(tmp_path))
    assert info == DatasetInfo("cifar10", 10, 32, 3, 20, 6)
    assert train.classes[0] == "class0"
    x, y = train[0]
    assert x.shape == (3, 32, 32) and isinstance(y, int)
    kinds = [type(t) for t in train.transform.transforms]
    assert kinds == [T.RandomCrop, T.RandomHorizontalFlip, T.ToTensor, T.Normalize]
    assert train.transform.transforms[0].padding == 4
    # The eval transform is exactly ToTensor + Normalize.
    x, _ = test[0]
    raw = torch.from_numpy(test_data[0].reshape(3, 32, 32)).float() / 255
    expected = (raw - torch.tensor(CIFAR_MEAN).view(3, 1, 1)) / torch.tensor(CIFAR_STD).view(3, 1, 1)
    torch.testing.assert_close(x, expected)
    # Already present: download=true does not touch the network either.
    build_datasets(cifar_cfg(download=True, augment=False), tmp_path)
    assert no_network == []


def test_fake_cifar100_loads(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name, n in (("train", 5), ("test", 3)):
        data = np.zeros((n, 3072), dtype=np.uint8)
        with open(folder / name, "wb") as fh:
            pickle.dump({"data": data, "fine_labels": list(range(n)), "coarse_labels": [0] * n}, fh)
    with open(folder / "meta", "wb") as fh:
        pickle.dump({"fine_label_names": [f"c{i}" for i in range(100)]}, fh)
    train, test, info = build_datasets(cifar_cfg("cifar100", augment=False), tmp_path)
    assert (info.num_classes, info.train_size, info.test_size) == (100, 5, 3)
    assert train[4][1] == 4


def test_corrupt_cifar_is_a_config_error(tmp_path: Path) -> None:
    write_fake_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_2").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match="corrupted"):
        build_datasets(cifar_cfg(), tmp_path)


def test_cifar_wrong_fields(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="num_classes"):
        build_datasets(cifar_cfg(num_classes=100), tmp_path)
    with pytest.raises(ConfigError, match="mean"):
        build_datasets(cifar_cfg(mean=[0.5, 0.5]), tmp_path)


# -------------------------------------------------------------------------------------------- ImageNet


def write_fake_imagenet(root: Path, classes: tuple[str, ...] = ("n01", "n02"), per_class: int = 2) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in classes:
            folder = root / "imagenet" / split / c
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, size=(30, 40, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"img{i}.png")


IMAGENET = {"name": "imagenet", "num_classes": 2, "image_size": 224, "mean": [0.485, 0.456, 0.406]}


def test_fake_imagenet_loads_with_the_right_transforms(tmp_path: Path) -> None:
    write_fake_imagenet(tmp_path)
    cfg = IMAGENET | {"std": [0.229, 0.224, 0.225]}
    train, val, info = build_datasets(cfg, tmp_path)
    assert info == DatasetInfo("imagenet", 2, 224, 3, 4, 4)
    assert train.classes == ["n01", "n02"]
    for dataset in (train, val):
        x, y = dataset[3]
        assert x.shape == (3, 224, 224) and y == 1
    train_kinds = [type(t) for t in train.transform.transforms]
    assert train_kinds == [T.RandomResizedCrop, T.RandomHorizontalFlip, T.ToTensor, T.Normalize]
    eval_kinds = [type(t) for t in val.transform.transforms]
    assert eval_kinds == [T.Resize, T.CenterCrop, T.ToTensor, T.Normalize]
    assert val.transform.transforms[0].size == 256


def test_imagenet_missing_or_empty_split_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=str(tmp_path / "imagenet" / "train")):
        build_datasets(IMAGENET, tmp_path)
    write_fake_imagenet(tmp_path)
    for f in (tmp_path / "imagenet" / "val").rglob("*.png"):
        f.unlink()
    with pytest.raises(ConfigError, match=r"val split at .*imagenet/val has no images"):
        build_datasets(IMAGENET, tmp_path)


def test_imagenet_class_count_must_match(tmp_path: Path) -> None:
    write_fake_imagenet(tmp_path)
    with pytest.raises(ConfigError, match="dataset.num_classes=2"):
        build_datasets(IMAGENET | {"num_classes": 1000}, tmp_path)


def test_unknown_dataset_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown dataset 'mnist'; choose dataset= one of") as info:
        build_datasets({"name": "mnist"}, "unused")
    assert all(name in str(info.value) for name in DATASET_NAMES)


# --------------------------------------------------------------------------------------------- loaders


def batches(loader: torch.utils.data.DataLoader) -> list[torch.Tensor]:
    return [y for _, y in loader]


def test_loader_order_is_fixed_by_the_seed() -> None:
    train, test, _ = build_datasets(SYNTH | {"train_size": 100}, "unused")
    a = make_loader(train, 16, train=True, seed=3)
    b = make_loader(train, 16, train=True, seed=3)
    c = make_loader(train, 16, train=True, seed=4)
    first, second = batches(a), batches(a)  # two epochs
    assert len(first) == 6  # 100 // 16: drop_last for training
    assert all(torch.equal(u, v) for u, v in zip(first, batches(b), strict=True))
    assert not all(torch.equal(u, v) for u, v in zip(first, batches(c), strict=True))
    assert not all(torch.equal(u, v) for u, v in zip(first, second, strict=True))  # reshuffled per epoch
    assert all(torch.equal(u, v) for u, v in zip(second, batches(b), strict=True))

    ordered = make_loader(test, 10, train=False, seed=0)
    assert torch.equal(torch.cat(batches(ordered)), test.targets)  # in order, last partial batch kept
    assert not ordered.pin_memory or torch.cuda.is_available()


def test_loader_with_workers_is_deterministic(digits: tuple) -> None:
    train, _, _ = build_datasets(DIGITS | {"augment": True}, "unused")
    small = torch.utils.data.Subset(train, range(64))
    runs = []
    for _ in range(2):
        loader = make_loader(small, 16, train=True, seed=5, num_workers=2)
        assert loader.persistent_workers
        runs.append(torch.cat([x for x, _ in loader]))
        del loader
    torch.testing.assert_close(runs[0], runs[1])


def test_loader_rejects_a_batch_larger_than_the_training_set() -> None:
    train, _, _ = build_datasets(SYNTH, "unused")
    with pytest.raises(ConfigError, match="batch_size=128"):
        make_loader(train, 128, train=True, seed=0)
    assert len(make_loader(train, 128, train=False, seed=0)) == 1
    with pytest.raises(ConfigError, match="batch_size"):
        make_loader(train, 0, train=False, seed=0)


# ------------------------------------------------------------------------------- defaults in one place


def test_every_bundled_dataset_builder_takes_its_schema_and_has_no_defaults() -> None:
    """The dataset schemas (adaloss.runner.schemas) are the one place for a dataset's defaults: each bundled
    builder takes exactly its schema's fields (plus data_dir) and gives none of them a default of its own,
    which could drift from the schema's (and would decide library calls)."""
    import dataclasses
    import inspect

    from hydra.utils import get_object

    from adaloss.runner.schemas import SCHEMAS

    checked = 0
    for group, name, kind in SCHEMAS:
        if group != "dataset" or kind.OPEN:
            continue
        fields = {f.name: f for f in dataclasses.fields(kind)}
        params = inspect.signature(get_object(fields["_target_"].default)).parameters
        assert set(params) - {"data_dir"} == set(fields) - {"_target_"}, name
        assert [p for p in params.values() if p.default is not p.empty] == [], name
        checked += 1
    assert checked == 8


def test_a_schema_default_is_what_the_builder_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A field left out of a library call gets its schema's default: change it there and the data follow."""
    from adaloss.runner.schemas import SyntheticConf

    small = {"name": "synthetic", "image_size": 8, "train_size": 8, "test_size": 4}
    assert build_datasets(small, "unused")[2].channels == 3
    monkeypatch.setattr(SyntheticConf.__dataclass_fields__["channels"], "default", 1)
    train, _, info = build_datasets(small, "unused")
    assert info.channels == 1 and train[0][0].shape == (1, 8, 8)
