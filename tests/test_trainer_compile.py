"""``trainer.compile=true``: the runner trains through ``torch.compile``
(:mod:`adaloss.runner.engine.compiling`).

A compiled FP32 run on digits trains, logs the first compiled step's time once and records the compile
settings in ``metrics.json``; its checkpoints hold the keys of an uncompiled run, so a compiled run resumes
an uncompiled run's checkpoint and the other way round; the CPU emulation of FP16 runs eagerly, said once,
because Dynamo cannot compile it (a test watches that it still cannot); a bad ``trainer.compile_mode`` is
one ``error:`` line. The runs are an MLP on digits, compiled with the ``aot_eager`` backend (Dynamo and
AOTAutograd without code generation: the same graphs, in seconds); the run with Inductor, the backend users
get, is marked slow (22 s with a cold Inductor cache on 2 cores, 2-6 s with a warm one; ResNet-20 takes
Inductor about 40 s).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch._dynamo as dynamo
from omegaconf import DictConfig, open_dict

from adaloss.errors import ConfigError
from adaloss.runner.engine import train
from adaloss.runner.engine.checkpoint import load_checkpoint
from adaloss.runner.engine.compiling import EMULATION_REASON
from conftest import QUIET, compose_train

#: An MLP on digits in FP32 with the dynamic scaler: telemetry at iterations 0, 3 and 5 (eager), the others
#: compiled; a checkpoint every 2 iterations.
DIGITS = (
    "dataset=digits",
    "precision=fp32",
    "scaler=dynamic",
    "trainer.max_steps=6",
    "trainer.log_every=2",
    "trainer.checkpoint_every=2",
    "trainer.save_final=true",
    "telemetry.every=3",
)
MLP = ("model=mlp", "model.hidden=[32]")
COMPILE_LINE = "compiled the training step in"


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch and counts its own graphs (Dynamo's caches and counters are per
    process)."""
    dynamo.reset()
    dynamo.utils.counters.clear()
    yield
    dynamo.reset()


@pytest.fixture
def aot_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile`` with the ``aot_eager`` backend (the run's mode dropped: it is Inductor's)."""
    compile_ = torch.compile

    def aot_eager_compile(model: torch.nn.Module, mode: str | None = None, **kwargs: object):
        return compile_(model, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch, "compile", aot_eager_compile)


@pytest.fixture
def digits_cfg(tmp_path: Path, single_thread: None) -> Callable[..., DictConfig]:
    """``digits_cfg(folder, *overrides, model=MLP)``: :data:`DIGITS` on the CPU, run folder
    ``tmp_path / folder``."""

    def make(folder: str, *overrides: str, model: tuple[str, ...] = MLP) -> DictConfig:
        cfg = compose_train([*QUIET, *DIGITS, *model, *overrides])
        with open_dict(cfg):
            cfg.paths.output_dir = str(tmp_path / folder)
        return cfg

    return make


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.mark.parametrize(
    "backend",
    ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)],  # Inductor: 8-22 s on 2 cores
)
def test_a_compiled_run_trains_and_logs_its_compile_time_once(
    digits_cfg: Callable[..., DictConfig],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
    backend: str,
) -> None:
    if backend == "aot_eager":
        request.getfixturevalue("aot_eager")
    with caplog.at_level(logging.INFO, logger="adaloss"):
        metrics = train(digits_cfg("run", "trainer.compile=true"))
    assert math.isfinite(metrics["train_loss"]) and metrics["steps"] == 6
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert written["config"]["trainer"]["compile"] is True
    assert written["config"]["trainer"]["compile_mode"] == "default"
    record = written["compile"]
    assert record["mode"] == "default" and record["eager"] is None and record["first_step_s"] > 0
    assert _messages(caplog, COMPILE_LINE) == [
        f"{COMPILE_LINE} {record['first_step_s']:.1f} s (mode default)"
    ]
    assert dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert not dynamo.utils.counters["graph_break"]


def test_an_uncompiled_run_records_no_compile_entry(make_cfg: Callable[..., DictConfig]) -> None:
    metrics = train(make_cfg("model=mlp", "precision=fp32"))
    assert "compile" not in metrics and metrics["config"]["trainer"]["compile"] is False
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 0


@pytest.mark.parametrize(("first", "then"), [(True, False), (False, True)], ids=["compiled", "uncompiled"])
def test_a_checkpoint_resumes_across_compile_settings(
    digits_cfg: Callable[..., DictConfig], tmp_path: Path, aot_eager: None, first: bool, then: bool
) -> None:
    """A run with ``trainer.compile=first`` checkpoints at iteration 4; a run with ``then`` resumes from it
    and ends where the uninterrupted run ended (to FP32 rounding: the backends may order sums apart)."""
    train(digits_cfg("first", f"trainer.compile={first}"))
    train(digits_cfg("plain", "trainer.compile=false"))
    checkpoint = tmp_path / "first" / "checkpoints" / "step_4.pt"
    saved = load_checkpoint(checkpoint)["model"]
    plain = load_checkpoint(tmp_path / "plain" / "checkpoints" / "step_4.pt")["model"]
    assert list(saved) == list(plain)  # an uncompiled run's keys: no _orig_mod. prefix
    steps: list[int] = []
    train(
        digits_cfg("resumed", f"trainer.compile={then}", f"resume={checkpoint}"),
        callbacks=[lambda step, *_: steps.append(step)],
    )
    assert steps == [5, 6]
    final = torch.load(tmp_path / "first" / "model.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed" / "model.pt", weights_only=True)
    assert list(final) == list(resumed) == list(plain)
    for key in final:
        torch.testing.assert_close(resumed[key], final[key], rtol=1e-5, atol=1e-6)


def test_the_cpu_emulation_runs_eagerly_and_says_so_once(
    make_cfg: Callable[..., DictConfig], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="adaloss"):
        metrics = train(
            make_cfg("model=mlp", "precision=fp16", "trainer.max_steps=3", "trainer.compile=true")
        )
    reason = f"the CPU emulation of fp16 runs eagerly ({EMULATION_REASON})"
    assert _messages(caplog, "trainer.compile:") == [f"trainer.compile: {reason}"]
    assert not _messages(caplog, COMPILE_LINE)
    assert metrics["compile"] == {"mode": "default", "first_step_s": None, "eager": reason}
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 0


def test_dynamo_still_cannot_compile_the_emulation() -> None:
    """Why the emulation runs eagerly (``EMULATION_REASON``): compiling a forward pass under
    ``EmulatedAutocast`` fails in Dynamo (torch 2.14: graph breaks at every op, then an internal error
    building a guard on the mode). If this test fails, Dynamo can trace it now: try compiling it (and
    update ``adaloss.runner.engine.compiling``)."""
    from adaloss.numerics.emulation import EmulatedAutocast
    from adaloss.numerics.formats import get_format

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 8)
    with pytest.raises(dynamo.exc.TorchDynamoException), EmulatedAutocast(get_format("fp16")):
        compiled(x).sum().backward()
    assert dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize(
    "model",
    [MLP, pytest.param(("model=resnet20",), marks=pytest.mark.slow)],
    ids=["mlp", "resnet20"],  # ResNet-20: about 40 s
)
def test_the_adaptive_scaler_compiles_and_trains_as_eagerly(
    digits_cfg: Callable[..., DictConfig],
    tmp_path: Path,
    aot_eager: None,
    caplog: pytest.LogCaptureFixture,
    model: tuple[str, ...],
) -> None:
    """``scaler=adaptive trainer.compile=true`` (FP32, so the step is compiled; the loss multiplier makes
    FP16 underflow, so the alphas grow, recomputed every 2 iterations): the weights and scales of the eager
    run, no graph break, at most one graph per pass kind (recompute, reuse), as issue 34 asks."""
    settings = ("scaler=adaptive", "adaptive_recipe.update_every=2", "trainer.max_steps=8",
                "trainer.loss_multiplier=9.5367431640625e-07")  # fmt: skip
    eager = train(digits_cfg("eager", *settings, model=model))
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 0
    with caplog.at_level(logging.INFO, logger="adaloss"):
        compiled = train(digits_cfg("compiled", *settings, "trainer.compile=true", model=model))
    assert _messages(caplog, COMPILE_LINE)
    assert max(compiled["loss_scale"].values()) > 1  # the scales changed while compiled
    assert compiled["loss_scale"] == eager["loss_scale"]
    assert compiled["train_loss"] == pytest.approx(eager["train_loss"], rel=1e-5)
    weights = [torch.load(tmp_path / run / "model.pt", weights_only=True) for run in ("eager", "compiled")]
    for key in weights[0]:
        torch.testing.assert_close(weights[1][key], weights[0][key], rtol=1e-5, atol=1e-6)
    assert not dynamo.utils.counters["graph_break"]
    assert dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_a_bad_compile_mode_is_one_error_line(make_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    """In-process, through ``train(cfg)``, the function ``train.py`` runs: it raises a one-line
    ``ConfigError`` before training, which ``train.py`` prints as ``error: <message>`` with exit status 2
    (that wrapper has its own subprocess rows in ``tests/test_bad_input.py``)."""
    with pytest.raises(ConfigError) as info:
        train(make_cfg("trainer.compile_mode=fast"))
    message = str(info.value)
    assert "\n" not in message.strip()
    assert " ".join(message.split()) == (
        "trainer.compile_mode must be one of default, reduce-overhead, max-autotune, got 'fast'; "
        "e.g. trainer.compile_mode=default"
    )
    assert not list(tmp_path.rglob("metrics.json"))
