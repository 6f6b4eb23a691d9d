"""SSD300 / SSD512: configuration, forward / loss / post-processing, fx, adaptive exactness, weights."""

import copy
from collections.abc import Callable

import pytest
import torch
import torch.fx as fx

from adaloss.errors import ConfigError
from adaloss.runner.models import build_detector, build_model
from adaloss.runner.models.ssd import (
    SSD_CONFIGS,
    VGG_LAYER_NAMES,
    SSDBackbone,
    SSDDetector,
    feature_map_sizes,
    load_backbone_weights,
    lsuv_init_,
    ssd_detector,
)
from adaloss.scalers.adaptive import AdaptiveLossScaler

SMALL = 128  # CPU-sized input: SSD512 maps 16, 8, 4, 2, 1, 1, 2


@pytest.fixture(scope="module")
def small_detector():
    torch.manual_seed(0)
    return build_detector({"name": "ssd512", "image_size": SMALL}, num_classes=3)


@pytest.mark.parametrize(
    "name, maps, boxes",
    [
        ("ssd300", [38, 19, 10, 5, 3, 1], 8732),
        ("ssd512", [64, 32, 16, 8, 4, 2, 1], 24564),
    ],
)
def test_native_size_feature_maps_and_default_boxes(name, maps, boxes):
    detector = build_model({"name": name}, num_classes=20)  # the runner's entry point dispatches here
    assert isinstance(detector, SSDDetector)
    size = detector.image_size
    assert feature_map_sizes(detector.net.backbone, size) == [(m, m) for m in maps]
    assert detector.num_anchors == boxes
    assert detector.net.backbone.adjusted_padding == {}
    # first default box: centre at step / 2 = 4 px, side = the first scale times the image size
    first_scale = {"ssd300": 0.1, "ssd512": 0.07}[name]
    half = first_scale * size / 2
    torch.testing.assert_close(detector.anchors[0], torch.tensor([4 - half, 4 - half, 4 + half, 4 + half]))
    # the last map is 1x1, its boxes centred in the image
    last = detector.anchors[-4:]
    torch.testing.assert_close((last[:, :2] + last[:, 2:]) / 2, torch.full((4, 2), size / 2))


def test_network_layout_follows_the_paper(small_detector):
    backbone = small_detector.net.backbone
    assert backbone.pool3.ceil_mode and not backbone.pool4.ceil_mode
    assert (backbone.pool5.kernel_size, backbone.pool5.stride) == (3, 1)
    assert (backbone.conv6.dilation, backbone.conv6.out_channels) == ((6, 6), 1024)
    assert backbone.conv7.kernel_size == (1, 1)
    assert backbone.conv12_2.kernel_size == (4, 4)
    torch.testing.assert_close(backbone.conv4_3_norm.weight, torch.full((512,), 20.0))
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in small_detector.modules())
    assert all(not m.inplace for m in small_detector.modules() if isinstance(m, torch.nn.ReLU))
    # SSD512 at 128: the 4x4 conv sees a 1x1 map, so its padding is raised to keep a (2x2) output
    assert backbone.adjusted_padding == {"conv12_2": 2}


def test_forward_loss_backward_postprocess(small_detector):
    detector = small_detector
    images = torch.randn(2, 3, SMALL, SMALL)
    targets = [
        {
            "boxes": torch.tensor([[10.0, 12.0, 60.0, 70.0], [70.0, 20.0, 120.0, 90.0]]),
            "labels": torch.tensor([1, 3]),
        },
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)},  # an image without objects
    ]
    cls_logits, bbox_regression = detector(images)
    assert cls_logits.shape == (2, detector.num_anchors, 4)
    assert bbox_regression.shape == (2, detector.num_anchors, 4)

    losses = detector.loss((cls_logits, bbox_regression), targets)
    assert torch.isfinite(losses.total) and losses.total > 0
    torch.testing.assert_close(losses.total, losses.classification + losses.bbox_regression)
    detector.net.zero_grad()
    losses.total.backward()
    assert all(p.grad is not None for p in detector.net.parameters())

    detections = detector.postprocess((cls_logits, bbox_regression), image_sizes=[(256, 512), (SMALL, SMALL)])
    assert len(detections) == 2
    for det, (height, width) in zip(detections, [(256, 512), (SMALL, SMALL)], strict=True):
        assert len(det["boxes"]) <= 200 and det["boxes"].shape[1:] == (4,)
        assert (det["scores"] > 0.01).all() and set(det["labels"].tolist()) <= {1, 2, 3}
        assert (det["boxes"][:, 0::2] >= 0).all() and (det["boxes"][:, 0::2] <= width).all()
        assert (det["boxes"][:, 1::2] >= 0).all() and (det["boxes"][:, 1::2] <= height).all()


def test_half_precision_outputs_are_upcast_for_the_loss(small_detector):
    cls_logits = torch.randn(1, small_detector.num_anchors, 4).half()
    bbox_regression = torch.randn(1, small_detector.num_anchors, 4).half()
    target = [{"boxes": torch.tensor([[10.0, 10.0, 50.0, 50.0]]), "labels": torch.tensor([2])}]
    losses = small_detector.loss((cls_logits, bbox_regression), target)
    assert losses.total.dtype == torch.float32 and torch.isfinite(losses.total)


def test_net_traces_with_fx_and_matches_eager(small_detector):
    traced = fx.symbolic_trace(small_detector.net)
    x = torch.randn(1, 3, SMALL, SMALL)
    for got, expected in zip(traced(x), small_detector.net(x), strict=True):
        torch.testing.assert_close(got, expected)


def _one_box_per_map(detector):
    """Ground truth equal to one default box of each feature map: every head and layer gets a gradient."""
    sizes = feature_map_sizes(detector.net.backbone, detector.image_size)
    per_location = [4, 6, 6, 6, 6, 4, 4]
    start, boxes = 0, []
    for (h, w), k in zip(sizes, per_location, strict=True):
        boxes.append(detector.anchors[start + (h * w // 2) * k])  # may reach outside the image: fine
        start += h * w * k
    labels = torch.arange(len(boxes)) % 3 + 1
    return [{"boxes": torch.stack(boxes), "labels": labels}]


@pytest.mark.parametrize("rule", ["reference", "paper"])
def test_adaptive_scaling_gives_plain_backprop_gradients_in_float64(rule):
    """The adaptive issue's exactness test on SSD: its branches (feature maps feeding a head and the next
    layer) get rescaled, and the unscaled gradients equal plain backprop, under both scale rules."""
    torch.manual_seed(0)
    reference = build_detector({"name": "ssd512", "image_size": SMALL}, num_classes=3).double()
    detector = copy.deepcopy(reference)
    x = torch.randn(1, 3, SMALL, SMALL, dtype=torch.float64)
    targets = _one_box_per_map(reference)
    loss_factor = 1e-6  # gradients small enough for several layers to get betas > 1

    (reference.loss(reference.net(x), targets).total * loss_factor).backward()

    scaler = AdaptiveLossScaler(update_every=1, rule=rule)
    net = scaler.attach(detector.net)
    assert {id(p) for p in net.parameters()} == {id(p) for p in detector.net.parameters()}
    loss = detector.loss(net(x), targets).total * loss_factor
    scaler.scale(loss).backward()
    scaler.unscale_(torch.optim.SGD(net.parameters(), lr=0.1))

    grads = dict(net.named_parameters())
    for name, ref in reference.net.named_parameters():
        scale = ref.grad.abs().max()
        assert scale > 0, name
        assert ((grads[name].grad - ref.grad).abs().max() / scale).item() <= 1e-10, name

    alphas = scaler.layer_scales()
    assert len({a for a in alphas.values() if a > 1}) >= 2, alphas
    rescaled = scaler.branch_rescaled()
    assert any(rescaled.values()), rescaled
    assert "backbone_relu7" in rescaled  # conv7 feeds both heads and conv8_1


def test_backbone_weights_round_trip(tmp_path):
    torch.manual_seed(1)
    source = build_detector({"name": "ssd300", "image_size": 64}, num_classes=2)
    own = tmp_path / "backbone.pt"
    torch.save(source.net.backbone.state_dict(), own)
    loaded = build_detector({"name": "ssd300", "image_size": 64, "backbone_weights": str(own)}, num_classes=2)
    for (name, a), b in zip(
        source.net.backbone.state_dict().items(), loaded.net.backbone.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name

    # torchvision's VGG-16 layout (features.<i>, classifier.*): conv1_1..conv5_3 load, conv6/conv7 stay random
    convs = [getattr(source.net.backbone, name) for name in VGG_LAYER_NAMES[:13]]  # conv1_1 .. conv5_3
    indices = [0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28]
    state = {
        f"features.{i}.{p}": getattr(c, p).detach().clone()
        for i, c in zip(indices, convs, strict=True)
        for p in ("weight", "bias")
    }
    state["classifier.0.weight"] = torch.zeros(4, 4)
    torchvision_file = tmp_path / "vgg16.pth"
    torch.save(state, torchvision_file)
    torch.manual_seed(2)
    other = build_detector({"name": "ssd300", "image_size": 64, "backbone_weights": str(torchvision_file)}, 2)
    assert torch.equal(other.net.backbone.conv5_3.weight, source.net.backbone.conv5_3.weight)
    assert not torch.equal(other.net.backbone.conv6.weight, source.net.backbone.conv6.weight)


def test_bad_backbone_weights_are_config_errors(tmp_path):
    cfg = {"name": "ssd300", "image_size": 64}
    with pytest.raises(ConfigError, match="no file at") as info:
        build_detector(cfg | {"backbone_weights": str(tmp_path / "missing.pt")}, 2)
    assert "\n" not in str(info.value) and "backbone_weights=null" in str(info.value)

    backbone = SSDBackbone(SSD_CONFIGS["ssd300"], 64)
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a checkpoint")
    unrelated = tmp_path / "unrelated.pt"
    torch.save({"encoder.weight": torch.zeros(3)}, unrelated)
    partial = tmp_path / "partial.pt"
    torch.save({"conv1_1.weight": backbone.conv1_1.weight.detach()}, partial)
    wrong_shape = tmp_path / "wrong.pt"
    state = backbone.state_dict()
    state["conv1_1.weight"] = torch.zeros(64, 1, 3, 3)  # a grey-scale VGG
    torch.save(state, wrong_shape)
    for path, match in [
        (garbage, "cannot read"),
        (unrelated, "keys the SSD backbone does not"),
        (partial, "lacks 25 VGG-16 tensors"),
        (wrong_shape, "conv1_1.weight of shape"),
    ]:
        with pytest.raises(ConfigError, match=match) as info:
            load_backbone_weights(backbone, path)
        assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_invalid_model_fields_are_config_errors():
    with pytest.raises(ConfigError, match="image_size must be an integer >= 32"):
        build_model({"name": "ssd512", "image_size": 16}, num_classes=3)
    with pytest.raises(ConfigError, match="ssd512"):
        build_model({"name": "ssd1024"}, num_classes=3)
    with pytest.raises(ConfigError, match="at least one object class"):
        build_detector({"name": "ssd300", "image_size": 64}, num_classes=0)


def test_width_multiplier_scales_channels_but_keeps_layers_and_boxes(tmp_path):
    """model.width_multiplier (a CPU knob): fewer channels everywhere, same layers, maps and default boxes."""
    torch.manual_seed(0)
    full = build_detector({"name": "ssd512", "image_size": 64}, num_classes=3)
    thin = build_detector({"name": "ssd512", "image_size": 64, "width_multiplier": 0.25}, num_classes=3)
    assert full.net.backbone.width_multiplier == 1.0 and thin.net.backbone.width_multiplier == 0.25
    full_params, thin_params = dict(full.net.named_parameters()), dict(thin.net.named_parameters())
    assert list(full_params) == list(thin_params)  # same layer names and order
    assert full.net.backbone.conv1_1.in_channels == thin.net.backbone.conv1_1.in_channels == 3
    assert (thin.net.backbone.conv1_1.out_channels, thin.net.backbone.conv7.out_channels) == (16, 256)
    assert thin.net.backbone.out_channels == [128, 256, 128, 64, 64, 64, 64]
    assert thin.net.backbone.conv4_3_norm.weight.shape == (128,)
    assert feature_map_sizes(thin.net.backbone, 64) == feature_map_sizes(full.net.backbone, 64)
    torch.testing.assert_close(thin.anchors, full.anchors)
    assert sum(p.numel() for p in thin.net.parameters()) < sum(p.numel() for p in full.net.parameters()) / 10
    cls_logits, bbox_regression = thin(torch.randn(2, 3, 64, 64))
    assert cls_logits.shape == (2, thin.num_anchors, 4) and bbox_regression.shape == (2, thin.num_anchors, 4)
    fx.symbolic_trace(thin.net)  # still traceable for the adaptive scaler

    for bad in (0, -0.5, float("nan"), "wide", True):  # the function's own check, for direct callers
        with pytest.raises(ConfigError, match="width_multiplier must be a positive number"):
            ssd_detector("ssd300", 3, image_size=64, width_multiplier=bad)
    with pytest.raises(ConfigError, match="model.width_multiplier must be a number > 0"):  # the schema's
        build_detector({"name": "ssd300", "image_size": 64, "width_multiplier": 0}, num_classes=3)
    weights = tmp_path / "backbone.pt"
    torch.save(full.net.backbone.state_dict(), weights)
    cfg = {"name": "ssd512", "image_size": 64, "width_multiplier": 0.5, "backbone_weights": str(weights)}
    with pytest.raises(ConfigError, match="width_multiplier=1.0 or model.backbone_weights=null"):
        build_detector(cfg, num_classes=3)


def test_from_scratch_init_helpers():
    """lsuv_init_ gives every backbone conv a unit-std output (the deep small maps no longer vanish);
    model.background_prior sets the classification biases to that background probability."""
    torch.manual_seed(0)
    detector = build_detector(
        {"name": "ssd512", "image_size": 64, "width_multiplier": 0.25, "background_prior": 0.99},
        num_classes=3,
    )
    images = torch.randn(4, 3, 64, 64)
    before = [f.std().item() for f in detector.net.backbone(images)]
    stds = lsuv_init_(detector.net.backbone, images)
    convs = [n for n, m in detector.net.backbone.named_children() if isinstance(m, torch.nn.Conv2d)]
    assert list(stds) == convs and len(convs) == 25  # 13 VGG + conv6, conv7 + 5 extra blocks of 2
    # measured here, not taken from what lsuv_init_ reports: each conv's output std on the same images
    measured: dict[str, float] = {}

    def hook(name: str) -> Callable:
        def record(_module: torch.nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
            measured[name] = output.std().item()

        return record

    handles = [
        module.register_forward_hook(hook(name))
        for name, module in detector.net.backbone.named_children()
        if isinstance(module, torch.nn.Conv2d)
    ]
    with torch.no_grad():
        detector.net.backbone(images)
    for handle in handles:
        handle.remove()
    assert list(measured) == convs
    assert all(abs(std - 1.0) < 0.05 for std in measured.values()), measured
    assert measured == pytest.approx(stds, rel=1e-5)  # and the report is what the layers do
    after = [f.std().item() for f in detector.net.backbone(images)]
    assert before[-1] < 1e-3 < 0.1 < min(after)  # the last map: vanishing at the default init, O(1) after
    probs = detector.net(images)[0].softmax(-1)
    assert probs.shape[-1] == 4 and (probs[..., 0] > 0.9).float().mean() > 0.5
    with pytest.raises(ConfigError, match="background_prior"):
        build_detector({"name": "ssd300", "image_size": 64, "background_prior": 1.0}, num_classes=3)


def test_outputs_of_another_image_size_get_a_clear_error(small_detector):
    wrong = (torch.zeros(1, 100, 4), torch.zeros(1, 100, 4))
    target = [{"boxes": torch.tensor([[1.0, 1.0, 9.0, 9.0]]), "labels": torch.tensor([1])}]
    with pytest.raises(ValueError, match="model.image_size"):
        small_detector.loss(wrong, target)
    with pytest.raises(ValueError, match="128x128"):
        small_detector.postprocess(wrong)
