"""src/adaloss/lab/reports/claims.py: the verdict of each of the paper's claims, read from run folders.

Every test writes small run folders (metrics.json, scalars.csv, telemetry.jsonl) whose numbers are chosen so
that the right verdict is known, and checks what ``python -m adaloss.lab.reports.claims`` decides and
writes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from adaloss.lab.reports.claims import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    evaluate,
    interval,
    main,
    t_quantile,
    tasks_of,
)

SEEDS = (0, 1, 2, 3, 4)
#: Per-seed losses with a spread (0.5) far larger than the differences between methods tested below.
BASE = (5.0, 5.5, 6.0, 6.5, 7.0)


def write_run(root: Path, method: str, seed: int, loss: float | None, *, model: str = "ssd512",
              underflow: dict[str, float] | None = None, alphas: dict[str, float] | None = None,
              accuracy: float | None = None) -> Path:  # fmt: skip
    """One finished run folder; ``loss=None`` is a diverged run; ``accuracy``: a classification run."""
    precision, scaler, scale = "fp16", method, None
    if method == "fp32":
        precision, scaler = "fp32", "none"
    elif method.startswith("fixed"):
        scaler, scale = "fixed", float(method[5:])
    folder = root / f"{method}_seed{seed}"
    folder.mkdir(parents=True)
    config = {
        "seed": seed,
        "model": {"name": model},
        "dataset": {"name": "shapes" if model.startswith("ssd") else "digits"},
        "trainer": {"batch_size": 8},
        "precision": {"name": precision},
        "scaler": {"name": scaler, **({"scale": scale} if scale is not None else {})},
    }
    metrics = {"diverged": loss is None and accuracy is None, "config": config}
    if accuracy is not None:
        metrics["accuracy"] = accuracy
    else:
        metrics["map"] = 3.0
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "done").write_text("")  # finished: the trainer's marker
    with open(folder / "scalars.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "loss"])
        for step in range(1, 41):  # the first 20 rows are far off: only the last 20 count
            value = "nan" if loss is None else (100.0 if step <= 20 else loss)
            writer.writerow([step, value])
    lines = []
    for step in (1, 50, 100):
        row = {"step": step, "underflow_rate": underflow or {"conv1": 0.0}}
        row["loss_scale"] = alphas if alphas is not None else (scale or 1.0)
        lines.append(json.dumps(row))
    (folder / "telemetry.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def verdicts(root: Path) -> dict[int, str]:
    return {claim.number: claim.verdict for claim in evaluate(tasks_of([root]))}


def cell(root: Path, method: str, losses, seeds=SEEDS, **kwargs) -> None:
    for seed, loss in zip(seeds, losses, strict=True):
        write_run(root, method, seed, loss, **kwargs)


# ------------------------------------------------------------------------------------------- statistics


def test_t_quantiles_and_intervals_match_the_tables() -> None:
    assert t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-3)
    assert t_quantile(0.975, 4) == pytest.approx(2.7764, abs=1e-3)
    assert t_quantile(0.975, 30) == pytest.approx(2.0423, abs=1e-3)
    mean, low, high = interval([1.0, 2.0, 3.0, 4.0, 5.0])  # s = 1.5811, s / sqrt(5) = 0.7071
    assert (mean, low, high) == pytest.approx((3.0, 3.0 - 1.9632, 3.0 + 1.9632), abs=1e-3)
    assert interval([1.0]) is None


# -------------------------------------------------------------- comparisons: overlap is inconclusive


def test_overlapping_intervals_of_cells_with_other_seeds_are_inconclusive(tmp_path: Path) -> None:
    """Adaptive's mean is better than the best fixed scale's, but the cells ran different seeds and their
    intervals overlap: claim 4 cannot be decided."""
    cell(tmp_path, "fixed128", BASE)
    cell(tmp_path, "adaptive", [v - 0.2 for v in BASE], seeds=(10, 11, 12, 13, 14))
    assert verdicts(tmp_path)[4] == INCONCLUSIVE


def test_disjoint_intervals_of_cells_with_other_seeds_decide(tmp_path: Path) -> None:
    cell(tmp_path, "fixed128", [6.0, 6.01, 6.02, 6.03, 6.04])
    cell(tmp_path, "adaptive", [5.0, 5.01, 5.02, 5.03, 5.04], seeds=(10, 11, 12, 13, 14))
    assert verdicts(tmp_path)[4] == REPRODUCED  # lower loss is better
    worse = tmp_path / "worse"
    cell(worse, "fixed128", [5.0, 5.01, 5.02, 5.03, 5.04])
    cell(worse, "adaptive", [6.0, 6.01, 6.02, 6.03, 6.04], seeds=(10, 11, 12, 13, 14))
    assert verdicts(worse)[4] == NOT_REPRODUCED


def test_same_seeds_are_compared_by_their_paired_differences(tmp_path: Path) -> None:
    """Same seeds: a consistent per-seed gain separates the cells although their own intervals overlap; a gain
    whose sign changes from seed to seed does not."""
    cell(tmp_path, "fixed128", BASE)
    cell(tmp_path, "adaptive", [v - d for v, d in zip(BASE, (0.10, 0.12, 0.09, 0.11, 0.10), strict=True)])
    assert verdicts(tmp_path)[4] == REPRODUCED
    mixed = tmp_path / "mixed"
    cell(mixed, "fixed128", BASE)
    cell(mixed, "adaptive", [v + d for v, d in zip(BASE, (0.10, -0.12, 0.09, -0.11, 0.01), strict=True)])
    assert verdicts(mixed)[4] == INCONCLUSIVE


def test_accuracy_is_higher_is_better(tmp_path: Path) -> None:
    for seed, acc in zip(SEEDS, BASE, strict=True):
        write_run(tmp_path, "fixed128", seed, None, model="resnet20", accuracy=90 + acc)
        write_run(tmp_path, "adaptive", seed, None, model="resnet20", accuracy=90 + acc - 0.5)
    assert verdicts(tmp_path)[4] == NOT_REPRODUCED  # adaptive lower accuracy on every seed


# ------------------------------------------------------------------------------------------- the claims


@pytest.mark.parametrize(("diverged", "expected"), [(5, REPRODUCED), (0, NOT_REPRODUCED), (2, INCONCLUSIVE)])
def test_claim_1_counts_the_diverged_runs_without_scaling(tmp_path: Path, diverged: int, expected) -> None:
    cell(tmp_path, "fp32", BASE)
    cell(tmp_path, "none", [None] * diverged + list(BASE[diverged:]))
    assert verdicts(tmp_path)[1] == expected


def test_claim_2_a_peak_over_the_scales_is_non_monotonic(tmp_path: Path) -> None:
    cell(tmp_path, "none", [v + 1.0 for v in BASE])  # scale 1
    cell(tmp_path, "fixed8", [v + 0.5 for v in BASE])
    cell(tmp_path, "fixed128", BASE)  # the best
    cell(tmp_path, "fixed2048", [v + 0.3 for v in BASE])
    assert verdicts(tmp_path)[2] == REPRODUCED


def test_claim_2_monotonic_scales_are_not_reproduced(tmp_path: Path) -> None:
    cell(tmp_path, "none", [v + 1.0 for v in BASE])
    cell(tmp_path, "fixed8", [v + 0.5 for v in BASE])
    cell(tmp_path, "fixed128", [v + 0.2 for v in BASE])
    cell(tmp_path, "fixed2048", BASE)
    assert verdicts(tmp_path)[2] == NOT_REPRODUCED


def test_claim_2_indistinguishable_scales_are_inconclusive(tmp_path: Path) -> None:
    for method, shift in (("none", 0.01), ("fixed8", -0.01), ("fixed128", 0.0), ("fixed2048", 0.02)):
        cell(tmp_path, method, [v + shift * (-1) ** i for i, v in enumerate(BASE)])
    assert verdicts(tmp_path)[2] == INCONCLUSIVE


def test_claim_3_dynamic_worse_than_the_best_fixed_scale(tmp_path: Path) -> None:
    cell(tmp_path, "fixed8", [v + 0.4 for v in BASE])
    cell(tmp_path, "fixed128", BASE)
    cell(tmp_path, "dynamic", [v + 0.2 for v in BASE])  # better than fixed 8, worse than the best (128)
    assert verdicts(tmp_path)[3] == REPRODUCED


def test_a_fully_diverged_cell_is_worse_than_any_finished_one(tmp_path: Path) -> None:
    cell(tmp_path, "fixed128", BASE)
    cell(tmp_path, "dynamic", [None] * 5)
    assert verdicts(tmp_path)[3] == REPRODUCED


def test_claim_5_compares_the_layers_that_underflow(tmp_path: Path) -> None:
    """Adaptive leaves less in 2 of the 3 layers that underflow (the two heads never do, and do not count):
    reproduced; the reverse profile: not reproduced."""
    heads = {"head": 0.0, "head2": 0.0}
    for seed in SEEDS:
        jitter = 0.001 * seed
        fixed = {"conv1": 0.30 + jitter, "conv2": 0.10 + jitter, "conv3": 0.01, **heads}
        adaptive = {"conv1": 0.05 + jitter, "conv2": 0.02 + jitter, "conv3": 0.01, **heads}
        write_run(tmp_path, "fixed128", seed, BASE[seed], underflow=fixed)
        write_run(tmp_path, "adaptive", seed, BASE[seed], underflow=adaptive, alphas={"conv1": 4.0})
    assert verdicts(tmp_path)[5] == REPRODUCED
    reverse = tmp_path / "reverse"
    for seed in SEEDS:
        write_run(
            reverse, "fixed128", seed, BASE[seed], underflow={"conv1": 0.05 + 0.001 * seed, "head": 0.0}
        )
        write_run(
            reverse, "adaptive", seed, BASE[seed], underflow={"conv1": 0.30 + 0.001 * seed, "head": 0.0}
        )
    assert verdicts(reverse)[5] == NOT_REPRODUCED


@pytest.mark.parametrize(
    ("alphas", "expected"),
    [
        ((2.0, 4.0), REPRODUCED),  # geometric mean ~2.8, 8x below 128 is 16
        ((256.0, 1024.0), NOT_REPRODUCED),
        ((8.0, 32.0), INCONCLUSIVE),  # per-seed geometric means around 16: the interval straddles it
    ],
)
def test_claim_6_the_adaptive_scales_against_128(tmp_path: Path, alphas, expected) -> None:
    low, high = alphas
    for seed in SEEDS:
        factor = 1.0 if expected != INCONCLUSIVE else (0.5 if seed % 2 else 2.0)
        write_run(tmp_path, "adaptive", seed, BASE[seed], alphas={"a": low * factor, "b": high * factor})
    assert verdicts(tmp_path)[6] == expected


# ---------------------------------------------------------------------------------------- the command


def test_the_command_writes_the_claims_table(tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    cell(runs, "fp32", BASE)
    cell(runs, "none", [None] * 5)
    cell(runs, "fixed128", BASE)
    assert main([str(runs), "--out", str(tmp_path / "claims")]) == 0
    text = (tmp_path / "claims" / "claims.md").read_text()
    assert "| 1 | no loss scaling diverges on SSD (Tables 3, 5)" in text
    assert "no scaling: 5 of 5 runs diverged" in text and "**reproduced**" in text
    rows = list(csv.DictReader(open(tmp_path / "claims" / "claims.csv")))
    assert rows[0]["number"] == "1" and rows[0]["verdict"] == REPRODUCED
    assert json.loads((tmp_path / "claims" / "claims.json").read_text())[0]["verdict"] == REPRODUCED


def test_the_command_rejects_a_folder_without_runs(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no such folder") and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "error: no finished run" in capsys.readouterr().err
