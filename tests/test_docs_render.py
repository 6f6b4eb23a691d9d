"""The tables and figures on the pages are what ``scripts/render_docs.py`` (:mod:`adaloss.lab.docgen`) renders
from the committed results.

A result file that changes without the pages being rendered again, or a page edited by hand inside a
generated region, fails here with the files that differ and the command that fixes them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from adaloss.lab.docgen import pages
from adaloss.lab.docgen.stamp import stamp
from conftest import load_script
from test_docs_blocks import ROOT


def test_committed_pages_match_the_render() -> None:
    stale = [p.relative_to(ROOT).as_posix() for p in pages.differences(ROOT)]
    assert not stale, f"out of date: {stale}; run: python scripts/render_docs.py"


def test_the_entry_point_checks_the_committed_pages(capsys) -> None:
    """``scripts/render_docs.py --check`` itself: exit status 0 and nothing listed on this checkout."""
    assert load_script("render_docs").main(["--check"]) == 0
    assert "out of date" not in capsys.readouterr().out


def _copy(tmp_path: Path) -> Path:
    """The files the renderer reads and writes, copied, so a test can change them."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copytree(
        ROOT / "results", root / "results", ignore=shutil.ignore_patterns("runs", "sweeps", "demo")
    )
    (root / "results" / "demo").mkdir()
    for name in ("table.md", "record.json"):  # the demo's committed table, not its run folders
        shutil.copy2(ROOT / "results" / "demo" / name, root / "results" / "demo" / name)
    shutil.copy2(ROOT / "README.md", root / "README.md")
    return root


def test_the_entry_point_renders_the_checkout_it_is_in(tmp_path: Path) -> None:
    """``scripts/render_docs.py`` copied into another checkout, ``src/`` linked (as the docs' blocks run it):
    it checks and writes that checkout's pages, not the package's."""
    import subprocess
    import sys

    root = _copy(tmp_path)
    shutil.copytree(ROOT / "scripts", root / "scripts")
    (root / "src").symlink_to(ROOT / "src", target_is_directory=True)
    page = root / "docs" / "precision.md"
    page.write_text(page.read_text(encoding="utf-8").replace("| ResNet-110  |", "| ResNet-111  |", 1))
    command = [sys.executable, str(root / "scripts" / "render_docs.py")]
    check = subprocess.run([*command, "--check"], cwd=root, capture_output=True, text=True)
    assert (check.returncode, check.stdout) == (1, "out of date: docs/precision.md\n"), check
    write = subprocess.run(command, cwd=root, capture_output=True, text=True)
    assert (write.returncode, write.stdout) == (0, "wrote docs/precision.md\n"), write
    assert pages.differences(root) == []


def test_a_changed_result_makes_its_page_stale_and_the_render_fixes_it(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    assert pages.differences(root) == []
    table = root / "results" / "mini" / "tables" / "table1_cifar.md"
    table.write_text(
        table.read_text(encoding="utf-8").replace("97.50 ± 1.94", "12.34 ± 5.67"), encoding="utf-8"
    )
    figure = root / "results" / "mini" / "figures" / "fig4a.png"
    figure.write_bytes(figure.read_bytes() + b"\0")
    assert pages.differences(root) == [
        root / "docs" / "reproducing.md",
        root / "docs" / "assets/mini/fig4a.png",
    ]
    pages.write(root)
    assert pages.differences(root) == []
    assert "12.34 ± 5.67" in (root / "docs" / "reproducing.md").read_text(encoding="utf-8")


def test_a_region_edited_by_hand_is_stale(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    page = root / "docs" / "precision.md"
    text = page.read_text(encoding="utf-8")
    page.write_text(text.replace("| ResNet-110  |", "| ResNet-111  |", 1), encoding="utf-8")
    assert pages.differences(root) == [page]


def test_every_region_is_on_a_page_and_closed(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    page = root / "docs" / "transform.md"
    text = page.read_text(encoding="utf-8")
    page.write_text(text.replace("<!-- end generated: attention-betas -->", ""), encoding="utf-8")
    with pytest.raises(SystemExit, match="has no"):
        pages.render(root)
    page.write_text(text.replace("attention-betas", "attention-gammas"), encoding="utf-8")
    with pytest.raises(SystemExit, match="unknown generated region"):
        pages.render(root)


def test_every_measurement_of_record_is_stamped() -> None:
    """Each ``results/bench/*.json`` names the machine, torch, date (the bench writes them) and the commit and
    command (``render_docs.py stamp``), and the performance page shows each file."""
    files = sorted((ROOT / "results" / "bench").glob("*.json"))
    assert files, "no measurement of record in results/bench/: run make bench"
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        assert {"cpu", "cores", "torch", "date"} <= set(data["machine"]), path.name
        record = data.get("record") or {}
        assert record.get("commit") and record.get("command"), (
            f"{path.name} is not stamped: see docs/performance.md"
        )
        assert f"`results/bench/{path.name}`" in page and record["commit"] in page


def test_every_gpu_check_result_is_on_the_performance_page_with_its_commit() -> None:
    """Each committed ``results/gpu/*.json`` (``make gpu-check``) is stamped and rendered: its GPU, torch,
    commit and every model's ratios, wall and kernel time, appear on the performance page."""
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    for path in sorted((ROOT / "results" / "gpu").glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        record = data.get("record") or {}
        assert record.get("commit"), f"{path.name} is not stamped: see docs/performance.md"
        assert f"`results/gpu/{path.name}`" in page and record["commit"] in page
        assert f"| {data['machine']['gpu']} | {data['machine']['torch']} |" in page
        for model, t in data["timing"].items():
            r = t["ratios"]
            assert f"| {model} | {t['batch']} |" in page
            assert (
                f"| {r['adaptive_u1_over_dynamic']:.3f}x | {r['adaptive_u100_over_dynamic']:.3f}x |" in page
            )
            assert f"| {r['kernel_u1_over_dynamic']:.3f}x | {r['kernel_u100_over_dynamic']:.3f}x |" in page


def test_stamp_records_the_commit_and_command(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"machine": {}, "table_markdown": "x"}))
    record = stamp(path, "make bench", root=ROOT)
    assert record["command"] == "make bench" and len(record["commit"]) >= 7
    assert json.loads(path.read_text())["record"] == record


def test_the_performance_page_renders_without_a_measurement(tmp_path: Path) -> None:
    """Before the first ``make bench`` the region says so, instead of failing or rendering an empty table."""
    root = _copy(tmp_path)
    for path in (root / "results" / "bench").glob("*.json"):
        path.unlink()
    text = pages.render(root)[root / "docs" / "performance.md"]
    assert "No measurement of record is committed yet" in text
