"""Fused CPU kernels for the FP16 emulation, compiled from ``_fast.c`` on first use and called with ctypes.

Why: emulating FP16 on the CPU means rounding every stored tensor to FP16. torch does that as two casts
(fp32 -> fp16 -> fp32: two passes and a temporary), and the adaptive scaler then reads each rounded gradient
twice more for Algorithm 4's statistics (its norm, its min and max). The kernels here do the rounding in one
pass, and the rounding plus the statistics in one pass, with the x86 F16C instructions, whose rounding is
IEEE round-to-nearest-even with subnormals kept and overflow to infinity: bit for bit what torch's cast gives
(NaN payloads aside). ``make bench`` prints both against torch on 524,288 floats (on this project's 2-core
Intel Xeon, one thread: rounding 1.4x faster, rounding plus statistics 2.3x) and their effect on whole
training steps.

How: the C file has no torch headers, so it builds with any C compiler in well under a second; the shared
library is cached under ``$ADALOSS_CACHE`` (default ``~/.cache/adaloss``), named by a hash of the source and
the compiler, written atomically so concurrent processes (DDP ranks, multirun jobs) never load a partial
file. Everything falls back to torch ops, with the same results, when there is no compiler, the CPU lacks
AVX2/FMA/F16C, ``ADALOSS_NATIVE=0`` is set, or a tensor is not a contiguous float32 CPU tensor. The kernels
are single-threaded (a second OpenMP runtime beside torch's would compete for the cores), and their
reductions run in a fixed order, so results do not depend on the thread count.

None of these functions synchronizes host and device: they only ever touch CPU tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

__all__ = ["MIN_NUMEL", "available", "disabled", "enabled", "round_f16", "status"]

log = logging.getLogger(__name__)

# Below this many elements the ctypes call saves nothing over torch's casts; keep those.
MIN_NUMEL = 64
_ABI = 11
_SOURCE = Path(__file__).with_name("_fast.c")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_status = "not loaded yet"
_enabled = True


def _cache_dir() -> Path:
    env = os.environ.get("ADALOSS_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "adaloss"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compile_atomically(command: Callable[[str], list[str]], target: Path, timeout: float = 120) -> None:
    """Run ``command(tmp)`` to build ``tmp`` in ``target``'s folder, then rename it to ``target``, so that
    concurrent processes (DDP ranks, multirun jobs) never load a partial file. Raises OSError on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = command(tmp)
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise OSError(f"{' '.join(cmd[:2])} ... failed: {res.stderr.strip()[-800:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(cc: str, target: Path) -> None:
    """Compile ``_fast.c`` into ``target``."""
    compile_atomically(
        lambda out: [cc, "-O3", "-fPIC", "-shared", "-fno-math-errno", str(_SOURCE), "-o", out, "-lm"], target
    )


def _load() -> ctypes.CDLL | None:
    global _lib, _tried, _status
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("ADALOSS_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
            _status = "disabled by ADALOSS_NATIVE=0"
            return None
        if sys.platform != "linux" and sys.platform != "darwin":
            _status = f"not built on {sys.platform}"
            return None
        import platform

        if platform.machine().lower() not in ("x86_64", "amd64"):
            _status = f"needs x86-64 (F16C), this is {platform.machine()}"
            return None
        cc = _compiler()
        if cc is None:
            _status = "no C compiler (cc, gcc or clang) on PATH"
            log.info("adaloss: %s; FP16 emulation uses torch's casts", _status)
            return None
        try:
            key = hashlib.sha256(_SOURCE.read_bytes() + cc.encode() + sys.platform.encode()).hexdigest()[:16]
            target = _cache_dir() / f"adaloss_fast_{key}.so"  # Path.home() raises RuntimeError without HOME
            if not target.exists():
                _build(cc, target)
            try:
                lib = ctypes.CDLL(str(target))
            except OSError:  # a damaged cache entry: build it again, once
                _build(cc, target)
                lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _status = f"build failed ({e})"
            log.warning("adaloss: native FP16 kernels unavailable, using torch's casts: %s", e)
            return None
        if lib.adaloss_fast_abi() != _ABI:
            _status = f"stale library {target} (ABI {lib.adaloss_fast_abi()}, expected {_ABI})"
            return None
        if not lib.adaloss_cpu_ok():
            _status = "this CPU lacks AVX2/FMA/F16C"
            return None
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.adaloss_round_f16.argtypes = [vp, vp, i64]
        lib.adaloss_round_f16.restype = None
        _lib = lib
        _status = f"loaded {target}"
        return lib


def available() -> bool:
    """Whether the kernels are usable in this process (compiles them on the first call)."""
    return (_lib if _tried else _load()) is not None


def status() -> str:
    """A one-line account of the kernels' state (loaded from where, or why not)."""
    available()
    return _status


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Use torch's ops instead of the kernels inside the block (for comparisons and benchmarks)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def enabled() -> bool:
    """Whether the kernels are available and not switched off by :func:`disabled`."""
    return _enabled and available()


def _eligible(x: torch.Tensor) -> bool:
    return (
        _enabled
        and (_lib is not None or (not _tried and _load() is not None))
        and x.dtype is torch.float32
        and x.is_cpu
        and x.numel() >= MIN_NUMEL
        and x.is_contiguous()
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def round_f16(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``fp16(x)`` stored as float32, in one pass; ``out`` may be ``x`` itself (in place). Returns None when
    the kernel does not apply (see the module docstring); the caller then uses torch's casts."""
    if not _eligible(x):
        return None
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _lib.adaloss_round_f16(x.data_ptr(), out.data_ptr(), x.numel())  # type: ignore[union-attr]
    return out
