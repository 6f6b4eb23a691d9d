"""SSD300 / SSD512 (Liu et al. 2016) on a VGG-16 backbone without batch norm, built from torchvision's parts.

The detector is split in two so that the adaptive loss scaler can rewrite the trainable part with torch.fx:

* :class:`SSDNet`, the **trainable network**: ``images [N, 3, S, S] -> (cls_logits [N, A, C+1],
  bbox_regression [N, A, 4])``. An fx-traceable ``nn.Module`` with no data-dependent control flow: the
  backbone (:class:`SSDBackbone`: VGG-16 conv1_1..conv7, L2-normalized conv4_3, the extra layers) returns a
  plain Python list of feature maps and torchvision's ``SSDHead`` turns it into per-default-box outputs.
* :class:`SSDDetector`, everything around it: the default boxes (``DefaultBoxGenerator``, computed once at
  build time), the training loss (``SSDMatcher`` at IoU 0.5, ``BoxCoder`` with weights (10, 10, 5, 5),
  smooth-L1 + cross-entropy with 3:1 hard-negative mining: torchvision's ``SSD.compute_loss``) and the
  post-processing (softmax, score threshold 0.01, per-class top-400, ``batched_nms`` at 0.45, top 200 per
  image: torchvision's ``SSD.postprocess_detections``). Both torchvision methods are called unbound on the
  detector, whose attributes carry torchvision's names for that reason; they are not copied.

Configurations (the original Caffe / ChainerCV VOC models the paper trains):

========  =====  =================================  ==========================================
model     size   feature maps                       default boxes (scales x image size)
========  =====  =================================  ==========================================
ssd300    300    38, 19, 10, 5, 3, 1 (6 maps)       8,732; scales 0.1, 0.2, 0.37, ... 0.88, 1.05
ssd512    512    64, 32, 16, 8, 4, 2, 1 (7 maps)    24,564; scales 0.07, 0.15, 0.3, ... 0.9, 1.05
========  =====  =================================  ==========================================

torchvision ships only SSD300 with COCO scales (0.07 ... 1.05) and no true SSD512 (its ``highres`` extra
layer keeps SSD300's unpadded convs, giving 64, 32, 16, 8, 6, 4, 1 maps); the SSD512 extras here are the
original ones (stride-2 3x3 convs, then a 4x4 conv with padding 1). Default boxes are not clipped, as in the
original configurations.

Other image sizes (``model.image_size=128`` for CPU runs): the feature-map sizes come from a forward pass on
the meta device at build time, and default-box centres from the grid (the configured steps only fit the
native size). Below the native size the last extra layers would see inputs smaller than their kernels; their
padding is then raised just enough for a 1x1 (or, for SSD512's 4x4 conv, 2x2) output, so the number of
layers, branches and parameters never changes. SSD512 at 128 has maps 16, 8, 4, 2, 1, 1, 2.

CPU runs can also thin the network: ``model.width_multiplier`` (default 1.0, the real SSD) multiplies every
backbone and extra layer's channel count (0.25: about 16x fewer FLOPs), keeping layer names, feature maps
and default boxes; pretrained ``backbone_weights`` need the full width.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torchvision.models.detection import _utils as det_utils
from torchvision.models.detection.anchor_utils import DefaultBoxGenerator
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.ssd import SSD, SSDHead
from torchvision.models.detection.transform import resize_boxes
from torchvision.ops import boxes as box_ops

from adaloss.errors import ConfigError

__all__ = [
    "DETECTION_MODEL_NAMES",
    "SSD_CONFIGS",
    "VGG_LAYER_NAMES",
    "DetectionLoss",
    "L2Norm",
    "SSDBackbone",
    "SSDConfig",
    "SSDDetector",
    "SSDNet",
    "ssd_detector",
    "load_backbone_weights",
    "lsuv_init_",
]


@dataclass(frozen=True)
class SSDConfig:
    """One SSD configuration: native input size, extra layers and default boxes.

    ``extras`` lists ``(name, mid_channels, out_channels, kernel, stride, padding)`` per extra block (a 1x1
    conv to ``mid_channels``, then the ``kernel`` conv); ``scales`` has one entry more than there are feature
    maps (the last one only sets the second square box of the last map); ``steps`` are the strides of the
    default-box centres in pixels at the native size.
    """

    image_size: int
    extras: tuple[tuple[str, int, int, int, int, int], ...]
    aspect_ratios: tuple[tuple[int, ...], ...]
    scales: tuple[float, ...]
    steps: tuple[int, ...]


SSD_CONFIGS: dict[str, SSDConfig] = {
    # Caffe's ssd_pascal.py for 300x300 (min_ratio 20, max_ratio 90, conv4_3 at 10%), as in ChainerCV.
    "ssd300": SSDConfig(
        image_size=300,
        extras=(
            ("conv8", 256, 512, 3, 2, 1),
            ("conv9", 128, 256, 3, 2, 1),
            ("conv10", 128, 256, 3, 1, 0),
            ("conv11", 128, 256, 3, 1, 0),
        ),
        aspect_ratios=((2,), (2, 3), (2, 3), (2, 3), (2,), (2,)),
        scales=(0.1, 0.2, 0.37, 0.54, 0.71, 0.88, 1.05),
        steps=(8, 16, 32, 64, 100, 300),
    ),
    # Caffe's ssd_pascal512.py (min_ratio 15, max_ratio 90, conv4_3 at 7%), as in ChainerCV.
    "ssd512": SSDConfig(
        image_size=512,
        extras=(
            ("conv8", 256, 512, 3, 2, 1),
            ("conv9", 128, 256, 3, 2, 1),
            ("conv10", 128, 256, 3, 2, 1),
            ("conv11", 128, 256, 3, 2, 1),
            ("conv12", 128, 256, 4, 1, 1),
        ),
        aspect_ratios=((2,), (2, 3), (2, 3), (2, 3), (2, 3), (2,), (2,)),
        scales=(0.07, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9, 1.05),
        steps=(8, 16, 32, 64, 128, 256, 512),
    ),
}
DETECTION_MODEL_NAMES: tuple[str, ...] = tuple(SSD_CONFIGS)

# VGG-16 (configuration D) up to conv5_3, then SSD's pool5 (3x3, stride 1) and fc6/fc7 as convolutions.
# Names are the paper's: per-layer telemetry reads backbone.conv4_3, backbone.conv7, backbone.conv8_2, ...
_VGG_CONVS: tuple[tuple[str, int, int], ...] = (
    ("conv1_1", 3, 64),
    ("conv1_2", 64, 64),
    ("conv2_1", 64, 128),
    ("conv2_2", 128, 128),
    ("conv3_1", 128, 256),
    ("conv3_2", 256, 256),
    ("conv3_3", 256, 256),
    ("conv4_1", 256, 512),
    ("conv4_2", 512, 512),
    ("conv4_3", 512, 512),
    ("conv5_1", 512, 512),
    ("conv5_2", 512, 512),
    ("conv5_3", 512, 512),
)
_POOL_AFTER = {"conv1_2": "pool1", "conv2_2": "pool2", "conv3_3": "pool3", "conv4_3": "pool4"}
VGG_LAYER_NAMES: tuple[str, ...] = (*(name for name, _, _ in _VGG_CONVS), "conv6", "conv7")
_MIN_IMAGE_SIZE = 32  # conv4_3 is then 4x4 and conv7 2x2; smaller inputs leave the extras nothing to see


class L2Norm(nn.Module):
    """Per-position L2 normalization over channels times a learnable per-channel scale (SSD's conv4_3_norm).

    conv4_3's activations are much larger than those of the deeper maps; normalizing them and learning the
    scale (initialized to 20, as in Liu et al. 2016) keeps the first head's inputs comparable.
    """

    def __init__(self, channels: int, scale: float = 20.0, eps: float = 1e-10) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((channels,), float(scale)))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight.view(1, -1, 1, 1) * F.normalize(x, dim=1, eps=self.eps)


def _scaled_channels(channels: int, width_multiplier: float) -> int:
    """``channels * width_multiplier`` rounded, at least 1 (``model.width_multiplier``, a CPU knob)."""
    return max(1, round(channels * width_multiplier))


def _conv_output(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _fc7_size(image_size: int) -> int:
    """Side of conv7's map for a square input (pool1/2 floor, pool3 ceil, pool4 floor; pool5 keeps it)."""
    conv4_3 = math.ceil((image_size // 2 // 2) / 2)
    return conv4_3 // 2


class SSDBackbone(nn.Module):
    """VGG-16 without batch norm plus SSD's extra layers; ``forward`` returns the list of feature maps.

    Layers, in order: conv1_1 ... conv5_3 (3x3, ReLU; 2x2 max-pools, pool3 in ceil mode), pool5 (3x3,
    stride 1, padding 1), conv6 (3x3, 1024 channels, dilation 6), conv7 (1x1, 1024), then each extra block
    ``convK_1`` (1x1) + ``convK_2``. The feature maps are the L2-normalized conv4_3 (``conv4_3_norm``), conv7
    and every ``convK_2``: 6 for SSD300, 7 for SSD512. Returning a Python list (not an OrderedDict) lets
    torchvision's ``SSDHead`` consume it under ``torch.fx.symbolic_trace``.

    Initialization: VGG layers conv1_1..conv5_3 as torchvision's VGG (Kaiming normal, fan-out), conv6/conv7
    and the extras Xavier-uniform as torchvision's SSD; all biases zero. ReLUs are not in-place.

    ``width_multiplier`` (default 1.0: the real SSD) is a CPU-only knob: every layer's channel count (the
    input image's 3 excepted) is multiplied by it and rounded (at least 1), so 0.25 gives 16, 32, 64, 128
    and 256 channels for VGG's 64 ... 1024 and about 16x fewer FLOPs. Layer names, the number of layers,
    the feature maps and the default boxes do not change; only ``out_channels`` (and so the head's inputs)
    follow. Raises ``ConfigError`` for a non-positive or non-finite value.
    """

    def __init__(self, config: SSDConfig, image_size: int, width_multiplier: float = 1.0) -> None:
        super().__init__()
        if isinstance(width_multiplier, bool) or not (
            isinstance(width_multiplier, int | float)
            and math.isfinite(width_multiplier)
            and width_multiplier > 0
        ):
            raise ConfigError(f"model.width_multiplier must be a positive number, got {width_multiplier!r}")
        self.width_multiplier = float(width_multiplier)

        def width(channels: int) -> int:
            return _scaled_channels(channels, self.width_multiplier)

        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for name, cin, cout in _VGG_CONVS:
            stage = name[4:]
            conv = nn.Conv2d(cin if name == "conv1_1" else width(cin), width(cout), kernel_size=3, padding=1)
            nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
            layers[name], layers[f"relu{stage}"] = conv, nn.ReLU()
            if name in _POOL_AFTER:
                pool = _POOL_AFTER[name]
                layers[pool] = nn.MaxPool2d(kernel_size=2, stride=2, ceil_mode=pool == "pool3")
        layers["pool5"] = nn.MaxPool2d(kernel_size=3, stride=1, padding=1)
        layers["conv6"] = nn.Conv2d(width(512), width(1024), kernel_size=3, padding=6, dilation=6)
        layers["relu6"] = nn.ReLU()
        layers["conv7"] = nn.Conv2d(width(1024), width(1024), kernel_size=1)
        layers["relu7"] = nn.ReLU()
        sources = ["relu4_3", "relu7"]
        channels, size = width(1024), _fc7_size(image_size)
        self.adjusted_padding: dict[str, int] = {}  # extras whose padding was raised for a small input
        for name, mid, out, kernel, stride, padding in config.extras:
            # Smallest padding giving a non-empty output: only differs from the configured one below the
            # native size, where this map would otherwise vanish.
            fitted = max(padding, math.ceil((kernel - size) / 2))
            if fitted != padding:
                self.adjusted_padding[f"{name}_2"] = fitted
            mid, out = width(mid), width(out)
            layers[f"{name}_1"] = nn.Conv2d(channels, mid, kernel_size=1)
            layers[f"relu{name[4:]}_1"] = nn.ReLU()
            layers[f"{name}_2"] = nn.Conv2d(mid, out, kernel_size=kernel, stride=stride, padding=fitted)
            layers[f"relu{name[4:]}_2"] = nn.ReLU()
            sources.append(f"relu{name[4:]}_2")
            channels, size = out, _conv_output(size, kernel, stride, fitted)
        for name, layer in layers.items():
            if isinstance(layer, nn.Conv2d):
                if name in ("conv6", "conv7") or name not in VGG_LAYER_NAMES:
                    nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)
            self.add_module(name, layer)
        self.conv4_3_norm = L2Norm(width(512))
        self._layer_names = tuple(layers)
        self._sources = frozenset(sources)
        self.out_channels = [width(512), width(1024)] + [width(out) for _, _, out, _, _, _ in config.extras]

    def forward(self, x: Tensor) -> list[Tensor]:
        features: list[Tensor] = []
        for name in self._layer_names:
            x = getattr(self, name)(x)
            if name == "relu4_3":
                features.append(self.conv4_3_norm(x))
            elif name in self._sources:
                features.append(x)
        return features


class SSDNet(nn.Module):
    """The trainable SSD: ``images [N, 3, S, S] -> (cls_logits [N, A, C+1], bbox_regression [N, A, 4])``.

    ``A`` is the number of default boxes, ``C + 1`` the object classes plus background (index 0). Regression
    outputs are box offsets encoded as torchvision's ``BoxCoder(weights=(10, 10, 5, 5))`` (SSD's variances
    0.1 / 0.2). fx-traceable: this is the module to give to ``scaler.attach``.
    """

    def __init__(self, backbone: SSDBackbone, head: SSDHead) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        features = self.backbone(images)
        outputs = self.head(features)
        return outputs["cls_logits"], outputs["bbox_regression"]


class DetectionLoss(NamedTuple):
    """SSD's multibox loss: ``total = classification + bbox_regression``, both divided by the number of
    matched default boxes in the batch (at least 1)."""

    total: Tensor
    classification: Tensor
    bbox_regression: Tensor


class SSDDetector(nn.Module):
    """An SSD: the trainable :class:`SSDNet` plus default boxes, loss and post-processing around it.

    * ``detector.net`` is the fx-traceable network (attach loss scalers to it, optimize its parameters);
      ``detector(images)`` calls it.
    * ``detector.loss(outputs, targets)`` matches default boxes to ground truth and returns a
      :class:`DetectionLoss`.
    * ``detector.postprocess(outputs, image_sizes)`` returns per-image detections after NMS.

    Example::

        detector = adaloss.runner.models.build_detector({"name": "ssd512", "image_size": 128}, num_classes=3)
        net = scaler.attach(detector.net)
        for images, targets in loader:            # adaloss.runner.data.detection.detection_collate
            with precision.autocast():
                outputs = net(images)
                loss = detector.loss(outputs, targets).total
            scaler.scale(loss).backward()
            ...
        detections = detector.postprocess(net(images))   # in eval mode, under torch.no_grad()

    Args:
        net (SSDNet): the network.
        anchors (Tensor): ``[A, 4]`` default boxes, ``(x1, y1, x2, y2)`` in input pixels.
        image_size (int): side of the square input.
        num_classes (int): object classes, without background.
        iou_threshold (float, optional, default=0.5): a default box matches a ground-truth box at this IoU
            (and every ground-truth box matches its best default box).
        neg_to_pos_ratio (float, optional, default=3.0): hard negatives kept per positive.
        score_threshold (float, optional, default=0.01), nms_threshold (float, optional, default=0.45),
        topk_candidates (int, optional, default=400), detections_per_image (int, optional, default=200):
            post-processing, as in SSD's evaluation.
    """

    def __init__(
        self,
        net: SSDNet,
        anchors: Tensor,
        image_size: int,
        num_classes: int,
        iou_threshold: float = 0.5,
        neg_to_pos_ratio: float = 3.0,
        score_threshold: float = 0.01,
        nms_threshold: float = 0.45,
        topk_candidates: int = 400,
        detections_per_image: int = 200,
    ) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("anchors", anchors, persistent=False)  # recomputed at build: not checkpointed
        self.image_size = int(image_size)
        self.num_classes = int(num_classes)
        # Attribute names are torchvision's: SSD.compute_loss / SSD.postprocess_detections read them.
        self.box_coder = det_utils.BoxCoder(weights=(10.0, 10.0, 5.0, 5.0))
        self.proposal_matcher = det_utils.SSDMatcher(iou_threshold)
        self.neg_to_pos_ratio = float(neg_to_pos_ratio)
        self.score_thresh = float(score_threshold)
        self.nms_thresh = float(nms_threshold)
        self.topk_candidates = int(topk_candidates)
        self.detections_per_img = int(detections_per_image)

    @property
    def num_anchors(self) -> int:
        return self.anchors.shape[0]

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        return self.net(images)

    def loss(self, outputs: tuple[Tensor, Tensor], targets: Sequence[Mapping[str, Tensor]]) -> DetectionLoss:
        """SSD's multibox loss for a batch (torchvision's ``SSD.compute_loss``).

        ``outputs`` is the net's ``(cls_logits, bbox_regression)``; ``targets`` one dict per image with
        ``boxes`` ``[K, 4]`` (xyxy, input pixels) and ``labels`` ``[K]`` (1..C); other keys are ignored, so
        difficult objects present in a target are trained on (the VOC loader drops them from training sets).
        Half-precision outputs are upcast to FP32 first. Cost: one IoU matrix ``[K, A]`` per image; the
        matching and mining use ``torch.where`` / ``nonzero``, which synchronize host and device on CUDA.
        """
        cls_logits, bbox_regression = (_upcast(t) for t in outputs)
        self._check_outputs(cls_logits, bbox_regression)
        if len(targets) != cls_logits.shape[0]:
            raise ValueError(f"got {len(targets)} targets for a batch of {cls_logits.shape[0]} images")
        anchors = self.anchors.to(device=bbox_regression.device, dtype=bbox_regression.dtype)
        matched_idxs, prepared = [], []
        for target in targets:
            boxes = target["boxes"].to(device=anchors.device, dtype=anchors.dtype)
            labels = target["labels"].to(device=anchors.device, dtype=torch.int64)
            prepared.append({"boxes": boxes, "labels": labels})
            if boxes.numel() == 0:
                matched_idxs.append(
                    torch.full((anchors.shape[0],), -1, dtype=torch.int64, device=anchors.device)
                )
            else:
                matched_idxs.append(self.proposal_matcher(box_ops.box_iou(boxes, anchors)))
        head_outputs = {"cls_logits": cls_logits, "bbox_regression": bbox_regression}
        parts = SSD.compute_loss(self, prepared, head_outputs, [anchors] * len(prepared), matched_idxs)
        classification, regression = parts["classification"], parts["bbox_regression"]
        return DetectionLoss(classification + regression, classification, regression)

    @torch.no_grad()
    def postprocess(
        self,
        outputs: tuple[Tensor, Tensor],
        image_sizes: Sequence[tuple[int, int]] | None = None,
    ) -> list[dict[str, Tensor]]:
        """Per-image ``{"boxes" [D, 4] xyxy, "scores" [D], "labels" [D] (1..C)}``, at most 200 each.

        Softmax scores, per class: score > 0.01, top 400, then class-wise NMS at IoU 0.45 and the 200 best
        (torchvision's ``SSD.postprocess_detections``). Boxes are clipped to the input and, when
        ``image_sizes`` (one ``(height, width)`` per image) is given, rescaled from the input size to those
        sizes; otherwise they stay in input pixels. Cost: per image, a decode of all ``A`` boxes and one NMS;
        synchronizes host and device (data-dependent sizes).
        """
        cls_logits, bbox_regression = (_upcast(t.detach()) for t in outputs)
        self._check_outputs(cls_logits, bbox_regression)
        n = cls_logits.shape[0]
        anchors = self.anchors.to(device=bbox_regression.device, dtype=bbox_regression.dtype)
        input_size = (self.image_size, self.image_size)
        head_outputs = {"cls_logits": cls_logits, "bbox_regression": bbox_regression}
        detections = SSD.postprocess_detections(self, head_outputs, [anchors] * n, [input_size] * n)
        if image_sizes is not None:
            if len(image_sizes) != n:
                raise ValueError(f"got {len(image_sizes)} image sizes for a batch of {n} images")
            for det, size in zip(detections, image_sizes, strict=True):
                det["boxes"] = resize_boxes(det["boxes"], input_size, (int(size[0]), int(size[1])))
        return detections

    def _check_outputs(self, cls_logits: Tensor, bbox_regression: Tensor) -> None:
        """A clear error when the images were not ``image_size`` squared (the default boxes would not fit)."""
        if cls_logits.shape[1] != self.num_anchors or bbox_regression.shape[1] != self.num_anchors:
            raise ValueError(
                f"the outputs have {cls_logits.shape[1]} boxes per image, but this detector's "
                f"{self.num_anchors} default boxes are for {self.image_size}x{self.image_size} images: feed "
                f"images of that size (set model.image_size to the dataset's image_size)"
            )


def _upcast(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


# ------------------------------------------------------------------------------------------ backbone weights


def _strip_prefix(key: str) -> str:
    for prefix in ("net.backbone.", "backbone.", "module."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _map_vgg_keys(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Rename a state dict's keys to :class:`SSDBackbone`'s.

    Understood layouts: this backbone's own (``conv4_3.weight``, optionally prefixed ``backbone.``), and
    VGG-16 ``nn.Sequential`` layouts whose convolutions are numbered (torchvision's ``vgg16`` state dict,
    ``features.<i>.weight``, whose ``classifier.*`` is dropped; or ``<i>.weight`` files that continue with
    conv6/conv7 as convolutions, like the "reduced fc" VGG of SSD ports): numbered convs map in order to
    conv1_1 ... conv5_3 (, conv6, conv7).
    """
    keys = {_strip_prefix(k): v for k, v in state.items()}
    if any(k.split(".")[0] in VGG_LAYER_NAMES for k in keys):
        return keys
    numbered: dict[int, dict[str, Tensor]] = {}
    other: dict[str, Tensor] = {}
    for key, value in keys.items():
        body = key[len("features.") :] if key.startswith("features.") else key
        index, _, param = body.partition(".")
        if key.startswith("classifier."):
            continue  # fully connected VGG classifier: SSD's conv6/conv7 are not a reshape of it
        if index.isdigit() and param in ("weight", "bias"):
            numbered.setdefault(int(index), {})[param] = value
        else:
            other[key] = value
    order = sorted(numbered)
    if len(order) > len(VGG_LAYER_NAMES):
        raise ValueError(f"it has {len(order)} numbered layers; a VGG-16 has at most 15 convolutions")
    mapped = dict(other)
    for name, index in zip(VGG_LAYER_NAMES, order, strict=False):
        for param, value in numbered[index].items():
            mapped[f"{name}.{param}"] = value
    return mapped


def load_backbone_weights(backbone: SSDBackbone, path: str | Path) -> list[str]:
    """Load a VGG-16 state-dict file into ``backbone`` (``torch.load(..., weights_only=True)``).

    The file must provide conv1_1 ... conv5_3 with the right shapes (see :func:`_map_vgg_keys` for the
    layouts understood); conv6, conv7, the conv4_3 scale and the extra layers are loaded when present and
    keep their random initialization otherwise. Returns the names of the parameters loaded. Raises
    ``ConfigError`` naming the file for a missing, unreadable or incompatible file. Cost: reading the file.
    """
    path = Path(path).expanduser()
    fix = (
        "give the path of a VGG-16 state-dict file (see adaloss.runner.models.ssd), "
        "or model.backbone_weights=null"
    )
    if not path.is_file():
        raise ConfigError(f"model.backbone_weights: no file at {path}: {fix}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle errors, zip errors, disallowed globals: all mean "not a state dict"
        reason = " ".join(str(exc).split())[:200]
        raise ConfigError(
            f"model.backbone_weights: cannot read {path} as a state dict ({reason}): {fix}"
        ) from exc
    if isinstance(state, Mapping) and "state_dict" in state and isinstance(state["state_dict"], Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping) or not state or not all(isinstance(v, Tensor) for v in state.values()):
        raise ConfigError(f"model.backbone_weights: {path} does not hold a state dict of tensors: {fix}")
    try:
        mapped = _map_vgg_keys(state)
    except ValueError as exc:
        raise ConfigError(
            f"model.backbone_weights: {path} is not a VGG-16 state dict ({exc}): {fix}"
        ) from exc
    own = backbone.state_dict()
    unknown = sorted(k for k in mapped if k not in own)
    if unknown:
        raise ConfigError(
            f"model.backbone_weights: {path} has keys the SSD backbone does not "
            f"(e.g. {', '.join(unknown[:3])}): {fix}"
        )
    missing = [f"{n}.{p}" for n, _, _ in _VGG_CONVS for p in ("weight", "bias") if f"{n}.{p}" not in mapped]
    if missing:
        raise ConfigError(
            f"model.backbone_weights: {path} lacks {len(missing)} VGG-16 tensors (e.g. {missing[0]}): {fix}"
        )
    for key, value in mapped.items():
        if tuple(value.shape) != tuple(own[key].shape):
            raise ConfigError(
                f"model.backbone_weights: {path} has {key} of shape {tuple(value.shape)}, the backbone needs "
                f"{tuple(own[key].shape)}: {fix}"
            )
    backbone.load_state_dict(mapped, strict=False)
    return sorted(mapped)


# ------------------------------------------------------------------------------------ from-scratch init


@torch.no_grad()
def lsuv_init_(
    backbone: SSDBackbone, images: Tensor, target_std: float = 1.0, max_iters: int = 5, tol: float = 0.02
) -> dict[str, float]:
    """Layer-sequential unit-variance init (Mishkin & Matas 2016) of ``backbone``'s convolutions, in place.

    For a CPU run from scratch (no pretrained VGG): in layer order, each conv's weight is rescaled until its
    (pre-ReLU) output on ``images`` has standard deviation ``target_std``. Without it, the small-input maps
    shrink by orders of magnitude from conv6 on (conv6's dilated taps and the extras' 3x3 kernels mostly see
    padding), so the deeper heads get almost no gradient. Call once, before training, on one training batch.
    Returns each conv's final output std. Cost: about ``max_iters`` forward passes per conv on ``images``.
    """
    stds: dict[str, float] = {}
    seen: list[Tensor] = []

    def record(_module: nn.Module, _inputs: Any, output: Tensor) -> None:
        seen.append(output)

    for name, module in backbone.named_children():
        if not isinstance(module, nn.Conv2d):
            continue
        handle = module.register_forward_hook(record)
        try:
            for _ in range(max_iters):
                seen.clear()
                backbone(images)
                std = seen[0].std().item()
                if std == 0 or not math.isfinite(std) or abs(std - target_std) < tol * target_std:
                    break
                module.weight.mul_(target_std / std)
        finally:
            handle.remove()
        stds[name] = std
    return stds


def _background_prior_(head: SSDHead, num_classes: int, prior: float) -> None:
    """Classification biases so that softmax gives background ``prior`` and the classes the rest evenly."""
    for conv in head.classification_head.module_list:
        bias = conv.bias.detach().view(-1, num_classes + 1)
        bias.zero_()
        bias[:, 0] = math.log(prior * num_classes / (1 - prior))


# --------------------------------------------------------------------------------------------------- build


def feature_map_sizes(backbone: SSDBackbone, image_size: int) -> list[tuple[int, int]]:
    """``(height, width)`` of each feature map, from one forward pass on the meta device (shapes only: no
    arithmetic, no memory, microseconds even for SSD512 at 512)."""
    meta = {k: v.to("meta") for k, v in [*backbone.named_parameters(), *backbone.named_buffers()]}
    dtype = next(backbone.parameters()).dtype
    x = torch.empty(1, 3, image_size, image_size, device="meta", dtype=dtype)
    return [tuple(f.shape[-2:]) for f in functional_call(backbone, meta, (x,))]


def default_boxes(config: SSDConfig, image_size: int, grid_sizes: Sequence[tuple[int, int]]) -> Tensor:
    """``[A, 4]`` default boxes (xyxy, pixels) from torchvision's ``DefaultBoxGenerator``.

    The configured ``steps`` place the centres at the native size; at any other size the centres follow the
    grid (``(i + 0.5) / f_k``). No clipping of box sizes, as in the original SSD VOC models.
    """
    steps = list(config.steps) if image_size == config.image_size else None
    generator = DefaultBoxGenerator(
        [list(r) for r in config.aspect_ratios], scales=list(config.scales), steps=steps, clip=False
    )
    images = ImageList(torch.empty(1, 0, image_size, image_size), [(image_size, image_size)])
    maps = [torch.empty(0, 0, h, w) for h, w in grid_sizes]
    return generator(images, maps)[0]


def ssd_detector(
    variant: str,
    num_classes: int,
    image_size: int | None = None,
    width_multiplier: float = 1.0,
    backbone_weights: str | None = None,
    background_prior: float | None = None,
) -> SSDDetector:
    """Build ``ssd300`` or ``ssd512`` (``variant``) for ``num_classes`` object classes (background added),
    on the CPU: the ``_target_`` of ``configs/model/ssd300.yaml`` and ``ssd512.yaml``.

    ``image_size`` (default: the native 300 / 512; at least 32); ``width_multiplier`` (default 1.0, the real
    SSD: a CPU-only knob multiplying the channels of every backbone and extra layer, see
    :class:`SSDBackbone`); ``backbone_weights`` (null for random initialization, or a state-dict file, see
    :func:`load_backbone_weights`; only with width 1); ``background_prior`` (default null: torchvision's
    zero classification biases; e.g. 0.99 sets them so every default box starts at that background
    probability, which calms the first steps from scratch). Raises ``ConfigError`` for invalid fields.
    Cost: allocating and initializing the weights (26M parameters for SSD300 with 21 classes, 27M for
    SSD512), a fraction of a second; the feature-map sizes come from a meta-device forward (free).
    """
    name = str(variant)
    if name not in SSD_CONFIGS:
        raise ConfigError(f"unknown detection model '{name}': choose one of {', '.join(SSD_CONFIGS)}")
    config = SSD_CONFIGS[name]
    if image_size is None:
        image_size = config.image_size
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < _MIN_IMAGE_SIZE:
        raise ConfigError(f"model.image_size must be an integer >= {_MIN_IMAGE_SIZE}, got {image_size!r}")
    if isinstance(num_classes, bool) or int(num_classes) < 1:
        raise ConfigError(f"a detector needs at least one object class, got num_classes={num_classes!r}")
    backbone = SSDBackbone(config, image_size, width_multiplier)  # validates width_multiplier
    weights = backbone_weights
    if weights is not None:
        if backbone.width_multiplier != 1.0:
            raise ConfigError(
                f"model.backbone_weights needs the full-width VGG-16, but model.width_multiplier="
                f"{width_multiplier}: set model.width_multiplier=1.0 or model.backbone_weights=null"
            )
        load_backbone_weights(backbone, str(weights))
    num_anchors = [2 + 2 * len(r) for r in config.aspect_ratios]
    head = SSDHead(backbone.out_channels, num_anchors, int(num_classes) + 1)  # Xavier-initialized
    prior = background_prior
    if prior is not None:
        if isinstance(prior, bool) or not isinstance(prior, int | float) or not 0 < prior < 1:
            raise ConfigError(f"model.background_prior must be null or a number in (0, 1), got {prior!r}")
        _background_prior_(head, int(num_classes), float(prior))
    grids = feature_map_sizes(backbone, image_size)
    anchors = default_boxes(config, image_size, grids)
    return SSDDetector(SSDNet(backbone, head), anchors, image_size, int(num_classes))
