"""Building the compiled prefix index and scoring: without a C compiler the build names the
missing one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_missing_compiler_is_named(tmp_path: Path) -> None:
    env = {**os.environ, "CC": "no-such-cc"}
    dirs = ["--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")]
    out = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", *dirs],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode != 0
    assert "C compiler 'no-such-cc' not found" in out.stderr + out.stdout
    assert "apt-get install gcc python3-dev" in out.stderr + out.stdout
    assert not list((tmp_path / "lib").rglob("*.so"))


def test_the_compiled_index_is_built() -> None:
    from kvsched.core._holdings import Holdings  # noqa: PLC0415  (the import is the test)

    assert len(Holdings(1)) == 0


def test_the_compiled_scoring_is_built() -> None:
    from kvsched.core import _scoring  # noqa: PLC0415  (the import is the test)

    assert _scoring.masked_min.__doc__
