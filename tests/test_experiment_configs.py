"""The paper's experiment configs (``configs/experiment/table*.yaml``) and the ``variant`` group they sweep.

``python train.py -m experiment=<name> --cfg job`` does not expand a sweep, so the grid is expanded here the
way Hydra's basic sweeper does it (``BasicSweeper.split_arguments``: the cartesian product of
``hydra.sweeper.params``, a command-line value replacing that key's values), and jobs are composed from it.
The SSD experiments need ``model=ssd512`` and ``dataset=voc``; until those configs exist, only their grid
(read from the YAML file) is checked and their composition is skipped.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict

from adaloss.numerics import get_format
from adaloss.runner.engine.config import resolved_config, validate_config
from adaloss.runner.utils.targets import build_scaler
from conftest import CONFIG_DIR, compose_train

EXPERIMENT_DIR = CONFIG_DIR / "experiment"
FIXED_SCALES = (1, 8, 16, 128, 1024, 2048, 4096, 8192, 16384)

#: variant -> (precision, scaler, fixed scale)
VARIANTS: dict[str, tuple[str, str, int | None]] = {
    "fp32": ("fp32", "none", None),
    "none": ("fp16", "none", None),
    "dynamic": ("fp16", "dynamic", None),
    "adaptive": ("fp16", "adaptive", None),
    **{f"fixed{s}": ("fp16", "fixed", s) for s in FIXED_SCALES},
}

_T1 = "fp32,none,fixed16,fixed128,fixed1024,fixed4096,fixed8192,fixed16384,adaptive"
#: experiment -> (its grid, the number of runs). The grids are the paper's (section 4, appendices A and B).
EXPERIMENTS: dict[str, tuple[dict[str, str], int]] = {
    "table1_cifar": (
        {
            "dataset": "cifar10,cifar100",
            "model": "resnet20,resnet56,resnet110",
            "variant": _T1,
            "seed": "0,1,2,3",
        },
        2 * 3 * 9 * 4,
    ),
    "table2_imagenet": (
        {"model": "resnet18,resnet50", "variant": "fp32,none,fixed128,dynamic,adaptive"},
        2 * 5,
    ),
    "table3_ssd": (
        {
            "trainer.batch_size": "8,32",
            "variant": "fp32,none,fixed8,fixed128,fixed1024,fixed2048,dynamic,adaptive",
        },
        2 * 8,
    ),
    "table4_fixed_scales": (
        {
            "model": "resnet20,resnet56",
            "variant": "fixed1,fixed16,fixed128,fixed1024,fixed4096,fixed8192,fixed16384",
            "seed": "0,1,2,3",
        },
        2 * 7 * 4,
    ),
    "table5_ssd_fixed": (
        {"variant": "fixed1,fixed8,fixed16,fixed128,fixed1024,fixed2048"},
        6,
    ),
}
#: The groups each experiment composes that are not all in configs/ yet (another issue adds the detector).
NEEDS = {
    "table3_ssd": ("model/ssd512.yaml", "dataset/voc.yaml"),
    "table5_ssd_fixed": ("model/ssd512.yaml", "dataset/voc.yaml"),
}


def expand(params: dict[str, str], command_line: tuple[str, ...] = ()) -> list[list[str]]:
    """The jobs Hydra's basic sweeper launches for ``params`` plus command-line overrides."""
    overrides = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    overrides += OverridesParser.create().parse_overrides(list(command_line))
    (jobs,) = BasicSweeper.split_arguments(overrides, None)
    return jobs


def _skip_if_missing(name: str) -> None:
    missing = [p for p in NEEDS.get(name, ()) if not (CONFIG_DIR / p).exists()]
    if missing:
        pytest.skip(f"{name} composes configs/{' and configs/'.join(missing)}, which do not exist yet")


def _check_job(cfg, overrides: list[str]) -> None:
    """A composed job has the precision/scaler of its variant and the values of its other overrides."""
    values = dict(o.split("=", 1) for o in overrides)
    precision, scaler, scale = VARIANTS[values.pop("variant")]
    assert cfg.precision.name == precision and cfg.scaler.name == scaler
    assert cfg.scaler.get("scale") == scale
    for key, value in values.items():
        node = OmegaConf.select(cfg, key)
        assert str(node.name if key in ("model", "dataset") else node) == value, key
    with open_dict(cfg):
        cfg.paths.output_dir = "/tmp/run"
    validate_config(cfg)
    resolved = resolved_config(cfg)
    assert f"_{precision}_{scaler}{scale or ''}_seed{cfg.seed}" in resolved["name"]
    if cfg.model.name.startswith("ssd"):  # batch 8 and 32 runs must not share a name (folders, W&B)
        assert f"_batch{cfg.trainer.batch_size}_" in resolved["name"]
    build_scaler(cfg.scaler, get_format("fp16"))  # the scaler accepts every field the variant gives it


def header_commands(name: str) -> list[list[str]]:
    """The ``python train.py`` commands in the comment at the top of ``configs/experiment/<name>.yaml``,
    as argument lists (what a reader copies from the file)."""
    commands = []
    for line in (EXPERIMENT_DIR / f"{name}.yaml").read_text().split("\n"):
        if not line.startswith("#"):
            break
        words = line.lstrip("# ").split(" #")[0].split()  # without a trailing comment
        if words[:2] == ["python", "train.py"]:
            commands.append(words[2:])
    return commands


def assert_header_commands_compose(name: str) -> None:
    """Each command the config's header shows runs this experiment and composes: at least one job, each job
    (first and last) a config the trainer accepts. Checked by composing, not by the comment's words."""
    commands = header_commands(name)
    assert commands, f"{name}.yaml's header shows no python train.py command"
    for args in commands:
        overrides = [a for a in args if a != "-m"]
        assert f"experiment={name}" in overrides, (name, args)
        if _missing(name):
            continue
        cfg = compose_train([f"experiment={name}"], return_hydra_config=True)
        params = {str(k): str(v) for k, v in cfg.hydra.sweeper.params.items()}
        rest = tuple(o for o in overrides if o != f"experiment={name}")
        jobs = expand(params, rest) if "-m" in args else [list(rest)]
        assert jobs, (name, args)
        for job in (jobs[0], jobs[-1]):
            validate_config(_with_output_dir(compose_train([f"experiment={name}", *job])))


def _missing(name: str) -> list[str]:
    return [p for p in NEEDS.get(name, ()) if not (CONFIG_DIR / p).exists()]


def _with_output_dir(cfg):
    with open_dict(cfg):
        cfg.paths.output_dir = "/tmp/run"
    return cfg


def test_every_table_of_the_paper_has_an_experiment() -> None:
    assert sorted(p.stem for p in EXPERIMENT_DIR.glob("table*.yaml")) == sorted(EXPERIMENTS)


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_the_grid_is_the_papers_and_the_header_says_so(name: str) -> None:
    """Read from the YAML file itself, so this runs even before every group it uses exists."""
    grid, runs = EXPERIMENTS[name]
    raw = OmegaConf.load(EXPERIMENT_DIR / f"{name}.yaml")
    assert dict(raw.hydra.sweeper.params) == grid
    assert len(expand(grid)) == runs
    header = (EXPERIMENT_DIR / f"{name}.yaml").read_text().split("\n")
    assert header[0] == "# @package _global_"  # Hydra reads this line: the config applies at the top level
    assert_header_commands_compose(name)
    for variant in grid["variant"].split(","):
        assert (CONFIG_DIR / "variant" / f"{variant}.yaml").exists(), variant


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_the_experiment_composes_and_its_jobs_are_what_the_grid_says(name: str) -> None:
    _skip_if_missing(name)
    grid, runs = EXPERIMENTS[name]
    cfg = compose_train([f"experiment={name}"], return_hydra_config=True)
    params = {str(k): str(v) for k, v in cfg.hydra.sweeper.params.items()}
    jobs = expand(params)
    assert len(jobs) == runs and len({tuple(j) for j in jobs}) == runs
    # every variant of the grid appears equally often
    counts = Counter(o for job in jobs for o in job if o.startswith("variant="))
    assert len(set(counts.values())) == 1 and len(counts) == len(grid["variant"].split(","))
    # compose the first and the last job as the sweeper would (one per variant is covered below)
    for job in (jobs[0], jobs[-1]):
        _check_job(compose_train([f"experiment={name}", *job]), job)


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_every_variant_of_the_experiment_composes(name: str) -> None:
    _skip_if_missing(name)
    grid, _ = EXPERIMENTS[name]
    first = {k: v.split(",")[0] for k, v in grid.items() if k != "variant"}
    for variant in grid["variant"].split(","):
        job = [*(f"{k}={v}" for k, v in first.items()), f"variant={variant}"]
        _check_job(compose_train([f"experiment={name}", *job]), job)


def test_the_command_line_narrows_the_grid() -> None:
    grid, _ = EXPERIMENTS["table1_cifar"]
    jobs = expand(grid, ("seed=0", "dataset=cifar10"))
    assert len(jobs) == 3 * 9
    assert all("seed=0" in job and "dataset=cifar10" in job for job in jobs)
    grid4, _ = EXPERIMENTS["table4_fixed_scales"]
    assert len(expand(grid4, ("variant=fixed1",))) == 2 * 4  # what is new after table1_cifar


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_variant_sets_precision_and_scaler_together(variant: str) -> None:
    precision, scaler, scale = VARIANTS[variant]
    cfg = compose_train([f"+variant={variant}"])
    assert cfg.precision.name == precision and cfg.scaler.name == scaler
    assert cfg.scaler.get("scale") == scale
    # a later command-line value still wins
    if scaler == "fixed":
        assert compose_train([f"+variant={variant}", "scaler.scale=32"]).name.endswith("_fixed32_seed0")


def test_the_variant_group_is_complete() -> None:
    files = sorted(p.stem for p in (CONFIG_DIR / "variant").glob("*.yaml"))
    assert files == sorted(VARIANTS)


# ---- the figure experiments (configs/experiment/fig*.yaml) -------------------------------------------------

#: experiment -> (its grid, the number of runs of its main command); fig4_scales' panel (a) is another
#: command, FIG4A.
FIGURE_EXPERIMENTS: dict[str, tuple[dict[str, str], int]] = {
    "fig1_ssd_stats": ({"variant": "fp32"}, 1),
    "fig4_scales": ({"variant": "fixed128,adaptive"}, 2),
}
FIG4A = ("model=resnet18", "dataset=imagenet", "variant=adaptive")


def test_every_figure_experiment_is_tested() -> None:
    assert sorted(p.stem for p in EXPERIMENT_DIR.glob("fig*.yaml")) == sorted(FIGURE_EXPERIMENTS)


@pytest.mark.parametrize("name", sorted(FIGURE_EXPERIMENTS))
def test_a_figure_experiments_grid_and_header(name: str) -> None:
    grid, runs = FIGURE_EXPERIMENTS[name]
    path = EXPERIMENT_DIR / f"{name}.yaml"
    assert dict(OmegaConf.load(path).hydra.sweeper.params) == grid
    assert len(expand(grid)) == runs
    lines = path.read_text().split("\n")
    assert lines[0] == "# @package _global_"
    assert_header_commands_compose(name)


def test_fig1_is_fp32_ssd512_on_voc_with_the_expected_loss_scale() -> None:
    cfg = compose_train(["experiment=fig1_ssd_stats"], return_hydra_config=True)
    jobs = expand({str(k): str(v) for k, v in cfg.hydra.sweeper.params.items()})
    assert jobs == [["variant=fp32"]]
    job = compose_train(["experiment=fig1_ssd_stats", *jobs[0]])
    _check_job(job, jobs[0])
    assert (job.model.name, job.dataset.name) == ("ssd512", "voc")
    assert (job.precision.name, job.scaler.name) == ("fp32", "none")
    assert job.telemetry.expected_loss_scale is True
    assert job.telemetry.format == "fp16" and job.telemetry.quantile == 0.01  # the paper's 2^-24 and 1%
    assert job.telemetry.every == 1000 and job.trainer.steps // job.telemetry.every == 120
    assert job.trainer.batch_size == 32  # the VOC recipe


def test_fig4b_sweeps_fixed_128_and_adaptive_on_ssd512_voc() -> None:
    cfg = compose_train(["experiment=fig4_scales"], return_hydra_config=True)
    jobs = expand({str(k): str(v) for k, v in cfg.hydra.sweeper.params.items()})
    assert jobs == [["variant=fixed128"], ["variant=adaptive"]]
    names = set()
    for job in jobs:
        composed = compose_train(["experiment=fig4_scales", *job])
        _check_job(composed, job)
        assert (composed.model.name, composed.dataset.name) == ("ssd512", "voc")
        assert composed.telemetry.every == 1000 and composed.trainer.steps == 120000
        with open_dict(composed):
            composed.paths.output_dir = "/tmp/run"
        names.add(resolved_config(composed)["name"])
    assert names == {"ssd512_voc_batch32_fp16_fixed128_seed0", "ssd512_voc_batch32_fp16_adaptive_seed0"}


def test_fig4a_is_the_command_line_narrowing_to_adaptive_resnet18_on_imagenet() -> None:
    cfg = compose_train(["experiment=fig4_scales", *FIG4A], return_hydra_config=True)
    jobs = expand({str(k): str(v) for k, v in cfg.hydra.sweeper.params.items()}, FIG4A)
    assert len(jobs) == 1
    job = compose_train(["experiment=fig4_scales", *jobs[0]])
    _check_job(job, jobs[0])
    assert (job.model.name, job.dataset.name) == ("resnet18", "imagenet")
    assert (job.precision.name, job.scaler.name, job.scaler.t_uf) == ("fp16", "adaptive", 1.0e-3)
    # the recipe is ImageNet's (the VOC one does not leak through the experiment)
    assert (job.trainer.batch_size, job.trainer.epochs, job.optimizer.lr) == (256, 90, 0.1)
    assert job.telemetry.every == 1000 and job.telemetry.expected_loss_scale is False
    header = (EXPERIMENT_DIR / "fig4_scales.yaml").read_text()
    assert f"python train.py -m experiment=fig4_scales {' '.join(FIG4A)}" in header
