"""The paper's experiment commands in the docs compose, and launch the number of runs the docs give.

``docs/reproducing.md`` has a table with one command per table and figure of the paper and its number of
runs; the README lists the same commands. Each command is taken apart as Hydra's basic sweeper would
(``test_experiment_configs.expand``), its first and last job are composed, and the number of jobs must be
the table's. So a grid that changes, or a command that no longer composes, fails here, whatever the prose
around it says.
"""

from __future__ import annotations

import re
import shlex

import pytest

from conftest import compose_train
from test_docs_blocks import ROOT, blocks
from test_experiment_configs import _check_job, _skip_if_missing, expand

TABLE = ROOT / "docs" / "reproducing.md"
COMMAND = re.compile(r"`(python train\.py -m experiment=[^`]+)`")


def table_rows() -> list[tuple[str, int]]:
    """(command, runs) for each row of the reproducing page's table that holds an experiment command."""
    rows = []
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and (m := COMMAND.search(cells[1])):
            rows.append((m.group(1), int(re.match(r"\d+", cells[2]).group())))
    return rows


def jobs_of(command: str) -> tuple[str, list[list[str]]]:
    """The experiment a ``python train.py -m experiment=...`` command runs, and its jobs."""
    words = shlex.split(command)
    assert words[:3] == ["python", "train.py", "-m"], command
    overrides = words[3:]
    (experiment,) = [o.split("=", 1)[1] for o in overrides if o.startswith("experiment=")]
    rest = tuple(o for o in overrides if not o.startswith("experiment="))
    cfg = compose_train([f"experiment={experiment}"], return_hydra_config=True)
    params = {str(k): str(v) for k, v in cfg.hydra.sweeper.params.items()}
    return experiment, expand(params, rest)


def test_the_table_has_every_experiment() -> None:
    experiments = {jobs_of(c)[0] for c, _ in table_rows()}
    assert experiments == {p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml")}


@pytest.mark.parametrize(("command", "runs"), table_rows(), ids=[c for c, _ in table_rows()])
def test_each_experiment_command_has_the_runs_the_table_gives(command: str, runs: int) -> None:
    experiment, jobs = jobs_of(command)
    _skip_if_missing(experiment)
    assert len(jobs) == runs, f"{command}: {len(jobs)} jobs, the table says {runs}"
    # the first and last job composed as the sweeper would, each with its variant's precision and scaler
    for job in (jobs[0], jobs[-1]):
        _check_job(compose_train([f"experiment={experiment}", *job]), job)


def test_the_readme_runs_the_same_commands() -> None:
    """The README's reproduction block holds the table's commands, no others."""
    table = {c for c, _ in table_rows()}
    readme = {
        m.group(1).strip()
        for b in blocks(ROOT / "README.md")
        for line in b.code.splitlines()
        if (m := re.match(r"(python train\.py -m experiment=[^#]+)", line))
    }
    assert readme and {" ".join(c.split()) for c in readme} == table
