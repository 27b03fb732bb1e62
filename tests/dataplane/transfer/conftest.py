"""Fixtures of the transfer tests: KV files (on the shared-memory filesystem when there is
one, removed after), regions mapped on them, backends in this process, and source Messengers'
transfer sides in processes of their own."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.dataplane.kv_layout import KvLayout
from services.dataplane.transfer.backend import Backend, SourceExport
from services.dataplane.transfer.factory import open_backend
from services.dataplane.transfer.region import KvRegion
from tests.dataplane.transfer.kvfiles import create_kv_file, fill_pages, new_kv_path

REPO = Path(__file__).resolve().parents[3]
LAYOUT = KvLayout(layers=4, pages=32, chunk_bytes=4096, block_size=16)


def block_hash(i: int) -> int:
    """A distinct fake block hash per index (any 64-bit value would do)."""
    return (0x9E3779B97F4A7C15 * (i + 1)) & (2**64 - 1)


@pytest.fixture
def kv_file() -> Iterator[Callable[[KvLayout], Path]]:
    """Makes zero-filled KV files; removes them after the test."""
    made: list[Path] = []

    def make(layout: KvLayout = LAYOUT) -> Path:
        path = create_kv_file(new_kv_path(), layout)
        made.append(path)
        return path

    yield make
    for path in made:
        path.unlink(missing_ok=True)


@pytest.fixture
def region(kv_file: Callable[[KvLayout], Path]) -> Iterator[Callable[..., KvRegion]]:
    """Maps KV files (new ones, or `path`), optionally computing blocks into pages."""
    opened: list[KvRegion] = []

    def open_region(
        layout: KvLayout = LAYOUT,
        *,
        path: Path | None = None,
        pages: Sequence[int] = (),
        hashes: Sequence[int] = (),
    ) -> KvRegion:
        r = KvRegion(path or kv_file(layout), layout)
        fill_pages(r, pages, hashes)
        opened.append(r)
        return r

    yield open_region
    for r in opened:
        r.close()


@pytest.fixture
async def backend() -> AsyncIterator[Callable[..., Any]]:
    """Starts backends in this process (stopped after the test, before regions close)."""
    started: list[Backend] = []

    async def start(name: str = "tcp", **kwargs: Any) -> Backend:
        b = open_backend(name, "127.0.0.1", **kwargs)
        await b.start()
        started.append(b)
        return b

    yield start
    for b in started:
        await b.stop()


@dataclass
class SourceProcess:
    """A source Messenger's transfer side in its own process (`source_proc`)."""

    process: subprocess.Popen[bytes]
    export: SourceExport

    def freeze(self) -> None:
        """SIGSTOP: alive, connections open, answering nothing (a hung peer)."""
        self.process.send_signal(signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _read_line(process: subprocess.Popen[bytes], timeout: float) -> bytes:
    assert process.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while not sel.select(max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise AssertionError(f"the source process said nothing within {timeout:g} s")
        return process.stdout.readline()


@pytest.fixture
def source_process(tmp_path: Path) -> Iterator[Callable[..., SourceProcess]]:
    """Starts `python -m tests.dataplane.transfer.source_proc` on a KV file; it prints its
    export, which is returned with the process (killed after the test)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(
        name: str, path: Path, layout: KvLayout = LAYOUT, *, allow: Sequence[int] | None = None
    ) -> SourceProcess:
        argv = [
            sys.executable, "-m", "tests.dataplane.transfer.source_proc", "--backend", name,
            "--path", str(path), "--layers", str(layout.layers), "--pages", str(layout.pages),
            "--chunk-bytes", str(layout.chunk_bytes), "--block-size", str(layout.block_size),
            "--allow", "all" if allow is None else ",".join(map(str, allow)),
        ]  # fmt: skip
        log_path = tmp_path / f"source-{len(started)}.log"
        log = log_path.open("wb")
        process = subprocess.Popen(
            argv, cwd=REPO, env=dict(os.environ), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log,
        )  # fmt: skip
        log.close()
        started.append(process)
        line = _read_line(process, 30.0)
        if not line:
            raise AssertionError(f"the source exited: {log_path.read_text()[-3000:]}")
        info = json.loads(line)
        export = SourceExport(info["endpoint"], info["base_address"], layout, info["export_id"])
        return SourceProcess(process, export)

    yield start
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()
