"""Fused autograd nodes in C++ for emulated FP16 on the CPU (``_fused.cpp``), built on first use.

Why: emulating FP16 around a conv or linear layer takes several autograd nodes written in Python: the
weight's rounding, the output's rounding, and for the adaptive scaler its scaling node and the rounding of
the incoming gradient. Each costs a Python call in the forward pass and another in the backward pass (a
few microseconds each, about 1 ms per ResNet-20 step), and the adaptive scaler's branch points add one
more per residual block. :func:`gemm` does the same work as one C++ node: FP16 weight, bias and output in
the forward pass; in the backward pass the incoming gradient rounded to FP16 (in place when nothing else
holds it), the input gradient computed from that gradient scaled by ``beta``, and the weight and bias
gradients rounded to FP16 and multiplied by ``inv_alpha``. With ``beta = inv_alpha = 1`` that is the
plain emulated layer every scaler uses (:class:`adaloss.numerics.emulation.EmulatedAutocast` routes
``conv2d`` and ``linear`` here); with a layer's beta and ``1/alpha`` it is the adaptive scaler's layer
on a step that reuses its scales (:mod:`adaloss.adaptive.ops`). :func:`rescale` is the branch point of
such a step: Algorithm 5's rescale-and-sum with the factors of the last recompute. Results are bit for
bit those of the Python nodes (``tests/test_fused.py`` trains with and without).

How: the extension includes torch's C++ headers, so it takes about 25 s to compile (once per machine: it
is cached under ``$ADALOSS_CACHE``, default ``~/.cache/adaloss``, named by a hash of the source, the
compiler and the torch and Python versions, and written atomically). ``make setup`` builds it, so tests
and runs find it ready. Everything falls back to the Python nodes when it cannot be built (no C++
compiler, no torch headers), when the native FP16 kernel is unavailable (:mod:`adaloss.numerics.native`,
whose rounding function it calls), or when ``ADALOSS_NATIVE=0`` or ``ADALOSS_FUSED=0`` is set; and per
call for anything but float32 CPU tensors, an FP16 format and no underflow probe.

None of these functions synchronizes host and device: they only ever touch CPU tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from adaloss.numerics import native

__all__ = ["available", "build", "disabled", "enabled", "gemm", "gemm_spec", "rescale", "status"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_fused.cpp")
_MODULE = "_adaloss_fused"
_ABI = 4
_lock = threading.Lock()
_ext: ModuleType | None = None
_tried = False
_status = "not loaded yet"
_enabled = True


def _off(var: str) -> bool:
    return os.environ.get(var, "1").strip().lower() in ("0", "false", "no", "off")


def _cxx() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _command(cxx: str, out: str) -> list[str]:
    root = Path(torch.__file__).parent
    torch_lib = root / "lib"
    # torch.utils.cpp_extension.include_paths(), without importing that module (it probes for CUDA)
    includes = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]
    includes.append(Path(sysconfig.get_paths()["include"]))
    return [
        cxx,
        "-O2",
        "-std=c++20",
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-DTORCH_EXTENSION_NAME={_MODULE}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-I{p}" for p in includes),
        str(_SOURCE),
        "-o",
        out,
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
        f"-Wl,-rpath,{torch_lib}",
    ]


def _target(cxx: str) -> Path:
    parts = [_SOURCE.read_bytes(), " ".join(_command(cxx, "-")).encode(), torch.__version__.encode()]
    key = hashlib.sha256(b"\0".join([*parts, sys.version.encode(), sys.platform.encode()])).hexdigest()[:16]
    return native._cache_dir() / f"adaloss_fused_{key}.so"


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
    spec = importlib.util.spec_from_file_location(_MODULE, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _load() -> ModuleType | None:
    global _ext, _tried, _status
    with _lock:
        if _tried:
            return _ext
        _tried = True
        if _off("ADALOSS_NATIVE") or _off("ADALOSS_FUSED"):
            _status = "disabled by ADALOSS_NATIVE=0 or ADALOSS_FUSED=0"
            return None
        if not native.available():
            _status = f"needs the native FP16 kernels, which are unavailable ({native.status()})"
            return None
        cxx = _cxx()
        if cxx is None:
            _status = "no C++ compiler (c++, g++ or clang++) on PATH"
            log.info("adaloss: %s; emulated FP16 uses the Python autograd nodes", _status)
            return None
        try:
            target = _target(cxx)
            if not target.exists():
                log.info("adaloss: compiling the fused FP16 nodes (about 25 s, once per machine)")
                native.compile_atomically(lambda out: _command(cxx, out), target, timeout=600)
            try:
                ext = _import(target)
            except ImportError:  # a damaged cache entry: build it again, once
                native.compile_atomically(lambda out: _command(cxx, out), target, timeout=600)
                ext = _import(target)
        except (OSError, ImportError, RuntimeError, subprocess.SubprocessError) as e:
            _status = f"build failed ({e})"
            log.warning("adaloss: fused FP16 nodes unavailable, using the Python nodes: %s", e)
            return None
        if getattr(ext, "ABI", None) != _ABI:
            _status = f"stale extension {target}"
            return None
        lib = native._lib
        names = ("round_f16", "round_scaled_f16", "grad_stats", "weight_factors", "beta", "max_abs")
        ext.set_kernels(*(ctypes.cast(getattr(lib, f"adaloss_{n}"), ctypes.c_void_p).value for n in names))
        _ext = ext
        _status = f"loaded {target}"
        return ext


def available() -> bool:
    """Whether the fused nodes are usable in this process (compiles them on the first call)."""
    return (_ext if _tried else _load()) is not None


def enabled() -> bool:
    """Available and not switched off by :func:`disabled` or :func:`adaloss.numerics.native.disabled`."""
    return _enabled and native._enabled and available()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Build the Python autograd nodes instead of the fused ones inside the block (for comparisons)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def status() -> str:
    """A one-line account of the extension's state (loaded from where, or why not)."""
    available()
    return _status


def build() -> str:
    """Compile the extension now if it is not cached yet (``make setup`` calls this); returns the status."""
    return status()


def gemm_spec(spec: dict[str, Any]) -> Any:
    """The C++ description of a layer from an :func:`adaloss.adaptive.transform._layer_spec`-style dict
    (``kind`` "conv" or "linear"); None for anything else (transposed convolutions stay in Python)."""
    if not available():
        return None
    if spec["kind"] == "linear":
        return _ext.GemmSpec(1, [], [], [], [], 1)  # type: ignore[union-attr]
    if spec["kind"] != "conv" or isinstance(spec["padding"], str):
        return None
    return _ext.GemmSpec(  # type: ignore[union-attr]
        0,
        list(spec["stride"]),
        list(spec["padding"]),
        list(spec["dilation"]),
        [0] * len(spec["stride"]),
        int(spec["groups"]),
    )


def gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    spec: Any,
    round_x: bool,
    round_grad_x: bool,
    beta: float = 1.0,
    inv_alpha: float = 1.0,
    record: torch.Tensor | None = None,
    where: tuple[int, int, int, int] = (),  # type: ignore[assignment]
    consts: tuple[float, float, float, float] = (),  # type: ignore[assignment]
) -> torch.Tensor:
    """One conv/linear layer in emulated FP16 as a single autograd node (module docstring).

    ``round_x``: round the input to FP16 first (it was not stored in FP16 by its producer);
    ``round_grad_x``: also round the input's gradient (what a separate rounding node on the input would
    do). ``beta`` and ``inv_alpha``: the constant scales of a reuse pass. With ``record`` (a float64 CPU
    tensor shared by the pass's nodes) the layer instead computes its beta in the backward pass, as
    Algorithm 4 on host floats: it reads the scale it receives at ``record[where[0]]``, writes the one it
    emits at ``record[where[1]]`` and its beta at ``record[where[2]]``; ``where[3]`` is the rule's
    :attr:`~adaloss.adaptive.rules.ScaleRule.flags` and ``consts`` are the layer's ``(A, B)``
    (:meth:`~adaloss.adaptive.rules.ScaleRule.layer_constants`) and the scale and accumulation bounds
    (inf: none). The caller checks :func:`enabled` and that the tensors are float32 CPU tensors.
    """
    return _ext.gemm(  # type: ignore[union-attr]
        x, weight, bias, spec, round_x, round_grad_x, beta, inv_alpha, record, list(where), list(consts)
    )


def rescale(
    xs: list[torch.Tensor],
    factors: list[float],
    shared: bool,
    record: torch.Tensor | None = None,
    where: list[int] | None = None,
    u_max: float = 0.0,
    reference: bool = False,
) -> list[torch.Tensor]:
    """Identity on ``xs``; the backward pass multiplies each output's gradient by its factor and, if
    ``shared`` (the same tensor once per consumer), returns their sum as the input's gradient.

    With ``record`` the factors come from Algorithm 5 in the backward pass instead: the incoming scales
    are read at ``record[where[4 + i]]``, the common one is written at ``record[where[0]]`` and
    ``record[where[1]]``, the factors from ``record[where[2]]`` on and the incoming scales (NaN for a
    consumer that sent no gradient) from ``record[where[3]]`` on; ``reference`` picks the rule's fallback
    when no incoming scale fits (:func:`adaloss.adaptive.rules.branch_loss_scale`)."""
    return _ext.rescale(xs, factors, shared, record, where or [], u_max, reference)  # type: ignore[union-attr]


if __name__ == "__main__":  # python -m adaloss.numerics.fused: build now and report
    print(f"native kernels: {native.status()}")
    print(f"fused nodes: {build()}")
