"""Where the data shipped inside the package (`kvsched/data/`) is read from."""

from __future__ import annotations

from pathlib import Path


def data_path(*parts: str) -> Path:
    """`kvsched/data/<parts>`, found beside this module.

    Not `importlib.resources.files("kvsched")`: that looks the package up by its name, and with
    an editable install, run from a folder that holds a directory named `kvsched` (what
    `git clone` makes), the name resolves to that directory as a namespace package, which
    holds none of the data (Python 3.11 then fails in `MultiplexedPath.joinpath`)."""
    return Path(__file__).parent.joinpath("data", *parts)
