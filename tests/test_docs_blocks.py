"""Every shell and Python block in the README and the docs is run, or says why not.

The convention (``docs/conventions.md``): the line right before each ```` ```bash ```` or ```` ```python ````
fence is one marker,

- ``<!-- run: fast -->``: run here, in ``make test``; ``<!-- run: fast; exit 2 -->``: and it must exit with 2
  (a block showing an error);
- ``<!-- run: slow -->``: run here, marked ``slow`` (``make test-full``);
- ``<!-- run: own-loop -->``: a Python block that uses ``model``, ``loader`` and ``criterion`` without
  defining them; they are supplied, ``"cuda"`` becomes ``"cpu"`` (real FP16 autocast on the CPU), and the
  run must train;
- ``<!-- not-run: <why> -->``: not run, for the reason given.

``test_every_block_is_run_or_marked`` enforces it; the other tests run the blocks. A block is checked by
what it does (exit status 0, a model that trained), never by the words around it.

Where a block runs: one that calls ``make`` runs in the repository, as a user would, once ``make setup`` has
made ``.venv`` there (otherwise the test skips and says so); every other block runs in a fresh temporary
folder with a copy of ``train.py`` and ``scripts/`` and links to ``configs/`` and ``src/``, so its runs and
result files land there. ``python`` and ``.venv/bin/python`` there are the interpreter running the tests.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

SHELL = {"bash", "sh", "shell"}
RUNNABLE = SHELL | {"python"}
MARKER = re.compile(
    r"^<!-- (?:run: (?P<run>fast|slow|own-loop)(?:; exit (?P<exit>\d+))?|not-run: (?P<reason>\S.*?)) -->$"
)
ANY_MARKER = re.compile(r"^<!-- (?:run|not-run)\b")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
#: Lines that are commands: a text block holding one would hide it from these tests.
COMMAND_LINE = re.compile(r"^\s*(?:\$ )?(?:python3?|make|torchrun|\.venv/bin/\w+|OMP_NUM_THREADS=\S+)\s")
TIMEOUT = {"fast": 600, "slow": 3600}


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md, every page under docs/, and the configs' READMEs (included into the site)."""
    return [
        root / "README.md",
        *sorted((root / "docs").rglob("*.md")),
        *sorted((root / "configs").rglob("README.md")),
    ]


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # "fast", "slow", "own-loop", "not-run", or None
    reason: str | None
    exit: int  # the exit status the block must end with (``; exit N`` in its marker; default 0)
    before: str  # the line right before the fence

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, each with the marker on the line before its fence."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group("lang")
        i += 1
        body = []
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        before = lines[start - 1].strip() if start else ""
        mm = MARKER.match(before)
        marker = (mm.group("run") or "not-run") if mm else None
        status = int(mm.group("exit")) if mm and mm.group("exit") else 0
        code = "\n".join(body) + "\n"
        out.append(Block(path, start + 1, lang, code, marker, mm and mm.group("reason"), status, before))
        i += 1
    return out


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path)]


def _params(kind: str) -> list:
    marks = [pytest.mark.slow] if kind == "slow" else []
    return [pytest.param(b, id=b.id, marks=marks) for b in all_blocks() if b.marker == kind]


# ------------------------------------------------------------------------------------------ the convention


def test_every_block_is_run_or_marked() -> None:
    problems = []
    for b in all_blocks():
        if not b.lang:
            problems.append(
                f"{b.id}: a fence without a language (use text for output, bash or python for code)"
            )
        elif b.lang in RUNNABLE and b.marker is None:
            problems.append(f"{b.id}: a {b.lang} block needs a marker on the line before it: {b.before!r}")
        elif b.lang in RUNNABLE and b.marker == "own-loop" and b.lang != "python":
            problems.append(f"{b.id}: run: own-loop is for python blocks")
        elif b.lang not in RUNNABLE and ANY_MARKER.match(b.before):
            problems.append(f"{b.id}: a run marker before a {b.lang} block, which is never run")
        elif b.lang not in RUNNABLE:
            commands = [line for line in b.code.splitlines() if COMMAND_LINE.match(line)]
            if commands:
                problems.append(
                    f"{b.id}: a {b.lang} block holds commands, which would not be run: {commands[0]!r}"
                )
    for path in doc_files():  # a marker that is not right before a fence marks nothing
        lines = path.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines):
            if ANY_MARKER.match(line.strip()):
                if not MARKER.match(line.strip()):
                    problems.append(f"{path.relative_to(ROOT)}:{n + 1}: malformed marker {line.strip()!r}")
                elif n + 1 >= len(lines) or not FENCE.match(lines[n + 1]):
                    problems.append(f"{path.relative_to(ROOT)}:{n + 1}: a marker not followed by a fence")
    assert not problems, "\n".join(problems)


def test_the_convention_is_in_use() -> None:
    """The README's own loop runs; the pages have fast, slow and not-run blocks: the parser sees them."""
    kinds = {b.marker for b in all_blocks()}
    assert {"fast", "slow", "own-loop", "not-run"} <= kinds, kinds
    readme = blocks(ROOT / "README.md")
    assert any(b.marker == "own-loop" for b in readme)


# ------------------------------------------------------------------------------------------ running them


def _sandbox(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy2(ROOT / "train.py", work / "train.py")
    shutil.copytree(ROOT / "scripts", work / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("configs", "src"):
        (work / name).symlink_to(ROOT / name, target_is_directory=True)
    for folder in (work / "bin", work / ".venv" / "bin"):
        folder.mkdir(parents=True)
        wrapper = folder / "python"
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        wrapper.chmod(0o755)
    return work


def _needs_setup(code: str) -> bool:
    targets = re.findall(r"^\s*make\s+([\w-]+)", code, flags=re.M)
    return any(t != "help" for t in targets)


def run_block(block: Block, tmp_path: Path, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1")
    if block.lang in SHELL and re.search(r"^\s*make\b", block.code, flags=re.M):
        stamp = ROOT / ".venv" / ".installed"
        if _needs_setup(block.code) and (
            not stamp.exists() or stamp.stat().st_mtime < (ROOT / "pyproject.toml").stat().st_mtime
        ):
            pytest.skip(
                "this block runs make targets, which need `make setup` in this checkout "
                "(.venv is missing or older than pyproject.toml)"
            )
        cwd = ROOT
    else:
        cwd = _sandbox(tmp_path)
        env["PATH"] = f"{cwd / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if block.lang == "python":
        args = [sys.executable, "-c", block.code]
    else:
        args = ["bash", "-euo", "pipefail", "-c", block.code]
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _check(done: subprocess.CompletedProcess, block: Block) -> None:
    assert done.returncode == block.exit, (
        f"{block.id} failed (exit {done.returncode}):\n{block.code}\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-3000:]}"
    )


@pytest.mark.parametrize("block", _params("fast"))
def test_fast_block_runs(block: Block, tmp_path: Path) -> None:
    _check(run_block(block, tmp_path, TIMEOUT["fast"]), block)


@pytest.mark.parametrize("block", _params("slow"))
def test_slow_block_runs(block: Block, tmp_path: Path) -> None:
    _check(run_block(block, tmp_path, TIMEOUT["slow"]), block)


@pytest.mark.parametrize("block", _params("own-loop"))
def test_own_loop_block_runs(block: Block) -> None:
    """The block runs as written with its one device string set to the CPU, on real FP16 autocast, and
    trains: every weight moves, the scales are finite, the steps after the first reuse them."""
    assert block.code.count('"cuda"') == 1, "one device string, so a reader (and this test) changes one place"
    code = block.code.replace('"cuda"', '"cpu"')
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    )
    initial = [p.detach().clone() for p in model.parameters()]
    loader = [(torch.randn(4, 3, 6, 6), torch.randint(0, 3, (4,))) for _ in range(3)]
    logits_dtypes = []

    def criterion(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits_dtypes.append(logits.dtype)
        return F.cross_entropy(logits, target)

    namespace = {"model": model, "loader": loader, "criterion": criterion, "__name__": "docs_own_loop"}
    exec(compile(code, block.id, "exec"), namespace)  # noqa: S102

    scaler = namespace["scaler"]
    assert logits_dtypes == [torch.float16] * 3  # real FP16 autocast reached the model, every step
    assert scaler.is_enabled() and scaler.skipped_steps == 0
    assert scaler.last_pass == "reuse"  # update_every=100: the last steps reused the first one's scales
    params = list(namespace["model"].parameters())
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in params)
    assert all(not torch.equal(p, q) for p, q in zip(params, initial, strict=True))  # every weight trained
    scales = scaler.layer_scales()
    assert len(scales) == 2 and all(math.isfinite(a) and a > 0 for a in scales.values())
