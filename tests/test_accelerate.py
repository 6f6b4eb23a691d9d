"""Accelerate with our scalers (:func:`adaloss.integrations.accelerate.use_scaler`): an ``Accelerator``
loop on the CPU (``accelerator.backward``, ``clip_grad_norm_``, ``optimizer.step()``, gradient accumulation)
ends with exactly our own loop's weights (tests/trainer_parity.py) under the FP16 emulation, and
``save_state`` / ``load_state`` resume the adaptive scaler exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

accelerate = pytest.importorskip("accelerate")

from adaloss.integrations.accelerate import use_scaler  # noqa: E402
from adaloss.precision import Precision  # noqa: E402
from adaloss.runner.utils.targets import build_scaler  # noqa: E402
from adaloss.scalers import LossScaler  # noqa: E402
from trainer_parity import (  # noqa: E402
    CLIP,
    LOSS_FACTOR,
    LR,
    SCALERS,
    STEPS,
    batches,
    equal,
    our_loop,
    seeded_net,
    weights,
)


def accelerate_loop(
    name: str,
    steps: int = STEPS,
    accumulate: int = 1,
    clip: float | None = CLIP,
    load: Path | None = None,
    save: Path | None = None,
) -> tuple[list[torch.Tensor], LossScaler]:
    """A user's Accelerate loop with our scaler and our FP16 emulation around the forward pass; resumes from
    ``load`` (``accelerator.load_state``) and saves into ``save`` at the end."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    scaler, precision = build_scaler(SCALERS[name]), Precision("fp16", "cpu")
    model = use_scaler(accelerator, scaler, seeded_net())
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    done = 0
    if load is not None:
        accelerator.load_state(load)
        done = accelerator.step  # micro-batches completed
    for x, y in batches(steps * accumulate // 10)[done:]:
        with accelerator.accumulate(model):
            with precision.autocast():
                loss = F.cross_entropy(model(x), y) * LOSS_FACTOR
            accelerator.backward(loss)
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if save is not None:
        accelerator.save_state(save)
    return weights(model), scaler


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in ("none", "fixed") else n for n in SCALERS]
)
def test_accelerate_loop_equals_our_loop(name: str) -> None:
    """With clipping: the dynamic scale is 2**16 and more, so clipping scaled gradients would differ."""
    expected, _ = our_loop(name, clip=CLIP)
    assert equal(accelerate_loop(name)[0], expected)


@pytest.mark.parametrize("name", ["dynamic", pytest.param("adaptive", marks=pytest.mark.slow)])
def test_gradient_accumulation_equals_our_loop(name: str) -> None:
    """Accelerator(gradient_accumulation_steps=2): two scaled backward passes of half the loss, one step."""
    expected, _ = our_loop(name, clip=CLIP, accumulate=2)
    assert equal(accelerate_loop(name, accumulate=2)[0], expected)


def test_save_state_and_load_state_resume_the_adaptive_scaler_exactly(tmp_path: Path) -> None:
    """10 steps, save_state; a new Accelerator, model and scaler load_state and train 10 more: the weights
    and the scaler's whole state are those of 20 steps in one go."""
    whole_weights, whole_scaler = accelerate_loop("adaptive")
    accelerate_loop("adaptive", steps=10, save=tmp_path / "state")
    assert (tmp_path / "state" / "scaler.pt").exists()
    resumed_weights, resumed_scaler = accelerate_loop("adaptive", load=tmp_path / "state")
    assert equal(resumed_weights, whole_weights)
    assert resumed_scaler.state_dict() == whole_scaler.state_dict()


def test_a_skipped_step_shows_in_step_was_skipped() -> None:
    """An overflow skips the step through Accelerate's optimizer wrapper, which reports it."""
    accelerator = accelerate.Accelerator(cpu=True)
    scaler = build_scaler(SCALERS["adaptive"])
    model = use_scaler(accelerator, scaler, seeded_net())
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    before = weights(model)
    accelerator.backward(model(torch.full((2, 8), float("inf"))).sum())
    optimizer.step()
    assert optimizer.step_was_skipped and scaler.skipped_steps == 1 and equal(weights(model), before)


# ------------------------------------------------------------------------------------------ bad input


def test_use_scaler_after_prepare_is_refused() -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    model = seeded_net()
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    with pytest.raises(RuntimeError, match="before prepare"):
        use_scaler(accelerator, build_scaler(SCALERS["fixed"]), model)


def test_a_grad_scaler_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="mixed_precision='fp16'"):
        use_scaler(accelerate.Accelerator(cpu=True), torch.amp.GradScaler("cpu"))


def test_fsdp_is_refused_with_the_true_reason() -> None:
    """Accelerate's FSDP is refused, with the reason: not the statistics (FSDP2 needs no reduction of them,
    docs/fsdp2.md) but a wrap policy that does not follow the adaptive scaler's rewrite."""
    from types import SimpleNamespace

    fsdp = SimpleNamespace(distributed_type=accelerate.utils.DistributedType.FSDP, _optimizers=[])
    with pytest.raises(ValueError, match=r"fully_shard replaces each wrapped module's parameters") as refused:
        use_scaler(fsdp, build_scaler(SCALERS["adaptive"]))
    assert "statistics" not in str(refused.value) and "distributed.strategy=fsdp2" in str(refused.value)
    with pytest.raises(ValueError, match="ShardedGradScaler"):
        use_scaler(fsdp, build_scaler(SCALERS["dynamic"]))


FULLY_SHARD_SCRIPT = """
import os, torch, torch.distributed as dist, transformers
from torch.distributed.fsdp import fully_shard
from adaloss.scalers import AdaptiveLossScaler
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
config.use_cache = False
model, ids = transformers.GPT2LMHeadModel(config), torch.randint(0, 50, (2, 8))
model = AdaptiveLossScaler().attach(model, input_ids=ids, labels=ids)
captured = model.transformer.h[0].attn.c_attn.weight
fully_shard(model.transformer.h[0])  # what Accelerate's wrap policy does to a GPT2Block
sharded = model.transformer.h[0].attn.c_attn.weight
graph = model.forward.gm.get_parameter("transformer.h.0.attn.c_attn.weight")
assert type(sharded.data).__name__ == "DTensor" and graph is captured and graph is not sharded
"""


@pytest.mark.slow
def test_fully_shard_leaves_a_captured_graph_on_the_parameters_it_replaced(tmp_path: Path) -> None:
    """The first half of that reason, measured: fully_shard swaps a module's parameters for sharded ones, and
    a captured transformers model's graph still holds the old ones (one process, gloo; 30 s on two busy
    cores, mostly imports)."""
    import os
    import socket
    import subprocess
    import sys

    pytest.importorskip("transformers")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PORT=str(port), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", FULLY_SHARD_SCRIPT], check=True, env=env, timeout=300)
