"""The Lightning plugins (:mod:`adaloss.integrations.lightning`): a real ``Trainer.fit`` and a Fabric loop on
the CPU train a small model as a Lightning user writes it, and end with exactly the weights of our own loop
(tests/trainer_parity.py) with the same scaler, under the FP16 emulation.

The task is made for the scalers to matter (FP16 gradients underflow unless scaled): the four scalers end
with four different sets of weights (``test_the_scalers_train_differently``), so equality with our loop is
equality of scaler handling.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning")

from lightning.pytorch.loggers import Logger  # noqa: E402

from adaloss.integrations.lightning import FabricScalerPrecision, ScalerPrecision  # noqa: E402
from adaloss.precision import Precision  # noqa: E402
from adaloss.runner.utils.targets import build_scaler  # noqa: E402
from adaloss.scalers import LossScaler  # noqa: E402
from trainer_parity import (  # noqa: E402
    CLIP,
    LOSS_FACTOR,
    LR,
    SCALERS,
    STEPS,
    X,
    batches,
    equal,
    loader,
    our_loop,
    seeded_net,
    weights,
)


class LitClassifier(L.LightningModule):
    """A LightningModule as a user writes it."""

    def __init__(self, lr: float = LR) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y) * LOSS_FACTOR
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Bypass(LitClassifier):
    """A training_step that calls a submodule instead of the module: the adaptive rewrite never runs."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)


class ManualClassifier(LitClassifier):
    """Manual optimization, as Lightning's docs write it: manual_backward, clip_gradients, step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        self.manual_backward(F.cross_entropy(self(x), y) * LOSS_FACTOR)
        self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        optimizer.step()


class RecordingLogger(Logger):
    """A logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def lit_module() -> LitClassifier:
    torch.manual_seed(0)
    return LitClassifier()


def fit(
    name: str, steps: int = STEPS, ckpt: Path | None = None, logger: Any = False, **trainer_args: Any
) -> tuple[L.Trainer, LitClassifier, LossScaler]:
    lit, scaler = lit_module(), build_scaler(SCALERS[name])
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, plugins=[ScalerPrecision(scaler)], logger=logger,
        enable_checkpointing="callbacks" in trainer_args, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=5, **trainer_args,
    )  # fmt: skip
    trainer.fit(lit, loader(), ckpt_path=ckpt)
    return trainer, lit, scaler


@pytest.fixture(scope="module")
def ours() -> dict[str, list[torch.Tensor]]:
    return {name: our_loop(name, lit_module)[0] for name in SCALERS}


def test_the_scalers_train_differently(ours: dict[str, list[torch.Tensor]]) -> None:
    names = list(SCALERS)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not equal(ours[a], ours[b]), (
                f"{a} and {b} trained alike: the task does not tell them apart"
            )


#: none and fixed run in make test-full only (marked slow): the fast suite keeps the two that change the scale
BY_SPEED = [pytest.param(n, marks=pytest.mark.slow) if n in ("none", "fixed") else n for n in SCALERS]


@pytest.mark.parametrize("name", BY_SPEED)
def test_trainer_fit_equals_our_loop(name: str, ours: dict[str, list[torch.Tensor]]) -> None:
    """20 steps of Trainer.fit with the plugin end with our loop's weights, bitwise; the per-layer telemetry
    went through the module's log on the Trainer's logging steps (log_every_n_steps=5), so it reached the
    logger and callback_metrics (what ModelCheckpoint and EarlyStopping monitor), named as our loop names
    the layers (0 and 2, not net.0), and changed nothing."""
    logger = RecordingLogger()
    trainer, lit, scaler = fit(name, logger=logger)
    assert equal(weights(lit), ours[name])
    telemetry = [(step, m) for step, m in logger.records if "mean_underflow_rate" in m]
    assert [step for step, _ in telemetry] == [4, 9, 14, 19]  # Lightning's logging steps
    record = telemetry[-1][1]
    assert {"underflow_rate/0", "underflow_rate/2"} <= set(record)
    assert all(0.0 <= record[f"underflow_rate/{i}"] <= 1.0 for i in (0, 2))
    assert all(float(trainer.callback_metrics[k]) == v for k, v in record.items() if k != "epoch")
    if name == "adaptive":
        assert {k: v for k, v in record.items() if k.startswith("alpha/")} == {
            f"alpha/{layer}": alpha for layer, alpha in scaler.layer_scales().items()
        }
        assert len(scaler.layer_scales()) == 2
    else:  # the last iteration's, after its update: the scaler's final scale
        assert record["loss_scale"] == scaler.get_scale()
    if name == "none":
        assert telemetry[0][1]["mean_underflow_rate"] > 0  # unscaled FP16 gradients lose values here


def test_the_scaler_state_carries_between_our_loop_and_lightning() -> None:
    """The layers are named relative to the LightningModule's network (its self.net), as our loop names
    them: after 20 steps, Lightning's scaler state is our loop's; our loop's state loads into a scaler that
    Lightning attaches, and Lightning's into one our loop attaches."""
    _, _, lightning = fit("adaptive")
    _, ours = our_loop("adaptive")  # on the network itself: layers 0 and 2
    assert lightning.state_dict() == ours.state_dict()
    plugin = ScalerPrecision(build_scaler(SCALERS["adaptive"]))
    plugin.scaler.load_state_dict(ours.state_dict())
    plugin.convert_module(lit_module())
    assert plugin.scaler.state_dict() == ours.state_dict()
    back = build_scaler(SCALERS["adaptive"])
    back.load_state_dict(lightning.state_dict())
    back.attach(seeded_net())
    assert back.state_dict() == lightning.state_dict()


def test_lightning_precision_names() -> None:
    """Lightning's names are taken and reported by trainer.precision (ours are reported as they are); half
    weights ("16-true") and unknown names are refused with the names to use."""
    for given, reported in (("16-mixed", "16-mixed"), ("bf16-mixed", "bf16-mixed"), ("32-true", "32-true"),
                            ("fp16", "16-mixed"), (32, "32-true"), ("fp8_e5m2", "fp8_e5m2")):  # fmt: skip
        plugin = ScalerPrecision(build_scaler(SCALERS["dynamic"]), precision=given)
        trainer = L.Trainer(accelerator="cpu", plugins=[plugin], logger=False, enable_progress_bar=False)
        assert trainer.precision == reported, given
    with pytest.raises(ValueError, match=r"half weights .* use '16-mixed'"):
        ScalerPrecision(build_scaler(SCALERS["dynamic"]), precision="16-true")
    with pytest.raises(ValueError, match=r"'bf16-mixed'.*fp8_e4m3"):
        ScalerPrecision(build_scaler(SCALERS["dynamic"]), precision="fp12")


@pytest.mark.parametrize("name", ["dynamic", pytest.param("adaptive", marks=pytest.mark.slow)])
def test_trainer_clips_and_accumulates_as_our_loop(name: str) -> None:
    """gradient_clip_val clips the unscaled gradients (the dynamic scale is 2**16 and more: clipping the
    scaled ones would differ); accumulate_grad_batches=2 sums two scaled backward passes of half the loss
    into one step: the weights are our loop's with the same two settings."""
    expected, _ = our_loop(name, lit_module, clip=CLIP, accumulate=2)
    _, lit, _ = fit(name, gradient_clip_val=CLIP, accumulate_grad_batches=2)
    assert equal(weights(lit), expected)


def test_manual_optimization_clips_as_our_loop() -> None:
    """Manual optimization: self.clip_gradients unscales first (Lightning hands it the LightningOptimizer,
    the step then the optimizer inside: one unscale), so the weights are our loop's with clipping."""
    expected, _ = our_loop("dynamic", clip=CLIP)
    torch.manual_seed(0)
    module, plugin = ManualClassifier(), ScalerPrecision(build_scaler(SCALERS["dynamic"]))
    trainer = L.Trainer(
        accelerator="cpu", max_steps=STEPS, plugins=[plugin], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, loader())
    assert equal(weights(module), expected)


def test_checkpoint_resumes_the_adaptive_scaler_exactly(tmp_path: Path) -> None:
    """A run of 20 steps saves a Lightning checkpoint at step 10 (ModelCheckpoint); a new Trainer with a new
    scaler resumes from it: the weights and the scaler's whole state (betas, alphas, root scale, counters,
    schedule) end as those of the uninterrupted run."""
    saver = L.pytorch.callbacks.ModelCheckpoint(tmp_path, every_n_train_steps=10, save_top_k=-1)
    _, whole, whole_scaler = fit("adaptive", callbacks=[saver])
    path = tmp_path / "epoch=0-step=10.ckpt"
    assert torch.load(path, weights_only=True)["ScalerPrecision"]["steps"] == 10
    _, resumed, resumed_scaler = fit("adaptive", ckpt=path)
    assert equal(weights(resumed), weights(whole))
    assert resumed_scaler.state_dict() == whole_scaler.state_dict()


@pytest.mark.parametrize("name", ["dynamic", "adaptive"])
def test_predict_after_fit(name: str) -> None:
    """After fit, trainer.predict with Lightning's default predict_step (Lightning's loop asks
    is_overridden("forward"), which reads forward's code) returns the module's outputs under the
    precision."""
    trainer, lit, _ = fit(name, steps=2)
    x = X[:16]
    batches = trainer.predict(lit, torch.utils.data.DataLoader(x, batch_size=8))
    with torch.no_grad(), Precision("fp16", "cpu").autocast():
        expected = lit(x)
    assert torch.equal(torch.cat(batches), expected)


@pytest.mark.parametrize("name", BY_SPEED)
def test_fabric_loop_equals_our_loop(name: str) -> None:
    """A Fabric loop (fabric.backward, fabric.clip_gradients, optimizer.step) with the plugin ends with our
    loop's weights with clipping, bitwise; telemetry is there for fabric.log_dict."""
    expected, _ = our_loop(name, clip=CLIP)
    plugin = FabricScalerPrecision(build_scaler(SCALERS[name]), telemetry_every=5)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = seeded_net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    logged = []
    for x, y in batches(STEPS // 10):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y) * LOSS_FACTOR
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        if telemetry := plugin.pop_telemetry():
            logged.append((plugin.steps, telemetry))
    assert equal(weights(model), expected)
    assert [step for step, _ in logged] == [1, 6, 11, 16]
    assert "underflow_rate/0" in logged[0][1]  # the Sequential's first Linear


def test_fabric_checkpoint_resumes_the_adaptive_scaler(tmp_path: Path) -> None:
    """fabric.save with the plugin in the state, fabric.load into a new plugin: the scaler continues."""

    def run(steps: int, load: Path | None = None, save: Path | None = None):
        plugin = FabricScalerPrecision(build_scaler(SCALERS["adaptive"]))
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = seeded_net()
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
        state = {"model": model, "optimizer": optimizer, "precision": plugin}
        if load is not None:
            fabric.load(load, state)
        for x, y in batches(2)[plugin.steps : steps]:
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(F.cross_entropy(model(x), y) * LOSS_FACTOR)
            optimizer.step()
        if save is not None:
            fabric.save(save, state)
        return weights(model), plugin.scaler.state_dict()

    whole = run(STEPS)
    run(10, save=tmp_path / "ten.ckpt")
    resumed = run(STEPS, load=tmp_path / "ten.ckpt")
    assert equal(resumed[0], whole[0]) and resumed[1] == whole[1]


#: Trainer(strategy="ddp", devices=2) on the CPU (gloo); Lightning relaunches this script for rank 1.
DDP_SCRIPT = """
import sys, torch, torch.nn.functional as F
from torch import nn
import lightning as L
from adaloss.integrations.lightning import ScalerPrecision
from adaloss.scalers import AdaptiveLossScaler

class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    def forward(self, x):
        return self.net(x)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y) * 1e-5
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e3, momentum=0.9)

g = torch.Generator().manual_seed(1)
x, y = torch.randn(80, 8, generator=g), torch.randint(0, 4, (80,), generator=g)
data = torch.utils.data.TensorDataset(x, y)
torch.manual_seed(0)
module, scaler = Classifier(), AdaptiveLossScaler(update_every=3)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=10, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    plugins=[ScalerPrecision(scaler, telemetry_every=None)])
trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
torch.save({"weights": [p.detach() for p in module.parameters()], "scaler": scaler.state_dict(),
            "reduced": scaler.state.reduce_fn is not None}, f"{sys.argv[1]}/rank{trainer.global_rank}.pt")
"""


@pytest.mark.slow
def test_ddp_attaches_before_wrapping_and_the_ranks_agree(tmp_path: Path) -> None:
    """Two gloo processes under Trainer(strategy="ddp"): the plugin attached the scaler once the process
    group existed (its statistics are reduced over the ranks) and before DDP wrapped the module; both ranks
    end with the same weights and the same scaler state, bitwise. 10 s of CPU (75 s wall on two busy
    cores)."""
    script = tmp_path / "ddp_fit.py"
    script.write_text(DDP_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, env=env, timeout=600)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["reduced"] and ranks[1]["reduced"]
    assert equal(ranks[0]["weights"], ranks[1]["weights"]) and ranks[0]["scaler"] == ranks[1]["scaler"]
    assert ranks[0]["scaler"]["iteration"] == 10


# ------------------------------------------------------------------------------------------ bad input


def test_a_grad_scaler_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="MixedPrecision"):
        ScalerPrecision(torch.amp.GradScaler("cpu"))


def test_a_training_step_that_bypasses_forward_is_refused() -> None:
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[ScalerPrecision(build_scaler(SCALERS["adaptive"]))],
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"call the module itself \(self\(x\)"):
        trainer.fit(Bypass(), loader())


def test_a_precision_for_another_device_is_refused() -> None:
    """CUDA autocast around a CPU model would train it in FP32 without a word: a device given that is not
    the model's is refused with the fix (without one, the plugin takes the model's)."""
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[ScalerPrecision(build_scaler(SCALERS["fixed"]), device="cuda")],
    )  # fmt: skip
    with pytest.raises(ValueError, match="pass device='cpu' to the plugin"):
        trainer.fit(lit_module(), loader())


def test_one_plugin_per_model() -> None:
    plugin = ScalerPrecision(build_scaler(SCALERS["adaptive"]))
    first = LitClassifier()
    assert plugin.convert_module(first) is first and plugin.convert_module(first) is first  # refit: once
    with pytest.raises(RuntimeError, match="one plugin"):
        plugin.convert_module(LitClassifier())


def test_a_foreign_plugin_state_is_refused() -> None:
    with pytest.raises(RuntimeError, match="resume with the plugin that saved it"):
        ScalerPrecision(build_scaler(SCALERS["dynamic"])).load_state_dict({"scale": 65536.0})


def test_adaloss_imports_without_lightning_or_accelerate() -> None:
    """With both libraries made unimportable, the package and the integrations package import; the
    Lightning module then fails with the extra to install."""
    code = (
        "import sys\n"
        "sys.modules['lightning'] = sys.modules['accelerate'] = None\n"  # `import lightning` raises
        "import adaloss, adaloss.integrations, adaloss.integrations.accelerate, adaloss.precision\n"
        "from adaloss.scalers import AdaptiveLossScaler\n"
        "try:\n"
        "    import adaloss.integrations.lightning\n"
        "except ImportError as error:\n"
        '    assert ".[lightning]" in str(error), error\n'
        "else:\n"
        "    raise AssertionError('imported without lightning')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
