"""What the CNN underflow table measures: the models, the scalers, the three gradient regimes, the FP32
training plan and the digits data."""

from __future__ import annotations

from typing import Any

DEFAULT_MODELS = ("resnet110", "vgg_nobn")
SCALERS: dict[str, dict[str, Any]] = {
    "none": {"name": "none"},
    "fixed128": {"name": "fixed", "scale": 128},
    # the reference rule with the authors' CIFAR settings (their cifar/utils.py:47-48), and the paper's rule
    "adaptive": {
        "name": "adaptive",
        "update_every": 1,
        "rule": "reference",
        "scale_upper_bound": 128,
        "accum_upper_bound": 4096,
    },
    "adaptive_paper": {"name": "adaptive", "update_every": 1, "rule": "paper"},
}
#: The adaptive variants, with the label the table gives each.
ADAPTIVE = {"adaptive": "adaptive (reference)", "adaptive_paper": "adaptive (paper)"}
REGIMES: dict[str, tuple[str, str]] = {  # regime -> (weights, precision)
    "init_fp16": ("init", "fp16"),
    "trained_fp16": ("trained", "fp16"),
    "trained_fp8": ("trained", "fp8_e5m2"),
}
#: FP32 training per model: steps and learning rate. VGG without BN diverges at lr 0.05 (NaN loss within
#: ~130 steps at batch 32 with momentum 0.9), ResNet-110 barely moves at 0.05 in 60 steps (He et al. warm it
#: up at 0.01 for the same reason); both train smoothly at 0.01.
TRAIN_PLAN = {
    "resnet110": {"steps": 80, "lr": 0.01},
    "vgg_nobn": {"steps": 150, "lr": 0.01},
}
DEFAULT_TRAIN = {"steps": 100, "lr": 0.05}
MOMENTUM = 0.9
DIGITS = {
    "name": "digits",
    "num_classes": 10,
    "image_size": 32,
    "test_fraction": 0.2,
    "split_seed": 0,
    "augment": False,
}
