"""What a Router does about the KV a placement moves, before it forwards the request.

The Conductor orders every transfer of a decision itself (from the Messengers); the Router
only waits where the request needs the KV, then sends the request where the core's rule
(`kvsched.core.turn_host`, which the simulator follows too) says its turn runs:

- On the critical path (a fetched prefix, a session migrating with this turn): wait for each
  to end (`AwaitTransfer`), then forward. A failed migration leaves the session on its
  source, which still holds its KV, so the turn goes there (when this Router knows it); a
  failed fetch costs only a recompute, so the turn goes where it was placed.
- A prefill→decode hand-off: the prompt is prefilled on the prefill instance (the request
  with `max_tokens` 1, not streamed) while its KV streams to the decode instance layer by
  layer; once the hand-off landed the whole request goes to the decode instance, which finds
  the prompt cached and decodes. When the hand-off failed, the prefill instance (which has the
  prompt cached) serves the request itself.
- Off the critical path (a replicated prefix, an idle-gap migration): nothing to wait for.
- Transfers still under way for earlier requests that bring blocks this one counts on (the
  Conductor names them: `landing`): wait for them too, or the engine computes what is still
  arriving; a failed one costs only a recompute.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from opentelemetry.trace import Tracer

from clients.python import ConductorClient, ConductorError
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.decision import TransferKind
from kvsched.core.turn_host import TransferOutcome, TurnHost, turn_host
from services.router.metrics import RouterMetrics
from services.router.placement import Placement, PlannedTransfer
from services.router.proxy import EngineFailed, EngineRefused, Upstream

log = logging.getLogger(__name__)
TRANSFER_KINDS: Final[dict[int, TransferKind]] = {
    common.TRANSFER_KIND_FETCH_PREFIX: TransferKind.FETCH_PREFIX,
    common.TRANSFER_KIND_MIGRATE_SESSION: TransferKind.MIGRATE_SESSION,
    common.TRANSFER_KIND_REPLICATE_PREFIX: TransferKind.REPLICATE_PREFIX,
    common.TRANSFER_KIND_HANDOFF: TransferKind.HANDOFF,
}


@dataclass(frozen=True, slots=True)
class Forward:
    """Where the request goes once its KV is settled, for the relay and the Finish report."""

    placement: Placement  # instance_id/url: where the client's request is sent
    prefill_instance_id: str = ""  # set when another instance ran the prefill (a hand-off)


class KvMoves:
    """Waits on a placement's KV moves (see the module docstring)."""

    def __init__(
        self,
        client: ConductorClient,
        upstream: Upstream,
        metrics: RouterMetrics,
        tracer: Tracer,
        *,
        wait_s: float,
    ) -> None:
        self._client = client
        self._upstream = upstream
        self._metrics = metrics
        self._tracer = tracer
        self._wait_s = wait_s

    async def settle(
        self,
        placement: Placement,
        *,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        source_url: Mapping[str, str],
    ) -> Forward:
        """Run what must happen before the request is forwarded; returns where it goes.
        `source_url` maps the instance ids this Router knows to base URLs (a failed
        migration's source)."""
        for planned in placement.landing:  # a failure costs only a recompute
            await self._landed(planned)
        handoff = next(
            (t for t in placement.transfers if t.kind == common.TRANSFER_KIND_HANDOFF), None
        )
        if handoff is not None and placement.decode_url:
            landed = await self._handoff(placement, handoff, path, body, headers)
            moved = TransferOutcome(
                TransferKind.HANDOFF,
                placement.instance_id,
                placement.decode_instance_id,
                handoff.on_critical_path,
                landed,
            )
            host = turn_host(placement.instance_id, [moved])
        else:
            host = await self._critical_path(placement, source_url)
        return forward(placement, host, source_url)

    async def _critical_path(
        self, placement: Placement, source_url: Mapping[str, str]
    ) -> TurnHost[str]:
        """Wait for the transfers the turn waits for, one after the other, until a failure
        moves the turn: what still lands where it was placed no longer matters to it."""
        placed = placement.instance_id
        outcomes: list[TransferOutcome[str]] = []
        host = turn_host(placed, outcomes, up=source_url)
        for planned in placement.transfers:
            if not planned.on_critical_path:
                continue
            landed = await self._landed(planned)
            kind = TRANSFER_KINDS.get(planned.kind)
            if kind is None:  # not a kind this Router knows: it moves no turn
                continue
            outcomes.append(TransferOutcome(kind, planned.source_instance_id, placed, True, landed))
            host = turn_host(placed, outcomes, up=source_url)
            if host.why:
                break
        return host

    async def _handoff(
        self,
        placement: Placement,
        handoff: PlannedTransfer,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
    ) -> bool:
        """Prefill on the placed instance, then wait for its KV to reach the decode instance;
        True when both went well."""
        with self._tracer.start_as_current_span("prefill") as span:
            span.set_attribute("kvsched.instance", placement.instance_id)
            prefilled = await self._prefill(placement.url + path, body, headers)
        return prefilled and await self._landed(handoff)

    async def _prefill(self, url: str, body: bytes, headers: Mapping[str, str]) -> bool:
        """The request as a prefill only: one token, not streamed; True when it succeeded."""
        try:
            prefill = json.dumps(prefill_body(json.loads(body))).encode()
            status = await self._upstream.post(url, prefill, headers)
        except (ValueError, EngineRefused, EngineFailed) as exc:
            log.warning("prefill on %s failed: %s", url, exc)
            return False
        return status < 400

    async def _landed(self, planned: PlannedTransfer) -> bool:
        """Wait for one transfer; True when it landed verified."""
        kind = kind_label(planned.kind)
        started = time.perf_counter()
        with self._tracer.start_as_current_span("transfer wait") as span:
            span.set_attribute("kvsched.transfer.id", planned.transfer_id)
            span.set_attribute("kvsched.transfer.kind", kind)
            try:
                answer = await self._client.await_transfer(planned.transfer_id, self._wait_s)
                status = answer.status
            except ConductorError as exc:
                log.warning("cannot follow transfer %s: %s", planned.transfer_id, exc)
                status = pb.TRANSFER_STATUS_UNSPECIFIED
            ok = status == pb.TRANSFER_STATUS_DONE
            outcome = (
                "done"
                if ok
                else pb.TransferStatus.Name(status).removeprefix("TRANSFER_STATUS_").lower()
            )
            span.set_attribute("kvsched.transfer.outcome", outcome)
        self._metrics.transfer_wait.labels(kind).observe(time.perf_counter() - started)
        self._metrics.transfer_outcomes.labels(kind, outcome).inc()
        return ok


def forward(placement: Placement, host: TurnHost[str], source_url: Mapping[str, str]) -> Forward:
    """The placement the request is sent with, once `host` says where its turn runs."""
    if host.handed_off:
        decode = replace(
            placement,
            instance_id=host.decode,
            url=placement.decode_url,
            expected_cached_tokens=0,
        )
        return Forward(decode, prefill_instance_id=host.prefill)
    if host.prefill != placement.instance_id:  # nothing of what it expected is there
        return Forward(
            replace(
                placement,
                instance_id=host.prefill,
                url=source_url[host.prefill],
                rule=placement.rule + host.why,
                expected_cached_tokens=0,
            )
        )
    if host.why:
        return Forward(replace(placement, rule=placement.rule + host.why))
    return Forward(placement)


def kind_label(kind: int) -> str:
    """A transfer kind as the metrics and spans name it."""
    found = TRANSFER_KINDS.get(kind)
    return found.value if found is not None else "unknown"


def prefill_body(body: Any) -> dict[str, Any]:
    """A completion request as its prefill alone: one token, no stream (vLLM's disaggregated
    proxies send the same)."""
    if not isinstance(body, dict):
        raise ValueError("the request body is not a JSON object")
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out
