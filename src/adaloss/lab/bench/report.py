"""The Markdown tables the bench prints and keeps in its JSON: the ResNets' ratios against their targets
(with the depth trend, median step times and the copies' A/A spread), the tiny GPT's, and the dispatched
ops per step with where the adaptive steps' extra ops come from."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from adaloss.lab.bench.opcounts import OP_KINDS, per_point
from adaloss.lab.bench.specs import GPT_BLOCK, GPT_MODEL, GPT_RATIOS, RATIOS, SPECS, RatioDef
from adaloss.lab.bench.stats import replica_ratios
from adaloss.lab.bench.timing import ModelResult
from adaloss.lab.reports.measurement import PRETTY, header_line, markdown_table, median


def _fmt_x(v: float, digits: int = 3) -> str:
    return f"{v:.{digits}f}x" if math.isfinite(v) else "n/a"


def _verdict(entry: dict[str, Any]) -> str:
    if entry["pass"] is None:
        return "n/a"
    return "PASS" if entry["pass"] else "over target"


def _resolved(entry: dict[str, Any]) -> str:
    """``yes`` when the target lies outside the per-round ratios' p25-p75: the verdict does not hinge on
    noise; ``no`` when it lies inside, so another run on this machine could well flip it."""
    lo, hi, target = entry["p25"], entry["p75"], entry["target"]
    if target is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return "n/a"
    return "no" if lo <= target <= hi else "yes"


def depth_trend(ratios: dict[str, dict[str, Any]], key: str, models: Sequence[str]) -> str | None:
    """One line saying whether ``key``'s median grows with depth across the ResNets measured."""
    depth_models = [m for m in ("resnet20", "resnet56", "resnet110") if m in models]
    if len(depth_models) < 2:
        return None
    meds = [ratios[f"{key}/{m}"]["median"] for m in depth_models]
    chain = " -> ".join(f"{_fmt_x(v)} ({PRETTY[m]})" for v, m in zip(meds, depth_models, strict=True))
    if not all(math.isfinite(v) for v in meds):
        verdict = "undetermined"
    elif all(b > a for a, b in zip(meds, meds[1:], strict=False)):
        verdict = "yes, monotonically"
    elif meds[-1] > meds[0]:
        verdict = "overall yes, not monotonically"
    else:
        verdict = "no"
    # Whether the difference is resolved: do the end points' interquartile ranges overlap?
    first, last = ratios[f"{key}/{depth_models[0]}"], ratios[f"{key}/{depth_models[-1]}"]
    overlap = not (first["p75"] < last["p25"] or last["p75"] < first["p25"])
    note = " (the shallowest and deepest IQRs overlap: within noise)" if overlap else ""
    return f"{chain}: grows with depth: {verdict}{note}"


def ratio_tables(
    ratios: dict[str, Any],
    present: Sequence[RatioDef],
    models: Sequence[str],
    context: str = "the noise floor and the step kinds behind the amortized rows",
) -> list[str]:
    """The lines of the two ratio tables: those with a target (median, p25-p75, verdict, whether it is
    resolved), then the context rows without one."""
    lines: list[str] = []
    rows = []
    for r in present:
        if r.target is None:
            continue
        for m in models:
            e = ratios[f"{r.key}/{m}"]
            rows.append(
                [
                    r.label,
                    PRETTY.get(m, m),
                    _fmt_x(e["median"]),
                    f"{e['p25']:.3f}-{e['p75']:.3f}",
                    f"<= {r.target:g}x",
                    _verdict(e),
                    _resolved(e),
                    r.paper or "",
                    e["rounds"],
                ]
            )
    lines.append(
        markdown_table(
            ["Ratio", "Model", "Median", "p25-p75", "Target", "Result", "Resolved", "Paper", "Rounds"],
            rows,
            left=2,
        )
    )
    lines += ["", f"Context (no target): {context}.", ""]
    rows = []
    for r in present:
        if r.target is not None:
            continue
        for m in models:
            e = ratios[f"{r.key}/{m}"]
            rows.append([r.label, PRETTY.get(m, m), _fmt_x(e["median"]), f"{e['p25']:.3f}-{e['p75']:.3f}"])
    lines.append(markdown_table(["Ratio", "Model", "Median", "p25-p75"], rows, left=2))
    return lines


def render(
    info: dict[str, Any], settings: dict[str, Any], results: Sequence[ModelResult], ratios: dict[str, Any]
) -> str:
    models = [r.model for r in results]
    lines = [
        f"### Step-time ratios (batch {settings['batch']}, synthetic 32x32 inputs, CPU, emulated FP16, "
        f"{settings.get('clock', 'wall')} clock)",
        "",
        header_line(info),
        "",
        f"malloc tuned: {'yes' if settings.get('malloc_tuned') else 'no'}.",
        "",
        "Each ratio is the median over interleaved rounds of the per-round ratio of mean step times, all "
        "configurations in one process (p25-p75 of the per-round ratios beside it; Resolved: no when the "
        "target lies inside that range). A step is forward + loss + scaled backward + scaler.step + update "
        "+ zero_grad; SGD lr 0.01 momentum 0.9.",
        "",
    ]
    present = [r for r in RATIOS if f"{r.key}/{models[0]}" in ratios] if models else []
    lines += ratio_tables(ratios, present, models)
    trends = [
        (key, depth_trend(ratios, key, models))
        for key in ("adaptive_u1_over_dynamic", "adaptive_u100_over_dynamic")
        if models and f"{key}/{models[0]}" in ratios
    ]
    trends = [(k, t) for k, t in trends if t]
    if trends:
        lines.append("")
        for key, text in trends:
            lines.append(f"- {key}: {text}")

    lines += ["", "Median step time in seconds in this run (for scale only; compare ratios, not these):", ""]
    measured = {c["key"] for c in settings.get("configs", [])} or {s.key for s in SPECS}
    cols = [(s.key, "plain") for s in SPECS] + [
        ("fp16_none", "telemetry"),
        ("fp16_adaptive_u1", "recompute"),
        ("fp16_adaptive_u100", "recompute"),
        ("fp16_adaptive_u100", "reuse"),
    ]
    adaptive_plain = {("fp16_adaptive_u1", "plain"), ("fp16_adaptive_u100", "plain")}
    cols = [c for c in cols if c[0] in measured and c not in adaptive_plain]
    rows = []
    for res in results:
        row: list[Any] = [PRETTY.get(res.model, res.model)]
        for config, kind in cols:
            xs = [t for rd in res.rounds for t in rd.get(config, {}).get(kind, [])]
            row.append(f"{median(xs):.3f}" if xs else "n/a")
        rows.append(row)
    lines.append(markdown_table(["Model", *(f"{c} {k}" for c, k in cols)], rows))
    notes = []
    for res in results:
        skipped = {k: v for k, v in res.skipped.items() if v}
        if skipped:
            notes.append(f"{res.model}: timed steps skipped on Inf/NaN gradients: {skipped}")
        if res.cut_by_budget:
            notes.append(f"{res.model}: stopped after {len(res.rounds)} rounds by the time budget")
    if notes:
        lines += [""] + [f"- note: {n}" for n in notes]
    spread = [(res.model, replica_ratios(res)) for res in results]
    spread = [(m, sp) for m, sp in spread if sp]
    if spread:
        lines += [
            "",
            f"A/A between copies ({settings.get('replicas', 1)} per configuration, averaged in every ratio "
            "above): each copy's plain step time over copy 0's, median (p25-p75) over the rounds:",
            "",
        ]
        rows = []
        for m, sp in spread:
            for config, entries in sp.items():
                cells = ", ".join(
                    f"#{e['replica']}: {_fmt_x(e['median'])} ({e['p25']:.3f}-{e['p75']:.3f})" for e in entries
                )
                rows.append([PRETTY.get(m, m), config, cells])
        lines.append(markdown_table(["Model", "Configuration", "Copy / copy 0"], rows, left=3))
    total = sum(r.seconds for r in results)
    lines += ["", f"Total measurement time {total:.0f}s."]
    return "\n".join(lines)


def render_gpt(
    info: dict[str, Any], settings: dict[str, Any], result: ModelResult, ratios: dict[str, Any]
) -> str:
    """The tiny GPT's table: adaptive ``update_every=100`` against dynamic, with and without attention's
    own betas, and the step kinds behind them."""
    lines = [
        f"### Tiny GPT step-time ratios (model=gpt, batch {settings['batch']} x {GPT_BLOCK} tokens, CPU, "
        f"emulated FP16, {settings.get('clock', 'wall')} clock)",
        "",
        header_line(info),
        "",
        "Interleaved rounds and steps as for the ResNets (SGD lr 0.01, momentum 0.9; the language model's "
        "cross-entropy). Amortized: (one recompute step + 99 reuse steps) / (100 dynamic steps).",
        "",
        *ratio_tables(
            ratios, GPT_RATIOS, [GPT_MODEL], "without attention's betas, the noise floor, the step kinds"
        ),
    ]
    skipped = {k: v for k, v in result.skipped.items() if v}
    if skipped:
        lines += ["", f"- note: timed steps skipped on Inf/NaN gradients: {skipped}"]
    if result.cut_by_budget:
        lines += ["", f"- note: stopped after {len(result.rounds)} rounds by the time budget"]
    lines += ["", f"Total measurement time {result.seconds:.0f}s."]
    return "\n".join(lines)


def _diff_table(
    base: dict[str, int], other: dict[str, int], what: str, points: dict[str, int], top: int
) -> str:
    """The ``top`` largest differences ``other - base`` of two op histograms, each also per GEMM point
    (per branch point for a site that runs once per branch point)."""
    diff = Counter(other)
    diff.subtract(base)
    rows = []
    for k, v in sorted(diff.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:top]:
        if not v:
            continue
        point = (per_point(k) if what != "op" else None) or "gemm"
        per = f"{v / points[point]:+.2f} per {'GEMM' if point == 'gemm' else 'branch'} point"
        rows.append([k, base.get(k, 0), other.get(k, 0), f"{v:+d}", per])
    return markdown_table([what, "dynamic", "adaptive", "difference", "per point"], rows)


def _by_function(by_origin: dict[str, int]) -> dict[str, int]:
    """Sum ``module.py:function:line`` counts per ``module.py:function``."""
    out: Counter[str] = Counter()
    for origin, n in by_origin.items():
        out[re.sub(r":\d+ \(in ", " (in ", origin)] += n
    return dict(out)


def render_op_counts(info: dict[str, Any], op: dict[str, Any], top: int = 16) -> str:
    """The op-count table, and where the adaptive steps' extra ops come from (by op and by origin)."""
    lines = [
        "### Dispatched ATen ops per training step (GPU-cost proxy: the GPU code path run on the CPU)",
        "",
        header_line(info),
        "",
        "Real CPU FP16 autocast; adaptive scaler with update_every=100, a recompute step "
        f"forced with recompute_next(); SGD foreach; batch {op['batch']}. Counted with a TorchDispatchMode "
        "(each op that reaches a kernel, once). Count cells: all ops / of which not views (views launch no "
        "kernel); reuse cells add how many betas are not 1. Ratio cells: all ops / not views.",
        "",
    ]
    rows = []
    for name, res in op["models"].items():
        c, n_gemm = res["counts"], res["points"]["gemm"]
        row: list[Any] = [PRETTY.get(name, name), f"{n_gemm} / {res['points']['branch']}"]
        for kind in OP_KINDS:
            cell = f"{c[kind.key]['ops']} / {c[kind.key]['kernels']}"
            if kind.recompute is False:
                cell += f" ({c[kind.key]['betas_not_1']} of {n_gemm} betas not 1)"
            row.append(cell)
            if kind.goal is not None:
                r, kr = res["ratios"][kind.key], res["kernel_ratios"][kind.key]
                verdict = "PASS" if r <= kind.goal else "over goal"
                row.append(f"{_fmt_x(r)} / {_fmt_x(kr)} (<= {kind.goal:g}x: {verdict})")
        rows.append(row)
    headers = ["Model", "GEMM / branch points"]
    for kind in OP_KINDS:
        headers.append(kind.label)
        if kind.goal is not None:
            headers.append("/ dynamic")
    lines.append(markdown_table(headers, rows, left=2))
    check = op["batch_check"]
    same = "the same ops, op for op" if check["equal"] else "DIFFERENT op counts"
    betas = check.get("betas_not_1", {})
    if check["equal"] and any(a != b for a, b in betas.values()):
        same += " (up to one multiply per beta that is not 1, which depends on the data)"
    lines += [
        "",
        f"Batch-size check ({PRETTY.get(check['model'], check['model'])}, batch "
        f"{check['batches'][0]} and {check['batches'][1]}): {same} "
        f"({', '.join(f'{k} {a}/{b}' for k, (a, b) in check['ops'].items())}).",
    ]
    notes = {
        "op": "",
        "site": "; site: the outermost adaloss frame, the scaler method or autograd node that ran",
        "origin": "; origin: the function of the innermost adaloss frame, in its site",
    }
    for name, res in op["models"].items():
        c = res["counts"]
        for kind in OP_KINDS[1:]:
            extra = c[kind.key]["ops"] - c["dynamic"]["ops"]
            for what in ("op", "site", "origin"):
                if kind.recompute is False and what == "origin":
                    continue  # a reuse step's few extra ops are named by the other two
                base, other = c["dynamic"][f"by_{what}"], c[kind.key][f"by_{what}"]
                if what == "origin":  # per function: the JSON keeps the lines
                    base, other = _by_function(base), _by_function(other)
                lines += [
                    "",
                    f"{PRETTY.get(name, name)}, {kind.label}: {extra:+d} ops against dynamic, by {what} "
                    f"(the largest {top}{notes[what]}):",
                    "",
                    _diff_table(base, other, what, res["points"], top),
                ]
    return "\n".join(lines)
