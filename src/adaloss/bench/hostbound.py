"""A host-bound step on the CPU: ResNet-20 on a batch of two 8x8 images in FP32, one thread, where a step's
time is mostly Python and op dispatch, as on a GPU at the sizes ``make gpu-check`` times (an H200 keeps
its kernels busy for about half of a dynamic ResNet-20 step at batch 128). It prices the adaptive
scaler's host-side cost, its Python autograd nodes, without a GPU: the wall-time ratios it gives (adaptive
``update_every`` 1 and 100 against dynamic) came out near the H200's (2.2x and 1.5x against 2.7-3.6x and
1.5-1.7x). The GPU check's own timing (:func:`adaloss.gpucheck.time_steps`): interleaved rounds of ten
steps per configuration, medians, ``update_every=100`` amortized over one recompute and 99 reuse steps.

    python -m adaloss.bench.hostbound [--rounds 20]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from adaloss.gpucheck import step_ratios, time_steps


def measure(rounds: int = 20, steps: int = 10) -> dict[str, dict[str, float]]:
    """:func:`adaloss.gpucheck.time_steps` (the GPU check's interleaved timing) on ResNet-20, two 8x8
    images, FP32, one CPU thread: median milliseconds per step of each configuration."""
    torch.set_num_threads(1)
    return time_steps("resnet20", 2, "cpu", rounds=rounds, steps=steps, dtype=None, image_size=8)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds of ten steps each (default 20)")
    args = parser.parse_args(argv)
    ms = measure(args.rounds)
    ratios = step_ratios(ms)
    dynamic = ms["dynamic"]["step"]
    rows = {
        "dynamic": (dynamic, 1.0),
        "adaptive_u1": (ms["adaptive_u1"]["step"], ratios["adaptive_u1_over_dynamic"]),
        "adaptive_u100": (
            dynamic * ratios["adaptive_u100_over_dynamic"],
            ratios["adaptive_u100_over_dynamic"],
        ),
    }
    print("| configuration | ms/step (update_every=100: amortized) | / dynamic |\n| --- | --- | --- |")
    for key, (value, ratio) in rows.items():
        print(f"| {key} | {value:.2f} | {ratio:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
