"""What a Router does about the KV a placement moves, before it forwards the request.

The Conductor orders every transfer of a decision itself (from the Messengers); the Router
only waits where the request needs the KV:

- On the critical path (a fetched prefix, a session migrating with this turn): wait for each
  to end (`AwaitTransfer`), then forward. A failed migration leaves the session on its
  source, which still holds its KV, so the turn goes there; a failed fetch costs only a
  recompute, so the turn goes where it was placed.
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
from services.router.metrics import RouterMetrics
from services.router.placement import Placement, PlannedTransfer
from services.router.proxy import EngineFailed, EngineRefused, Upstream

log = logging.getLogger(__name__)
KIND_NAMES: Final[dict[int, str]] = {
    common.TRANSFER_KIND_FETCH_PREFIX: "fetch_prefix",
    common.TRANSFER_KIND_MIGRATE_SESSION: "migrate_session",
    common.TRANSFER_KIND_REPLICATE_PREFIX: "replicate_prefix",
    common.TRANSFER_KIND_HANDOFF: "handoff",
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
        `source_url` maps instance ids to base URLs (a failed migration's source)."""
        for planned in placement.landing:  # a failure costs only a recompute
            await self._landed(planned)
        handoff = next(
            (t for t in placement.transfers if t.kind == common.TRANSFER_KIND_HANDOFF), None
        )
        if handoff is not None and placement.decode_url:
            return await self._handoff(placement, handoff, path, body, headers)
        for planned in placement.transfers:
            if not planned.on_critical_path:
                continue
            if await self._landed(planned):
                continue
            if planned.kind == common.TRANSFER_KIND_MIGRATE_SESSION:
                url = source_url.get(planned.source_instance_id)
                if url:
                    return Forward(
                        replace(
                            placement,
                            instance_id=planned.source_instance_id,
                            url=url,
                            rule=placement.rule + " (migration failed: stays on its source)",
                            expected_cached_tokens=0,
                        )
                    )
        return Forward(placement)

    async def _handoff(
        self,
        placement: Placement,
        handoff: PlannedTransfer,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
    ) -> Forward:
        with self._tracer.start_as_current_span("prefill") as span:
            span.set_attribute("kvsched.instance", placement.instance_id)
            prefilled = await self._prefill(placement.url + path, body, headers)
        if prefilled and await self._landed(handoff):
            decode = replace(
                placement,
                instance_id=placement.decode_instance_id,
                url=placement.decode_url,
                expected_cached_tokens=0,
            )
            return Forward(decode, prefill_instance_id=placement.instance_id)
        # The prefill instance holds the prompt's KV: it decodes too.
        return Forward(replace(placement, rule=placement.rule + " (hand-off failed: decoded here)"))

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
        kind = KIND_NAMES.get(planned.kind, "unknown")
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
