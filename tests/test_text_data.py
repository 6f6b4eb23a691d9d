"""The text datasets: the standard library corpus (fixed selection and split, sizes, windows) and
memory-mapped token files (scripts/prepare_tokens.py, the loader, its errors)."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from adaloss.errors import ConfigError
from adaloss.runner.data import build_datasets, make_loader
from adaloss.runner.data.text import TokenWindows, pystdlib_files
from conftest import ROOT


def _fake_stdlib(folder: Path, n: int = 12) -> list[bytes]:
    """``n`` source files plus the files the corpus must skip; returns the kept files' bytes by name."""
    folder.mkdir()
    kept = []
    for i in range(n):
        data = f"# module {i:02d}\n".encode() + bytes(range(32, 127)) * (i + 1)
        (folder / f"mod{i:02d}.py").write_bytes(data)
        kept.append(data)
    (folder / "_sysconfigdata__linux_x86_64-linux-gnu.py").write_text("build_time_vars = {}\n")
    (folder / "sitecustomize.py").write_text("import apport\n")
    (folder / "notes.txt").write_text("not python\n")
    (folder / "pkg").mkdir()
    (folder / "pkg" / "inner.py").write_text("# in a package: not part of the corpus\n")
    return kept


def test_pystdlib_split_is_by_whole_files_and_fixed(tmp_path: Path) -> None:
    kept = _fake_stdlib(tmp_path / "lib")
    cfg = {"name": "pystdlib", "block_size": 8, "stdlib": str(tmp_path / "lib"), "val_windows": None}
    train, val, info = build_datasets(cfg, tmp_path)
    # every 10th file (the 10th of 12) is validation, the other 11 training, in sorted order
    assert info.source["files"] == 12 and info.source["val_files"] == 1 and info.source["train_files"] == 11
    assert bytes(train.tokens.tolist()) == b"".join(kept[:9] + kept[10:])
    assert bytes(val.tokens.tolist()) == kept[9]
    assert (
        info.vocab_size == info.num_classes == 256 and info.block_size == 8 and info.task == "language_model"
    )
    assert len(train) == len(kept[0] * 0) + info.source["train_tokens"] - 8  # every offset is a window
    assert len(val) == (len(kept[9]) - 9) // 8 + 1  # non-overlapping validation windows
    again = build_datasets(cfg, tmp_path)[2]
    assert again.source == info.source  # same files, same digest
    (tmp_path / "lib" / "mod03.py").write_bytes(b"# changed\n" * 30)
    assert build_datasets(cfg, tmp_path)[2].source["sha256"] != info.source["sha256"]


def test_windows_are_the_next_byte_targets(tmp_path: Path) -> None:
    data = torch.arange(0, 50, dtype=torch.uint8)
    windows = TokenWindows(data, block_size=8, stride=3)
    assert len(windows) == (50 - 9) // 3 + 1
    x, y = windows[2]
    assert x.dtype == torch.int64 and x.tolist() == list(range(6, 14)) and y.tolist() == list(range(7, 15))
    x, y = windows[len(windows) - 1]
    assert int(y[-1]) <= 49
    loader = make_loader(windows, batch_size=4, train=True, seed=0)
    xb, yb = next(iter(loader))
    assert xb.shape == yb.shape == (4, 8) and torch.equal(xb[:, 1:], yb[:, :-1])
    with pytest.raises(ConfigError, match="shorter than one window"):
        TokenWindows(data[:8], block_size=8)


def test_the_real_standard_library_corpus() -> None:
    """What runs on this machine and CI (CPython 3.11): a fixed, sorted selection of the stdlib's own
    top-level modules, 0.4 MB of it for validation, never the platform's _sysconfigdata."""
    files = pystdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert Path(sysconfig.get_paths()["stdlib"]) == files[0].parent
    names = {p.name for p in files}
    assert {"os.py", "functools.py", "typing.py"} <= names
    assert not [n for n in names if n.startswith(("_sysconfigdata", "sitecustomize"))]
    train, val, info = build_datasets(
        {"name": "pystdlib", "block_size": 64, "val_windows": 256}, "/nonexistent"
    )
    source = info.source
    assert source["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert source["files"] == len(files) and source["val_files"] == len(files) // 10
    assert source["train_tokens"] + source["val_tokens"] == sum(p.stat().st_size for p in files)
    assert 0.05 < source["val_tokens"] / source["train_tokens"] < 0.2
    assert len(val) == 256 and len(train) == source["train_tokens"] - 64
    x, _ = val[0]
    assert bytes(x.tolist()).decode("utf-8", errors="replace").strip()  # real text


def _prepare(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "prepare_tokens.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def test_prepare_tokens_and_the_memmap_loader(tmp_path: Path) -> None:
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(12):
        (texts / f"doc{i:02d}.txt").write_text(
            f"document {i}: " + "héllo wörld " * (20 + i), encoding="utf-8"
        )
    done = _prepare(tmp_path, str(texts), "--out", str(tmp_path / "data" / "tokens"))
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "data" / "tokens" / "meta.json").read_text())
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16" and meta["files"] == 12
    train_ids = np.fromfile(tmp_path / "data" / "tokens" / "train.bin", dtype=np.uint16)
    expected = "".join((texts / f"doc{i:02d}.txt").read_text(encoding="utf-8") for i in range(11)).encode()
    assert bytes(train_ids.astype(np.uint8)) == expected  # the last of 12 files (10%) is validation
    train, val, info = build_datasets({"name": "tokens", "block_size": 16, "stride": 16}, tmp_path / "data")
    assert isinstance(train.tokens, np.memmap) and info.vocab_size == 256
    assert info.source["train_tokens"] == len(expected) and len(train) == (len(expected) - 17) // 16 + 1
    x, y = train[1]
    assert bytes(x.tolist()) == expected[16:32] and bytes(y.tolist()) == expected[17:33]


def test_missing_or_bad_token_files_are_one_line_errors(tmp_path: Path) -> None:
    cfg = {"name": "tokens", "block_size": 4, "folder": "corpus"}
    with pytest.raises(ConfigError) as info:
        build_datasets(cfg, tmp_path)
    message = str(info.value)
    assert "token files not found" in message and "scripts/prepare_tokens.py" in message
    assert str(tmp_path / "corpus") in message and "\n" not in message
    folder = tmp_path / "corpus"
    folder.mkdir()
    np.arange(100, dtype=np.uint16).tofile(folder / "train.bin")
    (folder / "val.bin").write_bytes(b"\x01\x00\x02")  # 3 bytes: not whole uint16 ids
    with pytest.raises(ConfigError, match="not a whole number of uint16"):
        build_datasets({**cfg, "vocab_size": 256}, tmp_path)
    np.array([1, 2, 3, 300, 4, 5], dtype=np.uint16).tofile(folder / "val.bin")
    with pytest.raises(ConfigError, match="vocabulary size of .* is unknown"):
        build_datasets(cfg, tmp_path)  # no meta.json, no dataset.vocab_size
    with pytest.raises(ConfigError, match="token id 300, outside a vocabulary of 256"):
        build_datasets({**cfg, "vocab_size": 256}, tmp_path)
    assert (
        len(build_datasets({**cfg, "vocab_size": 512}, tmp_path)[0]) == (100 - 5) // 4 + 1
    )  # stride: block_size
