"""FSDP2 (``fully_shard``) against DDP: 2 gloo processes on the CPU, float64, the adaptive scaler.

The same model (the project's tiny GPT with its tied head, and ResNet-20 in eval mode: per-sample batch
norm, as in ``test_distributed.py``) is trained for a few steps twice in the same two processes, once in
DDP and once sharded by :func:`adaloss.distributed.shard_model`, each rank on its half of every batch.
Asserted, at every step:

* the unscaled gradients are bitwise equal to DDP's (each rank's shard against the same rows of DDP's
  all-reduced gradient): the GEMMs' backward passes read the whole, all-gathered weight, and the
  reduce-scatter sums as DDP's all-reduce does;
* the per-layer betas and alphas equal DDP's and are identical on both ranks (the activation-gradient
  statistics are reduced over the ranks, the weight statistics are those of the whole weight);
* the backward pass (all-gathers, reduce-scatters and the statistics' collectives) reads no value on the
  host (``tests/sync_trap.py``);

and after the last step the weights are equal. Everything runs in one spawn of 2 workers.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from torch import nn

WORLD = 2
BATCH = 8
STEPS = 3
LOSS_FACTOR = 2.0**-20  # small gradients: betas above 1 (FP16's u_min = 2**-24)
KINDS = ("gpt", "resnet20")


def _model(kind: str) -> nn.Module:
    from adaloss.runner.models import build_model

    torch.manual_seed(0)
    if kind == "gpt":
        from adaloss.runner.models.gpt import GPT

        return GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16).double()
    return build_model(OmegaConf.create({"name": "resnet20"}), 10, (3, 8, 8)).double().eval()


def _batches(kind: str, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    half = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    out = []
    for _ in range(STEPS):
        if kind == "gpt":
            x = torch.randint(0, 32, (BATCH, 8), generator=g)
            y = torch.randint(0, 32, (BATCH, 8), generator=g)
        else:
            x = torch.randn(BATCH, 3, 8, 8, generator=g, dtype=torch.float64)
            y = torch.randint(0, 10, (BATCH,), generator=g)
        out.append((x[half], y[half]))
    return out


def _local_rows(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as this rank holds it: a DTensor's local shard, or a plain tensor whole."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _train(kind: str, rank: int, strategy: str) -> dict:
    from adaloss.adaptive import algorithm3 as ops

    seen: list[tuple[str, tuple[int, ...]]] = []  # what Algorithm 4's weight statistics read, per GEMM call
    scale = ops.gemm_loss_scale

    def spy(weight, *args, **kwargs):
        seen.append((type(weight).__name__, tuple(weight.shape)))
        return scale(weight, *args, **kwargs)

    ops.gemm_loss_scale = spy
    try:
        return {**_steps(kind, rank, strategy), "weights_seen": seen}
    finally:
        ops.gemm_loss_scale = scale


def _steps(kind: str, rank: int, strategy: str) -> dict:
    from adaloss.distributed import DistInfo
    from adaloss.runner.utils.targets import build_scaler
    from sync_trap import no_host_sync

    scaler = build_scaler(OmegaConf.create({"name": "adaptive", "update_every": 2, "rule": "paper"}), None)
    module = scaler.attach(_model(kind))
    info = DistInfo(rank, WORLD, rank, torch.device("cpu"), "gloo")
    model = info.wrap(module, strategy)
    opt = torch.optim.SGD(module.parameters(), lr=0.05 / LOSS_FACTOR, momentum=0.9)
    out: dict = {"grads": [], "betas": [], "alphas": []}
    for x, y in _batches(kind, rank):
        logits = model(x)
        logits = logits.transpose(1, 2) if kind == "gpt" else logits
        loss = nn.functional.cross_entropy(logits, y) * LOSS_FACTOR * info.loss_factor
        scaled = scaler.scale(loss)
        with no_host_sync():
            scaled.backward()
        scaler.unscale_(opt)
        out["grads"].append({n: _local_rows(p.grad).clone() for n, p in module.named_parameters()})
        scaler.step(opt)
        out["betas"].append(scaler.layer_betas())
        out["alphas"].append(scaler.layer_scales())
        scaler.update()
        opt.zero_grad(set_to_none=True)
    out["weights"] = {n: _local_rows(p.detach()).clone() for n, p in module.named_parameters()}
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": str(port)}
    )  # fmt: skip
    from adaloss.distributed import destroy, init_distributed

    init_distributed(device="cpu", timeout_s=60)
    try:
        results = {(kind, s): _train(kind, rank, s) for kind in KINDS for s in ("ddp", "fsdp2")}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp2")
    port = _free_port()
    mp.start_processes(_worker, args=(port, str(out_dir)), nprocs=WORLD, join=True, start_method="spawn")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def _rows(full: torch.Tensor, shard: torch.Tensor, rank: int) -> torch.Tensor:
    """The rows of ``full`` that ``rank`` holds under FSDP2's dim-0 sharding (``shard`` has their shape)."""
    if full.dim() == 0:
        return full
    per_rank = -(-full.shape[0] // WORLD)  # torch.chunk's split: the last rank may hold fewer (or none)
    return full[rank * per_rank : rank * per_rank + shard.shape[0]]


@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_gradients_and_betas_equal_ddp(runs, kind):
    for rank, run in enumerate(runs):
        ddp, fsdp = run[(kind, "ddp")], run[(kind, "fsdp2")]
        # measured: the GEMMs' backward passes read the whole (all-gathered) weight, a plain tensor
        assert fsdp["weights_seen"] == ddp["weights_seen"] and ddp["weights_seen"], rank
        assert {name for name, _ in fsdp["weights_seen"]} <= {"Parameter", "Tensor"}, fsdp["weights_seen"]
        for step in range(STEPS):
            assert fsdp["betas"][step] == ddp["betas"][step], (rank, step)
            assert fsdp["alphas"][step] == ddp["alphas"][step], (rank, step)
            for name, full in ddp["grads"][step].items():
                shard = fsdp["grads"][step][name]
                assert torch.equal(shard, _rows(full, shard, rank)), (rank, step, name)
        for name, full in ddp["weights"].items():
            shard = fsdp["weights"][name]
            assert torch.equal(shard, _rows(full, shard, rank)), (rank, name)
    betas = runs[0][(kind, "fsdp2")]["betas"]
    assert betas == runs[1][(kind, "fsdp2")]["betas"]  # identical on every rank
    assert len({b for step in betas for b in step.values() if b > 1}) >= 2, betas  # the test sees betas
    fsdp, ddp = runs[0][(kind, "fsdp2")]["grads"][0], runs[0][(kind, "ddp")]["grads"][0]
    assert all(fsdp[n].shape != ddp[n].shape for n in ddp if ddp[n].dim()), "a parameter was not sharded"
