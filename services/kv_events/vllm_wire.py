"""vLLM's KV-event wire format: decoding every shape vLLM has sent, and encoding the two
current ones (what the simulated engine publishes).

A ZMQ message is three frames: `[topic, seq (8 bytes, big-endian), msgpack payload]`. The
payload is a batch `[ts, events, dp_rank]` (older vLLM: `[ts, events]`; some versions: a map
with those keys). Events are tagged arrays (vLLM ≤ 0.11: `["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
...]`) or maps with a `"type"` key (newer vLLM; fields at their default left out). Hashes are
u64 integers, possibly above the signed 64-bit range, or raw digests (bytes).

Decoding never trusts the sender: a message that is not a well-formed batch raises
`MalformedFrames` (the relay counts it and moves on); an event of an unknown type, of the
wrong shape or over the size limits is skipped and counted in the batch; unknown fields are
ignored. Encoding reproduces vLLM's bytes exactly (msgspec's field order, defaults left out
of maps, map headers sized as msgspec sizes them). Pure: no sockets here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

EngineHash = int | bytes  # what vLLM calls a block hash: a u64 or a digest


class MalformedFrames(ValueError):
    """The frames are not a KV-event message (wrong count, truncated, not a batch)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps on what one message may carry (beyond them: refused or skipped)."""

    max_payload_bytes: int = 64 << 20
    max_events: int = 65_536
    max_hashes: int = 65_536  # per event
    max_tokens: int = 1 << 20  # per event
    max_digest_bytes: int = 64


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks stored, in chain order, continuing `parent_block_hash` (None: from the root)."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None  # per-block extra hash inputs (LoRA name, cache salt, ...), opaque
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole cache."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One decoded message."""

    topic: bytes
    seq: int
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None
    skipped: int  # events dropped: unknown type, wrong shape or over the limits


class _BadEvent(ValueError):
    pass


def decode_frames(frames: Sequence[bytes], limits: Limits | None = None) -> EventBatch:
    """Decode one multipart message; raises `MalformedFrames` when it is not one."""
    lim = limits or Limits()
    if len(frames) != 3:
        raise MalformedFrames(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq_frame, payload = frames
    if len(seq_frame) != 8:
        raise MalformedFrames(f"sequence frame has {len(seq_frame)} bytes, expected 8")
    if len(payload) > lim.max_payload_bytes:
        raise MalformedFrames(f"payload of {len(payload)} bytes over {lim.max_payload_bytes}")
    try:
        # msgpack bounds every length by the payload's size, which is capped above; the
        # per-event limits below decide what is skipped.
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
    ) as exc:
        raise MalformedFrames(f"payload is not msgpack: {exc}") from None
    ts, events, dp_rank = _batch_fields(batch)
    if len(events) > lim.max_events:
        raise MalformedFrames(f"{len(events)} events in one batch, over {lim.max_events}")
    decoded: list[Event] = []
    skipped = 0
    for raw in events:
        try:
            event = _event(raw, lim)
        except _BadEvent:
            skipped += 1
            continue
        if event is None:
            skipped += 1
        else:
            decoded.append(event)
    return EventBatch(
        topic=bytes(topic),
        seq=int.from_bytes(seq_frame, "big"),
        ts=ts,
        events=tuple(decoded),
        dp_rank=dp_rank,
        skipped=skipped,
    )


def _batch_fields(batch: Any) -> tuple[float, Sequence[Any], int | None]:
    if isinstance(batch, Mapping):
        ts, events, rank = batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")
    elif isinstance(batch, list) and len(batch) in (2, 3):
        ts, events = batch[0], batch[1]
        rank = batch[2] if len(batch) == 3 else None
    else:
        raise MalformedFrames("payload is not a batch [ts, events(, dp_rank)]")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(events, list):
        raise MalformedFrames("batch needs a numeric timestamp and a list of events")
    if rank is not None and not _is_int(rank):
        raise MalformedFrames("batch data-parallel rank is not an integer")
    return float(ts), events, rank


# Positions of the fields in the tagged-array form, after the tag.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _event(raw: Any, lim: Limits) -> Event | None:
    """One event, None when its type is unknown; raises _BadEvent when it is malformed."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind, fields = raw[0], raw[1:]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        data: Mapping[str, Any] = dict(zip(names, fields, strict=False))
    elif isinstance(raw, Mapping) and isinstance(raw.get("type"), str):
        kind, data = raw["type"], raw
    else:
        raise _BadEvent("not a tagged event")
    if kind == "BlockStored":
        hashes = _hashes(data.get("block_hashes"), lim)
        parent = data.get("parent_block_hash")
        tokens = data.get("token_ids", [])
        block_size: Any = data.get("block_size")
        if not hashes or not _is_int(block_size) or block_size <= 0:
            raise _BadEvent("BlockStored needs block hashes and a positive block size")
        if not isinstance(tokens, list) or len(tokens) > lim.max_tokens:
            raise _BadEvent("token_ids is not a list within the limit")
        if not all(_is_int(t) and 0 <= t < 1 << 32 for t in tokens):
            raise _BadEvent("token ids must be u32 integers")
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if parent is None else _hash(parent, lim),
            token_ids=tuple(tokens),
            block_size=block_size,
            medium=_optional(data.get("medium"), str),
            lora_name=_optional(data.get("lora_name"), str),
            extra_keys=data.get("extra_keys"),
            group_idx=_optional(data.get("group_idx"), int),
            kv_cache_spec_kind=_optional(data.get("kv_cache_spec_kind"), str),
            session_id=_optional(data.get("session_id"), str),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(data.get("block_hashes"), lim),
            medium=_optional(data.get("medium"), str),
            group_idx=_optional(data.get("group_idx"), int),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _hashes(raw: Any, lim: Limits) -> tuple[EngineHash, ...]:
    if not isinstance(raw, list) or len(raw) > lim.max_hashes:
        raise _BadEvent("block_hashes is not a list within the limit")
    return tuple(_hash(h, lim) for h in raw)


def _hash(raw: Any, lim: Limits) -> EngineHash:
    if _is_int(raw) and 0 <= raw < 1 << 64:
        return int(raw)
    if isinstance(raw, bytes) and 0 < len(raw) <= lim.max_digest_bytes:
        return raw
    if _is_int(raw) and -(1 << 63) <= raw < 0:  # a signed reading of a u64
        return int(raw) + (1 << 64)
    raise _BadEvent("a block hash must be a u64 or a digest")


def _optional(value: Any, kind: type) -> Any:
    if value is None:
        return None
    if kind is int and not _is_int(value):
        raise _BadEvent("expected an integer")
    if kind is str and not isinstance(value, str):
        raise _BadEvent("expected a string")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- encoding ------------------------------------------------------------------------------

Shape = Literal["map", "array"]


def encode_frames(
    topic: bytes,
    seq: int,
    ts: float,
    events: Sequence[Event],
    dp_rank: int | None = 0,
    *,
    shape: Shape = "map",
    stored_fields: int = 16,
) -> list[bytes]:
    """The three frames vLLM sends for `events`: maps as vLLM ≥ 0.32 does (fields at their
    default left out), or tagged arrays as vLLM 0.11 did (fields it did not have yet dropped).
    `stored_fields` is how many fields vLLM's BlockStored struct declares, its tag included:
    16 from vLLM 0.33 on, 15 in 0.32; only the size of a BlockStored map's header follows it."""
    packer = msgpack.Packer(use_bin_type=True)
    parts = [
        packer.pack_array_header(2 if dp_rank is None else 3),
        packer.pack(float(ts)),
        packer.pack_array_header(len(events)),
    ]
    for event in events:
        if shape == "array":
            parts.append(packer.pack(_event_array(event)))
            continue
        fields = _event_map(event)
        if isinstance(event, BlockStored):
            parts.append(_struct_map_header(stored_fields, len(fields)))
            parts.extend(packer.pack(k) + packer.pack(v) for k, v in fields.items())
        else:
            parts.append(packer.pack(fields))
    if dp_rank is not None:
        parts.append(packer.pack(dp_rank))
    return [topic, seq.to_bytes(8, "big"), b"".join(parts)]


def _struct_map_header(declared: int, written: int) -> bytes:
    """msgspec reserves a struct's map header for all `declared` fields, then writes into it
    how many it did not leave out: from 16 declared fields on, that is a map16 header even
    when fewer than 16 are written (a fixmap below)."""
    if declared < 16:
        return bytes([0x80 | written])
    return b"\xde" + written.to_bytes(2, "big")


def _event_map(event: Event) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        optional = (
            ("extra_keys", event.extra_keys),
            ("group_idx", event.group_idx),
            ("kv_cache_spec_kind", event.kv_cache_spec_kind),
            ("session_id", event.session_id),
        )
        out.update((k, v) for k, v in optional if v is not None)
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes)}
        out["medium"] = event.medium
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    return {"type": "AllBlocksCleared"}


def _event_array(event: Event) -> list[Any]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            None,  # lora_id
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    return ["AllBlocksCleared"]
