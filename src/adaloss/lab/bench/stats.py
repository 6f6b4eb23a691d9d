"""From timed rounds to ratios: each ratio per round from the round's mean step times, its median and
interquartile range over the rounds (with the target's verdict), and the A/A ratios between copies."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from adaloss.lab.bench.specs import RATIOS, RatioDef
from adaloss.lab.bench.timing import ModelResult
from adaloss.lab.reports.measurement import median, quantile


def _round_mean(rd: dict[str, dict[str, list[float]]], config: str, kind: str) -> float:
    xs = rd.get(config, {}).get(kind, [])
    return sum(xs) / len(xs) if xs else float("nan")


def per_round_ratios(result: ModelResult, ratios: Sequence[RatioDef] = RATIOS) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {r.key: [] for r in ratios}
    for rd in result.rounds:

        def t(config: str, kind: str, rd=rd) -> float:
            return _round_mean(rd, config, kind)

        for r in ratios:
            try:
                out[r.key].append(float(r.fn(t)))
            except ZeroDivisionError:
                out[r.key].append(float("nan"))
    return out


def replica_ratios(result: ModelResult) -> dict[str, list[dict[str, float]]]:
    """Per configuration with several copies: each copy's step time over copy 0's (A/A between copies).

    Per round, the mean of a copy's plain (adaptive: reuse) steps over copy 0's; median and p25-p75 over
    the rounds. How far identical copies differ within one run."""
    out: dict[str, list[dict[str, float]]] = {}
    per: dict[tuple[str, int], dict[int, float]] = {}  # (config, copy) -> {round: mean step time}
    for r, records in enumerate(result.raw):
        sums: dict[tuple[str, int], list[float]] = {}
        for rec in records:
            if rec["kind"] in ("plain", "reuse"):
                sums.setdefault((rec["config"], rec.get("replica", 0)), []).append(rec["s"])
        for key, ts in sums.items():
            per.setdefault(key, {})[r] = sum(ts) / len(ts)
    for config in sorted({c for c, _ in per}):
        copies = sorted(i for c, i in per if c == config)
        if len(copies) < 2 or copies[0] != 0:
            continue
        base = per[(config, 0)]
        rows = []
        for i in copies[1:]:
            vals = [t / base[r] for r, t in per[(config, i)].items() if r in base]
            rows.append(
                {
                    "replica": i,
                    "median": median(vals),
                    "p25": quantile(vals, 0.25),
                    "p75": quantile(vals, 0.75),
                }
            )
        out[config] = rows
    return out


def summarize(results: Sequence[ModelResult], defs: Sequence[RatioDef] = RATIOS) -> dict[str, dict[str, Any]]:
    """``{"<ratio>/<model>": {median, p25, p75, per_round, target, pass, ...}}`` for the ratios ``defs``."""
    ratios: dict[str, dict[str, Any]] = {}
    for res in results:
        per = per_round_ratios(res, defs)
        for r in defs:
            vals = per[r.key]
            med = median(vals)
            ratios[f"{r.key}/{res.model}"] = {
                "ratio": r.key,
                "model": res.model,
                "label": r.label,
                "median": med,
                "p25": quantile(vals, 0.25),
                "p75": quantile(vals, 0.75),
                "rounds": len(vals),
                "per_round": vals,
                "target": r.target,
                "pass": (med <= r.target) if (r.target is not None and math.isfinite(med)) else None,
                "paper": r.paper or None,
            }
    return ratios
