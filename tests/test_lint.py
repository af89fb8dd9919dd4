"""The code passes the project's lint rules and is in its format (ruff, configured in pyproject.toml's [tool.ruff]):
unused imports and variables, undefined names, mutable defaults and the like fail the suite, not a later reader, and
so does code that `ruff format` would rewrite."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "services", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_changes_nothing():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "services", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, "run `ruff format services tests benchmarks`:\n" + done.stdout + done.stderr
