"""Shared fixtures: the real config, composed with ``hydra.compose`` and shrunk to run in seconds on a CPU.

As in lightning-hydra-template, tests build configs from the YAML files users run (not hand-written
dicts), so a broken config fails here first. ``make_cfg`` composes the ``TINY`` overrides (a few iterations
on small synthetic images, CPU only, no W&B, no progress bar) plus the test's own; ``make_full_cfg`` keeps
the recipe and only turns W&B and the bar off.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from adaloss.runner.schemas import register

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"
os.environ.setdefault("ADALOSS_ROOT", str(ROOT))
register()  # the config schemas into Hydra's ConfigStore, as train.py does

#: Overrides that make any configuration run in about a second: 2 iterations of batch 4 on 16x16
#: synthetic images, one evaluation, CPU, no W&B, no progress bar.
TINY: tuple[str, ...] = (
    "dataset=synthetic",
    "dataset.image_size=16",
    "dataset.train_size=16",
    "dataset.test_size=8",
    "trainer.batch_size=4",
    "trainer.eval_batch_size=8",
    "trainer.max_steps=2",
    "trainer.progress_bar=false",
    "device=cpu",
    "logger=none",
)


#: The finished run of :func:`finished_cli_run`: ``TINY``'s MLP for 3 iterations, a checkpoint at 2.
FINISHED_RUN: tuple[str, ...] = ("model=mlp", "trainer.max_steps=3", "trainer.checkpoint_every=2")
#: Its whole command line (``TINY`` with its iterations replaced, then ``FINISHED_RUN``).
FINISHED_CLI: tuple[str, ...] = (*(o for o in TINY if not o.startswith("trainer.max_steps=")), *FINISHED_RUN)


@pytest.fixture(scope="session")
def finished_cli_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run made by ``python train.py <FINISHED_CLI>`` once per test process, so it has Hydra's
    ``.hydra/`` and ``train.log`` as a user's run does. Shared: a test copies it before it runs anything
    that could write into it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    proc = subprocess.run(
        [sys.executable, "train.py", *FINISHED_CLI, f"hydra.run.dir={run}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run / "metrics.json").is_file() and (run / ".hydra" / "config.yaml").is_file()
    return run


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported as a module (the scripts are entry points, not a package); its folder
    goes on ``sys.path`` for their shared ``_common`` helpers."""
    scripts = ROOT / "scripts"
    if str(scripts) not in sys.path:
        sys.path.insert(0, str(scripts))
    spec = importlib.util.spec_from_file_location(f"_adaloss_script_{name}", scripts / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def slow_train_command(seconds: float, hold: Path | None = None) -> list[str]:
    """The command that runs ``train.py`` (append its overrides) with every SGD step sleeping ``seconds``
    first, so that a run lasts while a test signals it or starts another; it changes no number. With
    ``hold``, a step also waits while that file exists: the test decides when the iteration may end."""
    code = (
        "import os, runpy, sys, time, torch\n"
        "_step = torch.optim.SGD.step\n"
        "def _slow_step(self, *args, **kwargs):\n"
        f"    time.sleep({seconds!r})\n"
        f"    while {str(hold) if hold else ''!r} and os.path.exists({str(hold) if hold else ''!r}):\n"
        "        time.sleep(0.01)\n"
        "    return _step(self, *args, **kwargs)\n"
        "torch.optim.SGD.step = _slow_step\n"
        "sys.argv[0] = 'train.py'\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    return [sys.executable, "-c", code]


def compose_train(overrides: Sequence[str] = (), return_hydra_config: bool = False) -> DictConfig:
    """``configs/train.yaml`` composed with ``overrides``, exactly as ``python train.py`` would."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(
            config_name="train", overrides=list(overrides), return_hydra_config=return_hydra_config
        )


#: Overrides for a real (not shrunk) run inside a test: CPU, no W&B, no progress bar.
QUIET: tuple[str, ...] = ("device=cpu", "logger=none", "trainer.progress_bar=false")


def _factory(tmp_path: Path, base: Sequence[str]) -> Callable[..., DictConfig]:
    def _make(*overrides: str) -> DictConfig:
        cfg = compose_train([*base, *overrides])
        with open_dict(cfg):
            # stands in for the folder Hydra would create (${hydra:...} does not resolve outside @hydra.main)
            cfg.paths.output_dir = str(tmp_path)
        return cfg

    return _make


@pytest.fixture
def single_thread() -> Iterator[None]:
    """Run torch on one thread for the test. At batch 4 intra-op threads buy nothing, and on a busy
    machine (CI, several engineers' test runs) their spin-waiting made runs 3-4x slower; one thread
    keeps the suite's time predictable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_cfg(tmp_path: Path, single_thread: None) -> Callable[..., DictConfig]:
    """``make_cfg(*overrides)``: a tiny run's config (``TINY`` + overrides), run folder ``tmp_path``."""
    return _factory(tmp_path, TINY)


@pytest.fixture
def make_full_cfg(tmp_path: Path, single_thread: None) -> Callable[..., DictConfig]:
    """``make_full_cfg(*overrides)``: the real recipe on the CPU without W&B, run folder ``tmp_path``."""
    return _factory(tmp_path, QUIET)


@pytest.fixture
def cfg_tiny(make_cfg: Callable[..., DictConfig]) -> DictConfig:
    """The default configuration (ResNet-20, FP16, no scaling) shrunk to a 2-iteration CPU run."""
    return make_cfg()


class _TinyNet(torch.nn.Module):
    """A conv, a batch norm, a residual branch and a linear head: every kind of point the adaptive scaler
    rewrites, small enough to compile in seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        h = h + torch.relu(h)
        return self.head(h.mean((2, 3)))


@pytest.fixture
def tiny_timed_model(monkeypatch: pytest.MonkeyPatch, single_thread: None) -> Callable[[int | None], None]:
    """Make :mod:`adaloss.lab.gpucheck`'s timed model (whatever its name) a :class:`_TinyNet` on 4x4 images,
    so that compiled steps (``time_steps(..., backend="aot_eager")``) compile in seconds on the CPU. Call it
    (``tiny_timed_model()``); ``tiny_timed_model(n)``: each built model's batches grow to 5x5 images after its
    first ``n``, which makes Dynamo compile again when it sees them."""
    import adaloss.lab.gpucheck as gpucheck

    def install(grow_after: int | None = None) -> None:
        def build(name: str, device: str, image_size: int = 32) -> tuple[torch.nn.Module, Callable]:
            made = [0]

            def images(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
                made[0] += 1
                side = 5 if grow_after is not None and made[0] > grow_after else 4
                x = torch.randn(batch, 3, side, side, device=device)
                return x, torch.randint(0, 10, (batch,), device=device)

            return _TinyNet().to(device), images

        monkeypatch.setattr(gpucheck, "_model", build)

    return install


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps process-wide state (mixed precision, gradient accumulation) that a transformers
    Trainer or an Accelerator leaves behind; reset it after each test that loaded it, as transformers' own
    tests do, so the next Accelerator in this worker starts from none whatever the test order."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
