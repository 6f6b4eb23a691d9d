"""GradScaler's documented recipes with the adaptive scaler: every parameter gradient leaves the backward pass
carrying ``get_scale()``, so gradient penalties, clipping without ``unscale_``, copies and pickles behave as
under ``torch.amp.GradScaler``. Each recipe is checked in float64 against plain autograd without any
scaling, with betas other than 1 taking part (the scales are powers of two, so the results are exact)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from adaloss.scalers.adaptive import AdaptiveLossScaler

#: alpha_{N+1} far below 1: Algorithm 4 then raises the scale layer by layer (betas above 1)
LOW_ROOT = 2.0**-20


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    ).double()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 8, generator=g).double(), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)
    ]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-12) -> bool:
    return all(
        ((x - y).abs().max() / y.abs().max().clamp_min(1e-300)).item() <= tol
        for x, y in zip(a, b, strict=False)
    )


def _penalty_run(
    scaler: AdaptiveLossScaler | None, steps: int = 4, passes: list | None = None
) -> list[torch.Tensor]:
    """GradScaler's gradient-penalty recipe (``torch.amp`` examples), or the same without scaling;
    ``passes`` collects ``scaler.last_pass`` after each backward pass."""
    model = _model()
    model = scaler.attach(model) if scaler is not None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        params = list(model.parameters())
        if scaler is None:
            grads = torch.autograd.grad(loss, params, create_graph=True)
        else:
            grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
            if passes is not None:
                passes.append(scaler.last_pass)
            inv_scale = 1.0 / scaler.get_scale()
            grads = [g * inv_scale for g in grads]
        loss = loss + torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            if passes is not None:
                passes.append(scaler.last_pass)
            scaler.step(opt)
            scaler.update()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("update_every", [1, 3])
def test_the_gradient_penalty_recipe_trains_as_without_scaling(update_every: int) -> None:
    """The penalty's gradients reach the forward graph at the root scale: the pass after a
    ``create_graph`` pass applies the root scale everywhere, and the weights match plain autograd."""
    reference = _penalty_run(None)
    scaler = AdaptiveLossScaler(update_every=update_every, init_scale=LOW_ROOT)
    assert scaler.last_pass is None  # no backward pass yet
    passes: list = []
    weights = _penalty_run(scaler, passes=passes)
    assert max(scaler.layer_betas().values()) > 1  # layer-wise scales took part in the first pass
    assert _close(weights, reference)
    # the user-visible pass kinds: each step's first pass recomputes or reuses, the second is plain
    first = ["recompute" if i % update_every == 0 else "reuse" for i in range(4)]
    assert passes == [kind for f in first for kind in (f, "plain")]


def _clip_run(scaler: AdaptiveLossScaler | None, unscale_first: bool, steps: int = 4) -> list[torch.Tensor]:
    model = _model()
    model = scaler.attach(model) if scaler is not None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    max_norm = 0.05  # below the gradients' norm: clipping acts
    for x, y in _batches(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if scaler is None:  # what GradScaler does with a scale of LOW_ROOT (exact: a power of two)
            loss.backward()
            scale = 1.0 if unscale_first else LOW_ROOT
            for p in model.parameters():
                p.grad.mul_(scale)
            nn.utils.clip_grad_norm_(model.parameters(), max_norm * scale)
            for p in model.parameters():
                p.grad.div_(scale)
            opt.step()
            continue
        scaler.scale(loss).backward()
        if unscale_first:  # the recipe of the AMP docs
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        else:  # clipping the scaled gradients at max_norm * get_scale()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("unscale_first", [True, False], ids=["unscale-then-clip", "clip-scaled"])
def test_gradient_clipping_recipes_clip_as_without_scaling(unscale_first: bool) -> None:
    """Both of the AMP docs' clipping recipes clip as GradScaler would (clipping the scaled gradients at
    ``max_norm * get_scale()`` differs from clipping true ones only through clip_grad_norm_'s epsilon)."""
    reference = _clip_run(None, unscale_first)
    weights = _clip_run(AdaptiveLossScaler(update_every=2, init_scale=LOW_ROOT), unscale_first)
    assert _close(weights, reference, 1e-10)


def _train(scaler: AdaptiveLossScaler, model: nn.Module, batches: list) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(model(x), y) * 1e-6).backward()
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_carries_the_state_and_is_independent(how: str) -> None:
    """A copy has the original's state (scale, counters, per-layer scales); attached to a copy of the model
    it trains as the original goes on training; changing the copy does not reach the original's model."""
    batches = _batches(5)
    plain = _model()
    scaler = AdaptiveLossScaler(update_every=2, init_scale=LOW_ROOT)
    model = scaler.attach(copy.deepcopy(plain))
    _train(scaler, model, batches[:3])
    twin = copy.deepcopy(scaler) if how == "deepcopy" else pickle.loads(pickle.dumps(scaler))
    assert twin.state_dict() == scaler.state_dict()
    twin_model = twin.attach(copy.deepcopy(plain))
    twin_model.load_state_dict(model.state_dict())
    twin.update(LOW_ROOT * 1024)  # only the copy's scale changes
    assert scaler.get_scale() == LOW_ROOT
    twin.update(LOW_ROOT)
    _train(scaler, model, batches[3:])
    _train(twin, twin_model, batches[3:])
    assert twin.layer_scales() == scaler.layer_scales()
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), twin_model.state_dict().values(), strict=False)
    )


def test_a_scaler_is_not_copied_in_the_middle_of_an_iteration() -> None:
    scaler = AdaptiveLossScaler()
    model = scaler.attach(_model())
    x, y = _batches(1)[0]
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    with pytest.raises(RuntimeError, match="between iterations only"):
        copy.deepcopy(scaler)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("root", ["fixed", "adaptive"])
def test_a_copy_goes_on_training_the_originals_model(how: str, root: str) -> None:
    """GradScaler's habit (PyTorch's test_grad_scaling_autocast): copy the scaler after every iteration and
    train the same model on with the copy. The weights and the scaler's state end as the uninterrupted
    run's, bitwise; the scaler a copy took the model from is refused with the reason."""
    batches = _batches(6)
    whole = AdaptiveLossScaler(update_every=2, init_scale=LOW_ROOT, root=root)
    whole_model = whole.attach(_model())
    _train(whole, whole_model, batches)
    scaler = first = AdaptiveLossScaler(update_every=2, init_scale=LOW_ROOT, root=root)
    model = scaler.attach(_model())
    for batch in batches:
        _train(scaler, model, [batch])
        scaler = copy.deepcopy(scaler) if how == "deepcopy" else pickle.loads(pickle.dumps(scaler))
    ours, theirs = model.state_dict(), whole_model.state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert scaler.state_dict() == whole.state_dict()
    x, y = batches[0]
    with pytest.raises(RuntimeError, match="driven by a copy of it now"):
        first.scale(nn.functional.cross_entropy(model(x), y))


def test_a_scaler_not_bound_to_the_model_is_named_in_the_error() -> None:
    """A backward pass that reaches an attached model unscaled says why: no scale() at all, or the scale()
    of a scaler bound elsewhere (a copy attached to another model, a scaler attached to none)."""
    scaler = AdaptiveLossScaler()
    model = scaler.attach(_model())
    elsewhere = copy.deepcopy(scaler)
    elsewhere.attach(_model())
    x, y = _batches(1)[0]
    for wrong in (elsewhere, AdaptiveLossScaler()):
        with pytest.raises(RuntimeError, match="not bound to this model"):
            wrong.scale(nn.functional.cross_entropy(model(x), y)).backward()
    with pytest.raises(RuntimeError, match=r"call scaler.scale\(loss\).backward\(\) rather"):
        nn.functional.cross_entropy(model(x), y).backward()
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()  # the right one still works
