"""Image classification datasets: ``cifar``, ``imagenet``, ``digits``, ``synthetic`` (the ``_target_`` of
``configs/dataset/*.yaml``; ``adaloss.runner.data.build_datasets`` instantiates them).

* ``cifar10`` / ``cifar100``: torchvision's pickled CIFAR under ``data_dir``, the He et al. augmentation.
* ``imagenet``: ImageFolder trees ``data_dir/imagenet/{train,val}/<class>/*``.
* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 real images, no download), upsampled to
  32x32 and kept in memory; the dataset the CPU tests and the demo train on.
* ``synthetic``: seeded class templates plus noise, for smoke tests of any image size.

Nothing touches the network unless ``download=true`` for CIFAR. Missing data raises ``ConfigError`` with
one line naming the path and the remedies.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from torchvision import datasets as tvd

from adaloss.errors import ConfigError
from adaloss.runner.data import transforms as tr

__all__ = ["DATASET_NAMES", "DatasetInfo", "TensorImageDataset", "cifar", "digits", "imagenet", "synthetic"]

DATASET_NAMES: tuple[str, ...] = ("cifar10", "cifar100", "imagenet", "digits", "synthetic")

# Per-channel statistics of the training splits, used when the config does not give them.
_CIFAR10_MEAN, _CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
_CIFAR100_MEAN, _CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
_IMAGENET_MEAN, _IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class DatasetInfo:
    """What the trainer and the model builder need to know about a dataset."""

    name: str
    num_classes: int
    image_size: int
    channels: int
    train_size: int
    test_size: int

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(channels, image_size, image_size)``, the ``input_shape`` argument of ``build_model``."""
        return (self.channels, self.image_size, self.image_size)


def _stats(key: str, values: Sequence[float] | None, own: Sequence[float], channels: int) -> list[float]:
    """``dataset.mean`` / ``dataset.std`` (the schema checks each value); null: the dataset's own."""
    values = [float(v) for v in (own if values is None else values)]
    if len(values) != channels:
        raise ConfigError(f"dataset.{key} needs {channels} per-channel values, got {values}")
    return values


def _check_num_classes(num_classes: int | None, name: str, expected: int) -> int:
    """``dataset.num_classes`` of a dataset whose classes are fixed (null: its own)."""
    if num_classes is not None and num_classes != expected:
        raise ConfigError(f"dataset {name} has {expected} classes, but dataset.num_classes={num_classes}")
    return expected


class TensorImageDataset(Dataset):
    """In-memory ``(N, C, H, W)`` float images with integer labels; optional random translation.

    With ``translate > 0`` the images are stored pre-padded by ``translate`` pixels (filled with
    ``pad_value``, the background) and ``__getitem__`` returns a random ``H x W`` window: a view of shared
    memory, a few microseconds per sample. Without it ``__getitem__`` is a plain index.
    """

    def __init__(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        translate: int = 0,
        pad_value: Sequence[float] | float = 0.0,
    ) -> None:
        if images.ndim != 4 or len(images) != len(targets):
            raise ValueError(
                f"expected (N, C, H, W) images and N targets, got {tuple(images.shape)}, {len(targets)}"
            )
        self.size = images.shape[-1]
        self.translate = int(translate)
        self.images = tr.pad_images(images, self.translate, pad_value).contiguous()
        self.targets = targets.long()
        self._labels = self.targets.tolist()  # python ints: cheaper to return than 0-d tensors

    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if self.translate:
            image = tr.random_crop(image, self.size)
        return image, self._labels[index]


# ----------------------------------------------------------------------------------------------- CIFAR


class _PresenceCheckMixin:
    """torchvision's CIFAR checks every file's MD5 on each construction (about a second for the 170 MB) and
    refuses anything else. Only check that the files exist; the download path still verifies the archive's
    MD5, and a damaged pickle is reported as a ConfigError when it is read."""

    base_folder: str
    root: str
    train_list: list[list[str]]
    test_list: list[list[str]]
    meta: dict[str, str]

    def _check_integrity(self) -> bool:
        folder = os.path.join(self.root, self.base_folder)
        return all(os.path.isfile(os.path.join(folder, f)) for f, _ in self.train_list + self.test_list)

    def _load_meta(self) -> None:
        with open(os.path.join(self.root, self.base_folder, self.meta["filename"]), "rb") as fh:
            self.classes = pickle.load(fh, encoding="latin1")[self.meta["key"]]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}


class _CIFAR10(_PresenceCheckMixin, tvd.CIFAR10):
    pass


class _CIFAR100(_PresenceCheckMixin, tvd.CIFAR100):
    pass


def _cifar_files(cls: type[tvd.CIFAR10]) -> list[str]:
    return [f for f, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]


def _build_cifar(args: dict[str, Any], name: str, data_dir: Path) -> tuple[Dataset, Dataset, DatasetInfo]:
    cls, pretty, classes = (_CIFAR10, "CIFAR-10", 10) if name == "cifar10" else (_CIFAR100, "CIFAR-100", 100)
    default_mean, default_std = (
        (_CIFAR10_MEAN, _CIFAR10_STD) if name == "cifar10" else (_CIFAR100_MEAN, _CIFAR100_STD)
    )
    num_classes = _check_num_classes(args["num_classes"], name, classes)
    image_size = 32 if args["image_size"] is None else args["image_size"]
    if image_size != 32:
        raise ConfigError(f"{pretty} images are 32x32, but dataset.image_size={image_size}")
    mean = _stats("mean", args["mean"], default_mean, 3)
    std = _stats("std", args["std"], default_std, 3)
    augment, download = bool(args["augment"]), bool(args["download"])

    folder = data_dir / cls.base_folder
    missing = [f for f in _cifar_files(cls) if not (folder / f).is_file()]
    if missing and not download:
        what = "not found" if len(missing) == len(_cifar_files(cls)) else f"incomplete (no {missing[0]})"
        raise ConfigError(
            f"{pretty} {what} under {data_dir} (expected {cls.base_folder}/): put the dataset there, "
            f"or pass dataset.download=true on a machine with network access"
        )
    try:
        train = cls(
            root=str(data_dir),
            train=True,
            download=download,
            transform=tr.cifar_train_transform(mean, std, image_size, augment),
        )
        test = cls(
            root=str(data_dir), train=False, download=False, transform=tr.cifar_eval_transform(mean, std)
        )
    except (OSError, RuntimeError) as exc:  # URLError is an OSError; torchvision raises RuntimeError on MD5
        reason = " ".join(str(exc).split())
        if missing:
            raise ConfigError(
                f"could not download {pretty} to {data_dir} ({reason}): put the dataset there by hand "
                f"(expected {cls.base_folder}/)"
            ) from exc
        raise ConfigError(f"could not read {pretty} under {folder}: {reason}") from exc
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError) as exc:
        raise ConfigError(
            f"{pretty} under {folder} looks corrupted ({type(exc).__name__}): delete the folder and put the "
            f"dataset there again, or pass dataset.download=true on a machine with network access"
        ) from exc
    info = DatasetInfo(name, num_classes, image_size, 3, len(train), len(test))
    return train, test, info


# ------------------------------------------------------------------------------------------- ImageNet


def _image_folder(path: Path, split: str, transform: Any) -> tvd.ImageFolder:
    hint = (
        f"put the ILSVRC2012 {split} images there as {split}/<class>/*.JPEG (torchvision ImageFolder layout)"
    )
    if not path.is_dir():
        raise ConfigError(f"ImageNet {split} split not found at {path}: {hint}")
    try:
        return tvd.ImageFolder(str(path), transform=transform)
    except FileNotFoundError as exc:  # no class folders, or no image files in them
        raise ConfigError(f"ImageNet {split} split at {path} has no images: {hint}") from exc


def _build_imagenet(args: dict[str, Any], data_dir: Path) -> tuple[Dataset, Dataset, DatasetInfo]:
    num_classes = 1000 if args["num_classes"] is None else args["num_classes"]  # null: ILSVRC2012's classes
    image_size = 224 if args["image_size"] is None else args["image_size"]  # null: the usual 224 crop
    mean = _stats("mean", args["mean"], _IMAGENET_MEAN, 3)
    std = _stats("std", args["std"], _IMAGENET_STD, 3)
    root = data_dir / "imagenet"
    train = _image_folder(root / "train", "train", tr.imagenet_train_transform(mean, std, image_size))
    test = _image_folder(root / "val", "val", tr.imagenet_eval_transform(mean, std, image_size))
    if train.classes != test.classes:
        extra = sorted(set(train.classes) ^ set(test.classes))[:3]
        raise ConfigError(
            f"ImageNet train/ and val/ under {root} have different class folders (e.g. {extra}): "
            "give both splits the same <class> subfolders"
        )
    if len(train.classes) != num_classes:
        raise ConfigError(
            f"ImageNet under {root} has {len(train.classes)} class folders, but dataset.num_classes="
            f"{num_classes}: set dataset.num_classes={len(train.classes)} or add the missing classes"
        )
    info = DatasetInfo("imagenet", num_classes, image_size, 3, len(train), len(test))
    return train, test, info


# --------------------------------------------------------------------------------------------- digits


def _build_digits(args: dict[str, Any]) -> tuple[Dataset, Dataset, DatasetInfo]:
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download
    from sklearn.model_selection import train_test_split

    num_classes = _check_num_classes(args["num_classes"], "digits", 10)
    image_size = 32 if args["image_size"] is None else args["image_size"]
    if image_size < 8:
        raise ConfigError(f"dataset.image_size must be >= 8 (the digits are 8x8), got {image_size}")
    fraction, split_seed = float(args["test_fraction"]), args["split_seed"]
    translate = args["translate"] if args["augment"] else 0

    pixels, labels = load_digits(return_X_y=True)
    index = np.arange(len(labels))
    try:
        train_idx, test_idx = train_test_split(
            index, test_size=fraction, stratify=labels, random_state=split_seed, shuffle=True
        )
    except ValueError as exc:
        raise ConfigError(f"dataset.test_fraction={fraction} cannot split digits: {exc}") from exc
    # Sorted indices: the split is a fixed set, the order is the loader's business.
    train_idx, test_idx = np.sort(train_idx), np.sort(test_idx)

    images = torch.from_numpy(pixels / 16.0).float().reshape(-1, 1, 8, 8)
    if image_size != 8:  # once, up front: the upsampled set is 1797 x 3 x 32 x 32 floats, 22 MB
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    images = images.clamp_(0.0, 1.0).expand(-1, 3, -1, -1)
    targets = torch.from_numpy(labels).long()

    train_images, test_images = images[train_idx], images[test_idx]
    mean = train_images.mean(dim=(0, 2, 3), keepdim=True)
    std = train_images.std(dim=(0, 2, 3), keepdim=True)
    train_images = (train_images - mean) / std
    test_images = (test_images - mean) / std
    background = (-mean / std).reshape(-1)  # a blank (0) pixel after normalization

    train = TensorImageDataset(train_images, targets[train_idx], translate=translate, pad_value=background)
    test = TensorImageDataset(test_images, targets[test_idx])
    info = DatasetInfo("digits", num_classes, image_size, 3, len(train), len(test))
    return train, test, info


# ------------------------------------------------------------------------------------------ synthetic


def _build_synthetic(args: dict[str, Any]) -> tuple[Dataset, Dataset, DatasetInfo]:
    """Seeded class templates plus noise, learnable by any model in a few steps.

    Each class has a fixed smooth random template (8x8 noise, bilinearly upsampled, unit variance); a sample
    is its class template plus i.i.d. Gaussian noise of std ``noise``, scaled to unit variance. Classes are
    balanced. Everything is drawn from one generator seeded with ``seed``: same seed, same tensors.
    """
    num_classes = 10 if args["num_classes"] is None else args["num_classes"]  # null: 10 templates
    image_size = 32 if args["image_size"] is None else args["image_size"]  # null: CIFAR's 32x32
    channels, train_size, test_size = args["channels"], args["train_size"], args["test_size"]
    seed, noise = args["seed"], float(args["noise"])

    gen = torch.Generator().manual_seed(seed)
    coarse = min(8, image_size)
    templates = torch.randn(num_classes, channels, coarse, coarse, generator=gen)
    if coarse != image_size:
        templates = F.interpolate(
            templates, size=(image_size, image_size), mode="bilinear", align_corners=False
        )
    templates = templates - templates.mean(dim=(1, 2, 3), keepdim=True)
    templates = templates / templates.std(dim=(1, 2, 3), keepdim=True).clamp_min(1e-6)
    scale = 1.0 / (1.0 + noise**2) ** 0.5

    def draw(n: int) -> TensorImageDataset:
        targets = (torch.arange(n) % num_classes)[torch.randperm(n, generator=gen)]
        x = templates[targets] + noise * torch.randn(n, channels, image_size, image_size, generator=gen)
        return TensorImageDataset(x * scale, targets)

    train, test = draw(train_size), draw(test_size)
    info = DatasetInfo("synthetic", num_classes, image_size, channels, train_size, test_size)
    return train, test, info


# ---------------------------------------------------------------------------------------------- entry


# ------------------------------------------------------------------------- the configs' _target_s
# configs/dataset/<name>.yaml names one of these; adaloss.runner.utils.targets.build_target calls it with the
# dataset node's fields and paths.data_dir.


# Every field of the dataset's schema (adaloss.runner.schemas) is passed: its defaults and ranges live there
# alone. ``num_classes``, ``image_size``, ``mean`` and ``std`` may be null: the dataset's own.


def cifar(
    data_dir: str | os.PathLike[str], *, name: str, num_classes: int | None, image_size: int | None,
    mean: Sequence[float] | None, std: Sequence[float] | None, download: bool, augment: bool,
) -> tuple[Dataset, Dataset, DatasetInfo]:  # fmt: skip
    """``dataset=cifar10`` / ``cifar100`` (``name``), under ``data_dir``."""
    fields = {"num_classes": num_classes, "image_size": image_size, "mean": mean, "std": std}
    args = {**fields, "download": download, "augment": augment}
    return _build_cifar(args, name, Path(data_dir).expanduser().resolve())


def imagenet(
    data_dir: str | os.PathLike[str], *, name: str, num_classes: int | None, image_size: int | None,
    mean: Sequence[float] | None, std: Sequence[float] | None,
) -> tuple[Dataset, Dataset, DatasetInfo]:  # fmt: skip
    """``dataset=imagenet``: ImageFolder ``imagenet/train`` and ``imagenet/val`` under ``data_dir``."""
    args = {"num_classes": num_classes, "image_size": image_size, "mean": mean, "std": std}
    return _build_imagenet(args, Path(data_dir).expanduser().resolve())


def digits(
    *, name: str, num_classes: int | None, image_size: int | None, mean: Sequence[float] | None,
    std: Sequence[float] | None, test_fraction: float, split_seed: int, augment: bool, translate: int,
) -> tuple[Dataset, Dataset, DatasetInfo]:  # fmt: skip
    """``dataset=digits``: scikit-learn's bundled digits (normalized by their own statistics: ``mean``
    and ``std`` are not used)."""
    return _build_digits(
        {"num_classes": num_classes, "image_size": image_size, "test_fraction": test_fraction,
         "split_seed": split_seed, "augment": augment, "translate": translate}
    )  # fmt: skip


def synthetic(
    *, name: str, num_classes: int | None, image_size: int | None, mean: Sequence[float] | None,
    std: Sequence[float] | None, channels: int, train_size: int, test_size: int, seed: int, noise: float,
) -> tuple[Dataset, Dataset, DatasetInfo]:  # fmt: skip
    """``dataset=synthetic``: seeded class templates plus noise (unit variance: ``mean`` and ``std`` are
    not used)."""
    return _build_synthetic(
        {"num_classes": num_classes, "image_size": image_size, "channels": channels,
         "train_size": train_size, "test_size": test_size, "seed": seed, "noise": noise}
    )  # fmt: skip
