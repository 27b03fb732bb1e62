"""Each seed's finished knee search kept beside the report, so a run stopped after some seeds
(a machine that is lent for less time than the whole run takes) goes on from the others.

A seed's part is kept as `<out>/seeds/<seed>.json` with the run's key: the digest of what
decides its figures, the run's settings (its flags but the seeds and how it runs, and the
trace file's bytes) and the simulator's own code (every file of the `kvsched` package but
compiled ones, whose sources count). A part whose key differs (another run, or code changed
since) is searched again and replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvsched.sim.report import to_jsonable

PACKAGE = Path(__file__).resolve().parents[1]
SKIPPED_SUFFIXES = (".so", ".pyc")


def code_digest(root: Path = PACKAGE) -> str:
    """SHA-256 over the paths and bytes of the package's files, in path order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.suffix in SKIPPED_SUFFIXES or "__pycache__" in path.parts:
            continue
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def run_key(settings: Mapping[str, Any], code: str) -> str:
    """The key of a run with `settings` (values JSON-able, or by their repr) on code of
    digest `code`."""
    text = json.dumps(settings, sort_keys=True, default=repr)
    return hashlib.sha256(f"{code}\n{text}".encode()).hexdigest()


class SeedParts:
    """The seeds' parts of one run kept under `directory`."""

    def __init__(self, directory: Path, key: str) -> None:
        self.directory = directory
        self.key = key

    def load(self, seeds: tuple[int, ...]) -> dict[int, dict[str, Any]]:
        """The parts of `seeds` kept with this run's key (none for a file that is missing,
        unreadable, or of another run). Changes nothing."""
        parts = {}
        for seed in seeds:
            try:
                kept = json.loads(self._path(seed).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(kept, dict) and kept.get("key") == self.key and "part" in kept:
                parts[seed] = kept["part"]
        return parts

    def save(self, seed: int, part: Mapping[str, Any]) -> None:
        """Keep `seed`'s part, replacing the file whole (a stop mid-write leaves the old)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(seed)
        partial = path.with_suffix(".json.partial")
        body = {"key": self.key, "seed": seed, "part": to_jsonable(part)}
        partial.write_text(json.dumps(body) + "\n", encoding="utf-8")
        os.replace(partial, path)

    def _path(self, seed: int) -> Path:
        return self.directory / f"{seed}.json"
