"""Read what W&B wrote: the records of an offline run's ``run-<id>.wandb`` file, for tests.

W&B stores a run as a LevelDB-style log of protobuf ``Record`` messages (``wandb.proto.wandb_internal_pb2``):
a 7-byte header (``:W&B``, a 2-byte magic, a version byte), then 32 KiB blocks of chunks, each with a
4-byte checksum, a 2-byte little-endian length and a type byte (1: a whole record, 2/3/4: first, middle and
last piece of one). These are the bytes ``wandb sync`` uploads, so a test that reads them checks what the
W&B server would receive, not what our code meant to send.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7
_CHUNK_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    """The ``Record`` messages of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B data file"
    pos, pending = _HEADER, b""
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # the rest of a block too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        pending += data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _set(target: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value


def _items(items: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        keys = list(item.nested_key) or [item.key]
        _set(out, keys, json.loads(item.value_json))
    return out


@dataclass
class OfflineRun:
    """One offline run folder (``<run dir>/wandb/offline-run-*``) as W&B recorded it."""

    folder: Path
    run: Any = None  # the RunRecord: run_id, group, tags, config
    metrics: dict[str, set[str]] = field(default_factory=dict)  # define_metric: name or glob -> summary ops
    history: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> logged values (merged)
    summary: dict[str, Any] = field(default_factory=dict)  # the final run summary
    exited: bool = False  # an exit record: the run was finished

    @classmethod
    def read(cls, folder: Path) -> OfflineRun:
        (data,) = Path(folder).glob("run-*.wandb")
        out = cls(folder=Path(folder))
        for record in records(data):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out.run = record.run
            elif kind == "metric":
                name = record.metric.name or record.metric.glob_name
                ops = {
                    op for op in ("min", "max", "mean", "last", "first") if getattr(record.metric.summary, op)
                }
                out.metrics[name] = ops
            elif kind == "history":
                values = _items(record.history.item)
                step = int(values.pop("_step", record.history.step.num))
                out.history.setdefault(step, {}).update(values)
            elif kind == "summary":
                for item in record.summary.update:
                    _set(out.summary, list(item.nested_key) or [item.key], json.loads(item.value_json))
            elif kind == "exit":
                out.exited = True
        return out

    @property
    def config(self) -> dict[str, Any]:
        return {item.key: json.loads(item.value_json) for item in self.run.config.update}

    def media(self, value: dict[str, Any]) -> Path:
        """The file a logged table or image points to (``{"_type": ..., "path": "media/..."}``)."""
        return self.folder / "files" / value["path"]

    def table(self, value: dict[str, Any]) -> list[dict[str, Any]]:
        """A logged ``wandb.Table`` as a list of row dicts."""
        content = json.loads(self.media(value).read_text())
        return [dict(zip(content["columns"], row, strict=True)) for row in content["data"]]


def offline_runs(run_dir: Path) -> list[OfflineRun]:
    """Every offline W&B run under ``<run_dir>/wandb``, oldest first."""
    return [OfflineRun.read(f) for f in sorted(Path(run_dir, "wandb").glob("offline-run-*"))]
