"""The server end of the KV pool's local socket (`PoolServer`; the wire format is
`services.dataplane.pool_wire`): the node's engines attach to the pool, load blocks from it
and save blocks into it.

Every argument is checked before the pool sees it; a bad call gets an error answer and
changes nothing; a connection that breaks the framing is closed. What a connection pinned or
staged and did not end is released when it closes (an engine that died leaves nothing held),
and anyway at its hold time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from services.dataplane.errors import PoolError, PoolRefused
from services.dataplane.kv_pool import NodePool
from services.dataplane.pool_format import BlockFormat
from services.dataplane.pool_wire import OPS, WireError, body_length, decode, encode

log = logging.getLogger(__name__)
MAX_HASHES = 1 << 16  # blocks a call may name (2M tokens of 32-token blocks)
MAX_HOLD_S = 600.0
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


class BadCall(Exception):
    """A call whose arguments are not what the wire says."""


class PoolServer:
    """Serves `pool` on the Unix socket `path` (created owner-only)."""

    def __init__(self, pool: NodePool, path: str | os.PathLike[str]) -> None:
        self.pool = pool
        self.path = Path(path)
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        """Bind the socket (a stale one left by a dead Messenger is replaced)."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        finally:
            os.umask(old)
        log.info("KV pool socket at %s", self.path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        # Closing a connection ends its reader at once, and its task with it.
        for writer in self._connections.values():
            writer.close()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        held = _Held()
        try:
            while True:
                try:
                    header = await reader.readexactly(4)
                    message = decode(await reader.readexactly(body_length(header)))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except WireError as exc:
                    log.warning("KV pool socket: closing a connection that sent %s", exc)
                    return
                writer.write(encode(await self._answer(message, held)))
                await writer.drain()
        except ConnectionError:
            return
        finally:
            self._connections.pop(task, None)
            held.end(self.pool)
            writer.close()

    async def _answer(self, message: dict[str, Any], held: _Held) -> dict[str, Any]:
        op = message.get("op")
        if op not in OPS:
            return {"ok": False, "error": f"unknown op {op!r}: one of {sorted(OPS)}"}
        try:
            result = await _HANDLERS[op](self.pool, message, held)
        except BadCall as exc:
            return {"ok": False, "error": f"{op}: {exc}"}
        except (PoolError, PoolRefused, OSError) as exc:
            return {"ok": False, "error": f"{op}: {exc}"}
        return {"ok": True, **result}


class _Held:
    """Exports and imports a connection opened and has not ended."""

    def __init__(self) -> None:
        self.exports: set[str] = set()
        self.imports: set[str] = set()

    def end(self, pool: NodePool) -> None:
        if not pool.attached:
            return
        for export_id in self.exports:
            pool.release(export_id)
        for import_id in self.imports:
            pool.abort(import_id)


async def _attach(pool: NodePool, m: dict[str, Any], held: _Held) -> dict[str, Any]:
    raw = m.get("format")
    if not isinstance(raw, dict) or not isinstance(raw.get("kind"), str):
        raise BadCall("format must be an object with a kind")
    try:
        fmt = BlockFormat(
            raw["kind"],
            _int(raw, "layers", high=1 << 16),
            _int(raw, "chunk_bytes", high=1 << 40),
            _int(raw, "block_size", high=1 << 20),
        )
    except ValueError as exc:
        raise BadCall(str(exc)) from None
    memory = pool.attach(fmt)
    return {"path": str(memory.path), "pages": memory.layout.pages}


async def _load(pool: NodePool, m: dict[str, Any], held: _Held) -> dict[str, Any]:
    hashes = _hashes(m)
    start, end = _int(m, "start", high=len(hashes)), _int(m, "end", high=len(hashes))
    if start >= end:
        raise BadCall(f"start {start} must be below end {end}")
    # A scheduler asking must never wait: what is not in the pool now is a miss.
    grant = await pool.export_blocks(hashes, start, end, wait_s=0.0, hold_s=_hold(m), landing_s=0.0)
    if grant.export_id:
        held.exports.add(grant.export_id)
    return {
        "export_id": grant.export_id or None,
        "blocks": grant.blocks,
        "pages": list(grant.pages),
        "path": str(pool.memory.path),
    }


async def _release(pool: NodePool, m: dict[str, Any], held: _Held) -> dict[str, Any]:
    export_id = _str(m, "export_id")
    copied = _copied(m)
    held.exports.discard(export_id)
    released = pool.release(export_id)
    pool.copies.record("load", *copied)
    return {"released": released}


async def _save(pool: NodePool, m: dict[str, Any], held: _Held) -> dict[str, Any]:
    hashes = _hashes(m)
    upto = _int(m, "upto", low=1, high=len(hashes))
    slots = await pool.begin_import(hashes, upto, hold_s=_hold(m))
    if slots.import_id:
        held.imports.add(slots.import_id)
    return {
        "import_id": slots.import_id,
        "have": slots.have,
        "pages": list(slots.pages),
        "path": str(pool.memory.path),
    }


async def _commit(pool: NodePool, m: dict[str, Any], held: _Held) -> dict[str, Any]:
    import_id = _str(m, "import_id")
    tokens = m.get("token_ids")
    if not isinstance(tokens, list) or len(tokens) > MAX_HASHES * 1024:
        raise BadCall("token_ids must be a list")
    if not all(type(t) is int and 0 <= t <= _U32 for t in tokens):
        raise BadCall("token_ids must be u32 integers")
    salt = m.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadCall("cache_salt must be a string or null")
    lora = m.get("lora")
    if lora is not None and not (
        isinstance(lora, list) and len(lora) == 2 and all(isinstance(x, str) and x for x in lora)
    ):
        raise BadCall("lora must be [name, path] or null")
    copied = _copied(m)
    held.imports.discard(import_id)  # a commit that fails aborts the import
    adapter = None if lora is None else (lora[0], lora[1])
    stored = await pool.commit_import(import_id, tokens, salt or None, adapter)
    pool.copies.record("save", *copied)
    return {"stored": stored}


async def _abort(pool: NodePool, m: dict[str, Any], held: _Held) -> dict[str, Any]:
    import_id = _str(m, "import_id")
    held.imports.discard(import_id)
    return {"aborted": pool.abort(import_id)}


_HANDLERS: dict[str, Callable[[NodePool, dict[str, Any], _Held], Awaitable[dict[str, Any]]]] = {
    "attach": _attach,
    "load": _load,
    "release": _release,
    "save": _save,
    "commit": _commit,
    "abort": _abort,
}


def _int(m: dict[str, Any], key: str, *, low: int = 0, high: int) -> int:
    value = m.get(key)
    if type(value) is not int or not low <= value <= high:
        raise BadCall(f"{key} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _str(m: dict[str, Any], key: str) -> str:
    value = m.get(key)
    if not isinstance(value, str) or not value or len(value) > 256:
        raise BadCall(f"{key} must be a non-empty string")
    return value


def _hashes(m: dict[str, Any]) -> list[int]:
    hashes = m.get("block_hashes")
    if not isinstance(hashes, list) or not 0 < len(hashes) <= MAX_HASHES:
        raise BadCall(f"block_hashes must be a list of 1 to {MAX_HASHES} hashes")
    if not all(type(h) is int and 0 <= h <= _U64 for h in hashes):
        raise BadCall("block_hashes must be u64 integers")
    return hashes


def _copied(m: dict[str, Any]) -> tuple[int, float]:
    """The optional (copied_bytes, copy_s) an engine reports with a release or a commit."""
    nbytes = _int(m, "copied_bytes", high=1 << 50) if "copied_bytes" in m else 0
    took = m.get("copy_s", 0.0)
    if not isinstance(took, int | float) or isinstance(took, bool) or not 0 <= took <= 3600:
        raise BadCall("copy_s must be seconds in [0, 3600]")
    return nbytes, float(took)


def _hold(m: dict[str, Any]) -> float:
    value = m.get("hold_s")
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= MAX_HOLD_S:
        raise BadCall(f"hold_s must be in (0, {MAX_HOLD_S:.0f}]")
    return float(value)
