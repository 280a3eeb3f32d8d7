"""The linters people expect, run as tests so CI keeps them green: ruff's lint and format
check over the repository, and mypy over the fully typed packages (pyproject.toml configures
all three)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (it comes with the [test] extra)")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_lint() -> None:
    done = _run("ruff", "check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_format() -> None:
    done = _run("ruff", "format", "--no-cache", "--check", ".")
    assert done.returncode == 0, "run `ruff format .`:\n" + done.stdout[-4000:] + done.stderr[-2000:]


def test_mypy_on_typed_packages() -> None:
    done = _run("mypy", "--no-incremental")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
