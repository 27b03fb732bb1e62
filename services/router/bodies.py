"""A completion's request body: its size limit, and where it is decoded.

A body over `max_bytes` is refused 413 at once: by its Content-Length before the handler
reads a byte of it, or (sent chunked) as soon as what arrived passes the limit. The handler
reads no more; aiohttp then discards the rest for up to its lingering time (10 s), so that
the client, still sending, gets to read the answer.

A body under `worker_bytes` is decoded on the event loop (a millisecond at most). A larger one
goes, in the pieces it arrived in, to the body worker process (`body_worker`), which decodes
it and makes the first checks without holding this process's GIL: a 10 MB prompt beyond the
context comes back refused in a few bytes, and the requests beside it are not held up by the
15 ms `json.loads` takes (`bench.router_large_prompt`). When the worker cannot answer (it
died), the body is decoded here, and the worker started again for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from services.common.inference_api.openai_api import (
    MAX_BODY_BYTES,
    Kind,
    body_cut_short,
    body_too_large,
    decode_json,
)
from services.router.body_worker import BODY, HEADER, KIND_CODES, REFUSED, refusal_from_json
from services.router.tokenizer import body_bytes_bound

log = logging.getLogger(__name__)

# The folder that holds `services/`: the worker imports the same code as this process.
_CODE_ROOT: Final = Path(__file__).resolve().parents[2]
# glibc's malloc in the worker: a body's buffers (tens of MB) from the heap, and the heap kept
# for the next body rather than handed back (at most 64 MiB idle): each body then costs no
# page faults, which halves a 10 MB body's time there (25 -> 15 ms). Other allocators
# ignore these.
_WORKER_MALLOC: Final = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # glibc's most
    "MALLOC_TRIM_THRESHOLD_": str(64 << 20),
}


def body_limit(max_body_bytes: int, max_model_len: int, max_token_bytes: int | None) -> int:
    """The longest body a Router takes: `max_body_bytes` when given (not 0), else the longest
    a prompt within `max_model_len` tokens can need (`tokenizer.body_bytes_bound`), at most
    `MAX_BODY_BYTES` (a request's memory stays bounded; only a prompt of control characters
    escaped as `\\u0001` could need more)."""
    if max_body_bytes:
        return max_body_bytes
    return min(body_bytes_bound(max_model_len, max_token_bytes) or MAX_BODY_BYTES, MAX_BODY_BYTES)


@dataclass(frozen=True, slots=True)
class Body:
    """A request body as read: its bytes and its JSON object."""

    raw: bytes
    fields: dict[str, Any]
    # The body worker found its fields valid and its prompt not beyond the context by its
    # bytes (`body_worker.check_body`): the Router need not count its bytes again.
    checked: bool


class WorkerFailed(Exception):
    """The body worker gave no answer (it died, hung or spoke out of turn)."""


class BodyWorker:
    """The body worker process (`body_worker`) as the Router drives it: one body at a time,
    in the order asked; started again on the next use after it failed."""

    def __init__(
        self, max_token_bytes: int | None, max_model_len: int, *, timeout_s: float = 10.0
    ) -> None:
        self._argv = [
            sys.executable,
            "-m",
            "services.router.body_worker",
            "--max-model-len",
            str(max_model_len),
            "--max-token-bytes",
            str(max_token_bytes or 0),
        ]
        self._timeout_s = timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self.starts = 0  # processes started so far

    async def start(self) -> None:
        """Start the process (it imports its code meanwhile: the first body may wait)."""
        if self._proc is not None:
            return
        path = os.pathsep.join(filter(None, [str(_CODE_ROOT), os.environ.get("PYTHONPATH")]))
        self._proc = await asyncio.create_subprocess_exec(
            *self._argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**_WORKER_MALLOC, **os.environ, "PYTHONPATH": path},
            limit=1 << 20,
        )
        self.starts += 1

    async def check(self, kind: Kind, chunks: list[bytes], size: int) -> dict[str, Any]:
        """The body made of `chunks` (`size` bytes in all) as `body_worker.check_body` finds
        it: its JSON object, or the `ApiError` it raises. Raises `WorkerFailed` when the
        worker gives no answer. A caller cancelled meanwhile leaves the exchange to finish,
        so the next body finds the pipe in step."""
        exchange = asyncio.ensure_future(self._exchange(kind, chunks, size))
        exchange.add_done_callback(_retrieve)  # its failure is the caller's, if still there
        tag, payload = await asyncio.shield(exchange)
        if tag == REFUSED:
            raise refusal_from_json(payload)
        fields: dict[str, Any] = marshal.loads(payload)
        return fields

    async def _exchange(self, kind: Kind, chunks: list[bytes], size: int) -> tuple[bytes, bytes]:
        async with self._lock:
            try:
                await self.start()  # (again, after a failure)
                proc = self._proc
                assert proc is not None and proc.stdin is not None and proc.stdout is not None
                async with asyncio.timeout(self._timeout_s):
                    proc.stdin.write(HEADER.pack(KIND_CODES[kind], size))
                    proc.stdin.writelines(chunks)
                    await proc.stdin.drain()
                    tag, length = HEADER.unpack(await proc.stdout.readexactly(HEADER.size))
                    if tag not in (BODY, REFUSED):
                        raise WorkerFailed(f"the body worker answered tag {tag!r}")
                    return tag, await proc.stdout.readexactly(length)
            except (OSError, EOFError, TimeoutError, WorkerFailed) as exc:
                await self._discard()
                raise WorkerFailed(f"the body worker gave no answer: {exc!r}") from exc

    async def _discard(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def close(self) -> None:
        """End the process: its input closed, it exits; killed if it does not in a second
        (a body in its hands is answered first, within its timeout)."""
        async with self._lock:
            proc, self._proc = self._proc, None
            if proc is None:
                return
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                async with asyncio.timeout(1.0):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(TimeoutError):  # never hang a stop on its exit
                    async with asyncio.timeout(1.0):
                        await proc.wait()


class BodyReader:
    """Reads completion bodies (see the module docstring); owns the body worker."""

    def __init__(self, max_bytes: int, worker: BodyWorker | None, worker_bytes: int) -> None:
        """`worker` None (or `worker_bytes` 0): every body is decoded on the event loop."""
        self.max_bytes = max_bytes
        self.worker = worker if worker_bytes > 0 else None
        self.worker_bytes = worker_bytes

    async def read(self, request: web.Request, kind: Kind | None) -> Body:
        """The body of `request`; raises `ApiError` 413 over `max_bytes`, 400 for a body cut
        short, not JSON, not an object, or (from the worker) what `check_body` refuses for a
        request of `kind` (None: a body the worker does not check, decoded here)."""
        chunks, size = await self._chunks(request)
        if self.worker is not None and kind is not None and size >= self.worker_bytes:
            try:
                fields = await self.worker.check(kind, chunks, size)
            except WorkerFailed as exc:
                log.warning("%s; decoding a %d-byte body here", exc, size)
            else:
                return Body(await _join(chunks, size), fields, checked=True)
        raw = await _join(chunks, size)
        return Body(raw, decode_json(raw), checked=False)

    async def _chunks(self, request: web.Request) -> tuple[list[bytes], int]:
        """The body's pieces as they arrived and their size, read up to `max_bytes`."""
        if request.content_length is not None and request.content_length > self.max_bytes:
            raise body_too_large(self.max_bytes)
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > self.max_bytes:
                    raise body_too_large(self.max_bytes)
                chunks.append(chunk)
        except (ConnectionError, HttpProcessingError):  # it ended before its Content-Length
            raise body_cut_short() from None
        return chunks, size


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _join(chunks: list[bytes], size: int) -> bytes:
    """The pieces as one `bytes`: over a megabyte on a thread (`bytes.join` lets go of the
    GIL while it copies that much), so the loop is not held for the copy."""
    if len(chunks) == 1:
        return chunks[0]
    if size < 1 << 20:
        return b"".join(chunks)
    return await asyncio.to_thread(b"".join, chunks)
