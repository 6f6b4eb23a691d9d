"""Compiling a model attached to the adaptive scaler: graphs, graph breaks and recompiles over a run in which
the scales change, and whether the scale buffers kept their addresses.

``torch.compile(scaler.attach(model), fullgraph=True)`` traces forward and backward passes with Algorithm 3
inside (:mod:`adaloss.adaptive.ops`): one graph per pass kind (recompute, reuse), read the scales from
device buffers. This runs ``steps`` training steps of a model with ``update_every`` small and a root scale
that moves (``root="dynamic"``, growing every ``growth_interval`` steps, each change a recompute), warms
up until both kinds have been compiled, then forbids recompiling (``torch.compiler.set_stance(
"fail_on_recompile")``): a recompile is an error, counted and reported.

    python -m adaloss.lab.bench.compiled [--models resnet20 resnet110 ssd300 gpt] [--steps 300]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from adaloss.scalers.adaptive import AdaptiveLossScaler

__all__ = ["MODELS", "build", "compile_run", "main"]

#: the models of issue 34's compile goal, each ``(batch, build arguments)``
MODELS = ("resnet20", "resnet110", "ssd300", "gpt")

Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def build(
    name: str, device: str = "cpu"
) -> tuple[nn.Module, Batch, Callable[[Any, torch.Tensor], torch.Tensor]]:
    """A small instance of model ``name`` (a CIFAR ResNet of any depth ``resnetN``, ``ssd300`` at 64x64,
    the tiny ``gpt``), a maker of synthetic batches and a loss; seeded, on ``device``."""
    torch.manual_seed(0)
    if name == "ssd300":
        from adaloss.runner.models import build_detector

        net = build_detector({"name": "ssd300", "image_size": 64}, num_classes=3).net.to(device)

        def images(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(batch, 3, 64, 64, device=device), torch.zeros(batch, device=device)

        def detection_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
            locs, scores = out
            return locs.float().square().mean() + F.cross_entropy(
                scores.flatten(0, -2).float(),
                torch.zeros(scores[..., 0].numel(), dtype=torch.long, device=scores.device),
            )

        return net, images, detection_loss  # fmt: skip
    from adaloss.lab.gpucheck import _loss, _model

    model, make = _model(name, device, image_size=8)
    return model, make, _loss


def compile_run(
    name: str,
    steps: int = 300,
    backend: str = "aot_eager",
    batch: int = 2,
    update_every: int = 5,
    growth_interval: int = 4,
    init_scale: float = 2.0**3,
    device: str = "cpu",
) -> dict[str, Any]:
    """Train a compiled, attached ``name`` for ``steps`` steps (:func:`build`); count what Dynamo made.

    Returns ``graphs`` (unique graphs), ``graph_breaks``, ``recompiles`` (after the warm-up, which
    compiles both pass kinds), ``kinds`` (steps of each pass kind), ``root_scales`` and ``beta_sets``
    (distinct root scales and distinct sets of betas the run went through: the scales did change),
    ``addresses_fixed`` (every scale buffer kept its ``data_ptr``) and ``error`` (what stopped the run,
    or None)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    base, make, loss_fn = build(name, device)
    options = {"update_every": update_every, "init_scale": init_scale, "growth_interval": growth_interval}
    scaler = AdaptiveLossScaler(device, root="dynamic", **options)
    model = scaler.attach(copy.deepcopy(base))
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    buffers = scaler.state.buffers.tensors()
    addresses = {k: t.data_ptr() for k, t in buffers.items()}
    kinds: dict[str, int] = {}
    roots, beta_sets = set(), set()
    graphs_warm, error = None, None
    gen = torch.Generator(device="cpu").manual_seed(1)
    for step in range(steps):
        if graphs_warm is None and {"recompute", "reuse"} <= set(kinds):
            graphs_warm = counters["stats"]["unique_graphs"]
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        x, y = make(batch)
        try:
            with torch.compiler.set_stance("fail_on_recompile" if graphs_warm is not None else "default"):
                loss = loss_fn(compiled(x), y)
                scaler.scale(loss).backward()
        except Exception as exc:  # a recompile after the warm-up, or what the compiler refused
            error = f"step {step}: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            break
        scaler.step(opt)
        kinds[scaler.last_pass] = kinds.get(scaler.last_pass, 0) + 1
        roots.add(scaler.get_scale())
        if scaler.last_pass == "recompute":
            beta_sets.add(tuple(sorted(scaler.layer_betas().items())))
        scaler.update()
        opt.zero_grad(set_to_none=True)
    graphs = counters["stats"]["unique_graphs"]
    return {
        "model": name,
        "backend": backend,
        "steps": sum(kinds.values()),
        "graphs": graphs,
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompiles": graphs - graphs_warm if graphs_warm is not None else None,
        "kinds": kinds,
        "root_scales": len(roots),
        "beta_sets": len(beta_sets),
        "addresses_fixed": all(t.data_ptr() == addresses[k] for k, t in buffers.items()),
        "error": error,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="models (default: all four)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per model (default 300)")
    parser.add_argument("--backend", default="aot_eager", help="the compiler backend (default aot_eager)")
    args = parser.parse_args(argv)
    columns = "model, steps (recompute / reuse), graphs, graph breaks, recompiles, root scales, beta sets, "
    columns += "addresses fixed, error"
    print("| " + " | ".join(columns.split(", ")) + " |\n|" + " --- |" * 9)
    failed = False
    for name in args.models:
        r = compile_run(name, args.steps, args.backend)
        kinds = f"{r['kinds'].get('recompute', 0)} / {r['kinds'].get('reuse', 0)}"
        print(
            f"| {name} | {r['steps']} ({kinds}) | {r['graphs']} "
            f"| {r['graph_breaks']} | {r['recompiles']} | {r['root_scales']} | {r['beta_sets']} "
            f"| {r['addresses_fixed']} | {r['error'] or ''} |",
            flush=True,
        )
        failed |= bool(r["error"]) or r["graph_breaks"] > 0 or r["recompiles"] != 0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
