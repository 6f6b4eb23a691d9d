"""What the reports share: the error they raise, reading numbers and keys out of run records, labels,
seed statistics and Markdown tables."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DATASET_LABELS",
    "DIVERGED",
    "IRRELEVANT_KEYS",
    "MISSING",
    "MODEL_LABELS",
    "ReportError",
    "Skip",
    "Stats",
    "config_value",
    "flatten",
    "fmt_num",
    "format_stats",
    "markdown_table",
    "number",
]


class ReportError(Exception):
    """Bad input (a missing folder, no finished run, W&B unreachable, nothing to draw): the command line
    prints ``error: <message>`` and exits with status 2."""


class Skip(Exception):
    """A record that is not a run of the table at hand; the message says why."""


MODEL_LABELS = {
    "resnet18": "ResNet-18",
    "resnet20": "ResNet-20",
    "resnet50": "ResNet-50",
    "resnet56": "ResNet-56",
    "resnet110": "ResNet-110",
    "ssd300": "SSD300",
    "ssd512": "SSD512",
    "mlp": "MLP",
    "vgg_nobn": "VGG (no BN)",
}
DATASET_LABELS = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "imagenet": "ImageNet", "voc": "VOC"}

DIVERGED = "diverged"
MISSING = "—"  # a cell without runs: never zero

#: Config keys that never change a result (where a run is written, how it logs, workers): left out when
#: checking that runs share their setting, and when naming what sets the runs of a sweep apart.
IRRELEVANT_KEYS = (
    "seed",
    "name",
    "device",
    "paths.",
    "logger.",
    "telemetry.",
    "trainer.num_workers",
    "trainer.progress_bar",
    "trainer.log_every",
    "trainer.eval_batch_size",
    "trainer.on_divergence",  # only decides whether a diverged run is recorded or raised
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.save_final",
    "resume",
    "dataset.download",
)


def config_value(mapping: Mapping[str, Any], dotted: str) -> Any:
    """``mapping["a"]["b"]`` for ``dotted="a.b"``.

    Raises:
        Skip: if a key on the way is missing.
    """
    value: Any = mapping
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise Skip(f"its config has no {dotted}")
        value = value[part]
    return value


def number(value: Any) -> float | None:
    """A finite float, or None for null / NaN / Inf / non-numbers."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a.b": json of the value}`` for every leaf of a nested config."""
    out: dict[str, str] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = json.dumps(value, sort_keys=True)
    return out


def fmt_num(x: float) -> str:
    """``128`` for whole numbers, else the shortest ``%g``."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Stats:
    """The runs of one cell: mean and sample standard deviation of the finite values, and how many diverged
    (``None``: a diverged run, or a metric that is not a finite number)."""

    n: int  # runs with a finite value
    mean: float | None
    std: float | None  # None for n < 2
    n_diverged: int

    @classmethod
    def of_values(cls, values: Iterable[float | None]) -> Stats:
        values = list(values)
        finite = [v for v in values if v is not None]
        return cls(
            n=len(finite),
            mean=statistics.fmean(finite) if finite else None,
            std=statistics.stdev(finite) if len(finite) > 1 else None,
            n_diverged=len(values) - len(finite),
        )

    @classmethod
    def of(cls, runs: Iterable[Any]) -> Stats:
        """Of objects with a ``value`` attribute (the tables' runs)."""
        return cls.of_values(r.value for r in runs)

    @property
    def missing(self) -> bool:
        return self.n == 0 and self.n_diverged == 0

    @property
    def all_diverged(self) -> bool:
        return self.n == 0 and self.n_diverged > 0


def format_stats(stats: Stats | None, scale: float | None = None) -> str:
    """``92.30 ± 0.20 (n=3)``, ``93.10 (n=1, 1 diverged, S=128)``, ``diverged (n=2)`` or ``—`` (no runs);
    ``scale`` names the fixed scale a cell was chosen at."""
    if stats is None or stats.missing:
        return MISSING
    chosen = [f"S={fmt_num(scale)}"] if scale is not None else []
    if stats.all_diverged:
        return f"{DIVERGED} ({', '.join([f'n={stats.n_diverged}', *chosen])})"
    details = [f"n={stats.n}", *([f"{stats.n_diverged} {DIVERGED}"] if stats.n_diverged else []), *chosen]
    spread = f" ± {stats.std:.2f}" if stats.std is not None else ""
    return f"{stats.mean:.2f}{spread} ({', '.join(details)})"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    """A GitHub Markdown table; cells are ``str()``-ed, the first ``left`` columns left-aligned, the rest
    (numbers) right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"]
    out.append(
        "|"
        + "|".join((":" + "-" * (w + 1)) if i < left else ("-" * (w + 1) + ":") for i, w in enumerate(widths))
        + "|"
    )
    for r in cells:
        padded = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.append("| " + " | ".join(padded) + " |")
    return "\n".join(out)
