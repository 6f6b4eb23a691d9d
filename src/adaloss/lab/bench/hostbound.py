"""A host-bound step on the CPU: ResNet-20 on a batch of two 8x8 images in FP32, one thread, where a step's
time is mostly Python and op dispatch, as on a GPU at the sizes ``make gpu-check`` times (an H200 keeps
its kernels busy for about half of a dynamic ResNet-20 step at batch 128). It prices the adaptive
scaler's host-side cost, its Python autograd nodes, without a GPU: the wall-time ratios it gives (adaptive
``update_every`` 1 and 100 against dynamic) came out near the H200's (2.2x and 1.5x against 2.7-3.6x and
1.5-1.7x). The GPU check's own timing (:func:`adaloss.lab.gpucheck.time_modes`): interleaved rounds of ten
steps per configuration, medians, ``update_every=100`` amortized over one recompute and 99 reuse steps.

Eager and compiled side by side (issue 34): each configuration also runs compiled,
``torch.compile(scaler.attach(model), fullgraph=True, backend=...)`` (Inductor by default), and every
round runs the eager and the compiled steps in turn, so a change in the shared machine's load moves both
columns alike. The warm-up round (dropped) compiles every pass kind; the table's notes say how long it
took, and how many graphs, graph breaks and recompiles Dynamo made (a recompile after the warm-up would
put compile time into a timed round). Issue 34's goals for the compiled proxy: adaptive ``update_every``
100 at most 1.05x a dynamic step, ``update_every`` 1 at most 1.5x.

    python -m adaloss.lab.bench.hostbound [--rounds 20] [--backend inductor|aot_eager|none]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from adaloss.lab.gpucheck import CONFIGS, step_ratios, time_modes

__all__ = ["GOALS", "main", "measure", "render"]

#: issue 34's goals for the compiled host-bound step: adaptive / dynamic at most these
GOALS = {"adaptive_u100_over_dynamic": 1.05, "adaptive_u1_over_dynamic": 1.5}
#: the table's rows: (label, configuration, what of its entry)
ROWS = (
    ("dynamic", "dynamic", "step"),
    ("adaptive_u1", "adaptive_u1", "step"),
    ("adaptive_u100 (amortized)", "adaptive_u100", "amortized"),
    ("adaptive_u100, a reuse step", "adaptive_u100", "reuse"),
    ("adaptive_u100, a recompute step", "adaptive_u100", "recompute"),
)


def measure(
    rounds: int = 20, steps: int = 10, backend: str | None = "inductor", budget_s: float | None = None
) -> dict[str, Any]:
    """ResNet-20, two 8x8 images, FP32, one CPU thread: :func:`adaloss.lab.gpucheck.time_modes` of the eager
    steps and, unless ``backend`` is None, of the steps compiled by ``backend``, in the same rounds.

    Returns ``ms`` (median milliseconds per step of each mode's configurations, a compiled one's compile
    counts beside them), ``ratios`` (each mode's :func:`adaloss.lab.gpucheck.step_ratios`), ``backend``,
    ``rounds``, ``cut_by_budget`` (``budget_s``: seconds for the timed rounds), ``warmup_s`` (the warm-up
    round's seconds, compiling included) and ``seconds`` (all rounds)."""
    modes: dict[str, tuple[str | None, str | None]] = {"eager": (None, None)}
    if backend is not None:
        modes["compiled"] = (backend, None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ms, info = time_modes(
            "resnet20", 2, "cpu", modes, rounds, steps, dtype=None, image_size=8, budget_s=budget_s
        )
    finally:
        torch.set_num_threads(threads)
    keep = ("rounds", "cut_by_budget", "warmup_s", "seconds")
    return {
        "backend": backend,
        **{k: info[k] for k in keep},
        "ms": ms,
        "ratios": {mode: step_ratios(m) for mode, m in ms.items()},
    }


def _cells(ms: dict[str, dict[str, float]], ratios: dict[str, float], config: str, what: str) -> list[str]:
    """One mode's two cells of a row: milliseconds per step and the ratio to a dynamic step."""
    dynamic = ms["dynamic"]["step"]
    if what == "amortized":
        ratio = ratios["adaptive_u100_over_dynamic"]
        value = dynamic * ratio
    else:
        value = ms[config][what]
        ratio = value / dynamic
    return [f"{value:.2f}", f"{ratio:.3f}x"]


def render(result: dict[str, Any], header: str | None = None) -> str:
    """The Markdown table (eager and, when measured, compiled columns), its goal lines and notes; under
    ``header`` (the bench's machine line) when given."""
    modes = list(result["ms"])
    both = "compiled" in modes
    lines = [
        f"### Host-bound step, eager{' and compiled' if both else ''} (ResNet-20, batch 2 x 8x8 images, "
        "FP32, CPU, one thread)",
        "",
    ]
    if header:
        lines += [header, ""]
    compiled = (
        ", each round running the eager steps and the compiled ones (`torch.compile(scaler.attach(model), "
        f"fullgraph=True, backend={result['backend']!r})`) in turn"
    )
    lines += [
        "Median milliseconds per step over interleaved rounds of ten steps per configuration"
        f"{compiled if both else ''}; update_every=100 amortized: (one recompute step + 99 reuse steps) / "
        "(100 dynamic steps).",
        "",
    ]
    headers = ["configuration", "eager ms/step", "eager / dynamic"]
    if both:
        headers += ["compiled ms/step", "compiled / dynamic"]
    lines += ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    for label, config, what in ROWS:
        cells = [label]
        for mode in modes:
            cells += _cells(result["ms"][mode], result["ratios"][mode], config, what)
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *_notes(result)]
    return "\n".join(lines)


def _notes(result: dict[str, Any]) -> list[str]:
    """The goal lines of the compiled columns, what Dynamo made, and how long the rounds took."""
    notes = []
    ms, ratios = result["ms"], result["ratios"]
    if "compiled" in ms:
        for key, goal in GOALS.items():
            value = ratios["compiled"][key]
            verdict = "PASS" if value <= goal else "over goal"
            notes.append(
                f"- Goal (issue 34), compiled {key}: <= {goal:g}x; measured {value:.3f}x: {verdict}."
            )
        counts = {k: ms["compiled"][k] for k in CONFIGS}
        graphs = ", ".join(f"{k} {c['graphs']}" for k, c in counts.items())
        breaks = sum(c["graph_breaks"] for c in counts.values())
        recompiles = sum(c["recompiles"] for c in counts.values())
        notes.append(
            f"- Compiled: graphs per configuration {graphs}; graph breaks {breaks}; recompiles after the "
            f"warm-up round {recompiles}"
            + (
                " (compile time in the timed rounds: these rows overstate the compiled steps)."
                if recompiles
                else "."
            )
        )
    cut = " (cut by the time budget)" if result["cut_by_budget"] else ""
    timed, warm = result["seconds"] - result["warmup_s"], result["warmup_s"]
    notes.append(
        f"- {result['rounds']} timed rounds{cut}, {timed:.0f} s; the warm-up round (dropped"
        f"{', compiling' if 'compiled' in ms else ''}) took {warm:.0f} s."
    )
    return notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds of ten steps each (default 20)")
    parser.add_argument(
        "--backend",
        default="inductor",
        help="torch.compile backend of the compiled columns (default inductor; none: eager only)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be positive, got {args.rounds}")
    result = measure(args.rounds, backend=None if args.backend == "none" else args.backend)
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
