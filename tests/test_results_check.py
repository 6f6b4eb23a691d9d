"""``make results-check`` (``adaloss.lab.results_check``): a rerun equal to the committed numbers passes,
a changed committed number or a planted change of behaviour fails naming the result and its command, every
result folder is covered, and the kernel path is recorded."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from adaloss.lab.results_check import cli
from adaloss.lab.results_check.compare import judge, read_record
from adaloss.lab.results_check.reruns import rerun
from adaloss.lab.results_check.samples import FAMILIES, SAMPLES, committed
from adaloss.runner.provenance import KERNEL_CAPS, cpu_vendor, kernel_key, kernel_path, pin_kernel_path
from conftest import ROOT

FP8_GPT = next(s for s in SAMPLES if (s.family, s.name) == ("fp8", "gpt fp32 seed 0"))
FP8_RESNET = next(s for s in SAMPLES if (s.family, s.name) == ("fp8", "resnet20 E5M2/adaptive/global seed 0"))


def _recorded_key(family: str) -> str | None:
    record = read_record(FAMILIES[family], ROOT)
    return None if record is None else (record.get("kernel_path") or {}).get("key")


def _rerun_here(sample, tmp_path: Path) -> dict:  # noqa: ANN001 - a Sample
    """The sample rerun in this process (so a test can plant a change), this process's threads restored."""
    threads = torch.get_num_threads()
    try:
        return rerun(sample, tmp_path / "rerun")
    finally:
        torch.set_num_threads(threads)


def _on_recorded_path(family: str) -> None:
    here = kernel_key({**kernel_path(), "threads": 1})
    if _recorded_key(family) != here:
        pytest.skip(
            f"the committed {family} results were recorded on {_recorded_key(family)}, this is {here}"
        )


def test_every_result_folder_belongs_to_a_family_with_a_record() -> None:
    """A result folder nobody checks is how a stale table goes unnoticed: each committed folder under
    results/ is a family's (rerun or listed), and each rerun family records commit, command, kernel path."""
    folders = {f.folder for f in FAMILIES.values()}
    tracked = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True).stdout
    for path in tracked.split():
        if Path(path).name in {".gitignore", "record.json"}:
            continue
        assert any(path.startswith(folder + "/") for folder in folders), f"{path}: no family in samples.py"
    for family in FAMILIES.values():
        assert (ROOT / family.page).is_file(), family.page
        if family.rerun:
            record = read_record(family, ROOT)
            assert record is not None, f"{family.folder}/record.json missing: render_docs.py stamp it"
            assert record["commit"] and record["command"], family.folder
            assert record["kernel_path"] is None or record["kernel_path"]["key"], family.folder
            assert any(s.family == family.key for s in SAMPLES), f"{family.key}: no sample"


def test_a_changed_committed_number_is_stale_and_names_its_command(tmp_path: Path) -> None:
    """The fp8 GPT cell rerun here equals the committed row bit for bit; the same rerun against a copy of
    the results with that number changed in its last digit is reported stale, with the command."""
    _on_recorded_path("fp8")
    result = _rerun_here(FP8_GPT, tmp_path)
    verdict = judge(FP8_GPT, committed(FP8_GPT, ROOT), result, _recorded_key("fp8"))
    assert verdict.ok, verdict.line
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT / "results" / "fp8", copy / "results" / "fp8")
    runs = copy / "results" / "fp8" / "runs_gpt.jsonl"
    rows = [json.loads(line) for line in runs.read_text().splitlines()]
    row = next(r for r in rows if (r["cell"], r["seed"]) == ("fp32", 0))
    row["value"] = math.nextafter(row["value"], math.inf)  # one ulp: a changed number, however small
    row["wall_time_s"] = 0.0  # a timing is never compared
    runs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    verdict = judge(FP8_GPT, committed(FP8_GPT, copy), result, _recorded_key("fp8"))
    assert not verdict.ok
    assert "STALE fp8: gpt fp32 seed 0" in verdict.line and "value: committed" in verdict.line
    assert "regenerate: python scripts/fp8_lab.py --models gpt --seeds 0" in verdict.line


def test_evaluating_on_batch_statistics_again_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planted change: ``model.eval()`` no longer reaching an attached model's batch norms (the bug
    32d926d fixed). ResNet-20's adaptive FP8 cell, the quick sample's attached batch-norm model, matches
    as committed, and goes stale with the plant."""
    _on_recorded_path("fp8")
    from adaloss.adaptive.transform import UnscaledParams

    expected = committed(FP8_RESNET, ROOT)
    clean = judge(FP8_RESNET, expected, _rerun_here(FP8_RESNET, tmp_path / "clean"), _recorded_key("fp8"))
    assert clean.ok, clean.line
    monkeypatch.setattr(
        UnscaledParams, "train", nn.Module.train
    )  # the wrapped batch norms keep training mode
    planted = judge(FP8_RESNET, expected, _rerun_here(FP8_RESNET, tmp_path / "planted"), _recorded_key("fp8"))
    assert not planted.ok
    assert "STALE fp8: resnet20 E5M2/adaptive/global seed 0" in planted.line
    assert "value: committed" in planted.line and "regenerate: python scripts/fp8_lab.py" in planted.line


def test_across_kernel_paths_the_headline_is_compared_within_the_tolerance() -> None:
    values = {"value": 3.0, "sqnr_db": {"lm_head": 50.0}}
    result = {"values": {"value": 3.01, "sqnr_db": {"lm_head": 49.0}}, "kernel_path": {"key": "aten=AVX2"}}
    verdict = judge(FP8_GPT, values, result, "aten=AVX512")
    assert verdict.ok and "within ±0.05 on value" in verdict.line and "spread 1" in verdict.line
    result["values"]["value"] = 3.2
    assert not judge(FP8_GPT, values, result, "aten=AVX512").ok
    assert not judge(FP8_GPT, values, result, None).ok  # no record: bit for bit


def test_unknown_family_is_one_error_line() -> None:
    with pytest.raises(SystemExit, match="error: unknown result family nope: choose from fp8"):
        cli.main(["--only", "nope", "--list"], root=ROOT)


def test_the_kernel_path_names_the_caps_and_pinning_sets_them(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_CAPS}
    assert pin_kernel_path(env) == KERNEL_CAPS and env["ATEN_CPU_CAPABILITY"] == "avx2"
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    code = "import json; from adaloss.runner.provenance import kernel_path; print(json.dumps(kernel_path()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    path = json.loads(out.stdout)
    assert path["torch_cpu_capability"] == "AVX2" and path["onednn_max_cpu_isa"] == "AVX2"
    assert path["key"] == f"aten=AVX2 onednn=AVX2 mkl=AVX2/{cpu_vendor() or 'unknown'} threads=1"
    with pytest.raises(RuntimeError, match="after torch was imported"):
        pin_kernel_path()  # this process imported torch: too late for ATen


@pytest.mark.slow
def test_the_full_sample_matches_the_committed_results(capsys: pytest.CaptureFixture[str]) -> None:
    """``scripts/results_check.py --full``: every sample, the mini reproduction's, the claims' and the demo's
    cells included (minutes: 9 of its 15 samples took 147 s two at a time on 2 cores)."""
    status = cli.main(["--full"], root=ROOT)
    assert status == 0, capsys.readouterr().out
