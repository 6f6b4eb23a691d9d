"""timm's training loop with our scalers (:mod:`adaloss.integrations.timm`): the scaler-facing part of
timm's ``train_one_epoch`` (``train.py``, timm 1.0.31: gradient accumulation through ``need_update``,
clipping through the scaler's ``clip_grad``/``parameters``, ``optimizer.zero_grad()`` after each update), with
``TimmScaler(scaler)`` in ``NativeScaler``'s place, trains timm's ``convnext_atto`` (built from its config, no
weights, 32x32 inputs) under the FP16 emulation and ends bitwise on our own loop's weights and scaler state;
timm's ``CheckpointSaver`` and ``resume_checkpoint`` carry the scaler across a resume exactly; and with the
dynamic scaler the loop ends bitwise where timm's own ``NativeScaler`` (``torch.amp.GradScaler``) ends.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

timm = pytest.importorskip("timm")

from timm.models import resume_checkpoint  # noqa: E402
from timm.models._manipulate import model_parameters  # noqa: E402
from timm.utils import CheckpointSaver  # noqa: E402
from timm.utils.cuda import NativeScaler  # noqa: E402

from adaloss.integrations.timm import TimmScaler  # noqa: E402
from adaloss.precision import Precision  # noqa: E402
from adaloss.scalers import AdaptiveLossScaler, DynamicLossScaler, LossScaler  # noqa: E402

ACCUM = 2  # micro-batches per update
UPDATES = 4  # per epoch; two epochs
CLIP = 2.0  # below the gradient norms of the first updates: clipping acts
_g = torch.Generator().manual_seed(3)
EPOCHS = [
    [
        (torch.randn(4, 3, 32, 32, generator=_g), torch.randint(0, 4, (4,), generator=_g))
        for _ in range(ACCUM * UPDATES)
    ]
    for _ in range(2)
]
amp_autocast = Precision("fp16", "cpu").autocast  # timm's amp_autocast: CUDA autocast's emulation on the CPU


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("convnext_atto", pretrained=False, num_classes=4)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adaptive() -> AdaptiveLossScaler:
    return AdaptiveLossScaler(update_every=3)


def timm_epoch(model: nn.Module, loader: list, optimizer: torch.optim.Optimizer, loss_scaler: Any) -> None:
    """train_one_epoch's calls of the loss scaler, as timm writes them."""
    accum_steps = ACCUM
    last_batch_idx = len(loader) - 1
    optimizer.zero_grad()
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0

        def _forward():
            with amp_autocast():
                output = model(input)  # noqa: B023 - as timm writes it
                loss = F.cross_entropy(output, target)  # noqa: B023
            if accum_steps > 1:
                loss /= accum_steps
            return loss

        def _backward(_loss):
            loss_scaler(
                _loss,
                optimizer,
                clip_grad=CLIP,
                clip_mode="norm",
                parameters=model_parameters(model, exclude_head=False),
                create_graph=False,
                need_update=need_update,  # noqa: B023
            )

        _backward(_forward())
        if not need_update:
            continue
        optimizer.zero_grad()


def timm_run(
    make_scaler: Callable[[], Any],
    epochs: range = range(2),
    save: Path | None = None,
    resume: Path | None = None,
) -> tuple[nn.Module, Any]:
    """timm's main() around train_one_epoch: model, optimizer, scaler, resume, the epochs, CheckpointSaver."""
    model = make_model()
    loss_scaler = make_scaler()
    if isinstance(loss_scaler, TimmScaler):
        model = loss_scaler.attach(model)
    optimizer = make_optimizer(model)
    start = 0
    if resume is not None:
        start = resume_checkpoint(
            model, str(resume), optimizer=optimizer, loss_scaler=loss_scaler, log_info=False
        )
    saver = None
    if save is not None:
        saver = CheckpointSaver(
            model, optimizer, amp_scaler=loss_scaler, checkpoint_dir=str(save), recovery_dir=str(save)
        )
    for epoch in epochs[start:]:
        timm_epoch(model, EPOCHS[epoch], optimizer, loss_scaler)
        if saver is not None:
            saver.save_checkpoint(epoch)
    return model, loss_scaler


def our_loop(scaler: LossScaler) -> nn.Module:
    """Our own loop (LossScaler's docstring order) on the same micro-batches."""
    model = scaler.attach(make_model())
    optimizer = make_optimizer(model)
    for epoch in EPOCHS:
        for i in range(0, len(epoch), ACCUM):
            optimizer.zero_grad(set_to_none=True)
            for x, y in epoch[i : i + ACCUM]:
                with amp_autocast():
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss / ACCUM).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            scaler.step(optimizer)
            scaler.update()
    return model


def equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def whole() -> tuple[nn.Module, TimmScaler]:
    return timm_run(lambda: TimmScaler(adaptive()))


def test_timm_loop_equals_our_loop(whole: tuple[nn.Module, TimmScaler]) -> None:
    """Two epochs of timm's loop with TimmScaler(AdaptiveLossScaler) end on our loop's weights and scaler
    state, bitwise; the scales moved (betas other than 1: the adaptive scaler did its work)."""
    model, loss_scaler = whole
    ours = adaptive()
    assert equal(model, our_loop(ours))
    assert loss_scaler.state_dict() == ours.state_dict()
    assert len(set(ours.layer_scales().values())) > 1
    assert ours.state_dict()["iteration"] == 2 * UPDATES


def test_timm_checkpoint_resumes_the_scaler_exactly(
    whole: tuple[nn.Module, TimmScaler], tmp_path: Path
) -> None:
    """CheckpointSaver writes the scaler's state under "amp_scaler" after the first epoch; a new run with a
    new scaler resumes from it (resume_checkpoint) and ends on the uninterrupted run's weights and scaler
    state."""
    timm_run(lambda: TimmScaler(adaptive()), epochs=range(1), save=tmp_path)
    path = tmp_path / "last.pth.tar"
    assert torch.load(path, weights_only=True)["amp_scaler"]["iteration"] == UPDATES
    model, loss_scaler = timm_run(lambda: TimmScaler(adaptive()), resume=path)
    assert equal(model, whole[0])
    assert loss_scaler.state_dict() == whole[1].state_dict()


def test_the_dynamic_scaler_trains_as_timms_native_scaler() -> None:
    """One line swapped: TimmScaler(DynamicLossScaler()) where timm has NativeScaler(device="cpu") (a
    GradScaler): the same weights and scale, bitwise."""
    theirs, native = timm_run(lambda: NativeScaler(device="cpu"))
    ours, loss_scaler = timm_run(lambda: TimmScaler(DynamicLossScaler("cpu")))
    assert equal(ours, theirs)
    assert loss_scaler.scaler.get_scale() == native._scaler.get_scale()


def test_bad_input_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="timm's own NativeScaler"):
        TimmScaler(torch.amp.GradScaler("cpu"))
    loss_scaler = TimmScaler(DynamicLossScaler("cpu"))
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"pass model_parameters\(model\)"):
        loss_scaler(model(torch.ones(1, 2)).sum(), make_optimizer(model), clip_grad=1.0)
