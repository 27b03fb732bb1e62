"""The engine's KV transfer routes, what a Messenger calls around moving blocks (JSON bodies,
every input checked; refusals are OpenAI error JSON through `ApiError`):

    POST   /kvsched/kv/export                {block_hashes, start, end, wait_s, hold_s}
           → {export_id, blocks, pages, token_ids, cache_salt}
    DELETE /kvsched/kv/export/{id}           → {released}
    POST   /kvsched/kv/import                {block_hashes, upto, hold_s}
           → {import_id, have, pages}; 507 when there is no room
    POST   /kvsched/kv/import/{id}/commit    {token_ids, cache_salt}
           → {stored, blocks}; 400 (import aborted) when the tokens are not the blocks',
             404 for an import that ended or never was
    DELETE /kvsched/kv/import/{id}           → {aborted}

The bookkeeping is `services.engine.kv_transfer`; this module parses and answers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from services.common.openai_api import ApiError, bad_request, read_json, unavailable
from services.engine.kv_transfer import NoRoom, Stopped, UnknownImport, WrongBlocks
from services.engine.runner import LiveEngine

MAX_WAIT_S = 300.0  # longest an export may wait for its first block
MAX_HOLD_S = 3600.0  # longest blocks may stay pinned or pages staged
DEFAULT_HOLD_S = 30.0
_U64 = 1 << 64
_U32 = 1 << 32


@dataclass(frozen=True, slots=True)
class ExportAsk:
    """A checked export body."""

    block_hashes: list[int]
    start: int
    end: int  # 0: the end of the chain
    wait_s: float
    hold_s: float


@dataclass(frozen=True, slots=True)
class ImportAsk:
    """A checked import body."""

    block_hashes: list[int]
    upto: int
    hold_s: float


@dataclass(frozen=True, slots=True)
class CommitAsk:
    """A checked commit body."""

    token_ids: list[int]
    cache_salt: str | None


def parse_export(body: Mapping[str, Any], max_blocks: int) -> ExportAsk:
    """Raises `ApiError` 400 naming the first field that is wrong."""
    hashes = _hashes(body, max_blocks)
    end = _int(body, "end", 0, 0, len(hashes))
    start = _int(body, "start", 0, 0, end or len(hashes))
    wait_s = _seconds(body, "wait_s", 0.0, MAX_WAIT_S, zero_ok=True)
    hold_s = _seconds(body, "hold_s", DEFAULT_HOLD_S, MAX_HOLD_S)
    return ExportAsk(hashes, start, end, wait_s, hold_s)


def parse_import(body: Mapping[str, Any], max_blocks: int) -> ImportAsk:
    """Raises `ApiError` 400 naming the first field that is wrong (`upto` defaults to the
    whole chain)."""
    hashes = _hashes(body, max_blocks)
    upto = _int(body, "upto", len(hashes), 0, len(hashes))
    return ImportAsk(hashes, upto, _seconds(body, "hold_s", DEFAULT_HOLD_S, MAX_HOLD_S))


def parse_commit(body: Mapping[str, Any], max_tokens: int) -> CommitAsk:
    """Raises `ApiError` 400 naming the first field that is wrong."""
    tokens = _int_list(body, "token_ids", max_tokens, _U32)
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise bad_request("`cache_salt` must be a string or null", "cache_salt")
    return CommitAsk(tokens, salt or None)


class KvTransferRoutes:
    """The routes over one live engine; `refusing()` true (the engine drains) refuses new
    imports with 503 (exports still serve: a draining engine's blocks may move elsewhere)."""

    def __init__(self, live: LiveEngine, refusing: Callable[[], bool]) -> None:
        self.live = live
        self.refusing = refusing

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/kvsched/kv/export", self.export),
            web.delete("/kvsched/kv/export/{export_id}", self.release_export),
            web.post("/kvsched/kv/import", self.import_begin),
            web.post("/kvsched/kv/import/{import_id}/commit", self.import_commit),
            web.delete("/kvsched/kv/import/{import_id}", self.import_abort),
        ]

    @property
    def _max_blocks(self) -> int:
        return self.live.model.capacity_blocks

    async def export(self, request: web.Request) -> web.Response:
        ask = parse_export(await read_json(request), self._max_blocks)
        try:
            grant = await self.live.transfers.export(
                ask.block_hashes, ask.start, ask.end, wait_s=ask.wait_s, hold_s=ask.hold_s
            )
        except Stopped as exc:
            raise unavailable(str(exc)) from None
        self.live.metrics.exported_blocks.inc(grant.blocks)
        return web.json_response(
            {
                "export_id": grant.export_id,
                "blocks": grant.blocks,
                "pages": grant.pages,
                "token_ids": grant.token_ids,
                "cache_salt": grant.cache_salt,
            }
        )

    async def release_export(self, request: web.Request) -> web.Response:
        released = self.live.transfers.release_export(request.match_info["export_id"])
        return web.json_response({"released": released})

    async def import_begin(self, request: web.Request) -> web.Response:
        ask = parse_import(await read_json(request), self._max_blocks)
        if self.refusing() or self.live.failed is not None:
            raise unavailable(self.live.failed or "the engine is shutting down")
        try:
            grant = self.live.transfers.import_begin(ask.block_hashes, ask.upto, ask.hold_s)
        except Stopped as exc:
            raise unavailable(str(exc)) from None
        except NoRoom as exc:
            raise ApiError(507, str(exc), type_="insufficient_storage", param="upto") from None
        await self.live.publish_changes()  # the reservation may have evicted blocks
        return web.json_response(
            {"import_id": grant.import_id, "have": grant.have, "pages": grant.pages}
        )

    async def import_commit(self, request: web.Request) -> web.Response:
        import_id = request.match_info["import_id"]
        max_tokens = self._max_blocks * self.live.model.block_size
        ask = parse_commit(await read_json(request), max_tokens)
        try:
            done = self.live.transfers.import_commit(import_id, ask.token_ids, ask.cache_salt)
        except UnknownImport as exc:
            raise ApiError(404, str(exc), type_="NotFoundError") from None
        except WrongBlocks as exc:
            raise bad_request(f"import aborted: {exc}", "token_ids") from None
        await self.live.publish_changes()
        self.live.metrics.imported_blocks.inc(done.stored)
        return web.json_response({"stored": done.stored, "blocks": done.blocks})

    async def import_abort(self, request: web.Request) -> web.Response:
        aborted = self.live.transfers.import_abort(request.match_info["import_id"])
        return web.json_response({"aborted": aborted})


# ---- body fields --------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = body.get(key, default)
    if not _is_int(value) or not lo <= value <= hi:
        raise bad_request(f"`{key}` must be an integer from {lo} to {hi}", key)
    return int(value)


def _int_list(body: Mapping[str, Any], key: str, max_len: int, bound: int) -> list[int]:
    value = body.get(key)
    if not isinstance(value, list):
        raise bad_request(f"`{key}` must be a list of integers", key)
    if len(value) > max_len:
        raise bad_request(f"`{key}` holds {len(value)} items, at most {max_len} allowed", key)
    if not all(_is_int(v) and 0 <= v < bound for v in value):
        raise bad_request(f"`{key}` must hold integers from 0 to {bound - 1}", key)
    return value


def _hashes(body: Mapping[str, Any], max_blocks: int) -> list[int]:
    hashes = _int_list(body, "block_hashes", max_blocks, _U64)
    if not hashes:
        raise bad_request("`block_hashes` must not be empty", "block_hashes")
    return hashes


def _seconds(
    body: Mapping[str, Any], key: str, default: float, most: float, *, zero_ok: bool = False
) -> float:
    value = body.get(key, default)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (0 <= value <= most) or (value == 0 and not zero_ok):
        low = "from 0" if zero_ok else "above 0"
        raise bad_request(f"`{key}` must be a number of seconds {low} up to {most:g}", key)
    return float(value)
