"""Writing a run's result file so that a reader never sees half of it."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO


def _jsonable(value: Any) -> Any:
    """Plain JSON values: tensors and NumPy scalars become numbers, Inf/NaN become null (JSON has neither)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # torch / numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_atomic(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> Path:
    """Create ``path`` atomically: ``write(handle)`` fills a temporary file in the same folder, which is
    fsynced, given a normal file's mode and renamed over ``path``; the folder is fsynced after the rename.

    A crash at any point leaves either the old file (or none) or the complete new one under ``path``, never a
    truncated one (at most a ``.<name>.*.tmp`` leftover). Cost: one fsync of the file and one of the folder.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it owner-only
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def write_json_atomic(path: str | os.PathLike[str], data: Mapping[str, Any]) -> Path:
    """Write ``data`` as JSON to ``path`` atomically (:func:`write_atomic`).

    The presence of ``metrics.json`` can then mark a finished run (as DomainBed's ``done`` file does).
    """
    text = json.dumps(_jsonable(data), indent=2, allow_nan=False) + "\n"
    return write_atomic(path, lambda handle: handle.write(text.encode("utf-8")))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
