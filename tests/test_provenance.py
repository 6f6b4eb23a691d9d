"""``adaloss.runner.provenance``: the ``provenance`` block of ``metrics.json`` says which code, packages,
hardware and numerics settings produced a run, and says plainly when it cannot tell (no checkout, no git)."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torchvision
from omegaconf import DictConfig

from adaloss.precision import Precision
from adaloss.runner.engine import train
from adaloss.runner.provenance import collect_provenance, cpu_name, git_state
from conftest import ROOT

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@needs_git
def test_a_checkout_reports_its_commit_and_whether_tracked_files_changed(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "pkg" / "code.py").write_text("x = 1\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert git_state(repo / "pkg") == {"git_commit": head, "git_dirty": False, "git_note": None}
    (repo / "pkg" / "notes.txt").write_text("untracked\n")  # untracked files do not make it dirty
    assert git_state(repo / "pkg")["git_dirty"] is False
    (repo / "pkg" / "code.py").write_text("x = 2\n")
    assert git_state(repo / "pkg") == {"git_commit": head, "git_dirty": True, "git_note": None}


@needs_git
def test_this_package_reports_the_checkout_it_runs_from() -> None:
    state = git_state()
    assert state["git_commit"] == _git(ROOT, "rev-parse", "HEAD").strip()
    assert state["git_dirty"] is bool(_git(ROOT, "status", "--porcelain", "--untracked-files=no").strip())


@needs_git
def test_outside_a_checkout_the_commit_is_none_and_the_note_says_why(tmp_path: Path) -> None:
    folder = tmp_path / "site-packages" / "adaloss"
    folder.mkdir(parents=True)
    state = git_state(folder)
    assert state["git_commit"] is None and state["git_dirty"] is None
    assert state["git_note"] == f"not a git checkout: {folder}"


def test_without_git_the_note_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on PATH
    assert git_state(ROOT) == {
        "git_commit": None,
        "git_dirty": None,
        "git_note": "git is not installed, so the commit is unknown",
    }


def test_versions_device_precision_and_tf32() -> None:
    info = collect_provenance(torch.device("cpu"), Precision("fp16", "cpu"))
    assert info["torch"] == torch.__version__ and info["torchvision"] == torchvision.__version__
    assert info["python"] == platform.python_version() and info["adaloss"]
    assert info["device"] == "cpu" and info["device_name"] == info["cpu"] == cpu_name()
    assert (info["precision"], info["precision_mode"], info["emulated"]) == ("fp16", "emulated", True)
    fp32 = collect_provenance(torch.device("cpu"), Precision("fp32", "cpu"))
    assert (fp32["precision"], fp32["precision_mode"], fp32["emulated"]) == ("fp32", "native", False)
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for setting in (True, False):
            torch.backends.cuda.matmul.allow_tf32 = setting
            torch.backends.cudnn.allow_tf32 = not setting
            tf32 = collect_provenance(torch.device("cpu"))["tf32"]
            assert tf32["matmul"] is setting and tf32["cudnn"] is (not setting)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    json.dumps(info)  # plain JSON values only


def test_cpu_name_reads_proc_cpuinfo() -> None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("model name")]
    if not names:
        pytest.skip("/proc/cpuinfo names no model")
    assert cpu_name() == names[0]


def test_metrics_json_carries_the_provenance(make_cfg: Callable[..., DictConfig], tmp_path: Path) -> None:
    train(make_cfg())
    written = json.loads((tmp_path / "metrics.json").read_text())["provenance"]
    assert written == json.loads(
        json.dumps(collect_provenance(torch.device("cpu"), Precision("fp16", "cpu")))
    )
    assert written["emulated"] is True and written["device"] == "cpu"
