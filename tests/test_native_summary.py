"""``make test`` says in its last line whether the native FP16 rounding kernel was tested,
and where they are required (``ADALOSS_REQUIRE_NATIVE=1``, set by ``.ci/run``, or ``CI``) a skip is an
error (``tests/conftest.py``). Checked on a pytest run of one test of ``test_native.py`` in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from adaloss.numerics import native
from conftest import ROOT, native_required

ONE_TEST = "tests/test_native.py::test_round_f16_is_bit_identical_to_torch_casts"


def _pytest(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("CI", "ADALOSS_REQUIRE_NATIVE", "ADALOSS_NATIVE")
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", ONE_TEST]
    return subprocess.run(
        command, cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=300
    )


def test_a_skipped_native_path_is_said_in_the_last_line() -> None:
    done = _pytest(ADALOSS_NATIVE="0", ADALOSS_REQUIRE_NATIVE="0")
    assert done.returncode == 0, done.stdout[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert (
        last == "native paths: native FP16 kernels NOT TESTED: 1 test skipped (disabled by ADALOSS_NATIVE=0)"
    )


def test_where_required_a_skipped_native_path_fails_the_run() -> None:
    done = _pytest(ADALOSS_NATIVE="0", CI="true")  # CI alone requires them
    assert done.returncode == 1, done.stdout[-2000:]
    assert (
        "native FP16 kernels are required (ADALOSS_REQUIRE_NATIVE=1 or CI is set) but unavailable"
        in done.stdout
    )
    assert "ERROR " + ONE_TEST in done.stdout
    assert (
        done.stdout.strip()
        .splitlines()[-1]
        .startswith("native paths: native FP16 kernels required but missing")
    )


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")
def test_a_tested_native_path_is_said_in_the_last_line() -> None:
    done = _pytest(ADALOSS_REQUIRE_NATIVE="1")
    assert done.returncode == 0, done.stdout[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last == "native paths: native FP16 kernels tested (1 test of test_native.py passed)"


@pytest.mark.parametrize(
    ("env", "required"),
    [
        ({}, False),
        ({"CI": "true"}, True),
        ({"CI": "false"}, False),
        ({"ADALOSS_REQUIRE_NATIVE": "1"}, True),
        ({"CI": "1", "ADALOSS_REQUIRE_NATIVE": "0"}, False),
    ],  # fmt: skip
)
def test_when_the_native_paths_are_required(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], required: bool
) -> None:
    for key in ("CI", "ADALOSS_REQUIRE_NATIVE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert native_required() is required
