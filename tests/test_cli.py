"""The `kvsched` command itself: its version and its list of commands."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from services import cli


def test_version_prints_the_installed_packages_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"kvsched {version('kvsched')}\n"


def test_an_unknown_command_prints_the_commands_and_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvsched [--version] {replay,knee,") and "conductor" in err
