"""``torchrun --nproc_per_node=2 train.py distributed.strategy=fsdp2 ...`` on the CPU (gloo): trains,
checkpoints sharded and resumes exactly.

One ``torch.distributed.run`` launch runs a Hydra sweep of ``distributed.strategy=ddp,fsdp2`` (ResNet-20 in
train mode, the adaptive scaler in emulated FP16 on gradients made small enough that its alphas differ between
layers) with ``ADALOSS_DEBUG_RANK_FILES=1``. Asserted:

* the FSDP2 run ends with DDP's weights and rank 0's batch-norm statistics (``model.pt``, gathered from the
  shards), bitwise, and DDP's per-layer alphas, skipped steps, training loss and test accuracy; both ranks
  hold the same whole parameters;
* its checkpoint is ``step_4.pt`` (``sharded``: no parameters and no optimizer state, rank 0's buffers) plus
  ``step_4.dcp/``, the shards written through ``torch.distributed.checkpoint``;
* a second launch resumed (``resume=auto``) from that checkpoint ends bitwise where the uninterrupted run did
  (buffers included: a checkpoint that kept another rank's batch-norm statistics fails here), and logs
  iteration 6 as it did (the checkpoint of iteration 4 holds each rank's training window: ``log_every=3``).

And without torchrun, ``distributed.strategy=fsdp2`` is one ``ConfigError`` naming the launch command, and a
checkpoint of one strategy resumed under the other names the strategy to resume with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from adaloss.errors import ConfigError
from adaloss.runner.engine import train
from conftest import compose_train
from test_ddp_train import _launch, _log_line

STEPS = 8
OVERRIDES = (
    "dataset=synthetic",
    "dataset.image_size=8",
    "dataset.train_size=64",
    "dataset.test_size=16",
    "trainer.batch_size=16",
    "trainer.eval_batch_size=16",
    f"trainer.max_steps={STEPS}",
    "trainer.eval_every=4",
    "trainer.log_every=3",  # not a divisor of checkpoint_every: the checkpoint holds a training window
    "trainer.checkpoint_every=4",
    "trainer.save_final=true",
    "trainer.progress_bar=false",
    "telemetry.every=2",
    "trainer.loss_multiplier=0.0009765625",  # 2**-10: small gradients, so the layers get betas above 1
    "model=resnet20",  # batch norm: running statistics per rank, not sharded
    "precision=fp16",
    "scaler=adaptive",
    "device=cpu",
    "logger=none",
)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2_train")
    done = _launch(
        "-m", *OVERRIDES, "distributed.strategy=ddp,fsdp2", f"hydra.sweep.dir={out}",
        "hydra.sweep.subdir=${distributed.strategy}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_fsdp2_trains_as_ddp(sweep):
    fsdp, ddp = sweep / "fsdp2", sweep / "ddp"
    got, ref = (json.loads((job / "metrics.json").read_text()) for job in (fsdp, ddp))
    for key in ("steps", "loss_scale", "skipped_steps", "train_loss", "test_accuracy", "world_size"):
        assert got[key] == ref[key], key
    assert len(set(got["loss_scale"].values())) >= 2, got["loss_scale"]  # alphas that mean something
    final, reference = _weights(fsdp / "model.pt"), _weights(ddp / "model.pt")
    assert final.keys() == reference.keys()
    ranks = [_weights(fsdp / f"debug_rank{r}.pt")["model"] for r in range(2)]
    for name, value in reference.items():
        assert torch.equal(final[name], value), name
        if "running" not in name and "num_batches" not in name:  # buffers are per rank
            assert torch.equal(ranks[1][name], value), name

    checkpoints = sorted(p.name for p in (fsdp / "checkpoints").iterdir())
    assert checkpoints == ["step_4.dcp", "step_4.pt"], checkpoints
    state = torch.load(fsdp / "checkpoints" / "step_4.pt", weights_only=True)
    assert state["sharded"] and state["optimizer"] == {}
    buffers = state["model"]  # rank 0's batch-norm statistics, nothing else
    assert buffers and all("running" in k or "num_batches" in k for k in buffers), list(buffers)
    assert (fsdp / "checkpoints" / "step_4.dcp" / ".metadata").is_file()


@pytest.mark.slow
def test_fsdp2_resume_continues_bitwise(sweep, tmp_path):
    job = sweep / "fsdp2"
    shutil.copytree(job / "checkpoints", tmp_path / "checkpoints")
    done = _launch(
        *OVERRIDES, "distributed.strategy=fsdp2", "resume=auto", f"hydra.run.dir={tmp_path}"
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    log = (tmp_path / "train.log").read_text()
    assert "resuming from" in log
    assert _log_line(log, 6) == _log_line((job / "train.log").read_text(), 6)  # each rank's window restored
    final, uninterrupted = _weights(tmp_path / "model.pt"), _weights(job / "model.pt")
    for name, value in uninterrupted.items():
        assert torch.equal(final[name], value), name
    got = json.loads((tmp_path / "metrics.json").read_text())
    ref = json.loads((job / "metrics.json").read_text())
    for key in ("loss_scale", "skipped_steps", "train_loss", "test_accuracy", "best_test_accuracy"):
        assert got[key] == ref[key], key


def test_fsdp2_needs_torchrun(tmp_path):
    cfg = compose_train([*OVERRIDES, "distributed.strategy=fsdp2", f"paths.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="one process: launch with python -m torch.distributed.run"):
        train(cfg)


def test_a_checkpoint_resumes_under_its_own_strategy():
    from adaloss.distributed import DistInfo
    from adaloss.runner.engine.checkpoint import CheckpointParts

    parts = CheckpointParts({}, None, None, None, None, None, None, None, None, DistInfo(), sharded=False)
    with pytest.raises(ConfigError, match="written with distributed.strategy=fsdp2 but this run uses ddp"):
        parts.load_state_dict({"sharded": True}, Path("step_4.pt"))
    parts.sharded = True
    with pytest.raises(ConfigError, match="written with distributed.strategy=ddp but this run uses fsdp2"):
        parts.load_state_dict({"model": {}}, Path("step_4.pt"))
