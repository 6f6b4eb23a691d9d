"""``AdaptiveLossScaler(root=...)``: how alpha_{N+1}, the scale the loss gradient enters the backward pass
with, is chosen (``fixed``, the paper's; ``dynamic``, GradScaler's rule; ``adaptive``, Algorithm 4 on the
loss gradient itself), with GradScaler's invariant kept: every parameter gradient leaves the backward pass
carrying ``get_scale()``."""

import copy
import io

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from adaloss.errors import ConfigError
from adaloss.precision import Precision
from adaloss.runner.models import build_model
from adaloss.runner.utils.targets import build_scaler
from adaloss.scalers.adaptive import AdaptiveLossScaler

ROOTS = ("fixed", "dynamic", "adaptive")


class _Head(nn.Module):
    """Two linear layers; ``forward`` returns the output the loss gradient reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _step(scaler, model, opt, x, grad_of_output):
    """One iteration whose loss gradient at the model's output is exactly ``grad_of_output``."""
    loss = (model(x) * grad_of_output).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------- the rules


def test_adaptive_root_lifts_a_loss_gradient_that_underflows_at_one():
    """Every element of the loss gradient is 2**-30, below FP16's 2**-24: the first iteration measures it,
    and alpha_{N+1} becomes the smallest power of two that lifts it to 2**-24 (64), where the fixed root
    stays at 1."""
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    tiny = torch.full((6, 4), 2.0**-30)
    for root, want in (("fixed", 1.0), ("adaptive", 64.0)):
        scaler = AdaptiveLossScaler(update_every=3, root=root)
        model = scaler.attach(_Head())
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        _step(scaler, model, opt, x, tiny)
        assert scaler.get_scale() == want, root
    # T_uf of the elements may stay below u_min: 1 element in 2000 far below, the rest 2**-20
    scaler = AdaptiveLossScaler(root="adaptive")
    assert scaler.root_target({-19: 1999, -39: 1}, 2.0**-20) == 1.0
    assert scaler.root_target({-19: 1990, -39: 10}, 2.0**-20) == 1024.0  # 0.5% > T_uf: up to the cap
    uncapped = AdaptiveLossScaler(root="adaptive", accum_upper_bound=None)
    assert uncapped.root_target({-19: 1990, -39: 10}, 2.0**-20) == 2.0**16  # 2**-40 * 2**16 = 2**-24
    # the overflow bound u_max / max|g| wins over the lower bound; the accumulation cap bounds both
    assert scaler.root_target({-29: 10}, 2.0**-29) == 64.0
    assert scaler.root_target({-29: 9, 10: 1}, 2.0**9) == 64.0  # 65504 / 512 = 127.9 -> 64
    assert scaler.root_target({-40: 10}, 2.0**-40) == 1024.0  # the task's accum_upper_bound
    # measured at a scale: the same distribution, counted at alpha_{N+1} = 2**5
    assert scaler.root_target({-24: 10}, 2.0**-29, measured_at=32.0) == 64.0


def test_adaptive_root_follows_the_loss_gradient_at_scheduled_recomputes():
    """update_every=3: measured on iteration 0 (applied, with a recompute, on 1) and on the iteration before
    each scheduled recompute (2 -> 3); a loss gradient that shrinks in between raises alpha_{N+1} there."""
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    scaler = AdaptiveLossScaler(update_every=3, root="adaptive")
    model = scaler.attach(_Head())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scales = []
    for it, e in enumerate((-30, -30, -32, -32, -32)):
        _step(scaler, model, opt, x, torch.full((6, 4), 2.0**e))
        scales.append(scaler.get_scale())
        if it == 1:  # not measured: the value of iteration 0 stays
            assert scaler.get_scale() == 64.0
    assert scales == [64.0, 64.0, 256.0, 256.0, 256.0]


def test_dynamic_root_backs_off_on_every_overflow_skips_the_step_and_grows():
    """GradScaler's rule on alpha_{N+1}: an overflow halves it at once and skips the step (the fixed root
    only recomputes the betas on a first overflow), growth_interval clean steps double it past init_scale."""
    torch.manual_seed(0)
    x, g = torch.randn(6, 8), torch.full((6, 4), 1e-3)
    for root, after_overflow in (("fixed", 1024.0), ("dynamic", 512.0)):
        scaler = AdaptiveLossScaler(update_every=2, root=root, init_scale=1024.0, growth_interval=2)
        model = scaler.attach(_Head())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _step(scaler, model, opt, x, g)
        before = [p.detach().clone() for p in model.parameters()]
        poisoned = g.clone()
        poisoned[0, 0] = float("inf")
        _step(scaler, model, opt, x, poisoned)
        assert scaler.last_step_skipped and scaler.skipped_steps == 1, root
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), root
        assert scaler.get_scale() == after_overflow, root
        for _ in range(4):
            _step(scaler, model, opt, x, g)
        # fixed: back to its ceiling init_scale; dynamic: doubled twice from 512
        assert scaler.get_scale() == (1024.0 if root == "fixed" else 2048.0), root


# ----------------------------------------------------------------------------------------- invariants


def _resnet(dtype=torch.float32):
    return build_model(OmegaConf.create({"name": "resnet20", "depth": 20}), 10).to(dtype)


@pytest.mark.parametrize("root", ROOTS)
def test_parameter_gradients_carry_get_scale_under_every_root(root):
    """Float64, loss gradients 2**-30 smaller than plain (the roots move): after each backward pass every
    ``p.grad`` is the plain gradient times ``get_scale()``, and ``unscale_`` gives the plain gradient."""
    torch.manual_seed(0)
    reference = _resnet(torch.float64)
    scaler = AdaptiveLossScaler(update_every=2, root=root, init_scale=2.0**12 if root == "dynamic" else 1.0)
    attached = scaler.attach(copy.deepcopy(reference))
    opt = torch.optim.SGD(attached.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(4):
        x = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=g)
        y = torch.randint(0, 10, (2,), generator=g)
        reference.zero_grad()
        (nn.functional.cross_entropy(reference(x), y) * 2.0**-30).backward()
        scaler.scale(nn.functional.cross_entropy(attached(x), y) * 2.0**-30).backward()
        root_scale = scaler.get_scale()
        seen.add(root_scale)
        names = dict(attached.named_parameters())
        scaled = {n: p.grad.clone() for n, p in names.items()}
        scaler.unscale_(opt)
        for name, ref in reference.named_parameters():
            got = names[name].grad
            assert ((got - ref.grad).abs().max() / ref.grad.abs().max()).item() <= 1e-10, (root, name)
            assert torch.equal(scaled[name], got * root_scale), (root, name)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    if root == "adaptive":
        assert max(seen) > 1.0, seen  # the root moved: the invariant held across the change


def _train(scaler, model, opt, data, precision, inf_at=()):
    for i, (x, y) in enumerate(data):
        with precision.autocast():
            loss = nn.functional.cross_entropy(model(x), y) * 2.0**-20
        scaler.scale(loss).backward()
        if i in inf_at:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    "root",
    # about 25 s each: make test keeps the adaptive root, whose state is the largest; the others in test-full
    [*(pytest.param(r, marks=pytest.mark.slow) for r in ("fixed", "dynamic")), "adaptive"],
)
def test_state_dict_round_trip_resumes_identically(root):
    """8 emulated-FP16 steps in one go, or 4, a checkpoint (through torch.save) and 4 more in a fresh scaler
    and model: the same weights bitwise, the same alpha_{N+1}, layer scales and betas. update_every=3 with
    the checkpoint between a measuring iteration and its recompute; an overflow on iteration 1."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(8)]
    precision = Precision("fp16", "cpu")
    torch.manual_seed(0)
    base = _resnet()
    options = dict(
        update_every=3, root=root, init_scale=2.0**14 if root == "dynamic" else 1.0, growth_interval=2
    )

    def fresh(weights):
        scaler = AdaptiveLossScaler(**options)
        model = precision.prepare(scaler.attach(copy.deepcopy(weights)))
        return scaler, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    scaler_a, model_a, opt_a = fresh(base)
    _train(scaler_a, model_a, opt_a, data, precision, inf_at=(1,))
    scaler_b, model_b, opt_b = fresh(base)
    _train(scaler_b, model_b, opt_b, data[:4], precision, inf_at=(1,))
    buffer = io.BytesIO()
    torch.save(
        {"model": model_b.state_dict(), "opt": opt_b.state_dict(), "scaler": scaler_b.state_dict()}, buffer
    )
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    scaler_c, model_c, opt_c = fresh(_resnet())
    model_c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    scaler_c.load_state_dict(saved["scaler"])
    _train(scaler_c, model_c, opt_c, data[4:], precision)

    for (name, a), c in zip(model_a.named_parameters(), model_c.parameters(), strict=True):
        assert torch.equal(a, c), (root, name)
    assert scaler_a.get_scale() == scaler_c.get_scale()
    assert scaler_a.layer_scales() == scaler_c.layer_scales()
    assert scaler_a.layer_betas() == scaler_c.layer_betas()
    assert scaler_a.state_dict() == scaler_c.state_dict()
    if root == "adaptive":
        assert scaler_a.get_scale() > 1.0  # the loss gradient (2**-20 smaller) raised alpha_{N+1}


def test_a_checkpoint_of_another_root_is_refused():
    scaler = AdaptiveLossScaler(root="fixed")
    model = scaler.attach(_Head())
    _step(scaler, model, torch.optim.SGD(model.parameters(), lr=0.0), torch.randn(2, 8), torch.ones(2, 4))
    other = AdaptiveLossScaler(root="adaptive")
    other.attach(_Head())
    with pytest.raises(ConfigError, match="scaler.root=fixed"):
        other.load_state_dict(scaler.state_dict())


def test_the_config_key_builds_each_root_and_rejects_others():
    for root in ROOTS:
        scaler = build_scaler(OmegaConf.create({"name": "adaptive", "root": root}), None)
        assert scaler.root == root
    assert build_scaler(OmegaConf.create({"name": "adaptive"}), None).root == "fixed"  # the paper's
    with pytest.raises(ConfigError, match=r"scaler.root must be one of fixed, dynamic, adaptive"):
        build_scaler(OmegaConf.create({"name": "adaptive", "root": "auto"}), None)
    from adaloss.runner.schemas import AdaptiveScalerConf  # the default lives in the schema, once

    assert AdaptiveScalerConf.root == "fixed"


# ----------------------------------------------------------------------------------------- DDP


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import os

    torch.set_num_threads(1)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": str(port)}
    )  # fmt: skip
    from adaloss.distributed import DistInfo, destroy, init_distributed, wrap_model

    init_distributed(device="cpu", timeout_s=60)
    try:
        torch.manual_seed(0)
        scaler = AdaptiveLossScaler(update_every=2, root="adaptive")
        model = wrap_model(scaler.attach(_Head()), DistInfo(rank, world, rank, torch.device("cpu")))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scales = []
        for step in range(4):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            # the ranks' loss gradients differ by 2**8: the root must follow both, alike
            _step(scaler, model, opt, x, torch.full((6, 4), 2.0 ** (-30 - 8 * rank)))
            scales.append(scaler.get_scale())
        weights = [p.detach().clone() for p in model.module.parameters()]
        torch.save({"scales": scales, "weights": weights}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy()


def test_adaptive_root_is_the_same_on_every_ddp_rank(tmp_path):
    """Two gloo ranks whose loss gradients differ: the measurement is combined over the ranks, so both set
    the same alpha_{N+1} (the smaller rank's elements decide it) and keep identical weights."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_ddp_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0]["scales"] == ranks[1]["scales"]
    # half the elements at 2**-38 (rank 1): lifting them to 2**-24 takes 2**15, capped at 1024
    assert ranks[0]["scales"][0] == 1024.0
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True):
        assert torch.equal(a, b)
