"""The engine's KV bytes: one file on a shared-memory filesystem, mapped read/write, laid out
as `services.dataplane.kv_layout` says, so the node's Messenger (another process) can map the
same file and read exported blocks or write imported ones.

The file is sized with `ftruncate`, so it is sparse: only pages a block was ever written to
take memory. Every cached block of the engine has one page (`page_of`); pages reserved for an
import are staged (a Messenger writes them, nothing reads them) until the import commits
(`adopt`) or ends (`free`). Free pages are handed out lowest first, so a fresh engine lays a
chain out on consecutive pages, which a transfer then moves as one piece per layer.

A file is named after its owner's pid; an engine killed with SIGKILL cannot remove its own,
so every new memory sweeps the files of pids that no longer run.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import mmap
import os
import re
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from services.dataplane.kv_layout import Bytes, KvLayout, fill

log = logging.getLogger("kvsched.engine")
DEFAULT_DIR = "/dev/shm"  # Linux's shared-memory filesystem
PREFIX = "kvsched-kv-"
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's value
_OWNER = re.compile(re.escape(PREFIX) + r"(\d+)-")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_MAX_ID_CHARS = 100
# Paths this process created (and has not removed): a file named with our own pid but not
# in here was left by an earlier process that had the same pid.
_OWNED: set[Path] = set()


class KvMemory:
    """One engine's KV memory file and its page table."""

    def __init__(
        self, layout: KvLayout, instance_id: str, directory: str | os.PathLike[str] = DEFAULT_DIR
    ) -> None:
        """Create and map the file (after sweeping dead engines' files from `directory`).
        Raises `OSError` when the directory cannot hold it."""
        self.layout = layout
        folder = Path(directory)
        sweep_stale(folder)
        self._path, fd = _create(folder, f"{PREFIX}{os.getpid()}-{_sanitise(instance_id)}")
        try:
            os.ftruncate(fd, layout.size)
            rw = mmap.PROT_READ | mmap.PROT_WRITE
            self._map = mmap.mmap(fd, layout.size, mmap.MAP_SHARED, rw)
        except BaseException:
            _remove(self._path)
            raise
        finally:
            os.close(fd)
        # Removes the file at interpreter exit too, should the owner never call `close`.
        self._finalizer = weakref.finalize(self, _remove, self._path)
        self.chunks: Bytes = np.frombuffer(self._map, dtype=np.uint8).reshape(
            layout.layers, layout.pages, layout.chunk_bytes
        )
        self.page_of: dict[int, int] = {}  # our block hash → page, for every cached block
        self._free = list(range(layout.pages))  # a heap (sorted is a valid heap)
        self._staged: set[int] = set()  # allocated for imports, not (yet) a cached block
        _refuse_if_oversized(folder, layout.size)

    @property
    def path(self) -> Path:
        """The file a Messenger maps."""
        return self._path

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def staged_pages(self) -> int:
        return len(self._staged)

    # ---- pages -------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take the `n` lowest free pages (sorted) as staged pages: a Messenger may write
        them; they belong to no block until `adopt`. Raises `RuntimeError` when fewer are
        free (the cache's reservations keep that from happening)."""
        pages = self._take(n)
        self._staged.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return staged pages to the free pool. Raises `KeyError` for a page not staged."""
        staged, free = self._staged, self._free
        for page in pages:
            staged.remove(page)
            heapq.heappush(free, page)

    def adopt(self, block_hash: int, page: int) -> None:
        """Staged `page` holds block `block_hash` (a Messenger wrote its bytes): it becomes
        the block's page."""
        if block_hash in self.page_of:
            raise ValueError(f"block {block_hash:#x} already has a page")
        self._staged.remove(page)
        self.page_of[block_hash] = page

    # ---- blocks ------------------------------------------------------------------------

    def store(self, hashes: Sequence[int]) -> None:
        """Blocks the engine computed entered its cache: give each a page and write its
        content (`kv_layout.fill`). Blocks already holding a page (imported) are skipped."""
        page_of = self.page_of
        new = [h for h in hashes if h not in page_of]
        if not new:
            return
        pages = self._take(len(new))
        for h, page in zip(new, pages, strict=True):
            page_of[h] = page
        # Pages come sorted, so consecutive ones form runs; each run of one layer is one
        # contiguous piece of the file, filled in place through a (blocks, layers, chunk) view.
        chunks, start = self.chunks, 0
        for end in range(1, len(pages) + 1):
            if end == len(pages) or pages[end] != pages[end - 1] + 1:
                first = pages[start]
                run = chunks[:, first : first + end - start, :].transpose(1, 0, 2)
                fill(run, new[start:end])
                start = end

    def remove(self, hashes: Iterable[int]) -> None:
        """Blocks left the cache: their pages are free (their bytes stay until reused)."""
        page_of, free = self.page_of, self._free
        for h in hashes:
            heapq.heappush(free, page_of.pop(h))

    def populate(self) -> None:
        """Fault every page of the file in now (Linux 5.14 and later), so that copies into it
        later run at memory speed rather than a page fault per 4 KiB (about 7x slower). Makes
        the whole file resident. A no-op where the kernel cannot."""
        try:
            self._map.madvise(MADV_POPULATE_WRITE)
        except (OSError, ValueError) as exc:  # an older kernel, or the memory was closed
            log.info("KV memory %s not populated: %s", self._path, exc)

    # ---- life --------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap and remove the file. Idempotent."""
        self.chunks = np.empty((0, 0, 0), dtype=np.uint8)
        # Someone still holding a view keeps the map alive until it lets go.
        with contextlib.suppress(BufferError):
            self._map.close()
        self._finalizer()

    def check_integrity(self) -> None:
        """Assert every page is exactly one of cached, free or staged."""
        pages = self.layout.pages
        every = [*self.page_of.values(), *self._free, *self._staged]
        assert len(every) == pages, (
            f"cached {len(self.page_of)} + free {len(self._free)} + staged "
            f"{len(self._staged)} != {pages} pages"
        )
        assert len(set(every)) == pages, "a page is in two places"
        assert min(every) >= 0 and max(every) < pages, "a page out of range"

    def _take(self, n: int) -> list[int]:
        free = self._free
        if n > len(free):
            raise RuntimeError(f"KV memory has {len(free)} free pages, {n} wanted")
        return [heapq.heappop(free) for _ in range(n)]


def sweep_stale(directory: Path) -> list[Path]:
    """Remove the KV memory files in `directory` whose owning process no longer runs (a
    live pid's file is never touched); returns the removed paths."""
    removed: list[Path] = []
    me = os.getpid()
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for path in entries:
        match = _OWNER.match(path.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if (pid == me and path in _OWNED) or (pid != me and _alive(pid)):
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue  # another engine swept it first
        except OSError as exc:  # not ours to remove: leave it
            log.warning("cannot remove stale KV memory %s: %s", path, exc)
            continue
        log.info("removed stale KV memory %s (its process %d is gone)", path, pid)
        removed.append(path)
    return removed


def _create(directory: Path, stem: str) -> tuple[Path, int]:
    """Create a new file named `stem` (or `stem-2`, `stem-3`… when several engines of one
    process share an instance id); returns it and its open descriptor."""
    for n in range(1, 1000):
        path = directory / (stem if n == 1 else f"{stem}-{n}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        _OWNED.add(path)
        return path, fd
    raise FileExistsError(f"no free KV memory file name for {directory / stem}")


def _remove(path: Path) -> None:
    """Remove a file this process created."""
    _OWNED.discard(path)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _sanitise(instance_id: str) -> str:
    return _UNSAFE.sub("_", instance_id)[:_MAX_ID_CHARS] or "engine"


def _refuse_if_oversized(directory: Path, size: int) -> None:
    """Writing a page the filesystem has no room for kills the process (SIGBUS): refuse to
    start when the memory could outgrow the filesystem. Raises `OSError`."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return
    room = st.f_bavail * st.f_frsize
    if size > room:
        raise OSError(
            f"the KV memory needs {size} bytes but {directory} has {room} free: lower "
            "--capacity-blocks, use a smaller --model-config, or give --kv-memory-dir a "
            "larger shared-memory filesystem"
        )
