"""Stock vLLM's OpenAI server as an engine port, through the API it has (0.11 and later):

- identity and limits: the served model name from `/v1/models`; block size, KV capacity and
  the prefix-caching settings from the `vllm:cache_config_info` metric (the engine must cache
  prefixes, with the hash algorithm the Routers use);
- KV-event endpoints: `/kv_event_sources` (vLLM 0.3x; bind addresses such as `tcp://*:5557`
  are reached at the engine's host), else the `--engine ...,events=...,replay=...` options;
- load: `/metrics` (running and waiting requests, KV cache usage), read at most every
  `metrics_interval_s`; between two reads `/load` (requests in flight, served with
  `--enable-server-load-tracking`) or else `/health` says that it answers. The Conductor adds
  its own count of what it placed since the last report;
- LoRA adapters, on an engine started with `--enable-lora` (its `/metrics` then has the
  `vllm:lora_requests_info` gauge): the adapters it holds from `/v1/models` (the cards with a
  `parent`), the ones its requests use and its `--max-loras` from the gauge's newest sample.
  An engine that has run nothing has no sample yet: its capacity is then the `--engine`
  option `max_loras`, else vLLM's default, 1;
- no snapshot: the relay rebuilds the index from the replay buffer instead.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvsched.core.adapters import MAX_ADAPTERS, AdapterReport
from kvsched.core.load import LoadReport
from services.dataplane import BlockHashes
from services.messenger.engine_api import (
    EngineInfo,
    EngineMalformed,
    EngineSilent,
    EngineUnreachable,
    KvEventsEndpoint,
    Snapshot,
)
from services.messenger.engines import EngineTarget

MAX_ANSWER_BYTES = 4 << 20  # /metrics of a busy engine stays far below this
DEFAULT_MAX_LORAS = 1  # vLLM's --max-loras default
_BIND_ANY = ("*", "0.0.0.0", "[::]", "::")


@dataclass(frozen=True, slots=True)
class _Usage:
    """What `/metrics` said last."""

    running: int
    waiting: int
    kv_usage: float  # share of the KV cache in use, 0..1
    lora: _LoraUsage | None = None  # None: the engine serves no adapter


@dataclass(frozen=True, slots=True)
class _LoraUsage:
    """What `vllm:lora_requests_info` said last."""

    max_loras: int  # 0: no sample yet
    busy: frozenset[str]  # adapters of running or waiting requests


class VllmEngine:
    """One vLLM server at `target.url`, on a shared HTTP session."""

    has_snapshot = False

    def __init__(
        self,
        target: EngineTarget,
        session: aiohttp.ClientSession,
        *,
        node: str,
        block_hashes: BlockHashes,
        timeout_s: float = 0.5,
        metrics_interval_s: float = 1.0,
    ) -> None:
        self.target = target
        self.base_url = target.url
        self._session = session
        self._node = node
        self._hashes = block_hashes
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.metrics_interval_s = metrics_interval_s
        self._capacity_blocks = 0
        self._block_size = 0
        self._usage: _Usage | None = None
        self._usage_at = -float("inf")
        self._adapters_held: frozenset[str] = frozenset()
        self._max_loras = target.max_loras or DEFAULT_MAX_LORAS
        self._has_load = True  # until the engine answers /load with a 404

    async def _get(self, path: str) -> tuple[int, bytes]:
        url = self.base_url + path
        try:
            async with self._session.get(url, timeout=self._timeout) as resp:
                body = await resp.content.read(MAX_ANSWER_BYTES + 1)
                if len(body) > MAX_ANSWER_BYTES:
                    raise EngineMalformed(f"GET {url}: answer over {MAX_ANSWER_BYTES} bytes")
                return resp.status, body
        except TimeoutError:
            raise EngineSilent(f"GET {url}: no answer in {self._timeout.total:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnreachable(f"GET {url}: {type(exc).__name__} {exc}") from None

    async def _json(self, path: str) -> Any:
        status, body = await self._get(path)
        if status != 200:
            raise EngineUnreachable(f"GET {self.base_url + path}: HTTP {status}")
        try:
            return json.loads(body)
        except ValueError as exc:
            raise EngineMalformed(f"{path}: not JSON ({exc})") from None

    async def info(self) -> EngineInfo:
        models = await self._json("/v1/models")
        data = models.get("data") if isinstance(models, Mapping) else None
        if not isinstance(data, list) or not data or not isinstance(data[0], Mapping):
            raise EngineMalformed("/v1/models lists no model")
        model = data[0].get("id")
        if not isinstance(model, str) or not model:
            raise EngineMalformed("/v1/models: the model has no id")
        config = cache_config(await self._metrics_text())
        self._check_caching(config)
        self._block_size = _positive(config, "block_size")
        self._capacity_blocks = _positive(config, "num_gpu_blocks")
        return EngineInfo(
            instance_id=self.target.instance_id or f"{self._node}-{self.target.port}",
            model=model,
            role=self.target.role,
            block_size=self._block_size,
            capacity_blocks=self._capacity_blocks,
            kv_events=await self._kv_events(),
            max_model_len=_context(data[0]),
        )

    def _check_caching(self, config: Mapping[str, str]) -> None:
        if config.get("enable_prefix_caching", "").lower() != "true":
            raise EngineMalformed("the engine does not cache prefixes (--enable-prefix-caching)")
        algo = config.get("prefix_caching_hash_algo") or self._hashes.algo
        if algo != self._hashes.algo:
            raise EngineMalformed(
                f"the engine hashes blocks with {algo}, this cluster with {self._hashes.algo} "
                "(--prefix-caching-hash-algo)"
            )

    async def _kv_events(self) -> KvEventsEndpoint:
        """The rank-0 publisher's endpoints: the flag's, else what the engine publishes."""
        t = self.target
        if t.events:
            return KvEventsEndpoint(t.events, t.replay or None, t.topic)
        try:
            sources = await self._json("/kv_event_sources")
        except EngineUnreachable:
            sources = None  # an older vLLM
        source = sources.get("0") if isinstance(sources, Mapping) else None
        if not isinstance(source, Mapping) or not source.get("enable_kv_cache_events"):
            raise EngineMalformed(
                "the engine publishes no KV events: start it with --kv-events-config, or name "
                "its endpoints with --engine URL,events=tcp://HOST:PORT[,replay=...]"
            )
        endpoint = self._reachable(source.get("endpoint"))
        if endpoint is None:
            raise EngineMalformed(f"/kv_event_sources: bad endpoint {source.get('endpoint')!r}")
        topic = source.get("topic")
        return KvEventsEndpoint(
            endpoint,
            self._reachable(source.get("replay_endpoint")),
            topic if isinstance(topic, str) else "",
        )

    def _reachable(self, address: object) -> str | None:
        """A publisher's bind address as a subscriber on this node reaches it."""
        if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
            return None
        if address.startswith("tcp://"):
            host, _, port = address[6:].rpartition(":")
            if host in _BIND_ANY:
                return f"tcp://{self.target.host}:{port}"
        return address

    async def load(self) -> LoadReport:
        """What the engine runs now; raises `EngineUnreachable` when it does not answer."""
        loop = asyncio.get_running_loop()
        in_flight = await self._in_flight()
        if self._usage is None or loop.time() - self._usage_at >= self.metrics_interval_s:
            self._usage = usage(await self._metrics_text())
            if self._usage.lora is not None:
                self._adapters_held = await self._adapters()
                self._max_loras = self._usage.lora.max_loras or self._max_loras
            self._usage_at = loop.time()
        u = self._usage
        adapters = None
        if u.lora is not None:
            adapters = AdapterReport(self._max_loras, self._adapters_held, u.lora.busy)
        used = round(u.kv_usage * self._capacity_blocks)
        # /load is fresh, /metrics up to a second old: the requests the server holds now,
        # split as /metrics last split them.
        running, waiting = u.running, u.waiting
        if in_flight is not None:
            running = min(running, in_flight)
            waiting = in_flight - running
        return LoadReport(
            pending_prefill_tokens=0,  # vLLM does not say: the Conductor counts its placements
            pending_prefill_s=0.0,
            waiting=waiting,
            running=running,
            decode_tokens=used * self._block_size,
            free_blocks=max(self._capacity_blocks - used, 0),
            adapters=adapters,
        )

    async def _adapters(self) -> frozenset[str]:
        """The adapters the server lists in `/v1/models` (cards with a `parent`)."""
        models = await self._json("/v1/models")
        data = models.get("data") if isinstance(models, Mapping) else None
        if not isinstance(data, list):
            raise EngineMalformed("/v1/models lists no model")
        return frozenset(
            card["id"]
            for card in data[:MAX_ADAPTERS]  # (the Conductor takes no more)
            if isinstance(card, Mapping) and card.get("parent") and isinstance(card.get("id"), str)
        )

    async def _in_flight(self) -> int | None:
        """Requests in the server (`/load`), or None where it does not count them; raises
        `EngineUnreachable` when it does not answer."""
        if not self._has_load:
            await self._json("/health")
            return None
        status, body = await self._get("/load")
        if status == 404:
            self._has_load = False
            return None
        if status != 200:
            raise EngineUnreachable(f"GET {self.base_url}/load: HTTP {status}")
        try:
            value = json.loads(body).get("server_load")
        except (ValueError, AttributeError):
            value = None
        return value if isinstance(value, int) and value >= 0 else None

    async def _metrics_text(self) -> str:
        status, body = await self._get("/metrics")
        if status != 200:
            raise EngineUnreachable(f"GET {self.base_url}/metrics: HTTP {status}")
        return body.decode("utf-8", "replace")

    async def snapshot(self) -> Snapshot:
        raise EngineMalformed("vLLM has no snapshot of its cache")


def cache_config(metrics: str) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` (the engine's CacheConfig, as strings)."""
    for family in _families(metrics):
        if family.name in ("vllm:cache_config_info", "vllm:cache_config"):
            for sample in family.samples:
                return dict(sample.labels)
    raise EngineMalformed("/metrics has no vllm:cache_config_info (is this a vLLM server?)")


def usage(metrics: str) -> _Usage:
    """Running and waiting requests and KV usage, summed over the engine's ranks."""
    values = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    kv: list[float] = []
    lora: _LoraUsage | None = None
    for family in _families(metrics):
        if family.name == "vllm:lora_requests_info":
            lora = _lora_usage(family.samples)
            continue
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
            elif sample.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                kv.append(sample.value)
    share = sum(kv) / len(kv) if kv else 0.0
    return _Usage(
        running=int(values["vllm:num_requests_running"]),
        waiting=int(values["vllm:num_requests_waiting"]),
        kv_usage=min(max(share, 0.0), 1.0),
        lora=lora,
    )


def _lora_usage(samples: Any) -> _LoraUsage:
    """The newest sample of `vllm:lora_requests_info` (each label set is one the engine saw;
    its value is when it last saw it)."""
    newest = max(samples, key=lambda s: s.value, default=None)
    if newest is None:
        return _LoraUsage(0, frozenset())
    labels = newest.labels
    busy = {
        name
        for key in ("running_lora_adapters", "waiting_lora_adapters")
        for name in labels.get(key, "").split(",")
        if name
    }
    cap = labels.get("max_lora", "")
    return _LoraUsage(int(cap) if cap.isdigit() else 0, frozenset(busy))


def _families(metrics: str) -> Any:
    try:
        return list(text_string_to_metric_families(metrics))
    except ValueError as exc:
        raise EngineMalformed(f"/metrics is not Prometheus text ({exc})") from None


def _positive(config: Mapping[str, str], key: str) -> int:
    try:
        value = int(config.get(key, ""))
    except ValueError:
        value = 0
    if value <= 0:
        raise EngineMalformed(f"vllm:cache_config_info has no positive {key}")
    return value


def _context(card: Mapping[str, Any]) -> int:
    """A `/v1/models` card's `max_model_len` (0 where it has none that is a token count)."""
    value = card.get("max_model_len")
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 32:
        return value
    return 0
