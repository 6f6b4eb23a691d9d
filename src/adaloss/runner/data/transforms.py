"""Image transforms for each dataset: the standard recipes of He et al. (2016) for CIFAR and ImageNet, and a
tensor-level random translation for the in-memory datasets (digits).

The PIL pipelines run per sample in the DataLoader workers; the tensor translation is a slice of a
pre-padded tensor, so it costs microseconds per sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchvision import transforms as T

__all__ = [
    "cifar_eval_transform",
    "cifar_train_transform",
    "imagenet_eval_transform",
    "imagenet_train_transform",
    "pad_images",
    "random_crop",
]


def cifar_train_transform(
    mean: Sequence[float], std: Sequence[float], size: int = 32, augment: bool = True
) -> T.Compose:
    """4-pixel zero padding + random ``size`` crop + horizontal flip, then ToTensor + Normalize.

    With ``augment=False`` it is the eval transform. Cost: a few tens of microseconds per 32x32 image.
    """
    if not augment:
        return cifar_eval_transform(mean, std)
    return T.Compose(
        [
            T.RandomCrop(size, padding=4),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(list(mean), list(std)),
        ]
    )


def cifar_eval_transform(mean: Sequence[float], std: Sequence[float]) -> T.Compose:
    """ToTensor + per-channel Normalize."""
    return T.Compose([T.ToTensor(), T.Normalize(list(mean), list(std))])


def imagenet_train_transform(mean: Sequence[float], std: Sequence[float], size: int = 224) -> T.Compose:
    """RandomResizedCrop(``size``) + horizontal flip + ToTensor + Normalize (torchvision reference recipe).

    Cost: dominated by JPEG decoding, several milliseconds per image; use DataLoader workers.
    """
    return T.Compose(
        [
            T.RandomResizedCrop(size),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(list(mean), list(std)),
        ]
    )


def imagenet_eval_transform(mean: Sequence[float], std: Sequence[float], size: int = 224) -> T.Compose:
    """Resize the short side to ``size*256/224`` (256 for 224), CenterCrop(``size``), ToTensor + Normalize."""
    return T.Compose(
        [
            T.Resize(round(size * 256 / 224)),
            T.CenterCrop(size),
            T.ToTensor(),
            T.Normalize(list(mean), list(std)),
        ]
    )


def pad_images(images: torch.Tensor, pad: int, value: torch.Tensor | Sequence[float] | float) -> torch.Tensor:
    """Pad an ``(N, C, H, W)`` batch by ``pad`` pixels on each side with ``value`` (scalar or per channel).

    Done once up front so that a random translation is a plain slice per sample. ``value`` should be the
    background in the tensor's units (after normalization, the normalized value of a blank pixel), so that
    translating a digit does not draw a frame around it. Cost: one copy of the batch, slightly larger.
    """
    if pad == 0:
        return images
    n, c, h, w = images.shape
    fill = torch.as_tensor(value, dtype=images.dtype).reshape(-1)
    if fill.numel() == 1:
        fill = fill.expand(c)
    out = fill.reshape(1, c, 1, 1).expand(n, c, h + 2 * pad, w + 2 * pad).clone()
    out[:, :, pad : pad + h, pad : pad + w] = images
    return out


def random_crop(padded: torch.Tensor, size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random ``size`` x ``size`` window of one ``(C, H, W)`` image (a view, no copy).

    Uses the global torch RNG unless ``generator`` is given: in DataLoader workers that RNG is seeded from the
    loader's generator, and in the main process from the run's seed, so crops are reproducible.
    """
    h, w = padded.shape[-2:]
    u, v = torch.rand(2, generator=generator).tolist()  # one RNG call for both offsets
    i, j = min(int(u * (h - size + 1)), h - size), min(int(v * (w - size + 1)), w - size)
    return padded[..., i : i + size, j : j + size]
