"""A host-bound step on the CPU: ResNet-20 on a batch of two 8x8 images in FP32, one thread, where a step's
time is mostly Python and op dispatch, as on a GPU at the sizes ``make gpu-check`` times (an H200 keeps
its kernels busy for about half of a dynamic ResNet-20 step at batch 128). It prices the adaptive
scaler's host-side cost, its Python autograd nodes, without a GPU: the wall-time ratios it gives (adaptive
``update_every`` 1 and 100 against dynamic) came out near the H200's (2.2x and 1.5x against 2.7-3.6x and
1.5-1.7x). Interleaved rounds of ten steps per configuration; medians.

    python -m adaloss.bench.hostbound [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from adaloss.models.cifar_resnet import cifar_resnet
from adaloss.scalers import AdaptiveLossScaler, DynamicLossScaler

CONFIGS = {
    "dynamic": lambda: DynamicLossScaler(),
    "adaptive_u1": lambda: AdaptiveLossScaler(update_every=1),
    "adaptive_u100": lambda: AdaptiveLossScaler(update_every=100),
}


def measure(rounds: int = 20, steps: int = 10, warmup: int = 5) -> dict[str, float]:
    """Median milliseconds per step of each configuration of :data:`CONFIGS`, interleaved in rounds."""
    torch.set_num_threads(1)
    runs = {}
    for key, make in CONFIGS.items():
        torch.manual_seed(0)
        scaler = make()
        model = scaler.attach(cifar_resnet(20, 10))
        runs[key] = (scaler, model, torch.optim.SGD(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 10, (2,), generator=g)
    times: dict[str, list[float]] = {key: [] for key in runs}
    for round_ in range(rounds + 1):  # round 0 warms up and is dropped
        for key, (scaler, model, opt) in runs.items():
            for _ in range(warmup if round_ == 0 else steps):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                scaler.scale(F.cross_entropy(model(x), y)).backward()
                scaler.step(opt)
                scaler.update()
                if round_ > 0:
                    times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(v) * 1e3 for key, v in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds of ten steps each (default 20)")
    args = parser.parse_args(argv)
    ms = measure(args.rounds)
    print("| configuration | ms/step | / dynamic |\n| --- | --- | --- |")
    for key, value in ms.items():
        print(f"| {key} | {value:.2f} | {value / ms['dynamic']:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
