"""Writing a run's result file so that a reader never sees half of it."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any


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


def write_json_atomic(path: str | os.PathLike[str], data: Mapping[str, Any]) -> Path:
    """Write ``data`` as JSON to ``path`` atomically: a temporary file in its folder, then ``os.replace``.

    A crash mid-write leaves either the old file or none, never a truncated one, so the presence of
    ``metrics.json`` can mark a finished run (as DomainBed's ``done`` file does). Cost: one fsync.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_jsonable(data), f, indent=2, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
