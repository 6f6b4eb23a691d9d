"""What produced a run: the code, the packages, the hardware and the numerics settings.

``metrics.json`` carries this as its ``provenance`` block, so a number in a table can be traced to the commit
that computed it and to the machine it ran on, and two runs that disagree can be checked for a difference in
torch version, device or TF32 before anyone looks at the code. Everything is read once, when training starts
(the code a process runs is the code it imported then, whatever happens to the checkout afterwards).

Cost: two ``git`` calls (``rev-parse`` and ``status``; tens of milliseconds, bounded by a timeout) and a read
of ``/proc/cpuinfo``. Nothing here raises: a field that cannot be read is ``None``, and for git a ``git_note``
says why in words (``"not a git checkout: ..."``, ``"git is not installed"``).
"""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "KERNEL_CAPS",
    "collect_provenance",
    "cpu_isa",
    "cpu_name",
    "cpu_vendor",
    "device_name",
    "git_state",
    "kernel_key",
    "kernel_path",
    "pin_kernel_path",
    "result_record",
]

#: Seconds each git call may take (a network file system can stall); past it the state is reported unknown.
GIT_TIMEOUT_S = 5.0


def git_state(path: str | Path | None = None) -> dict[str, Any]:
    """``{"git_commit", "git_dirty", "git_note"}`` of the checkout holding ``path`` (default: this package).

    ``git_dirty`` is True when tracked files differ from the commit (staged or not); untracked files do not
    count, since every run folder, cache and data set beside the code would otherwise make it dirty. Outside
    a git checkout (a wheel installed into site-packages, a copied folder), or without git, the commit and
    the flag are ``None`` and ``git_note`` says which case it is; in a checkout ``git_note`` is ``None``.
    """
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    unknown = {"git_commit": None, "git_dirty": None}

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", "-C", str(where), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            reason = " ".join(head.stderr.split()) or f"git rev-parse exited with {head.returncode}"
            if "not a git repository" in reason:
                return {**unknown, "git_note": f"not a git checkout: {where}"}
            return {**unknown, "git_note": f"git could not read the commit of {where}: {reason}"}
        status = git("status", "--porcelain", "--untracked-files=no")
    except FileNotFoundError:
        return {**unknown, "git_note": "git is not installed, so the commit is unknown"}
    except (OSError, subprocess.TimeoutExpired) as error:
        return {**unknown, "git_note": f"git failed ({type(error).__name__}: {error})"}
    dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    note = None if dirty is not None else f"git status failed: {' '.join(status.stderr.split())}"
    return {"git_commit": head.stdout.strip(), "git_dirty": dirty, "git_note": note}


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else what ``platform`` reports."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device: Any) -> str:
    """The CUDA device's name for a CUDA ``torch.device``, else the CPU's model name."""
    import torch

    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return cpu_name()


#: The environment variables that cap the instruction set of each CPU kernel library torch calls: ATen's own
#: vectorized kernels (read when torch starts), oneDNN's convolutions and matrix products (read at its first
#: call) and MKL's BLAS (``MKL_ENABLE_INSTRUCTIONS`` caps the dispatch, ``MKL_CBWR`` fixes one code path
#: whatever the CPU: Intel's "conditional numerical reproducibility"). Values for AVX2, in their spelling.
KERNEL_CAPS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "MKL_CBWR": "AVX2",
}


def cpu_isa() -> str:
    """The widest x86 vector instruction set the CPU offers, as torch's CPU capability names it:
    ``avx512`` (AVX-512 F, BW, VL and DQ, what ATen's AVX512 kernels need), ``avx2``, else ``default``
    (no ``/proc/cpuinfo``, or another architecture)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            flags = next(
                (set(line.split(":", 1)[1].split()) for line in handle if line.startswith("flags")), set()
            )
    except OSError:
        return "default"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "default"


def cpu_vendor() -> str | None:
    """``/proc/cpuinfo``'s ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``), or None: MKL picks its code
    path by vendor as well as by instruction set."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            return next(
                (line.split(":", 1)[1].strip() for line in handle if line.startswith("vendor_id")), None
            )
    except OSError:
        return None


def kernel_path() -> dict[str, Any]:
    """The CPU kernel path of this process: what decides the bits of a CPU result besides the code.

    ``torch_cpu_capability`` (``torch.backends.cpu.get_cpu_capability()``: ATen's vectorized kernels, whose
    reductions sum in an order set by the vector width), ``cpu_isa`` (:func:`cpu_isa`), the caps in effect
    (:data:`KERNEL_CAPS`' variables, ``None`` when unset), ``blas`` (torch's BLAS build setting: ``mkl``
    here), ``threads`` (``torch.get_num_threads()``: a parallel reduction splits by it) and ``key``
    (:func:`kernel_key`). Two CPU runs of the same code and settings agree bit for bit when their keys are
    equal (measured on issue 44's machines); across keys the numbers move by float rounding, and a short
    training run can end elsewhere.
    """
    import os

    import torch

    config = torch.__config__.show()
    blas = next(
        (part.split("=", 1)[1] for part in config.replace(",", " ").split() if part.startswith("BLAS_INFO=")),
        None,
    )
    path: dict[str, Any] = {
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_isa": cpu_isa(),
        "cpu_vendor": cpu_vendor(),
        **{name.lower(): os.environ.get(name) for name in KERNEL_CAPS},
        "blas": blas,
        "threads": torch.get_num_threads(),
    }
    path["key"] = kernel_key(path)
    return path


def kernel_key(path: dict[str, Any]) -> str:
    """One line naming a kernel path (:func:`kernel_path`'s dict): the instruction set each library runs
    (its cap when set, else the CPU's), MKL's with the CPU's vendor (MKL's reproducible ``MKL_CBWR`` branches
    are Intel's; on other CPUs MKL keeps its own dispatch), and the thread count, as
    ``aten=AVX2 onednn=AVX2 mkl=AVX2/AuthenticAMD threads=2``. Equal keys: the same kernels."""
    isa = str(path.get("cpu_isa") or "default").upper()
    onednn = path.get("onednn_max_cpu_isa") or isa
    mkl = path.get("mkl_cbwr") or path.get("mkl_enable_instructions") or isa
    return (
        f"aten={str(path.get('torch_cpu_capability')).upper()} onednn={str(onednn).upper()} "
        f"mkl={str(mkl).upper()}/{path.get('cpu_vendor') or 'unknown'} threads={path.get('threads')}"
    )


def pin_kernel_path(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Cap torch's, oneDNN's and MKL's CPU kernels at AVX2 (:data:`KERNEL_CAPS`) in ``environ`` (default
    ``os.environ``), so a result reproduces bit for bit on an AVX2 and on an AVX-512 CPU. Returns the caps.

    ATen reads its cap once, when torch is first imported: call this before ``import torch`` (a process
    that already imported torch raises ``RuntimeError``; set the variables for a child process instead).
    A variable already set is left as it is (the user's choice wins). Does not sync (no device)."""
    import os
    import sys

    target = os.environ if environ is None else environ
    if target is os.environ and "torch" in sys.modules:
        raise RuntimeError(
            "pin_kernel_path() after torch was imported: ATen has read ATEN_CPU_CAPABILITY already; call it "
            "first, or pass the environment of a child process"
        )
    for name, value in KERNEL_CAPS.items():
        target.setdefault(name, value)
    return {name: target[name] for name in KERNEL_CAPS}


def result_record(command: str, commit: str | None = None, root: str | Path | None = None) -> dict[str, Any]:
    """What a committed result file records about what made it: ``commit`` (the code's, default the
    checkout's HEAD), ``dirty`` (tracked files changed), ``command`` (what regenerates it), ``kernel_path``
    (:func:`kernel_path` of this process), ``cpu`` and ``torch``."""
    import torch

    state = git_state(root)
    return {
        "commit": commit or state["git_commit"],
        "dirty": False if commit else state["git_dirty"],
        "command": command,
        "kernel_path": kernel_path(),
        "cpu": cpu_name(),
        "torch": torch.__version__,
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _torchvision_version() -> str | None:
    try:
        import torchvision
    except ImportError:
        return None
    return str(torchvision.__version__)


def collect_provenance(device: Any, precision: Any = None) -> dict[str, Any]:
    """The ``provenance`` block of ``metrics.json``.

    Args:
        device (torch.device): the training device.
        precision (adaloss.precision.Precision, optional): the run's precision; gives ``precision`` (its
            name), ``precision_mode`` (``autocast``: real FP16/BF16 kernels, CUDA's or the CPU's;
            ``emulated``: FP32 compute rounded to the format, the CPU's default; ``native``: FP32) and
            ``emulated`` (True when the low-precision format was emulated: what "FP16" means for a CPU run).

    Returns a dict of plain JSON values: ``git_commit``, ``git_dirty``, ``git_note``, ``python``, ``torch``,
    ``torchvision``, ``adaloss`` (versions; ``None`` if not installed), ``cuda`` (torch's CUDA version or
    ``None``), ``device`` (``cpu``, ``cuda:0``), ``device_name``, ``cpu`` (also on CUDA), the precision
    fields above, and ``tf32`` ``{"matmul": bool, "cudnn": bool, "float32_matmul_precision": str}``: the
    settings in effect (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``),
    which decide whether FP32 matrix products on Ampere or newer GPUs round their inputs to 10 mantissa bits.
    """
    import torch  # here, not at the top: the scripts import cpu_name without paying for torch

    info: dict[str, Any] = dict(git_state())
    info.update(
        python=platform.python_version(),
        torch=torch.__version__,
        torchvision=_torchvision_version(),
        adaloss=_version("adaloss"),
        cuda=torch.version.cuda if torch.cuda.is_available() else None,
        device=str(device),
        device_name=device_name(device),
        cpu=cpu_name(),
        kernel_path=kernel_path(),
    )
    if precision is not None:
        mode = "autocast" if precision.uses_autocast else ("emulated" if precision.emulated else "native")
        info.update(
            precision=precision.name,
            precision_mode=mode,
            emulated=bool(precision.emulated),
        )
    info["tf32"] = {
        "matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    return info
