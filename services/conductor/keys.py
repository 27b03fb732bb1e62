"""The etcd keyspace (`/kvsched/v1/…`) and how each record is encoded.

    leader                                  {id, url, http_url}      bound to the leader's lease
    config/policy                           policy spec
    instances/{id}                          instance record          bound to the instance's lease
    cursors/{id}                            next KV event sequence   bound to the instance's lease
    blocks/{id}/{tier}/{hash:016x}          parent hash (hex) or ""  bound to the instance's lease
    sessions/{id}                           session record

Instance and session ids are percent-encoded so a `/` in an id cannot escape its folder.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import quote, unquote

from kvsched.core.cluster import Role
from kvsched.core.index import Tier
from kvsched.core.sessions import NO_HOST, Session
from services.common.serving.log_ids import session_tag

ROOT = "/kvsched/v1/"
LEADER = ROOT + "leader"
POLICY = ROOT + "config/policy"
INSTANCES = ROOT + "instances/"
CURSORS = ROOT + "cursors/"
BLOCKS = ROOT + "blocks/"
SESSIONS = ROOT + "sessions/"


def _part(name: str) -> str:
    return quote(name, safe="")


def instance_key(instance_id: str) -> str:
    return INSTANCES + _part(instance_id)


def cursor_key(instance_id: str) -> str:
    return CURSORS + _part(instance_id)


def blocks_prefix(instance_id: str) -> str:
    return BLOCKS + _part(instance_id) + "/"


def block_key(instance_id: str, tier: Tier, block: int) -> str:
    return f"{blocks_prefix(instance_id)}{int(tier)}/{block:016x}"


def session_key(session_id: str) -> str:
    return SESSIONS + _part(session_id)


def tail(key: str, prefix: str) -> str:
    """The decoded id after `prefix` (instances/, cursors/, sessions/)."""
    return unquote(key[len(prefix) :])


def loggable(key: str) -> str:
    """`key` as a log may name it: a session's id replaced by its tag (`session_tag`)."""
    if key.startswith(SESSIONS):
        return SESSIONS + session_tag(tail(key, SESSIONS))
    return key


def parse_block_key(key: str) -> tuple[str, Tier, int]:
    """(instance id, tier, block hash) of a `blocks/…` key."""
    instance, tier, block = key[len(BLOCKS) :].split("/")
    return unquote(instance), Tier(int(tier)), int(block, 16)


def encode_parent(parent: int | None) -> bytes:
    return b"" if parent is None else f"{parent:016x}".encode()


def decode_parent(value: bytes) -> int | None:
    return int(value, 16) if value else None


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """An instance as it registered."""

    instance_id: str
    url: str
    node: str
    role: Role
    model: str = ""
    messenger_url: str = ""
    max_model_len: int = 0  # its context, tokens (0: not said)


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """What etcd keeps of a registered instance."""

    spec: InstanceSpec
    slot: int
    lease_id: int

    def encode(self) -> bytes:
        body = asdict(self)
        body["spec"]["role"] = self.spec.role.value
        return json.dumps(body, sort_keys=True).encode()

    @staticmethod
    def decode(value: bytes) -> InstanceRecord:
        body = json.loads(value)
        spec = dict(body["spec"], role=Role(body["spec"]["role"]))
        return InstanceRecord(InstanceSpec(**spec), int(body["slot"]), int(body["lease_id"]))


_SESSION_FIELDS = (
    "turns",
    "last_arrival_at",
    "last_finish_at",
    "last_migration_at",
    "migrations",
    "context_tokens",
    "prompt_tokens",
    "growth_tokens",
    "idle_gap_s",
)


def encode_session(session: Session, host_id: str | None) -> bytes:
    """A session's binding (by instance id, slots are per process) and the history its
    policy reads; a copy of its KV in flight is not kept (a migration ends unbound)."""
    body: dict[str, Any] = {"host": host_id or ""}
    for name in _SESSION_FIELDS:
        value = getattr(session, name)
        body[name] = value if not isinstance(value, float) or math.isfinite(value) else None
    return json.dumps(body, sort_keys=True).encode()


def decode_session(session_id: str, value: bytes, host_slot: int | None) -> tuple[Session, str]:
    """The session (bound to `host_slot` when that instance is registered) and its host id."""
    body = json.loads(value)
    session = Session(session_id, host=NO_HOST if host_slot is None else host_slot)
    for name in _SESSION_FIELDS:
        raw = body.get(name)
        if raw is None:
            continue
        setattr(session, name, type(getattr(session, name))(raw))
    return session, str(body.get("host", ""))
