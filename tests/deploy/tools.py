"""The deploy checks' tools, from `.venv-deploy/` (made by `scripts/setup`): a check whose tool
is missing is skipped, saying how to get it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
DEPLOY = ROOT / "deploy"
TOOLS = ROOT / ".venv-deploy" / "bin"


def tool(name: str) -> Path:
    """The path of `name` in `.venv-deploy/bin`; skips the calling test when it is missing."""
    path = TOOLS / name
    if not path.exists():
        pytest.skip(f"{name} is missing: scripts/setup makes .venv-deploy/ with it")
    return path


def run_tool(name: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run `name` with `args` from the repository root; its output is captured as text."""
    return subprocess.run(
        [str(tool(name)), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
