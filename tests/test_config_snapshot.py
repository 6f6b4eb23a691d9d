"""Every documented command keeps resolving to the settings it resolved to before the configs were typed.

``tests/data/config_snapshot.json`` was written from the configs as they were before the schemas and the
``recipe`` group (``python tests/test_config_snapshot.py --write``, run once on that tree): for each command
below (README.md, docs/*.md, configs/**/README.md, the Makefile's and scripts' launches, and every job of
every ``configs/experiment/*`` sweep) the resolved config, flattened to ``key: value``. The first command
(``python train.py``) is stored whole; each other one as its difference from it. The test composes each
command again and compares key by key.

What may differ, and only that: the ``_target_``/``_partial_`` keys every group now names what it builds
with, the schema fields an option's YAML did not spell out (``NEW_KEYS``, each with the value it must
have), the name of the recipe a command selects (``recipe``, a new group), and the ``task`` node (a new
group too: the task each dataset selects, ``DATASET_TASKS``, with the detector's ``init`` and the
language model's ``masking``).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from adaloss.runner.schemas import register

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "data" / "config_snapshot.json"
_ROOT_MARK = "/ROOT"
register()  # the config schemas into Hydra's ConfigStore, as train.py does

#: The commands the documentation, the Makefile and the scripts run (their overrides; ``-m`` sweeps of an
#: experiment are expanded into their jobs below).
DOCUMENTED: tuple[tuple[str, ...], ...] = (
    (),
    ("+variant=fixed128",),
    ("dataset=digits", "trainer.max_steps=300"),
    ("scaler=adaptive", "model=resnet110"),
    ("scaler=adaptive", "model=resnet56"),
    ("scaler=adaptive", "model=resnet56", "dataset=digits"),
    ("scaler=adaptive", "scaler.rule=paper"),
    ("scaler=fixed", "scaler.scale=1024", "precision=fp16", "seed=3"),
    (
        "scaler=fixed",
        "scaler.scale=1024",
        "precision=fp16",
        "seed=3",
        "dataset=digits",
        "trainer.max_steps=20",
    ),
    ("scaler=fixed", "scaler.scale=16"),
    ("scaler=dynamic",),
    ("scaler=none",),
    ("model=gpt", "dataset=pystdlib", "precision=fp32"),
    ("model=gpt", "dataset=pystdlib", "scaler=adaptive"),
    ("model=gpt", "dataset=pystdlib", "scaler=dynamic"),
    ("model=gpt", "dataset=pystdlib", "scaler=fixed", "scaler.scale=1024"),
    (
        "model=gpt",
        "dataset=pystdlib",
        "model.n_layer=6",
        "dataset.block_size=128",
        "optimizer=sgd",
        "schedule=multistep",
    ),
    ("model=gpt2_small", "dataset=tokens", "scaler=adaptive"),
    ("model=resnet50", "dataset=imagenet", "scaler=dynamic"),
    ("model=ssd512", "dataset=shapes"),
    ("model=ssd512", "dataset=shapes", "scaler=adaptive"),
    ("model=ssd300", "dataset=shapes"),
    ("model=ssd512", "dataset=voc", "scaler=adaptive"),
    ("model=ssd512", "dataset=voc", "scaler=fixed", "scaler.scale=8"),
    ("model=vit", "dataset=digits", "scaler=adaptive", "optimizer=adamw", "optimizer.lr=2e-3"),
    ("model=mlp", "dataset=digits"),
    ("model=vgg_nobn", "dataset=digits"),
    ("model=resnet18", "dataset=digits"),
    ("dataset=cifar100",),
    ("dataset=synthetic",),
    ("precision=fp16", "precision.backend=autocast", "device=cpu", "dataset=digits", "scaler=adaptive"),
    ("precision=bf16",),
    ("precision=fp32",),
    ("precision=fp8_e5m2", "scaler=adaptive"),
    ("precision=fp8_e4m3", "scaler=dynamic"),
    ("optimizer._target_=torch.optim.RMSprop", "optimizer.lr=0.01", "dataset=digits"),
    ("schedule._target_=torch.optim.lr_scheduler.CosineAnnealingLR", "dataset=digits"),
    ("schedule=cosine",),
    ("logger=none",),
    ("logger.wandb.mode=online",),
    ("cluster=slurm",),
    ("cluster=local",),
    # scripts/demo.py
    *(
        ("dataset=digits", "model=resnet20", "device=cpu", "logger=none", *variant)
        for variant in (
            ("precision=fp32", "scaler=none"),
            ("precision=fp16", "scaler=none"),
            ("precision=fp16", "scaler=fixed", "scaler.scale=128"),
            ("precision=fp16", "scaler=dynamic"),
            ("precision=fp16", "scaler=adaptive"),
        )
    ),
    *((f"+variant={v}",) for v in ("fp32", "none", "fixed8", "fixed1024", "dynamic", "adaptive")),
)

#: scripts/reproduce_mini.py's extra overrides per experiment (on top of each experiment's own sweep).
_DIGITS = ("dataset=digits", "trainer.max_steps=100", "trainer.eval_every=100")
_SHAPES = (
    "dataset=shapes",
    "trainer.max_steps=300",
    "trainer.eval_every=300",
    "dataset.train_size=512",
    "dataset.test_size=64",
)
MINI: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("table1_cifar", (*_DIGITS, "model=resnet20")),
    ("table2_imagenet", (*_DIGITS, "model=resnet18")),
    ("table3_ssd", _SHAPES),
    ("fig4_scales", (*_DIGITS, "model=resnet18", "variant=adaptive")),
)
EXPERIMENTS = (
    "table1_cifar",
    "table2_imagenet",
    "table3_ssd",
    "table4_fixed_scales",
    "table5_ssd_fixed",
    "fig1_ssd_stats",
    "fig4_scales",
)
#: Sweep parameters whose values only repeat a run under another seed: not expanded.
_NOT_EXPANDED = ("seed",)

#: Keys the typed configs add to a resolved config, with the value they must have. ``None`` as the value of
#: a key ending in ``.*`` allows anything under that prefix (a group's own ``_target_``).
NEW_KEYS: dict[str, Any] = {
    "dynamic_recipe.rule": "torch",  # the dynamic scaler's rule and interval, default in one place
    "dynamic_recipe.growth_interval": 2000,
    "optimizer.decay_bias": True,  # the optimizers' parameter-group settings (voc's recipe sets them)
    "optimizer.bias_lr_factor": 1.0,
    "schedule.warmup_unless_batch_size": None,  # multistep's (voc's recipe sets them)
    "schedule.batch_size": None,
    "scaler.u_min": None,  # the adaptive scaler's optional format bounds (null: the format's)
    "scaler.u_max": None,
    "scaler.root": "fixed",  # how alpha_{N+1} is chosen (the root-scale option, added beside the schemas)
    "distributed.strategy": "ddp",  # under torchrun: replicate (DDP) or shard (FSDP2) the model
    "dataset.mean": None,  # digits and synthetic are not normalized
    "dataset.std": None,
    "dataset.translate": 2,  # digits' augmentation shift, read by the builder with this default
    "dataset.channels": 3,  # synthetic's, read by the builder with these defaults
    "dataset.noise": 1.0,
    "dataset.stdlib": None,  # pystdlib: another folder of sources (tests); null: this Python's
    "model.vocab_size": None,  # a GPT's: null follows the dataset
    "model.block_size": None,
    "trainer.compile": False,  # torch.compile of the training step (issue 34), off by default
    "trainer.compile_mode": "default",
    # the FP4 precisions' options (issue 37), null (the recipe's default) for every other precision
    **{
        f"precision.{key}": None
        for key in (
            "stochastic_rounding",
            "hadamard",
            "rounding",
            "operands",
            "keep",
            "keep_first",
            "keep_last",
            "seed",
        )
    },  # fmt: skip
}

#: The task each bundled dataset selects (``override /task`` in configs/dataset/); the others classification.
DATASET_TASKS = {
    "shapes": "detection",
    "voc": "detection",
    "pystdlib": "language_model",
    "tokens": "language_model",
}


def _task_keys(actual: dict[str, Any]) -> dict[str, Any]:
    """The ``task`` node a command must have: its dataset's task and, for detection, the model's init, for
    language models the model's masking (a masked LM's; 0: next-token prediction)."""
    name = DATASET_TASKS.get(actual["dataset.name"], "classification")
    return {
        "task.name": name,
        **({"task.init": actual.get("model.init", "default")} if name == "detection" else {}),
        **({"task.masking": actual.get("model.masking", 0.0)} if name == "language_model" else {}),
    }


#: Keys a command deliberately lost: the other schedule's settings a recipe set, which the schedule never took
#: (they were left out with a warning when it was built; the typed schedule has no such key).
GONE: dict[str, set[str]] = {
    "schedule=cosine": {"schedule.milestones", "schedule.gamma"},
    "model=gpt dataset=pystdlib model.n_layer=6 dataset.block_size=128 optimizer=sgd schedule=multistep": {
        "schedule.final_factor"
    },
}


def _compose(overrides: Sequence[str], hydra_cfg: bool = False) -> Any:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=hydra_cfg)


def _flat(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        if not node and prefix:
            yield prefix, {}
        for key, value in node.items():
            yield from _flat(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, list) and any(isinstance(v, dict | list) for v in node):
        for index, value in enumerate(node):
            yield from _flat(value, f"{prefix}[{index}]")
    else:
        yield prefix, node


def resolved(overrides: Sequence[str]) -> dict[str, Any]:
    """The composed config of ``overrides``, resolved and flattened (``paths.output_dir`` left out: it
    exists only inside a launched job; the repository's path written as /ROOT)."""
    old = os.environ.get("ADALOSS_ROOT")
    os.environ["ADALOSS_ROOT"] = _ROOT_MARK
    try:
        cfg = _compose(overrides)
        with open_dict(cfg):
            cfg.paths.output_dir = "<only in a launched job>"
        container = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(container, dict)
        del container["paths"]["output_dir"]
    finally:
        if old is None:
            os.environ.pop("ADALOSS_ROOT", None)
        else:
            os.environ["ADALOSS_ROOT"] = old
    return dict(_flat(container))


def sweep_jobs(experiment: str, extra: Sequence[str] = ()) -> list[tuple[str, ...]]:
    """The overrides of every job ``python train.py -m experiment=<name> <extra>`` launches (sweeps of
    ``extra`` and of the experiment's own ``hydra.sweeper.params``, the command line winning)."""
    base = [f"experiment={experiment}"]
    cfg = _compose(base, hydra_cfg=True)
    params = {str(k): str(v).split(",") for k, v in (cfg.hydra.sweeper.params or {}).items()}
    fixed = []
    for override in extra:
        key, _, value = override.partition("=")
        if key in params or "," in value:
            params[key] = value.split(",")
        else:
            fixed.append(override)
    for key in _NOT_EXPANDED:
        params.pop(key, None)
    keys = sorted(params)
    return [
        tuple([*base, *fixed, *(f"{k}={v}" for k, v in zip(keys, combo, strict=True))])
        for combo in itertools.product(*(params[k] for k in keys))
    ]


def all_commands() -> list[tuple[str, ...]]:
    commands = list(DOCUMENTED)
    for experiment in EXPERIMENTS:
        commands.append((f"experiment={experiment}",))
        commands += sweep_jobs(experiment)
    for experiment, extra in MINI:
        commands += sweep_jobs(experiment, extra)
    seen: dict[tuple[str, ...], None] = dict.fromkeys(commands)
    return list(seen)


def _key(overrides: Sequence[str]) -> str:
    return " ".join(overrides) or "<no overrides>"


def write_snapshot() -> None:
    commands = all_commands()
    base = resolved(commands[0])
    out: dict[str, Any] = {"base": base, "commands": {}}
    for overrides in commands[1:]:
        flat = resolved(overrides)
        diff = {k: v for k, v in flat.items() if base.get(k, "<absent>") != v}
        diff.update({k: "<absent>" for k in base if k not in flat})
        out["commands"][_key(overrides)] = diff
    SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
    SNAPSHOT.write_text(json.dumps(out, indent=1, sort_keys=True, default=str) + "\n")


def _expected(snapshot: dict[str, Any], key: str) -> dict[str, Any]:
    expected = dict(snapshot["base"])
    for k, v in snapshot["commands"].get(key, {}).items():
        if v == "<absent>":
            expected.pop(k, None)
        else:
            expected[k] = v
    return expected


def _ignored(key: str) -> bool:
    return key.endswith(("._target_", "._partial_")) or key == "recipe"


def _differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    problems = []
    for key in sorted(set(expected) | set(actual)):
        if _ignored(key):
            continue
        if key not in actual:
            problems.append(f"{key}: gone (was {expected[key]!r})")
        elif key not in expected:
            if key not in NEW_KEYS or NEW_KEYS[key] != actual[key]:
                problems.append(f"{key}: new ({actual[key]!r})")
        elif expected[key] != actual[key]:  # 128 and 128.0 are the same setting (a typed field is a float)
            problems.append(f"{key}: {expected[key]!r} -> {actual[key]!r}")
    return problems


def test_snapshot_covers_every_command() -> None:
    snapshot = json.loads(SNAPSHOT.read_text())
    keys = {_key(c) for c in all_commands()[1:]}
    assert keys == set(snapshot["commands"]), sorted(keys ^ set(snapshot["commands"]))


@pytest.mark.parametrize("overrides", all_commands(), ids=_key)
def test_documented_command_resolves_as_before(overrides: tuple[str, ...]) -> None:
    snapshot = json.loads(SNAPSHOT.read_text())
    expected = _expected(snapshot, _key(overrides))
    for key in GONE.get(_key(overrides), ()):
        expected.pop(key)
    actual = resolved(overrides)
    expected.update(_task_keys(actual))
    problems = _differences(expected, actual)
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_snapshot()
        print(f"wrote {SNAPSHOT}")
