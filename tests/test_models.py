"""The model zoo: sizes from the papers, shapes, option-A shortcuts, fx traceability, config errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
from omegaconf import OmegaConf
from torch import nn

from adaloss.errors import ConfigError
from adaloss.runner.models import MLP, CifarResNet, ShortcutA, VGGNoBN, build_model, model_names

#: The convolutional and MLP image classifiers (the paper's kind of model).
MODEL_NAMES = tuple(n for n in model_names("classification") if n != "vit")

VGG_WIDTHS = [64, "M", 128, "M", 256, 256, "M", 512, "M"]

CONFIGS = {
    "resnet20": {"name": "resnet20", "depth": 20},
    "resnet56": {"name": "resnet56", "depth": 56},
    "resnet110": {"name": "resnet110", "depth": 110},
    "resnet18": {"name": "resnet18"},
    "resnet50": {"name": "resnet50"},
    "mlp": {"name": "mlp", "hidden": [32, 16], "shared_hidden": False},
    "mlp_shared": {"name": "mlp", "hidden": [32, 16], "shared_hidden": True},
    "vgg_nobn": {"name": "vgg_nobn", "widths": VGG_WIDTHS},
}


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_every_model_name_has_a_config() -> None:
    assert {c["name"] for c in CONFIGS.values()} == set(MODEL_NAMES)


@pytest.mark.parametrize(("name", "millions"), [("resnet20", 0.27), ("resnet56", 0.85), ("resnet110", 1.7)])
def test_cifar_resnet_parameter_counts_match_he_et_al(name: str, millions: float) -> None:
    model = build_model(CONFIGS[name], num_classes=10)
    assert isinstance(model, CifarResNet)
    assert n_params(model) == pytest.approx(millions * 1e6, rel=0.02)


@pytest.mark.parametrize("name", ["resnet20", "resnet56", "resnet110"])
def test_cifar_resnet_structure(name: str) -> None:
    model = build_model(CONFIGS[name], num_classes=100)
    depth = CONFIGS[name]["depth"]
    n = (depth - 2) // 6
    modules = dict(model.named_modules())
    for stage in (1, 2, 3):
        assert len(modules[f"layer{stage}"]) == n
    assert f"layer3.{n - 1}.conv1" in modules and "conv1" in modules and "fc" in modules
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) + 1 == depth  # 6n+1 convs + the classifier
    assert [c.out_channels for c in convs[:: 2 * n]] == [16, 16, 32, 64][: len(convs[:: 2 * n])]
    assert modules["fc"].out_features == 100


def test_cifar_resnet_output_shape_and_downsampling() -> None:
    model = build_model(CONFIGS["resnet20"], num_classes=10).eval()
    shapes = {}
    for stage in ("layer1", "layer2", "layer3"):
        getattr(model, stage).register_forward_hook(lambda m, i, o, s=stage: shapes.__setitem__(s, o.shape))
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    assert shapes == {
        "layer1": (2, 16, 32, 32),
        "layer2": (2, 32, 16, 16),
        "layer3": (2, 64, 8, 8),
    }


def test_option_a_shortcut_is_parameter_free_subsample_and_zero_pad() -> None:
    model = build_model(CONFIGS["resnet56"], num_classes=10)
    shortcuts = {k: m for k, m in model.named_modules() if isinstance(m, ShortcutA)}
    assert sorted(shortcuts) == ["layer2.0.shortcut", "layer3.0.shortcut"]
    for m in shortcuts.values():
        assert n_params(m) == 0 and len(list(m.buffers())) == 0
    identity = [k for k, m in model.named_modules() if k.endswith("shortcut") and isinstance(m, nn.Identity)]
    assert len(identity) == 3 * 9 - 2

    x = torch.randn(2, 16, 8, 8)
    y = ShortcutA(16, 32, stride=2)(x)
    assert y.shape == (2, 32, 4, 4)
    kept = y[:, 8:24]
    torch.testing.assert_close(kept, x[:, :, ::2, ::2])
    assert y[:, :8].abs().sum() == 0 and y[:, 24:].abs().sum() == 0


def test_cifar_resnet_init_is_kaiming_normal() -> None:
    torch.manual_seed(0)
    model = build_model(CONFIGS["resnet110"], num_classes=10)
    w = model.layer2[1].conv1.weight  # 32 -> 32, 3x3
    fan_out = w.shape[0] * w.shape[2] * w.shape[3]
    assert w.std().item() == pytest.approx((2.0 / fan_out) ** 0.5, rel=0.1)
    assert model.bn1.weight.eq(1).all() and model.bn1.bias.eq(0).all()


@pytest.mark.parametrize(("name", "shape"), [("resnet18", (2, 3, 64, 64)), ("resnet50", (2, 3, 64, 64))])
def test_torchvision_resnets(name: str, shape: tuple[int, ...]) -> None:
    model = build_model(CONFIGS[name], num_classes=7).eval()
    assert model.fc.out_features == 7
    assert model(torch.randn(shape)).shape == (2, 7)
    expected = {"resnet18": 11.18e6, "resnet50": 23.52e6}[name]  # 11.7M / 25.6M at 1000 classes
    assert n_params(model) == pytest.approx(expected, rel=0.01)


def test_torchvision_resnet_other_input_channels() -> None:
    model = build_model(CONFIGS["resnet18"], num_classes=5, input_shape=(1, 32, 32)).eval()
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 5)


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_no_inplace_relu(key: str) -> None:
    model = build_model(CONFIGS[key], num_classes=10)
    relus = [m for m in model.modules() if isinstance(m, nn.ReLU)]
    assert relus and not any(m.inplace for m in relus)


@pytest.mark.parametrize(
    "key",
    # ResNet-110 (about 15 s) in make test-full: ResNet-20 and -56 trace the same blocks in make test
    [pytest.param(k, marks=pytest.mark.slow) if k == "resnet110" else k for k in sorted(CONFIGS)],
)
def test_every_model_traces_with_fx(key: str) -> None:
    """What the adaptive scaler needs of the fx graph it rewrites: every conv/linear layer is a
    ``call_module`` node (a layer applied functionally, ``F.linear(x, self.fc.weight)``, would escape its
    scaling), and the graph trains as the model does: the same outputs and parameter gradients in training
    mode (batch norm on batch statistics) as an independent eager copy, on a batch size not traced with."""
    torch.manual_seed(0)
    model = build_model(CONFIGS[key], num_classes=10).train()
    eager = copy.deepcopy(model)  # its own parameters and batch-norm buffers
    traced = torch.fx.symbolic_trace(model)
    gemms = {name for name, m in model.named_modules() if isinstance(m, nn.Conv2d | nn.Linear)}
    called = {n.target for n in traced.graph.nodes if n.op == "call_module"}
    assert gemms and gemms <= called, sorted(gemms - called)
    assert not [n.target for n in traced.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    x = torch.randn(3, 3, 32, 32)
    out, ref = traced(x), eager(x)
    torch.testing.assert_close(out, ref)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    (ref * torch.linspace(-1, 1, ref.numel()).view_as(ref)).sum().backward()
    for (name, p), (_, q) in zip(traced.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_mlp_shapes_and_in_features() -> None:
    model = build_model(CONFIGS["mlp"], num_classes=10, input_shape=(3, 8, 8))
    assert isinstance(model, MLP)
    assert model.hidden[0].in_features == 3 * 8 * 8
    assert [m.out_features for m in model.hidden] == [32, 16]
    assert model(torch.randn(4, 3, 8, 8)).shape == (4, 10)
    logistic = build_model({"name": "mlp", "hidden": []}, num_classes=3, input_shape=(1, 4, 4))
    assert [type(m) for m in logistic.children()] == [nn.Flatten, nn.ModuleList, nn.ModuleList, nn.Linear]


def test_shared_hidden_mlp_calls_one_module_twice() -> None:
    model = build_model(CONFIGS["mlp_shared"], num_classes=10)
    plain = build_model(CONFIGS["mlp"], num_classes=10)
    assert n_params(model) == n_params(plain) + 16 * 16 + 16  # one extra Linear(16, 16), not two
    calls = []
    model.shared.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    model(torch.randn(3, 3, 32, 32))
    assert calls == [(3, 16), (3, 16)]
    graph = torch.fx.symbolic_trace(model).graph
    targets = [n.target for n in graph.nodes if n.op == "call_module"]
    assert targets.count("shared") == 2
    assert targets.count("shared_act.0") == 1 and targets.count("shared_act.1") == 1


def test_shared_hidden_without_hidden_layers_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="shared_hidden"):
        build_model({"name": "mlp", "hidden": [], "shared_hidden": True}, num_classes=10)


def test_vgg_nobn_structure() -> None:
    model = build_model(CONFIGS["vgg_nobn"], num_classes=10).eval()
    assert isinstance(model, VGGNoBN)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    names = [k for k, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert names == [f"features.conv{i}" for i in range(1, 6)]
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.modules()) == 4
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize(
    "widths",
    [["M"] * 6 + [8], [8, "X"], [0, "M"], ["M"], [8.5]],
    ids=["too-many-pools", "bad-str", "zero", "no-conv", "float"],
)
def test_vgg_nobn_bad_widths(widths: list) -> None:
    with pytest.raises(ConfigError, match="vgg_nobn"):
        build_model({"name": "vgg_nobn", "widths": widths}, num_classes=10)


def test_build_model_accepts_struct_omegaconf() -> None:
    cfg = OmegaConf.create({"name": "vgg_nobn", "widths": [8, "M", 16]})
    OmegaConf.set_struct(cfg, True)
    assert build_model(cfg, num_classes=4)(torch.randn(1, 3, 32, 32)).shape == (1, 4)
    cfg = OmegaConf.create({"name": "mlp", "hidden": [8], "shared_hidden": True})
    OmegaConf.set_struct(cfg, True)
    assert build_model(cfg, num_classes=4).shared is not None


def test_unknown_model_name_is_a_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown model 'resnet21': choose one of mlp, resnet18, resnet20"
    ) as info:
        build_model({"name": "resnet21"}, num_classes=10)
    for name in MODEL_NAMES:
        assert name in str(info.value)


def test_depth_that_contradicts_the_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="depth"):
        build_model({"name": "resnet20", "depth": 56}, num_classes=10)


def test_missing_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="name"):
        build_model({"depth": 20}, num_classes=10)
