"""Which engines a Messenger serves and how it talks to each: the `--engine` flag, and the
engine port, the one interface a relay needs (who the engine is, its load, its KV-event
endpoints, an optional snapshot), with two implementations: stock vLLM's OpenAI server
(`VllmEngine`) and our simulated engine (`EngineApi`). Neither is asked for KV: both save to
and load from their node's KV pool, which transfers read and write.

`--engine URL[,key=value...]`, repeated or with several URLs in one value: `kind` (`auto`,
the default, asks for the simulated engine's `/kvsched/info` and takes a 404 for vLLM; `sim`;
`vllm`), and for vLLM `id` (the instance id; default NODE-PORT), `role` (both, prefill or
decode), `events`, `replay` and `topic` (the KV-event endpoints, when the engine does not
publish them at `/kv_event_sources`), and `max_loras` (its `--max-loras`, until its `/metrics`
says: an idle vLLM does not; default vLLM's, 1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol
from urllib.parse import urlsplit

from kvsched.core.load import LoadReport
from services.messenger.engine_api import ROLES, EngineInfo, Snapshot

KINDS = ("auto", "sim", "vllm")
_KEYS = frozenset({"kind", "id", "role", "events", "replay", "topic", "max_loras"})


class EnginePort(Protocol):
    """What a relay asks an engine. Every call raises `EngineUnreachable` (no answer) or
    `EngineMalformed` (an answer off the contract); none changes the engine."""

    base_url: str
    has_snapshot: bool  # whether `snapshot` can rebuild the index (vLLM has none)

    async def info(self) -> EngineInfo: ...

    async def load(self) -> LoadReport: ...

    async def snapshot(self) -> Snapshot: ...


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """One `--engine`: where it is and what the flag says of it."""

    url: str
    kind: str = "auto"
    instance_id: str = ""
    role: str = "both"
    events: str = ""
    replay: str = ""
    topic: str = ""
    max_loras: int = 0  # 0: not said

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise ValueError(f"--engine needs http(s)://host:port, got {self.url!r}")
        if self.kind not in KINDS:
            raise ValueError(f"--engine kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.role not in ROLES:
            raise ValueError(f"--engine role must be one of {', '.join(ROLES)}")
        for endpoint in (self.events, self.replay):
            if endpoint and not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"--engine events/replay must be ZMQ addresses, got {endpoint!r}")

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 0


def parse_engines(values: Sequence[str]) -> tuple[EngineTarget, ...]:
    """Every `--engine` value, in order: a part with `://` starts an engine, a `key=value`
    part sets one of its options. Raises ValueError naming what is wrong."""
    found: list[EngineTarget] = []
    for value in values:
        for raw in value.split(","):
            part = raw.strip()
            if not part:
                continue
            if "://" in part and "=" not in part.split("://", 1)[0]:
                found.append(EngineTarget(part.rstrip("/")))
                continue
            key, sep, option = part.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in _KEYS or not found:
                raise ValueError(f"--engine: {part!r} is neither a URL nor an option of one")
            field = "instance_id" if key == "id" else key
            options: dict[str, object] = {field: option.strip()}
            if field == "max_loras":
                options[field] = _max_loras(option.strip())
            found[-1] = replace(found[-1], **options)  # type: ignore[arg-type]  # str or int
    urls = [t.url for t in found]
    if len(set(urls)) != len(urls):
        raise ValueError("--engine names the same URL twice")
    return tuple(found)


def _max_loras(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--engine max_loras must be a positive integer, got {value!r}")
    return int(value)
