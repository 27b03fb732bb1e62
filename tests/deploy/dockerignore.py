"""Which paths of the build context `.dockerignore` leaves out, as Docker decides it: each
pattern (`*`, `?`, `**`, a leading `!` to put back) is matched against the path and each of
its parent folders, and the last pattern that matches wins."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path


@dataclass(frozen=True)
class DockerIgnore:
    """The patterns of one `.dockerignore`, in order."""

    patterns: tuple[str, ...]

    @classmethod
    def read(cls, path: Path) -> DockerIgnore:
        lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
        return cls(tuple(line for line in lines if line and not line.startswith("#")))

    @cached_property
    def _compiled(self) -> tuple[tuple[bool, re.Pattern[str]], ...]:
        out = []
        for pattern in self.patterns:
            keep = pattern.startswith("!")
            body = pattern.removeprefix("!").strip("/")
            out.append((keep, re.compile(_regex(body))))
        return tuple(out)

    def excludes(self, relative: str) -> bool:
        """Whether the file at `relative` (to the context's root, `/`-separated) is left out."""
        parts = relative.strip("/").split("/")
        candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        excluded = False
        for keep, regex in self._compiled:
            if any(regex.fullmatch(c) for c in candidates):
                excluded = not keep
        return excluded


def _regex(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)
