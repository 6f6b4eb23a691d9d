"""The cases on which ``tests/test_reference_rule.py`` compares the reference rule with the port of the
authors' code (``tests/authors_port.py``): NumPy only, so the same cases could be fed to the authors' own
functions in an environment with Chainer and without torch."""

from __future__ import annotations

import math

import numpy as np

SHAPES = [  # (kind, weight shape, gradient shape)
    ("linear", (10, 64), (32, 10)),
    ("linear", (100, 512), (16, 100)),
    ("linear", (512, 512), (8, 512)),
    ("conv", (16, 3, 3, 3), (4, 16, 16, 16)),
    ("conv", (64, 64, 3, 3), (4, 64, 8, 8)),
    ("conv", (128, 64, 1, 1), (4, 128, 8, 8)),
    ("conv", (512, 512, 3, 3), (2, 512, 4, 4)),
]
GRAD_RMS = [1e-1, 1e-3, 1e-5, 1e-7, 3e-8]  # the last is below FP16's smallest subnormal: mostly zeros
ALPHAS = [1.0, 8.0, 64.0, 512.0, 2048.0, 8192.0]


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def layer_cases() -> list[dict]:
    """Deterministic cases: every shape with every gradient magnitude, a spike near overflow on some,
    each with one incoming alpha (cycling through ``ALPHAS``). Arrays are FP16 values (as stored in
    mixed precision), held as float32."""
    rng = np.random.default_rng(0)
    cases = []
    for i, (kind, w_shape, g_shape) in enumerate(SHAPES):
        fan = w_shape[1] * (w_shape[2] * w_shape[3] if len(w_shape) == 4 else 1)
        w = _fp16(rng.standard_normal(w_shape) * math.sqrt(2.0 / fan))  # He initialization
        for j, rms in enumerate(GRAD_RMS):
            alpha = ALPHAS[(i + j) % len(ALPHAS)]
            g = rng.standard_normal(g_shape) * rms * alpha  # the gradient as received: scaled by alpha
            if (i + j) % 3 == 0:
                g.flat[rng.integers(g.size)] = 3.0e4 * (1 if j % 2 else -1)  # a spike near overflow
            cases.append({"kind": kind, "w": w, "g": _fp16(g), "alpha": alpha})
    return cases


def branch_cases() -> list[tuple[list[float], list[np.ndarray]]]:
    """Incoming (alphas, gradients) at a branch: equal and different alphas, maxima that make the largest,
    a middle, the smallest or none of the alphas fit, and cases the authors' halving has to rescue."""
    rng = np.random.default_rng(1)
    cases = []
    for alphas in (
        [1.0, 1.0],
        [4.0, 64.0],
        [1.0, 16.0, 256.0],
        [2048.0, 8.0],
        [0.5, 2.0],
        [0.125, 1.0],
        [0.0625, 1.0],
    ):
        # 65504 (FP16's largest value) at its own scale fails "< u_max": only then the authors' halving
        for top in (1e-3, 10.0, 2000.0, 5000.0, 30000.0, 60000.0, 65504.0):
            grads = []
            for k in range(len(alphas)):
                g = rng.standard_normal(64) * 1e-2
                g[k] = top if k == len(alphas) - 1 else 1.0
                grads.append(_fp16(g))
            cases.append((alphas, grads))
            if top == 65504.0:  # ... also at the smallest scale
                order = sorted(range(len(alphas)), key=lambda k: alphas[k])
                cases.append(([alphas[k] for k in order], [grads[k] for k in order][::-1]))
    return cases
