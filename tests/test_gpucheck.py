"""``make gpu-check`` (:mod:`adaloss.lab.gpucheck`): without CUDA one line and exit 0; its measurements, run
here on the CPU with host timers, give the ratios and gradient comparisons it records on a GPU."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import adaloss.lab.gpucheck as gpucheck
from adaloss.lab.gpucheck import CONFIGS, WARM_RUNS, compare_gradients, step_ratios, time_modes, time_steps
from conftest import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu-check runs the checks")
def test_without_cuda_it_says_so_in_one_line() -> None:
    results = ROOT / "results" / "gpu"

    def listing() -> dict[str, int]:  # the committed GPU results stay as they are
        return {f.name: f.stat().st_mtime_ns for f in results.iterdir()} if results.exists() else {}

    before = listing()
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and done.stdout.startswith("gpu-check: no CUDA device here")
    assert listing() == before


@pytest.mark.parametrize("model", ["resnet20", "gpt"])
def test_step_times_give_the_issue_ratios(model: str) -> None:
    # The shared machine stalls now and then for longer than a whole step (a reuse step 18x a dynamic one
    # once in CI, a dynamic step 22x an adaptive one another time, even as medians of three rounds): a
    # measurement out of bounds is taken again, up to three times. A bug that times the wrong thing (a step
    # without its backward pass, say) is out of bounds every time and still fails.
    tries = []
    for _ in range(3):
        ms = time_steps(model, batch=2, device="cpu", rounds=3, steps=2, dtype=torch.bfloat16)
        assert set(ms) == {"dynamic", "adaptive_u1", "adaptive_u100"}
        assert ms["adaptive_u100"].keys() == {"step", "recompute", "reuse"}
        ratios = step_ratios(ms)
        tries.append(ratios)
        if all(0.1 < r < 10 for r in ratios.values()):
            break
    assert all(0.1 < r < 10 for r in tries[-1].values()), tries


def test_autocast_gradients_are_compared_with_fp32() -> None:
    result = compare_gradients("cpu", torch.bfloat16, batch=8)
    # BF16 keeps 8 significand bits: measured min 0.924, median 0.979 (FP16: min 0.995)
    assert result["min_cosine"] > 0.9 and result["median_cosine"] > 0.95, result


def test_a_part_that_raises_is_recorded_and_the_others_still_measured(monkeypatch, tmp_path, capsys) -> None:
    """On a user's GPU one broken part (an API their older torch lacks, say) must not cost the rest."""
    import adaloss.lab.gpucheck as gpucheck

    def broken(device: str, dtype: torch.dtype) -> dict:
        raise AttributeError("module 'torch' has no attribute 'something_new'")

    monkeypatch.setattr(gpucheck, "compare_gradients", broken)
    monkeypatch.setattr(gpucheck, "_run_tests", lambda log: {"status": "passed", "line": "2 passed"})
    monkeypatch.setattr(gpucheck, "time_steps", lambda *a: time_steps("gpt", 2, "cpu", 1, 2, torch.bfloat16))
    report = gpucheck.collect("cpu", "Some GPU", tmp_path, timing={"gpt": 2})
    assert report["gradients"]["fp16"] == {
        "error": "AttributeError: module 'torch' has no attribute 'something_new'"
    }
    assert set(report["timing"]["gpt"]["ratios"]) == {
        "adaptive_u1_over_dynamic",
        "adaptive_u100_over_dynamic",
    }
    assert gpucheck.failed(report)
    assert "fp16 autocast vs FP32 gradients: error: AttributeError" in gpucheck._table(report)
    assert "something_new" in capsys.readouterr().err


def test_a_python_without_the_projects_dependencies_gets_one_error_line() -> None:
    """``make gpu-check`` runs on the GPU machine's own python (GPU_PYTHON): without Hydra there it says
    what to install, in one line, instead of a traceback."""
    code = (
        "import sys, runpy; sys.modules['hydra'] = None; sys.argv = ['scripts/gpu_check.py']; "
        "runpy.run_path('scripts/gpu_check.py', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: gpu-check:"), done.stderr
    assert "pip install -e '.[runner]'" in done.stderr  # hydra is the runner extra's


# ------------------------------------------------------------------------------ compiled steps (issue 34)


def test_compiled_step_times_cover_every_configuration_and_compile_only_in_the_warm_up(
    tiny_timed_model,
) -> None:
    """``time_steps(..., backend=...)`` compiles each configuration's attached model (``fullgraph=True``):
    finite step times for every configuration and kind, one graph per pass kind (adaptive_u100 both,
    in the warm-up round although a round here has only two steps), no graph break, no recompile."""
    tiny_timed_model()
    ms = time_steps("tiny", 2, "cpu", rounds=1, steps=2, dtype=None, backend="aot_eager")
    assert set(ms) == set(CONFIGS)
    for key, entry in ms.items():
        times = {k: v for k, v in entry.items() if k in ("step", "recompute", "reuse")}
        assert all(math.isfinite(v) and v > 0 for v in times.values()), (key, entry)
        assert entry["graph_breaks"] == 0 and entry["recompiles"] == 0, (key, entry)
    assert {k: e["graphs"] for k, e in ms.items()} == {"dynamic": 1, "adaptive_u1": 1, "adaptive_u100": 2}
    assert {"recompute", "reuse"} <= ms["adaptive_u100"].keys()
    assert all(0.1 < r < 10 for r in step_ratios(ms).values())


def test_a_graph_compiled_in_a_timed_round_is_counted_as_a_recompile(tiny_timed_model) -> None:
    """What keeps compile time out of the timed rounds is checked, not assumed: batches that change shape
    after the warm-up round (2 * WARM_RUNS steps per configuration) make every configuration compile
    again in the timed round, and its entry says so."""
    tiny_timed_model(2 * WARM_RUNS)
    by_mode, info = time_modes("tiny", 2, "cpu", {"c": ("aot_eager", None)}, rounds=1, steps=2, dtype=None)
    assert info["rounds"] == 1 and info["errors"] == {}
    assert all(entry["recompiles"] >= 1 for entry in by_mode["c"].values()), by_mode


def test_the_gpu_timing_records_each_compiled_mode_beside_the_eager_steps(tiny_timed_model) -> None:
    """``make gpu-check``'s timing of one model with compiled modes (on CUDA: Inductor, default and
    reduce-overhead; here aot_eager on the CPU, the same code path without CUDA graphs): the eager entry
    as before, each mode's ratios and compile counts, the tables of the check and of the docs page."""
    from adaloss.lab.docgen.regions import _gpu_compiled_rows

    tiny_timed_model()
    modes = ("default", "reduce-overhead")
    entry = gpucheck._timing("tiny", 2, "cpu", modes, backend="aot_eager", rounds=1, steps=2)
    assert set(entry["ratios"]) == {"adaptive_u1_over_dynamic", "adaptive_u100_over_dynamic"}
    assert set(entry["compiled"]) == set(modes) and entry["backend"] == "aot_eager"
    for mode in modes:
        c = entry["compiled"][mode]
        assert set(c) == {"ms", "ratios", "compile"}, c
        assert all(math.isfinite(r) and r > 0 for r in c["ratios"].values())
        assert c["compile"]["adaptive_u100"] == {
            "graphs": 2,
            "graph_breaks": 0,
            "cudagraph_skips": 0,
            "recompiles": 0,
        }
        assert set(c["ms"]["adaptive_u100"]) == {"step", "recompute", "reuse"}  # counts kept apart
    report = _report({"tiny": entry})
    assert not gpucheck.failed(report)
    table = gpucheck._table(report)
    assert "| tiny | default |" in table and "| tiny | reduce-overhead |" in table
    assert "| 1, 1, 2 | 0 | 0 | 0 |" in table
    rows = _gpu_compiled_rows(report["timing"])
    assert sum(row.startswith("| tiny | ") for row in rows) == 2
    assert all(row.count("|") == rows[2].count("|") for row in rows[2:])


def test_a_compiled_mode_that_fails_is_recorded_and_the_eager_steps_still_measured(
    tiny_timed_model, capsys
) -> None:
    """A compile failure in one mode (a backend that raises, here) is one recorded error, not a lost
    model: the eager steps keep their times and ratios, the check fails, and the tables say why."""
    from adaloss.lab.docgen.regions import _gpu_compiled_rows

    def broken(graph, example_inputs):
        raise RuntimeError("this backend cannot compile")

    tiny_timed_model()
    entry = gpucheck._timing("tiny", 2, "cpu", ("default",), backend=broken, rounds=1, steps=2)
    assert "this backend cannot compile" in entry["compiled"]["default"]["error"]
    assert set(entry["ratios"]) == {"adaptive_u1_over_dynamic", "adaptive_u100_over_dynamic"}
    report = _report({"tiny": entry})
    assert gpucheck.failed(report)
    assert "| tiny | default | error: BackendCompilerFailed" in gpucheck._table(report)
    assert "gpu-check: tiny's default steps failed" in capsys.readouterr().err
    assert any("| tiny | default | error: " in row for row in _gpu_compiled_rows(report["timing"]))


def test_the_compile_modes_are_an_option(capsys) -> None:
    """``scripts/gpu_check.py --compile MODE ... --models MODEL ...`` (default: default and reduce-overhead;
    none: eager only; every timed model); a mode torch.compile does not have, or a model the check does
    not time, is an ``error:`` line before anything runs."""
    assert gpucheck.COMPILE_MODES == ("default", "reduce-overhead")
    with pytest.raises(SystemExit) as exc:
        gpucheck.main(["--compile", "fastest"])
    assert exc.value.code == 2 and "invalid choice: 'fastest'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        gpucheck.main(["--models", "resnet56"])
    assert exc.value.code == 2 and "invalid choice: 'resnet56'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert gpucheck.main(["--compile", "none"]) == 0


def _report(timing: dict) -> dict:
    """A report around ``timing`` whose other parts passed."""
    return {
        "machine": {"gpu": "Some GPU", "torch": torch.__version__},
        "tests": {"status": "passed", "line": "2 passed"},
        "gradients": {},
        "timing": timing,
    }
