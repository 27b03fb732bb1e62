"""What the Messenger asks an engine over HTTP (the simulated engine's `/kvsched/*` JSON
endpoints): who it is and where it publishes KV events, its load, and a snapshot of every
cached block. Answers are validated into values; nothing the engine sends can crash the
caller: an engine that does not answer raises `EngineUnreachable`, an answer that is not what
the contract says raises `EngineMalformed`."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvsched.core.adapters import MAX_ADAPTER_NAME, MAX_ADAPTERS, AdapterReport
from kvsched.core.load import LoadReport
from services.kv_events.vllm_wire import BlockStored, Limits

ROLES = frozenset({"both", "prefill", "decode"})


class EngineError(Exception):
    """The engine did not give a usable answer."""


class EngineUnreachable(EngineError):
    """No answer: connection refused or reset, a timeout, or an HTTP error status."""


class EngineSilent(EngineUnreachable):
    """The request timed out: the engine took the connection but answered nothing in time
    (busy, or hung), unlike a refused or reset one (its process gone)."""


class EngineLacksRoute(EngineUnreachable):
    """The engine answers 404: it is not the kind of engine that serves that route."""


class EngineMalformed(EngineError):
    """An answer that is not what the contract says."""


@dataclass(frozen=True, slots=True)
class KvEventsEndpoint:
    """Where an engine publishes its KV events."""

    endpoint: str
    replay_endpoint: str | None
    topic: str


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """`GET /kvsched/info`."""

    instance_id: str
    model: str
    role: str  # both, prefill or decode
    block_size: int
    capacity_blocks: int
    kv_events: KvEventsEndpoint
    max_model_len: int = 0  # its context, tokens (0: not said)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """`GET /kvsched/kv/snapshot`: every cached block as stored events (chains from the root
    first), and the sequence number of the first KV event batch it does not include."""

    next_seq: int
    block_size: int
    blocks: int
    events: tuple[BlockStored, ...]


class EngineApi:
    """HTTP calls to one simulated engine at `base_url` on a shared session."""

    has_snapshot = True

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        *,
        timeout_s: float = 0.5,
        snapshot_timeout_s: float = 10.0,
        limits: Limits | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._snapshot_timeout = aiohttp.ClientTimeout(total=snapshot_timeout_s)
        self._limits = limits or Limits()

    async def _request(
        self, method: str, path: str, body: Any, timeout: aiohttp.ClientTimeout
    ) -> tuple[int, bytes]:
        """The answer's status and whole body; raises `EngineUnreachable` (no answer) or
        `EngineMalformed` (an answer over the size limit)."""
        url = self.base_url + path
        cap = self._limits.max_payload_bytes
        chunks: list[bytes] = []
        size = 0
        try:
            async with self._session.request(method, url, json=body, timeout=timeout) as resp:
                async for chunk in resp.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > cap:
                        raise EngineMalformed(f"{method} {url}: answer over {cap} bytes")
                    chunks.append(chunk)
                return resp.status, b"".join(chunks)
        except TimeoutError:
            raise EngineSilent(f"{method} {url}: no answer in {timeout.total:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnreachable(f"{method} {url}: {type(exc).__name__} {exc}") from None

    async def _read(self, path: str, timeout: aiohttp.ClientTimeout) -> bytes:
        """A GET's body; an error status raises `EngineUnreachable` too."""
        status, data = await self._request("GET", path, None, timeout)
        if status == 404:
            raise EngineLacksRoute(f"GET {self.base_url + path}: HTTP 404")
        if status != 200:
            raise EngineUnreachable(f"GET {self.base_url + path}: HTTP {status}")
        return data

    async def _get(self, path: str, timeout: aiohttp.ClientTimeout) -> Any:
        return _json(path, await self._read(path, timeout))

    async def info(self) -> EngineInfo:
        """Raises `EngineUnreachable` or `EngineMalformed` (as do the others)."""
        return parse_info(await self._get("/kvsched/info", self._timeout))

    async def load(self) -> LoadReport:
        return parse_load(await self._get("/kvsched/load", self._timeout))

    async def snapshot(self) -> Snapshot:
        path = "/kvsched/kv/snapshot"
        body = await self._read(path, self._snapshot_timeout)
        # A large cache makes a large document: parse it off the event loop.
        return await asyncio.to_thread(lambda: parse_snapshot(_json(path, body), self._limits))


# ---- validation ------------------------------------------------------------------------------


def _json(path: str, body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise EngineMalformed(f"{path}: not JSON ({exc})") from None


def _object(raw: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise EngineMalformed(f"{what} is not a JSON object")
    return raw


def _int(raw: Mapping[str, Any], key: str, *, low: int = 0, high: int = (1 << 63) - 1) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise EngineMalformed(f"{key} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _str(raw: Mapping[str, Any], key: str, *, optional: bool = False) -> str:
    value = raw.get(key)
    if value is None and optional:
        return ""
    if not isinstance(value, str) or (not value and not optional) or len(value) > 4096:
        raise EngineMalformed(f"{key} must be a non-empty string, got {value!r}")
    return value


def parse_info(raw: Any) -> EngineInfo:
    """An `EngineInfo` from `/kvsched/info`'s JSON; raises `EngineMalformed`."""
    info = _object(raw, "info")
    events = _object(info.get("kv_events"), "info.kv_events")
    role = _str(info, "role", optional=True) or "both"
    if role not in ROLES:
        raise EngineMalformed(f"role must be one of {sorted(ROLES)}, got {role!r}")
    endpoint = _str(events, "endpoint")
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise EngineMalformed(f"kv_events.endpoint is not a ZMQ address: {endpoint!r}")
    return EngineInfo(
        instance_id=_str(info, "instance_id"),
        model=_str(info, "model", optional=True),
        role=role,
        block_size=_int(info, "block_size", low=1, high=1 << 20),
        capacity_blocks=_int(info, "capacity_blocks"),
        max_model_len=_int(info, "max_model_len", high=(1 << 32) - 1)
        if "max_model_len" in info
        else 0,
        kv_events=KvEventsEndpoint(
            endpoint=endpoint,
            replay_endpoint=_str(events, "replay_endpoint", optional=True) or None,
            topic=_str(events, "topic", optional=True),
        ),
    )


def parse_load(raw: Any) -> LoadReport:
    """A `LoadReport` from `/kvsched/load`'s JSON; raises `EngineMalformed`."""
    load = _object(raw, "load")
    seconds = load.get("pending_prefill_s")
    if (
        not isinstance(seconds, int | float)
        or isinstance(seconds, bool)
        or not math.isfinite(seconds)
        or not 0 <= seconds < 1e9
    ):
        raise EngineMalformed(f"pending_prefill_s must be a finite time, got {seconds!r}")
    u32 = (1 << 32) - 1
    return LoadReport(
        pending_prefill_tokens=_int(load, "pending_prefill_tokens"),
        pending_prefill_s=float(seconds),
        waiting=_int(load, "waiting", high=u32),
        running=_int(load, "running", high=u32),
        decode_tokens=_int(load, "decode_tokens"),
        free_blocks=_int(load, "free_blocks"),
        adapters=None if load.get("adapters") is None else _adapters(load["adapters"]),
    )


def _adapters(raw: Any) -> AdapterReport:
    """The `adapters` of `/kvsched/load`: {"capacity", "held", "busy"}."""
    adapters = _object(raw, "adapters")
    names: dict[str, frozenset[str]] = {}
    for key in ("held", "busy"):
        value = adapters.get(key, [])
        if not (
            isinstance(value, list)
            and len(value) <= MAX_ADAPTERS
            and all(isinstance(n, str) and 0 < len(n) <= MAX_ADAPTER_NAME for n in value)
        ):
            raise EngineMalformed(f"adapters.{key} must list at most {MAX_ADAPTERS} names")
        names[key] = frozenset(value)
    capacity = _int(adapters, "capacity", high=MAX_ADAPTERS)
    return AdapterReport(capacity, names["held"], names["busy"])


def _hash(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64:
        return value
    raise EngineMalformed(f"a block hash must be a u64, got {value!r}")


def _block_keys(raw: Any) -> Any:
    """A snapshot block's own extra keys (a tuple, or None), whether the engine wrote the
    block's tuple or a one-block per-block list."""
    if isinstance(raw, list) and len(raw) == 1 and (raw[0] is None or isinstance(raw[0], list)):
        return raw[0]
    return raw


def parse_snapshot(raw: Any, limits: Limits | None = None) -> Snapshot:
    """A `Snapshot` from `/kvsched/kv/snapshot`'s JSON; raises `EngineMalformed`. Blocks that
    continue the previous one on the same medium are joined into one stored event, as the
    engine would have published them (the translator cuts long ones)."""
    lim = limits or Limits()
    snap = _object(raw, "snapshot")
    block_size = _int(snap, "block_size", low=1, high=1 << 20)
    blocks = snap.get("blocks")
    if not isinstance(blocks, list):
        raise EngineMalformed("snapshot.blocks is not a list")
    events: list[BlockStored] = []
    run: list[tuple[int, list[int], Any]] = []  # (hash, tokens, extra keys) of the open chain
    run_parent: int | None = None
    run_medium = "GPU"

    def close_run() -> None:
        if run:
            events.append(
                BlockStored(
                    block_hashes=tuple(h for h, _, _ in run),
                    parent_block_hash=run_parent,
                    token_ids=tuple(t for _, tokens, _ in run for t in tokens),
                    block_size=block_size,
                    medium=run_medium,
                    extra_keys=[k for _, _, k in run],
                )
            )
            run.clear()

    for i, item in enumerate(blocks):
        block = _object(item, f"snapshot.blocks[{i}]")
        h = _hash(block.get("block_hash"))
        parent_raw = block.get("parent_block_hash")
        parent = None if parent_raw is None else _hash(parent_raw)
        tokens = block.get("token_ids")
        if (
            not isinstance(tokens, list)
            or len(tokens) > lim.max_tokens
            or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in tokens
            )
        ):
            raise EngineMalformed(f"snapshot.blocks[{i}].token_ids is not a list of u32")
        medium = block.get("medium") or "GPU"
        if not isinstance(medium, str):
            raise EngineMalformed(f"snapshot.blocks[{i}].medium is not a string")
        if not run or parent != run[-1][0] or medium != run_medium:
            close_run()
            run_parent, run_medium = parent, medium
        run.append((h, tokens, _block_keys(block.get("extra_keys"))))
    close_run()
    return Snapshot(
        next_seq=_int(snap, "next_seq"),
        block_size=block_size,
        blocks=len(blocks),
        events=tuple(events),
    )
