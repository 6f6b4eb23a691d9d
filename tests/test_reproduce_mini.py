"""scripts/reproduce_mini.py: every experiment has a reduced launch, each launch composes, the claims stage is
calibrated consistently, and (slow) the whole pipeline runs end to end at 2 iterations per run and yields all
tables, figures and the claims table."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import open_dict

from conftest import CONFIG_DIR, ROOT, compose_train

sys.path.insert(0, str(ROOT / "scripts"))
import reproduce_mini  # noqa: E402
from adaloss.runner.engine.config import validate_config  # noqa: E402


def test_every_experiment_has_a_mini_launch() -> None:
    experiments = {p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml")}
    launched = {name for name, _ in (*reproduce_mini.LAUNCHES, *reproduce_mini.CLAIM_LAUNCHES)}
    assert launched == experiments


@pytest.mark.parametrize(("experiment", "overrides"), reproduce_mini.LAUNCHES + reproduce_mini.CLAIM_LAUNCHES)
def test_each_launch_composes_on_bundled_data(experiment: str, overrides: tuple[str, ...]) -> None:
    # a comma list is a sweep; composing one of its values is what each job does
    single = [o.split(",")[0] for o in overrides]
    cfg = compose_train([f"experiment={experiment}", *single, *reproduce_mini.COMMON[:-1]])
    with open_dict(cfg):
        cfg.paths.output_dir = "/tmp/unused"
    validate_config(cfg)
    assert cfg.dataset.name in ("digits", "shapes")  # nothing to download
    assert cfg.trainer.max_steps <= 200


@pytest.mark.slow
def test_smoke_reproduction_builds_every_table_and_figure(tmp_path: Path) -> None:
    out = tmp_path / "mini"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "reproduce_mini.py"), "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    tables = (out / "tables" / "tables.md").read_text()
    for title in ("Table 1", "Table 2", "Table 3", "Table 4", "Table 5"):
        assert title in tables
    assert "digits" in tables and "shapes" in tables
    for figure in ("fig1a", "fig1b", "fig4a", "fig4b"):
        png = out / "figures" / f"{figure}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    claims = (out / "claims" / "claims.md").read_text()  # one seed: every comparison is inconclusive
    assert "| 1 | no loss scaling diverges on SSD" in claims and "SSD512 on shapes, batch 8" in claims


@pytest.mark.parametrize("variant", ["fp32", "adaptive"])
@pytest.mark.parametrize("launch", range(len(reproduce_mini.CLAIM_LAUNCHES)))
def test_the_claims_calibration_leaves_fp32_training_unchanged(variant: str, launch: int) -> None:
    """claims_ssd shrinks the gradients by trainer.loss_multiplier; the learning rate, weight decay and
    gradient-clipping norm are rescaled by the same power of two, so FP32 SGD takes the shapes recipe's
    steps: lr x m, weight decay / m and clip / m equal the recipe's values exactly."""
    recipe = compose_train(["dataset=shapes", "model=ssd512"])
    experiment, overrides = reproduce_mini.CLAIM_LAUNCHES[launch]
    cfg = compose_train([f"experiment={experiment}", *overrides, f"variant={variant}"])
    m = cfg.trainer.loss_multiplier
    assert m < 1 and math.log2(m).is_integer()  # a power of two: the rescaling is exact
    assert cfg.optimizer.lr * m == recipe.optimizer.lr
    assert cfg.optimizer.weight_decay / m == recipe.optimizer.weight_decay
    assert cfg.trainer.grad_clip / m == recipe.trainer.grad_clip
    assert (cfg.dataset.name, cfg.model.name, cfg.trainer.batch_size) == ("shapes", "ssd512", 8)


def test_bad_claims_seeds_are_one_error_line(capsys) -> None:
    assert reproduce_mini.main(["--claims-only", "--claims-seeds", "0,x", "--out", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --claims-seeds must be integers") and "Traceback" not in err


def test_the_committed_claims_table_has_five_seeds_per_cell() -> None:
    """results/mini/claims/ (rendered into docs/reproducing.md) comes from the full claims stage: the six
    claims, each with a verdict, and every cell of the cells table a mean over 5 runs."""
    folder = ROOT / "results" / "mini" / "claims"
    rows = list(csv.DictReader(open(folder / "claims.csv", encoding="utf-8")))
    assert sorted({int(r["number"]) for r in rows}) == [1, 2, 3, 4, 5, 6]
    assert all(r["verdict"] in ("reproduced", "not reproduced", "inconclusive") for r in rows)
    cells = [r for r in (folder / "claims.md").read_text().split("## The cells")[1].splitlines()
             if r.startswith("| SSD512")]  # fmt: skip
    assert len(cells) == 7 * len(reproduce_mini.CLAIM_LAUNCHES), cells
    assert all("(n=5)" in r.split("|")[4] for r in cells), cells


def test_the_committed_mini_tables_average_three_seeds() -> None:
    """The committed tables (results/mini/tables/, rendered into docs/reproducing.md by
    scripts/render_docs.py) are a full --seeds 0,1,2 reproduction: every filled cell is a mean over 3 runs."""
    tables = sorted((ROOT / "results" / "mini" / "tables").glob("table[1-5]_*.md"))
    assert len(tables) == 5
    for table in tables:
        rows = [r for r in table.read_text().splitlines() if r.startswith(("| digits", "| shapes"))]
        assert rows, table.name
        for row in rows:
            cells = [c for c in row.split("|")[3:] if "(n=" in c]
            assert cells and all("(n=3" in c for c in cells), row  # every cell averages 3 seeds
