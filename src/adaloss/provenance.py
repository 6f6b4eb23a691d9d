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

__all__ = ["collect_provenance", "cpu_name", "device_name", "git_state"]

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
