"""The placement streams open on this Conductor, so that losing leadership ends them at once
(each caller then reconnects to the new leader) instead of answering from a dead term."""

from __future__ import annotations

import asyncio
from typing import Any


class OpenStreams:
    """The answer queues of the open placement streams; a None queued ends a stream."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[Any]] = set()

    def add(self, answers: asyncio.Queue[Any]) -> None:
        self._queues.add(answers)

    def discard(self, answers: asyncio.Queue[Any]) -> None:
        self._queues.discard(answers)

    def end_all(self) -> None:
        """End every open stream after the answers it has queued."""
        for answers in self._queues:
            if answers.full():  # a busy stream: its reader ends it after the queued answers
                asyncio.get_running_loop().create_task(answers.put(None))
            else:
                answers.put_nowait(None)
