"""The launcher's log files: owner-only, whatever the umask."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from services.launcher.supervisor import make_log_dir, open_log


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_logs_are_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    fresh = tmp_path / "run" / "logs"
    reused = tmp_path / "reused"  # a `--run-dir` given again: its logs exist, readable by all
    reused.mkdir(mode=0o755)
    (reused / "router-0.log").write_bytes(b"the last run's log")
    (reused / "router-0.log").chmod(0o644)
    umask = os.umask(0)  # the most permissive: nothing is taken off the modes asked for
    try:
        for logs in (fresh, reused):
            make_log_dir(logs)
            with open_log(logs / "router-0.log") as log:
                command = [sys.executable, "-c", "print('serving')"]
                subprocess.run(command, stdout=log, check=True, timeout=60)
    finally:
        os.umask(umask)
    for logs in (fresh, reused):
        assert mode(logs) == 0o700
        assert mode(logs / "router-0.log") == 0o600
        assert (logs / "router-0.log").read_bytes() == b"serving\n"  # written from the start
