"""``adaloss.lab.reports.figures`` (``scripts/make_figures.py``) on synthetic run folders (``metrics.json``,
``telemetry.jsonl``).

The data each figure plots is checked through the module's extraction functions (``fig1a_data`` ...), the
PNGs by their signature and size, the run selection on mixes of paper-setting and mini-reproduction runs, and
the exit status and messages when runs are missing. The last test runs a real (tiny) sweep of the figure
experiments through ``train.py`` so the script is held to what the trainer writes.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from adaloss.lab.reports import figures as mf

#: SSD512's GEMM layers as the trainer names them (network order).
SSD_LAYERS = [
    *(
        f"backbone.{n}"
        for n in (
            "conv1_1 conv1_2 conv2_1 conv2_2 conv3_1 conv3_2 conv3_3 conv4_1 conv4_2 conv4_3 conv5_1 conv5_2 "
            "conv5_3 conv6 conv7 conv8_1 conv8_2 conv9_1 conv9_2 conv10_1 conv10_2 conv11_1 conv11_2 "
            "conv12_1 conv12_2"
        ).split()
    ),
    *(f"head.classification_head.module_list.{i}" for i in range(7)),
    *(f"head.regression_head.module_list.{i}" for i in range(7)),
]
#: torchvision ResNet-18's GEMM layers (network order).
RESNET18_LAYERS = [
    "conv1",
    *(
        f"layer{s}.{b}.{c}"
        for s in range(1, 5)
        for b in range(2)
        for c in (("conv1", "conv2", "downsample.0") if s > 1 and b == 0 else ("conv1", "conv2"))
    ),
    "fc",
]


# ---- synthetic runs ----------------------------------------------------------------------------------------


def _config(
    model: str,
    dataset: str,
    precision: str,
    scaler: str,
    scale: float | None = None,
    seed: int = 0,
    batch_size: int = 32,
    expected: bool = False,
    image_size: int | None = None,
) -> dict[str, Any]:
    scaler_cfg: dict[str, Any] = {"name": scaler}
    if scaler == "fixed":
        scaler_cfg["scale"] = scale
    model_cfg: dict[str, Any] = {"name": model}
    if image_size is not None:
        model_cfg["image_size"] = image_size
    return {
        "seed": seed,
        "name": f"{model}_{dataset}_{precision}_{scaler}{scale or ''}_seed{seed}",
        "model": model_cfg,
        "dataset": {"name": dataset},
        "precision": {"name": precision},
        "scaler": scaler_cfg,
        "trainer": {"batch_size": batch_size},
        "telemetry": {"every": 1000, "format": "fp16", "expected_loss_scale": expected, "quantile": 0.01},
        "logger": {"wandb": {"project": "adaloss-test"}},
    }


def write_run(
    folder: Path,
    config: dict[str, Any],
    rows: list[dict[str, Any]] | None,
    experiment: str | None = None,
) -> Path:
    """A finished run: ``metrics.json`` with ``config``, ``telemetry.jsonl`` with ``rows`` (none if None),
    and Hydra's ``.hydra/overrides.yaml`` naming ``experiment``."""
    folder.mkdir(parents=True)
    if rows is not None:
        text = "".join(json.dumps(row) + "\n" for row in rows)
        (folder / "telemetry.jsonl").write_text(text, encoding="utf-8")
    if experiment is not None:
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "overrides.yaml").write_text(f"- experiment={experiment}\n", encoding="utf-8")
    record = {"test_accuracy": 50.0, "map": 50.0, "steps": 3000, "config": config}
    (folder / "metrics.json").write_text(json.dumps(record), encoding="utf-8")
    (folder / "done").write_text("")  # finished: the trainer's marker
    return folder


def _steps(n: int = 5, every: int = 1000) -> list[int]:
    return [1 + i * every for i in range(n)]


def fp32_rows(layers: list[str], n: int = 5, expected: bool = True) -> list[dict[str, Any]]:
    """Underflow grows towards the input and over iterations; expected scale 2^4 ... 2^22."""
    rows = []
    for k, step in enumerate(_steps(n)):
        depth = {layer: 1 - i / (len(layers) - 1) for i, layer in enumerate(layers)}  # 1 at the input
        row: dict[str, Any] = {
            "step": step,
            "underflow_rate": {layer: round(0.02 + 0.5 * d * (k + 1) / n, 6) for layer, d in depth.items()},
            "loss_scale": 1.0,
        }
        if expected:
            row["expected_loss_scale"] = {layer: 2.0 ** (4 + 18 * d + k) for layer, d in depth.items()}
        rows.append(row)
    return rows


def underflow_rows(layers: list[str], level: float, n: int = 5, scale: Any = 128.0) -> list[dict[str, Any]]:
    return [
        {
            "step": step,
            "underflow_rate": {
                layer: round(level * (i + 1) / len(layers) + 0.01 * k, 6) for i, layer in enumerate(layers)
            },
            "loss_scale": scale,
        }
        for k, step in enumerate(_steps(n))
    ]


def adaptive_rows(layers: list[str], n: int = 5, level: float = 0.01) -> list[dict[str, Any]]:
    rows = underflow_rows(layers, level, n)
    for k, row in enumerate(rows):
        row["loss_scale"] = {
            layer: 2.0 ** (1 + (len(layers) - 1 - i) // 3 + k) for i, layer in enumerate(layers)
        }
        row["loss_scale_beta"] = {layer: 2.0 for layer in layers}
    return rows


def paper_runs(root: Path) -> dict[str, Path]:
    """The paper's four runs: FP32, fixed 128 and adaptive SSD512 on VOC; adaptive ResNet-18 on ImageNet."""
    return {
        "fp32": write_run(
            root / "fig1" / "0_variant=fp32",
            _config("ssd512", "voc", "fp32", "none", expected=True),
            fp32_rows(SSD_LAYERS),
            "fig1_ssd_stats",
        ),
        "fixed": write_run(
            root / "fig4" / "0_variant=fixed128",
            _config("ssd512", "voc", "fp16", "fixed", 128),
            underflow_rows(SSD_LAYERS, 0.3),
            "fig4_scales",
        ),
        "adaptive": write_run(
            root / "fig4" / "1_variant=adaptive",
            _config("ssd512", "voc", "fp16", "adaptive"),
            adaptive_rows(SSD_LAYERS),
            "fig4_scales",
        ),
        "resnet18": write_run(
            root / "fig4a" / "0_variant=adaptive",
            _config("resnet18", "imagenet", "fp16", "adaptive", batch_size=256),
            adaptive_rows(RESNET18_LAYERS),
            "fig4_scales",
        ),
    }


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _run_info(path: Path):
    runs, _ = mf.read_runs([path])
    (run,) = runs
    return run


# ---- the whole command -------------------------------------------------------------------------------------


def test_every_figure_from_the_papers_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = paper_runs(tmp_path / "results")
    out = tmp_path / "figures"
    assert mf.main([str(tmp_path / "results"), "--out", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    assert "skipped" not in stderr
    for figure in mf.FIGURES:
        path = out / f"{figure}.png"
        assert path.is_file()
        width, height = _png_size(path)
        assert 1000 <= width <= 4000 and 500 <= height <= 2000, (figure, width, height)
        assert path.stat().st_size > 20_000
        assert f"{figure}: {path}" in stdout
    # which runs each figure used, on stdout and in the index
    index = json.loads((out / "figures.json").read_text())
    assert index["figures"]["fig1a"]["runs"] == [str(runs["fp32"])]
    assert index["figures"]["fig1b"]["runs"] == [str(runs["fp32"])]
    assert index["figures"]["fig4a"]["runs"] == [str(runs["resnet18"])]
    assert index["figures"]["fig4b"]["runs"] == [str(runs["fixed"]), str(runs["adaptive"])]
    assert index["figures"]["fig1a"]["iterations"] == [1, 1001, 2001, 3001, 4001]  # all 5 (default: 6)
    assert index["figures"]["fig1a"]["layers"] == len(SSD_LAYERS)
    assert index["skipped"] == {}
    assert "SSD512 on VOC" in index["figures"]["fig1a"]["title"]
    assert "not the paper's setting" not in index["figures"]["fig4a"]["title"]
    markdown = (out / "figures.md").read_text()
    for figure in mf.FIGURES:
        assert f"[{figure}]({figure}.png)" in markdown
    assert str(runs["resnet18"]) in markdown and "ResNet-18 on ImageNet" in markdown


def test_no_runs_at_all_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert mf.main([str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert "error: no finished run (metrics.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert mf.main([str(tmp_path / "nowhere")]) == 2
    assert "error: no such folder" in capsys.readouterr().err


def test_runs_without_telemetry_make_no_figure_and_that_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path / "a", _config("resnet20", "cifar10", "fp16", "fixed", 128), None)
    assert mf.main([str(tmp_path), "--out", str(tmp_path / "out"), "--all"]) == 2
    err = capsys.readouterr().err
    assert (
        "error: no figure could be made from the 1 finished runs" in err and "(0 with telemetry.jsonl" in err
    )
    for figure in mf.FIGURES:
        assert f"{figure} skipped: " in err  # --all: a line for each paper figure


def test_a_plain_fixed_scale_run_gets_sweep_figures_not_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(
        tmp_path / "a", _config("resnet20", "cifar10", "fp16", "fixed", 128), underflow_rows(["conv1"], 0.1)
    )
    out = tmp_path / "out"
    assert mf.main([str(tmp_path), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert " skipped: " not in err  # no paper figure could be made: one line says so, not four
    assert "paper figures not made (fig1a, fig1b, fig4a, fig4b)" in err
    index = json.loads((out / "figures.json").read_text())
    assert sorted(index["sweep_figures"]) == [
        f"sweeps/{tmp_path.name}_loss_scale.png",
        f"sweeps/{tmp_path.name}_underflow.png",
    ]
    assert index["figures"] == {}


def test_a_missing_run_skips_its_figure_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = paper_runs(tmp_path / "results")
    for key in ("adaptive", "resnet18"):  # leaves fig1 and the fixed SSD run
        (runs[key] / "metrics.json").unlink()  # unfinished: no longer a run
    out = tmp_path / "out"
    assert mf.main([str(tmp_path / "results"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    lines = {line.split(" ", 1)[0]: line for line in err.splitlines() if " skipped: " in line}
    assert set(lines) == {"fig4a", "fig4b"}
    assert "no finished adaptive-scaling classification run" in lines["fig4a"]
    assert "model=resnet18 dataset=imagenet variant=adaptive" in lines["fig4a"]
    assert "no finished adaptive-scaling detection run" in lines["fig4b"]
    assert "fixed-scaling" not in lines["fig4b"]  # the fixed run is there
    assert "2 unfinished run folders (no metrics.json) passed over" in err  # they keep Hydra's .hydra/
    assert (out / "fig1a.png").is_file() and (out / "fig1b.png").is_file()
    assert not (out / "fig4a.png").exists() and not (out / "fig4b.png").exists()
    index = json.loads((out / "figures.json").read_text())
    assert set(index["skipped"]) == {"fig4a", "fig4b"}
    assert "fig4b: no finished adaptive-scaling detection run" in (out / "figures.md").read_text()


def test_telemetry_without_expected_loss_scale_skips_fig1b(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path / "r", _config("ssd512", "voc", "fp32", "none"), fp32_rows(SSD_LAYERS, expected=False))
    assert mf.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert (
        "fig1b skipped: its telemetry has no expected_loss_scale (run with telemetry.expected_loss_scale"
        in err
    )
    assert (tmp_path / "out" / "fig1a.png").is_file()


def test_a_run_without_telemetry_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "r", _config("ssd512", "voc", "fp32", "none", expected=True), None)
    write_run(
        tmp_path / "s", _config("resnet18", "imagenet", "fp16", "adaptive"), adaptive_rows(["conv1", "fc"])
    )
    assert mf.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert (
        "fig1a skipped: no finished FP32 detection run with telemetry (found some, but without telemetry"
        in err
    )


# ---- the data of each figure -------------------------------------------------------------------------------


def test_fig1_layers_follow_the_file_in_backprop_order(tmp_path: Path) -> None:
    layers = ["stem", "zeta.conv", "alpha.conv", "mid", "head.out"]  # network order, deliberately unsorted
    rows = fp32_rows(layers, n=3)
    rows[1]["underflow_rate"].pop("mid")  # a layer a step did not record is NaN there
    run = _run_info(write_run(tmp_path / "r", _config("ssd512", "voc", "fp32", "none", expected=True), rows))
    data = mf.fig1a_data(run)
    assert data.layers == layers[::-1]  # layer ID 0 = the layer nearest the loss
    assert data.network_order == layers
    assert data.steps == [1, 1001, 2001]
    for row in rows:
        got = data.values[row["step"]]
        for i, layer in enumerate(data.layers):
            want = row["underflow_rate"].get(layer, math.nan)
            assert got[i] == want or (math.isnan(got[i]) and math.isnan(want))
    expected = mf.fig1b_data(run)
    assert expected.layers == layers[::-1]
    assert expected.values[2001] == [rows[2]["expected_loss_scale"][layer] for layer in layers[::-1]]
    # a layer without an expected loss scale (its gradient was all zeros) keeps its ID, as a gap
    for row in rows:
        row["expected_loss_scale"].pop("zeta.conv")
    run = _run_info(write_run(tmp_path / "s", _config("ssd512", "voc", "fp32", "none", expected=True), rows))
    expected = mf.fig1b_data(run)
    assert expected.layers == layers[::-1] and math.isnan(expected.values[1][3])


def test_fig4b_is_fixed_minus_adaptive_per_layer_at_common_steps(tmp_path: Path) -> None:
    layers = ["backbone.conv1_1", "backbone.conv4_3", "head.classification_head.module_list.0"]
    fixed_rows = [
        {"step": 1, "underflow_rate": {"backbone.conv1_1": 0.50, "backbone.conv4_3": 0.20, layers[2]: 0.05}},
        {
            "step": 101,
            "underflow_rate": {"backbone.conv1_1": 0.40, "backbone.conv4_3": 0.10, layers[2]: 0.00},
        },
        {
            "step": 201,
            "underflow_rate": {"backbone.conv1_1": 0.30, "backbone.conv4_3": 0.10, layers[2]: 0.00},
        },
    ]
    adaptive = [
        {
            "step": 1,
            "underflow_rate": {"backbone.conv1_1": 0.01, "backbone.conv4_3": 0.02, layers[2]: 0.05},
            "loss_scale": {layer: 1.0 for layer in layers},
        },
        {
            "step": 201,
            "underflow_rate": {"backbone.conv1_1": 0.00, "backbone.conv4_3": 0.001, layers[2]: 0.001},
            "loss_scale": {layer: 4.0 for layer in layers},
        },
        {"step": 301, "underflow_rate": {"backbone.conv1_1": 0.00, "backbone.conv4_3": 0.0, layers[2]: 0.0}},
    ]
    f = _run_info(write_run(tmp_path / "f", _config("ssd512", "voc", "fp16", "fixed", 128), fixed_rows))
    a = _run_info(write_run(tmp_path / "a", _config("ssd512", "voc", "fp16", "adaptive"), adaptive))
    data = mf.fig4b_data(f, a)
    assert data.steps == [1, 201]  # only the steps both runs recorded
    assert data.layers == layers[::-1]
    by_step_f = {r["step"]: r["underflow_rate"] for r in fixed_rows}
    by_step_a = {r["step"]: r["underflow_rate"] for r in adaptive}
    for step in data.steps:
        want = [by_step_f[step][layer] - by_step_a[step][layer] for layer in data.layers]
        assert data.values[step] == pytest.approx(want)
    assert data.values[1] == pytest.approx([0.0, 0.18, 0.49])
    with pytest.raises(mf.NoData, match="no common step"):
        shifted = [{**r, "step": r["step"] + 1} for r in adaptive]
        mf.fig4b_data(
            f, _run_info(write_run(tmp_path / "b", _config("ssd512", "voc", "fp16", "adaptive"), shifted))
        )


def test_fig4a_reads_the_per_layer_alpha(tmp_path: Path) -> None:
    rows = adaptive_rows(RESNET18_LAYERS, n=8)
    run = _run_info(write_run(tmp_path / "r", _config("resnet18", "imagenet", "fp16", "adaptive"), rows))
    data = mf.fig4a_data(run, iterations=3)
    assert data.steps == [1, 4001, 7001]
    assert data.layers[0] == "fc" and data.layers[-1] == "conv1"
    assert data.values[4001] == [rows[4]["loss_scale"][layer] for layer in data.layers]
    # a run whose loss scale is one number (fixed, dynamic) has no per-layer alpha
    fixed = _run_info(
        write_run(
            tmp_path / "f", _config("resnet18", "imagenet", "fp16", "fixed", 128), underflow_rows(["a"], 0.1)
        )
    )
    with pytest.raises(mf.NoData, match="no per-layer loss_scale"):
        mf.fig4a_data(fixed)


def test_pick_steps_spreads_evenly_and_keeps_both_ends() -> None:
    steps = list(range(1, 120_002, 1000))  # 121 telemetry steps
    picked = mf.pick_steps(steps, 6)
    assert picked[0] == 1 and picked[-1] == 120_001 and len(picked) == 6
    assert mf.pick_steps([5, 1, 3], 6) == [1, 3, 5]
    assert mf.pick_steps(steps, 1) == [120_001]


def test_telemetry_lines_that_are_not_steps_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "telemetry.jsonl"
    path.write_text(
        '{"step": 2, "x": 1}\n\nnot json\n[1, 2]\n{"step": 1}\n{"step": 2, "x": 2}\n{"step": 3', "utf-8"
    )
    assert mf.read_telemetry(path) == [{"step": 1}, {"step": 2, "x": 2}]
    assert mf.read_telemetry(tmp_path / "absent.jsonl") == []


def test_short_layer_names() -> None:
    assert mf.short_layer("backbone.conv4_3") == "conv4_3"
    assert mf.short_layer("head.classification_head.module_list.2") == "cls.2"
    assert mf.short_layer("head.regression_head.module_list.6") == "reg.6"
    assert mf.short_layer("layer2.0.downsample.0") == "layer2.0.downsample.0"


# ---- choosing the runs -------------------------------------------------------------------------------------


def _mini_runs(root: Path) -> dict[str, Path]:
    """The mini reproduction: SSD512 at 128 px on shapes, ResNet-20 on digits."""
    small = SSD_LAYERS
    return {
        "fp32": write_run(
            root / "m0",
            _config("ssd512", "shapes", "fp32", "none", expected=True, image_size=128),
            fp32_rows(small),
        ),
        "fixed": write_run(
            root / "m1",
            _config("ssd512", "shapes", "fp16", "fixed", 128, image_size=128),
            underflow_rows(small, 0.2),
        ),
        "adaptive": write_run(
            root / "m2", _config("ssd512", "shapes", "fp16", "adaptive", image_size=128), adaptive_rows(small)
        ),
        "digits": write_run(
            root / "m3", _config("resnet20", "digits", "fp16", "adaptive"), adaptive_rows(["conv1", "fc"])
        ),
        "mlp_fixed": write_run(
            root / "m4", _config("mlp", "digits", "fp16", "fixed", 128), underflow_rows(["fc1"], 0.1)
        ),
    }


def test_the_mini_reproduction_makes_every_figure_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = _mini_runs(tmp_path / "mini")
    out = tmp_path / "out"
    assert mf.main([str(tmp_path / "mini"), "--out", str(out), "--iterations", "3"]) == 0
    index = json.loads((out / "figures.json").read_text())
    assert index["figures"]["fig1a"]["runs"] == [str(runs["fp32"])]
    assert index["figures"]["fig4a"]["runs"] == [str(runs["digits"])]
    assert index["figures"]["fig4b"]["runs"] == [str(runs["fixed"]), str(runs["adaptive"])]
    assert len(index["figures"]["fig4b"]["iterations"]) == 3
    for figure in mf.FIGURES:
        title = index["figures"][figure]["title"]
        assert "not the paper's setting" in title, title
    assert "SSD512 (128 px) on shapes" in index["figures"]["fig1a"]["title"]
    assert "ResNet-20 on digits" in index["figures"]["fig4a"]["title"]
    assert "ssd512_shapes_fp32_none_seed0" in index["figures"]["fig1b"]["title"]  # the run's name
    stdout = capsys.readouterr().out
    assert f"SSD512 (128 px) on shapes, FP32, batch 32, seed 0 ({runs['fp32']})" in stdout


def test_the_papers_setting_wins_over_the_mini_runs(tmp_path: Path) -> None:
    mini = _mini_runs(tmp_path / "a_mini")  # first in path order
    paper = paper_runs(tmp_path / "b_paper")
    runs, _ = mf.read_runs([tmp_path])
    chosen = {fig: [r.path for r in sel.runs] for fig, sel in mf.select_all(runs).items()}
    assert chosen == {
        "fig1a": [paper["fp32"]],
        "fig1b": [paper["fp32"]],
        "fig4a": [paper["resnet18"]],
        "fig4b": [paper["fixed"], paper["adaptive"]],
    }
    assert all(r.path not in mini.values() for sel in mf.select_all(runs).values() for r in sel.runs)


def test_ties_go_to_the_experiment_then_fixed_128_then_path_order(tmp_path: Path) -> None:
    cfg = _config("ssd512", "voc", "fp32", "none", expected=True)
    write_run(tmp_path / "a", cfg, fp32_rows(["x", "y"]))
    b = write_run(tmp_path / "b", cfg, fp32_rows(["x", "y"]), experiment="fig1_ssd_stats")
    # an FP32 run recording the expected loss scale wins over one that does not, whatever its experiment
    write_run(
        tmp_path / "c", _config("ssd512", "voc", "fp32", "none"), fp32_rows(["x", "y"]), "fig1_ssd_stats"
    )
    write_run(tmp_path / "d", _config("ssd512", "voc", "fp16", "fixed", 1024), underflow_rows(["x"], 0.1))
    f128 = write_run(
        tmp_path / "e", _config("ssd512", "voc", "fp16", "fixed", 128), underflow_rows(["x"], 0.1)
    )
    ad = write_run(tmp_path / "f", _config("ssd512", "voc", "fp16", "adaptive"), adaptive_rows(["x"]))
    # an adaptive SSD300 run cannot pair with SSD512's fixed runs; VOC SSD512 wins anyway
    write_run(tmp_path / "g", _config("ssd300", "voc", "fp16", "adaptive"), adaptive_rows(["x"]))
    runs, _ = mf.read_runs([tmp_path])
    assert [r.experiment for r in runs[:3]] == [None, "fig1_ssd_stats", "fig1_ssd_stats"]
    selections = mf.select_all(runs)
    assert selections["fig1a"].runs[0].path == b and selections["fig1a"].candidates == 3
    assert [r.path for r in selections["fig4b"].runs] == [f128, ad]
    only_ssd300 = [r for r in runs if r.model != "ssd512" or r.scaler != "adaptive"]
    missing = mf.select_fig4b(only_ssd300).missing
    assert missing and "of the same model, dataset and precision" in missing


def test_the_experiment_is_read_from_hydras_choices(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", _config("ssd512", "voc", "fp32", "none"), [])
    (run / ".hydra").mkdir()
    (run / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  runtime:\n    choices:\n      experiment: fig1_ssd_stats\n      model: ssd512\n", "utf-8"
    )
    assert _run_info(run).experiment == "fig1_ssd_stats"


# ---- W&B ---------------------------------------------------------------------------------------------------


def test_wandb_logs_each_png_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: dict[str, Any] = {"images": [], "logged": {}}

    class FakeRun:
        def log(self, payload: dict[str, Any]) -> None:
            calls["logged"].update(payload)

        def finish(self) -> None:
            calls["finished"] = True

    def init(**kwargs: Any) -> FakeRun:
        calls["init"] = kwargs
        return FakeRun()

    def image(path: str, caption: str = "") -> tuple[str, str]:
        calls["images"].append(path)
        return ("image", path)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Image=image))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    paper_runs(tmp_path / "results")
    out = tmp_path / "out"
    assert mf.main([str(tmp_path / "results"), "--out", str(out), "--wandb"]) == 0
    assert calls["init"]["mode"] == "offline" and calls["init"]["project"] == "adaloss-test"
    index = json.loads((out / "figures.json").read_text())
    sweep_pngs = sorted(
        index["sweep_figures"]
    )  # fig1, fig4, fig4a: an underflow and a loss-scale figure each
    assert len(sweep_pngs) == 6
    assert sorted(calls["logged"]) == sorted([*mf.FIGURES, *(f"sweep/{Path(p).stem}" for p in sweep_pngs)])
    assert sorted(calls["images"]) == sorted(
        [*(str(out / f"{f}.png") for f in mf.FIGURES), *(str(out / p) for p in sweep_pngs)]
    )
    assert calls["finished"]
    # a W&B failure is a warning; the figures stand
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=None, Image=image))
    assert mf.main([str(tmp_path / "results"), "--out", str(out), "--wandb"]) == 0
    assert "warning: W&B logging failed" in capsys.readouterr().err


# ---- against the trainer -----------------------------------------------------------------------------------

_TINY = (
    "trainer.num_workers=0",  # the experiments ask for 8 loader workers
    "trainer.eval_batch_size=4",
    "trainer.max_steps=3",
    "telemetry.every=2",
    "trainer.progress_bar=false",
    "device=cpu",
    "logger=none",
)
#: SSD512 at 64 px with 1/8 of the channels on a few ``shapes`` images.
_TINY_SSD = (
    "dataset=shapes",
    "model.image_size=64",
    "model.width_multiplier=0.125",
    "dataset.train_size=8",
    "dataset.test_size=4",
    "trainer.batch_size=2",
    *_TINY,
)
#: The MLP on 8x8 synthetic images stands in for ResNet-18 on ImageNet.
_TINY_CLASSIFIER = (
    "model=mlp",
    "dataset=synthetic",
    "dataset.image_size=8",
    "dataset.train_size=8",
    "dataset.test_size=4",
    "trainer.batch_size=4",
    *_TINY,
)


def _train(run_dir: Path, experiment: str, *overrides: str) -> None:
    """One job of ``experiment``, composed as ``train.py`` does and trained in-process into ``run_dir``."""
    from omegaconf import open_dict

    from adaloss.runner.engine import train
    from conftest import compose_train

    cfg = compose_train([f"experiment={experiment}", *overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = str(run_dir)
    run_dir.mkdir(parents=True)
    train(cfg)
    (run_dir / ".hydra").mkdir(exist_ok=True)  # what Hydra records of the launch
    (run_dir / ".hydra" / "overrides.yaml").write_text(f"- experiment={experiment}\n", encoding="utf-8")


# trains every figure experiment (about a minute alone): make test keeps the mini reproduction's test
@pytest.mark.slow
def test_the_figure_experiments_trained_for_real_feed_the_figures(tmp_path: Path) -> None:
    """Each job of fig1_ssd_stats and fig4_scales, shrunk to 3 iterations on CPU (SSD512 on ``shapes`` at
    64 px with 1/8 of the channels; the MLP on synthetic images for panel a): what the trainer writes is what
    the script reads."""
    results = tmp_path / "results"
    _train(results / "fig1" / "0_variant=fp32", "fig1_ssd_stats", "variant=fp32", *_TINY_SSD)
    if not (results / "fig1" / "0_variant=fp32" / "telemetry.jsonl").is_file():
        pytest.skip("the trainer does not write telemetry.jsonl yet")
    for i, variant in enumerate(("fixed128", "adaptive")):
        _train(results / "fig4" / f"{i}_variant={variant}", "fig4_scales", f"variant={variant}", *_TINY_SSD)
    _train(results / "fig4a" / "0_variant=adaptive", "fig4_scales", "variant=adaptive", *_TINY_CLASSIFIER)
    out = tmp_path / "out"
    assert mf.main([str(results), "--out", str(out)]) == 0
    index = json.loads((out / "figures.json").read_text())
    assert index["skipped"] == {}
    assert sorted(index["figures"]) == sorted(mf.FIGURES)
    for figure, entry in index["figures"].items():
        assert entry["iterations"] == [1, 3], figure  # iterations 0 and 2 (telemetry.every=2), 1 and 3 done
        assert "not the paper's setting" in entry["title"]
    assert index["figures"]["fig4b"]["runs"] == [
        str(results / "fig4" / "0_variant=fixed128"),
        str(results / "fig4" / "1_variant=adaptive"),
    ]
    runs, _ = mf.read_runs([results])
    fig1 = next(r for r in runs if r.precision == "fp32")
    assert fig1.experiment == "fig1_ssd_stats" and fig1.model == "ssd512"
    data = mf.fig1b_data(fig1)
    assert data.network_order[0] == "backbone.conv1_1" and len(data.layers) == len(SSD_LAYERS)
    assert all(v > 0 for v in data.values[1] if not math.isnan(v))
    assert mf.fig4a_data(next(r for r in runs if r.model == "mlp")).steps == [1, 3]
