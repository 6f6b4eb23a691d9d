"""The root-scale lab's tables (``root_scale.md``): the metric with each root's paired difference to
fixed, the underflow at the last step, and the cost per step; means with 95% t-intervals over the seeds."""

from __future__ import annotations

import math
import statistics
from typing import Any

from adaloss.lab.reports.measurement import header_line, markdown_table
from adaloss.lab.root_scale.tasks import PRETTY, ROOTS, TASKS

# Student's t, 97.5% quantile, by degrees of freedom (1-30): the 95% two-sided interval
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145)
_T975 += (2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048)
_T975 += (2.045, 2.042)


def t_interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval); half-width NaN for one value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    t = _T975[min(len(values) - 2, len(_T975) - 1)]
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def _ci(values: list[float], digits: int) -> str:
    mean, half = t_interval(values)
    return f"{mean:.{digits}f} ± {half:.{digits}f}" if math.isfinite(half) else f"{mean:.{digits}f}"


def _runs(rows: list[dict], task: str, root: str) -> list[dict]:
    return sorted((r for r in rows if r["task"] == task and r["root"] == root), key=lambda r: r["seed"])


def metric_table(rows: list[dict]) -> tuple[str, dict[str, dict[str, str]]]:
    """The validation metric per task and root, and each root's paired difference to fixed; verdicts."""
    headers = ["task (metric)", "seeds", *(f"{r}" for r in ROOTS), "dynamic - fixed", "adaptive - fixed"]
    body, verdicts = [], {}
    for task in [t for t in TASKS if any(r["task"] == t for r in rows)]:
        _, _, higher, label, _ = TASKS[task]
        cells = [f"{PRETTY[task]} ({label})"]
        fixed = {r["seed"]: r["metric"] for r in _runs(rows, task, "fixed")}
        cells.append(str(len(fixed)))
        digits = 3 if task == "gpt" else 2
        cells += [_ci([r["metric"] for r in _runs(rows, task, root)], digits) for root in ROOTS]
        verdicts[task] = {}
        for root in ("dynamic", "adaptive"):
            diffs = [r["metric"] - fixed[r["seed"]] for r in _runs(rows, task, root) if r["seed"] in fixed]
            mean, half = t_interval(diffs)
            separated = math.isfinite(half) and abs(mean) > half
            better = (mean > 0) == higher
            verdict = ("better" if better else "worse") if separated else "cannot separate"
            verdicts[task][root] = verdict
            cells.append(f"{mean:+.{digits}f} ± {half:.{digits}f} ({verdict})")
        body.append(cells)
    return markdown_table(headers, body), verdicts


def underflow_table(rows: list[dict]) -> str:
    """Per task and root: the output layers' and the other layers' mean underflow at the last step (mean
    over seeds), the worst layer, alpha_{N+1} at the end, skipped steps and recomputes per run."""
    headers = [
        "task", "root", "output layers' underflow (%)", "other layers' underflow (%)", "worst layer (%)",
        "alpha_{N+1} at the end", "skipped steps / run", "recomputes / run",
    ]  # fmt: skip
    body = []
    for task in [t for t in TASKS if any(r["task"] == t for r in rows)]:
        outputs = TASKS[task][4]
        for root in ROOTS:
            runs = _runs(rows, task, root)
            if not runs:
                continue
            out_rates, other_rates, worst = [], [], []
            for r in runs:
                rates = r["underflow_rate"]
                mine = [v for k, v in rates.items() if any(k == o or k.startswith(o) for o in outputs)]
                rest = [v for k, v in rates.items() if not any(k == o or k.startswith(o) for o in outputs)]
                out_rates.append(100 * statistics.fmean(mine) if mine else math.nan)
                other_rates.append(100 * statistics.fmean(rest) if rest else math.nan)
                name = max(rates, key=rates.get)
                worst.append((100 * rates[name], name))
            top = max(worst)
            scales = sorted(r["root_scale_end"] for r in runs)
            body.append([
                PRETTY[task], root, _ci(out_rates, 2), _ci(other_rates, 3), f"{top[0]:.1f} ({top[1]})",
                f"{scales[0]:g}" if scales[0] == scales[-1] else f"{scales[0]:g} to {scales[-1]:g}",
                f"{statistics.fmean(r['skipped_steps'] for r in runs):.1f}",
                f"{statistics.fmean(r['recomputes'] for r in runs):.1f}",
            ])  # fmt: skip
    return markdown_table(headers, body, left=2)


def cost_table(benches: list[dict]) -> str:
    headers = ["task", *(f"{r} (ms / step)" for r in ROOTS), "dynamic / fixed", "adaptive / fixed"]
    body = []
    for b in benches:
        m = b["median_s"]
        body.append([
            PRETTY[b["task"]], *(f"{1000 * m[r]:.1f}" for r in ROOTS),
            f"{m['dynamic'] / m['fixed']:.3f}", f"{m['adaptive'] / m['fixed']:.3f}",
        ])  # fmt: skip
    return markdown_table(headers, body)


def report(summary: dict[str, Any]) -> str:
    rows, benches = summary["runs"], summary["bench"]
    metrics, verdicts = metric_table(rows)
    seeds = sorted({r["seed"] for r in rows})
    parts = [
        f"{header_line(summary['machine'])}; seeds {','.join(map(str, seeds))}; emulated FP16 on the CPU",
        *(
            f"{PRETTY[task]}: rerun (`--merge`) on {header_line(machine)}"
            for task, machine in summary.get("merged", {}).items()
        ),
        "",
        "Validation metric (mean ± 95% t-interval over the seeds; differences paired by seed):",
        "",
        metrics,
        "",
        "Underflow at the last step (the runs' telemetry: share of each layer's non-zero output gradient "
        "flushed to zero in FP16; mean ± 95% t-interval over the seeds):",
        "",
        underflow_table(rows),
    ]
    if benches:
        steps, rounds = benches[0]["steps"], benches[0]["rounds"]
        parts += [
            "",
            f"Cost per step with update_every=1 (median of {rounds} interleaved blocks of {steps} steps, "
            "same process, same weights and batch):",
            "",
            cost_table(benches),
        ]
    summary["verdicts"] = verdicts
    return "\n".join(parts) + "\n"
