"""The CPU allocator tuning the trainer and the bench apply (:mod:`adaloss.runner.utils.allocator`)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_cpu_allocator_tuning_applies_once_and_can_be_turned_off():
    """glibc's mallopt accepts the settings (Linux); ADALOSS_TUNE_MALLOC=0 leaves malloc alone."""
    code = (
        "from adaloss.runner.utils.allocator import tune_cpu_allocator\n"
        "print(tune_cpu_allocator(), tune_cpu_allocator())\n"
    )
    on = _run(code, dict(os.environ))
    off = _run(code, {**os.environ, "ADALOSS_TUNE_MALLOC": "0"})
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    expected = "True True" if glibc else "False False"
    assert on.stdout.split() == expected.split()
    assert off.stdout.split() == ["False", "False"]
