"""The Node.js client package (services/transferqueue/client/node) as tests use it: its npm dependencies
installed once per session (the `node_client` fixture in tests/conftest.py), and its example scripts run
with JSON out."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "services" / "transferqueue" / "client" / "node"
NPM_TIMEOUT_S = 300
NODE_TIMEOUT_S = 60


def install_node_package() -> pathlib.Path:
    """The package with its npm dependencies installed (CI machines start clean)."""
    installed = PACKAGE / "node_modules" / ".package-lock.json"
    lock = PACKAGE / "package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail("node is installed but npm is not: cannot install the Node client's dependencies")
        try:
            done = subprocess.run(
                [npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"],
                cwd=PACKAGE,
                capture_output=True,
                text=True,
                timeout=NPM_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"npm ci in {PACKAGE} took more than {NPM_TIMEOUT_S} s")
        if done.returncode != 0:
            pytest.fail(
                f"npm ci in {PACKAGE} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
    return PACKAGE


def run_node(package: pathlib.Path, script: str, *args: str, expect_rc: int = 0, env: dict | None = None) -> dict:
    done = subprocess.run(
        ["node", str(package / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=NODE_TIMEOUT_S,
        env={**os.environ, "NODE_NO_WARNINGS": "1", **(env or {})},
    )
    assert done.returncode == expect_rc, f"node {script} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def cli(package, command: str, controller: str, *args: str, expect_rc: int = 0, env: dict | None = None) -> dict:
    return run_node(package, "cli.mjs", command, "--controller", controller, *args, expect_rc=expect_rc, env=env)
