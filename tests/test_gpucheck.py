"""``make gpu-check`` (:mod:`adaloss.gpucheck`): without CUDA one line and exit 0; its measurements, run
here on the CPU with host timers, give the ratios and gradient comparisons it records on a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from adaloss.gpucheck import compare_gradients, step_ratios, time_steps
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
    ms = time_steps(model, batch=2, device="cpu", rounds=1, steps=2, dtype=torch.bfloat16)
    assert set(ms) == {"dynamic", "adaptive_u1", "adaptive_u100"}
    assert ms["adaptive_u100"].keys() == {"step", "recompute", "reuse"}
    ratios = step_ratios(ms)
    assert all(0.1 < r < 10 for r in ratios.values()), ratios


def test_autocast_gradients_are_compared_with_fp32() -> None:
    result = compare_gradients("cpu", torch.bfloat16, batch=8)
    # BF16 keeps 8 significand bits: measured min 0.924, median 0.979 (FP16: min 0.995)
    assert result["min_cosine"] > 0.9 and result["median_cosine"] > 0.95, result


def test_a_part_that_raises_is_recorded_and_the_others_still_measured(monkeypatch, tmp_path, capsys) -> None:
    """On a user's GPU one broken part (an API their older torch lacks, say) must not cost the rest."""
    import adaloss.gpucheck as gpucheck

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
    assert "pip install -e ." in done.stderr
