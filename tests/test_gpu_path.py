"""The code a GPU run takes, run on the CPU with real half tensors (``torch.autocast("cpu", ...)``).

No GPU is available to this project. PyTorch's CPU autocast runs the same Python and the same ATen ops as
CUDA autocast, with real FP16/BF16 tensors and the CPU's half kernels (about 60x slower than FP32 here, so
the models are tiny). Covered:

* every scaler, FP16 and BF16, on an MLP, ResNet-20 and a small SSD512: one step's unscaled gradients equal
  those of plain autocast at a fixed loss scale (cosine > 0.999 per parameter; the check fails when a
  scaler unscales by the wrong factor or loses a layer's gradient);
* the adaptive scaler's device path (statistics, betas and alphas as tensors) computes the same betas as
  the emulated host path on the same batch;
* no host sync and no host-to-device copy in the adaptive scaler's backward pass, caught in ATen by
  ``tests/sync_trap.py`` (a trap that fails on the kinds of reads it is meant to catch, tested first);
* a telemetry step reads the per-layer scales with one host sync;
* with CUDA (never here): the same backward pass under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from adaloss.precision import Precision
from adaloss.runner.models import build_detector, build_model
from adaloss.runner.utils.targets import build_scaler
from sync_trap import HostSyncError, no_host_sync, trapped_steps

SCALERS = {
    "none": {"name": "none"},
    "fixed": {"name": "fixed", "scale": 1024},
    "dynamic": {"name": "dynamic", "init_scale": 1024},
    "adaptive": {"name": "adaptive", "update_every": 2},
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------- the trap itself


class _Reads(torch.autograd.Function):
    """Identity forward; the backward pass does one of the things the trap must catch."""

    @staticmethod
    def forward(ctx, x, how):  # type: ignore[override]
        ctx.how = how
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        how = ctx.how
        beta = g.abs().amax()
        if how == "bool":
            if bool(beta == 1.0):  # the read the issue planted: passed the old .item() trap unseen
                g = g * 1.0
        elif how == "if":
            if beta:
                g = g * 1.0
        elif how == "float":
            g = g * float(beta)
        elif how == "item":
            g = g * beta.item()
        elif how == "tensor":
            g = g * torch.tensor([1.0, 1.0, 1.0])
        elif how == "as_tensor":
            g = g * torch.as_tensor([1.0, 1.0, 1.0])
        elif how == "list_index":
            g = g[[0, 1, 2]]
        elif how == "tolist":
            g = g * g.tolist()[0]
        elif how == "cpu":
            g = g.cpu()
        return g, None


@pytest.mark.parametrize(
    "how", ["bool", "if", "float", "item", "tensor", "as_tensor", "list_index", "tolist", "cpu"]
)
def test_the_trap_catches_every_kind_of_host_read(how):
    x = torch.ones(3, requires_grad=True)
    y = _Reads.apply(x, how).sum()
    with pytest.raises(HostSyncError), no_host_sync():
        y.backward()


def test_the_trap_lets_device_work_through():
    x = torch.ones(3, requires_grad=True)
    y = _Reads.apply(x, "none").sum()
    with no_host_sync() as mode:
        y.backward()
    assert mode.seen > 0 and torch.equal(x.grad, torch.ones(3))


# ---------------------------------------------------------------------------------------- models


def _mlp() -> nn.Module:
    return build_model(OmegaConf.create({"name": "mlp", "hidden": [32, 32]}), 10, (3, 4, 4))


def _resnet20() -> nn.Module:
    return build_model(OmegaConf.create({"name": "resnet20", "depth": 20}), 10)


class _SmallSSD(nn.Module):
    """SSD512 at 128x128 and 1/8 width (the shapes recipe's CPU knobs: its seven maps, its branches), with
    its multibox loss against one box, as one module whose output is the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.detector = build_detector(
            {"name": "ssd512", "image_size": 128, "width_multiplier": 0.125}, num_classes=3
        )
        self.net = self.detector.net

    def targets(self, n: int) -> list[dict[str, torch.Tensor]]:
        box = torch.tensor([[16.0, 16.0, 80.0, 96.0]])
        return [{"boxes": box, "labels": torch.tensor([1])} for _ in range(n)]


MODELS = {
    "mlp": (_mlp, (2, 3, 4, 4)),
    "resnet20": (_resnet20, (2, 3, 8, 8)),
    "ssd": (_SmallSSD, (1, 3, 128, 128)),
}


def _loss(name: str, model: nn.Module, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if name == "ssd":
        return model.detector.loss(net(x), model.targets(x.shape[0])).total
    y = torch.arange(x.shape[0]) % 10
    return nn.functional.cross_entropy(net(x), y)


def _one_step(model_name: str, scaler_cfg: dict | None, dtype_name: str, backend: str = "autocast", seed=0):
    """One forward/backward/unscale under ``backend``; returns (parameter gradients, scaler)."""
    factory, shape = MODELS[model_name]
    torch.manual_seed(seed)
    model = factory()
    net = model.net if model_name == "ssd" else model
    precision = Precision(dtype_name, "cpu", backend=backend)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 1))
    if scaler_cfg is None:  # plain autocast, the loss times a fixed power of two, divided out by hand
        with precision.autocast():
            loss = _loss(model_name, model, net, x)
        (loss * 1024.0).backward()
        return {n: p.grad / 1024.0 for n, p in net.named_parameters() if p.grad is not None}, None
    scaler = build_scaler(OmegaConf.create(scaler_cfg), precision.grad_format)
    attached = precision.prepare(scaler.attach(net))
    with precision.autocast():
        loss = _loss(model_name, model, attached, x)
    scaler.scale(loss).backward()
    scaler.unscale_(torch.optim.SGD(attached.parameters(), lr=0.0))
    return {n: p.grad.clone() for n, p in attached.named_parameters() if p.grad is not None}, scaler


# ---------------------------------------------------------------------------------------- the matrix


#: PyTorch 2.14.1's CPU BF16 convolution computes a wrong, nondeterministic weight gradient (NaN, 1e37, or
#: plausible-looking values; 18 of 20 tries) for a 3x3 kernel with stride 2 and padding 1 over a 1x1 input,
#: which SSD512's last extra layer is at this input size (FP16 and FP32 are right; the input gradient is
#: right). Found by this test; reproduced with a bare ``F.conv2d`` in README's section on the GPU path.
#: Plain autocast is wrong there too, so that one weight has no reference to compare with.
CPU_BF16_CONV_DEFECT = {("ssd", "bf16"): {"backbone.conv11_2.weight"}}


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_every_scaler_under_real_autocast_gives_plain_autocast_gradients(model_name, dtype_name):
    reference, _ = _one_step(model_name, None, dtype_name)
    assert reference
    skip = CPU_BF16_CONV_DEFECT.get((model_name, dtype_name), set())
    for name, cfg in SCALERS.items():
        grads, _ = _one_step(model_name, cfg, dtype_name)
        assert grads.keys() == reference.keys(), name
        for param, ref in reference.items():
            if param in skip:
                continue
            got = grads[param]
            assert got.dtype == torch.float32, (name, param)  # FP32 master gradients
            assert torch.isfinite(got).all(), (name, param)
            if ref.abs().max() == 0:
                assert got.abs().max() == 0, (name, param)
                continue
            cos = nn.functional.cosine_similarity(got.flatten().double(), ref.flatten().double(), dim=0)
            assert cos > 0.999, (name, param, float(cos))


@pytest.mark.parametrize("model_name", ["mlp", "resnet20"])
def test_adaptive_under_autocast_computes_the_emulated_betas(model_name):
    """The same batch: real FP16 autocast and the emulation give the same betas (equal where FP16 compute
    and FP32-compute-then-round agree on the power of two; measured: every layer) and both scale some
    layer."""
    cfg = {"name": "adaptive", "update_every": 1}
    _, real = _one_step(model_name, cfg, "fp16", backend="autocast")
    _, emulated = _one_step(model_name, cfg, "fp16", backend="emulate")
    real_betas, emulated_betas = real.layer_betas(), emulated.layer_betas()
    assert real_betas.keys() == emulated_betas.keys()
    same = sum(real_betas[k] == emulated_betas[k] for k in real_betas)
    assert same == len(real_betas), (real_betas, emulated_betas)


# ---------------------------------------------------------------------------------------- host syncs


@pytest.mark.parametrize(
    "backend,dtype_name", [("emulate", "fp16"), ("autocast", "fp16"), ("autocast", "bf16")]
)
def test_no_host_sync_in_the_adaptive_backward_pass(backend, dtype_name):
    """Recompute and reuse steps: no value read on the host and no host data copied to the device while
    backpropagating."""
    precision = Precision(dtype_name, "cpu", backend=backend)
    cfg = {"name": "adaptive", "update_every": 2}
    scaler = build_scaler(OmegaConf.create(cfg), precision.grad_format)
    torch.manual_seed(0)
    model = precision.prepare(scaler.attach(_resnet20()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))) for _ in range(3)]

    def loss_fn(model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1]) * 2.0**-12  # small: FP16 betas above 1

    kinds = trapped_steps(scaler, model, opt, precision, batches, loss_fn)
    assert kinds == ["recompute", "reuse", "recompute"]
    # FP16: betas other than 1 took part. (BF16 has FP32's range: its betas are 1 unless the gradients are
    # so small that their FP32 second moments underflow, and then the rule reads them as zero: scale 1.)
    betas = set(scaler.layer_betas().values())
    assert len(betas) > 1 if dtype_name == "fp16" else betas == {1.0}


def test_a_telemetry_step_reads_the_scales_with_one_host_sync(monkeypatch):
    """The trainer reads, on a telemetry step, the loss scale (per-layer alphas) and the betas, for W&B and
    for telemetry.jsonl: one host sync for all of them on a recompute step, none on a reuse step."""
    precision = Precision("fp16", "cpu")
    scaler = build_scaler(OmegaConf.create({"name": "adaptive", "update_every": 2}), None)
    model = precision.prepare(scaler.attach(_resnet20()))
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.numel()) or real_tolist(t))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(2):
        with precision.autocast():
            loss = nn.functional.cross_entropy(model(torch.randn(2, 3, 8, 8)), torch.tensor([0, 1]))
        scaler.scale(loss).backward()
        reads.clear()
        for _ in range(2):  # W&B's metrics and the telemetry line both read them
            scaler.loss_scale_metric()
            scaler.layer_betas()
            scaler.layer_scales()
        assert len(reads) == (1 if step == 0 else 0), (step, reads)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none on this project's machines)"
)
def test_no_sync_on_cuda_with_the_sync_debug_mode():
    scaler = build_scaler(OmegaConf.create({"name": "adaptive", "update_every": 2}), None)
    precision = Precision("fp16", "cuda")
    model = precision.prepare(scaler.attach(_resnet20().cuda()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        x, y = torch.randn(8, 3, 32, 32, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
        with precision.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        scaled = scaler.scale(loss)
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaled.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_trainer_runs_real_autocast_on_the_cpu(make_cfg):
    """``precision.backend=autocast device=cpu``: the trainer's GPU path with real FP16 tensors."""
    from adaloss.runner.engine import train

    metrics = train(make_cfg("precision.backend=autocast", "scaler=adaptive", "model=mlp"))
    assert metrics["steps"] == 2 and metrics["skipped_steps"] == 0
    assert metrics["config"]["precision"]["backend"] == "autocast"
