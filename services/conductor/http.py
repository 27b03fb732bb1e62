"""The Conductor's HTTP admin endpoint: JSON views for people and dashboards, and /metrics.
With an admin token, every path but /metrics and /api/leader (readiness) asks for it."""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.requests import RequestError
from services.common.security.admin_token import bearer_required
from services.common.serving.api_errors import unavailable_headers
from services.common.serving.http_site import start_site
from services.conductor import instance_messages, placement_messages
from services.conductor.explain import Explainer
from services.conductor.leadership import Leadership
from services.conductor.term import CurrentTerm

# What anyone may read: the metrics and who leads (`kvsched up`'s readiness check).
OPEN_PATHS = frozenset({"/metrics", "/api/leader"})
_STATUS = {"invalid": 400, "not_found": 404, "out_of_range": 400, "unavailable": 503}


def _error(status: int, message: str) -> web.Response:
    """The error as JSON; a 503 says when to try again."""
    headers = unavailable_headers() if status == 503 else None
    body = {"error": {"message": message, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class AdminHttp:
    """`/api/nodes/stats`, `/api/sessions/{id}`, `/api/leader`, `/api/explain`, `/metrics`."""

    def __init__(
        self,
        current: CurrentTerm,
        leadership: Leadership,
        explainer: Explainer,
        registry: CollectorRegistry,
        admin_token: str | None = None,
    ) -> None:
        self.current = current
        self.leadership = leadership
        self.explainer = explainer
        self.registry = registry  # the Conductor's metrics
        middlewares = [] if admin_token is None else [bearer_required(admin_token, OPEN_PATHS)]
        self.app = web.Application(client_max_size=4 << 20, middlewares=middlewares)
        self.app.add_routes(
            [
                web.get("/api/nodes/stats", self.nodes),
                web.get("/api/sessions/{session_id}", self.session),
                web.get("/api/leader", self.leader),
                web.get("/api/explain", self.explain),
                web.post("/api/explain", self.explain),
                web.get("/metrics", self.metrics),
            ]
        )
        self._runner: web.AppRunner | None = None

    async def start(self, listen: str) -> int:
        self._runner, port = await start_site(self.app, listen)
        return port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def nodes(self, request: web.Request) -> web.Response:
        state = self.current().state
        rows = []
        for iid in sorted(state.instances, key=lambda i: state.instances[i].slot):
            status = instance_messages.instance_status(state, iid)
            inst = state.instances[iid]
            rows.append(
                {
                    "instance_id": iid,
                    "url": inst.spec.url,
                    "node": inst.spec.node,
                    "role": inst.spec.role.value,
                    "slot": inst.slot,
                    "gpu_blocks": status.gpu_blocks,
                    "reported_gpu_blocks": state.cluster.index.reported_count(inst.slot),
                    "in_flight": status.in_flight,
                    "pending_prefill_tokens": status.load.pending_prefill_tokens,
                    "running": status.load.running,
                    "waiting": status.load.waiting,
                    "free_blocks": status.load.free_blocks,
                    "sessions_bound": status.sessions_bound,
                    "next_event_sequence": status.next_event_sequence,
                }
            )
        return web.json_response(
            {
                "policy": state.scheduler.spec,
                "index_blocks": len(state.cluster.index),
                "sessions": len(state.cluster.sessions),
                "instances": rows,
            }
        )

    async def session(self, request: web.Request) -> web.Response:
        state = self.current().state
        try:
            s = state.session(request.match_info["session_id"])
        except RequestError as exc:
            return _error(404, str(exc))
        msg = placement_messages.session_message(state, s)
        return web.json_response(
            {
                "session_id": msg.session_id,
                "host_instance_id": msg.host_instance_id,
                "turns": msg.turns,
                "migrations": msg.migrations,
                "context_tokens": msg.context_tokens,
                "moving_to_instance_id": msg.moving_to_instance_id,
            }
        )

    async def leader(self, request: web.Request) -> web.Response:
        leadership = self.leadership
        leader = leadership.leader
        return web.json_response(
            {
                "self_id": leadership.self_id,
                "is_leader": leadership.serving,
                "leader_id": leader.id if leader else None,
                "leader_url": leader.http_url if leader else None,
            }
        )

    async def explain(self, request: web.Request) -> web.Response:
        """Query `?hashes=1,2,3` or `?tokens=…`, or a JSON body with `block_hashes`,
        `token_ids` or `prompt` (UTF-8 bytes as token ids), plus optional `prompt_tokens`,
        `output_tokens`, `session_id`."""
        try:
            body = await self._explain_body(request)
            msg = pb.ExplainRequest(
                block_hashes=[int(h) for h in body.get("block_hashes", [])],
                token_ids=[int(t) for t in body.get("token_ids", [])],
                prompt_tokens=int(body.get("prompt_tokens", 0)),
                output_tokens=int(body.get("output_tokens", 0)),
                session_id=str(body.get("session_id", "")),
            )
        except (ValueError, TypeError) as exc:  # JSON errors and bad text are ValueErrors
            return _error(400, f"bad explain request: {exc}")
        except RecursionError:  # json's parser recurses once per level of nesting
            return _error(400, "bad explain request: the body is nested too deeply")
        try:
            decision = self.explainer.explain(msg)
        except RequestError as exc:
            return _error(_STATUS[exc.kind], str(exc))
        state = self.current().state
        rows = decision.explain()
        for row in rows:
            row["instance"] = state.id_of(int(row["instance"]))
        return web.json_response(
            {
                "policy": state.scheduler.spec,
                "rule": decision.rule,
                "rejected": decision.rejected,
                "instance": state.id_of(decision.instance) if decision.instance >= 0 else None,
                "cached_tokens": decision.cached_tokens,
                "estimated_ttft_s": decision.estimated_ttft_s,
                "candidates": rows,
            },
            dumps=lambda obj: json.dumps(_scrub(obj)),
        )

    @staticmethod
    async def _explain_body(request: web.Request) -> dict[str, Any]:
        if request.method == "POST":
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        else:
            q = request.query
            body = {
                k: v for k, v in q.items() if k in {"prompt_tokens", "output_tokens", "session_id"}
            }
            if "hashes" in q:
                body["block_hashes"] = [h for h in q["hashes"].split(",") if h]
            if "tokens" in q:
                body["token_ids"] = [t for t in q["tokens"].split(",") if t]
            if "prompt" in q:
                body["prompt"] = q["prompt"]
        if "prompt" in body:
            body["token_ids"] = list(str(body.pop("prompt")).encode())
        return body

    async def metrics(self, request: web.Request) -> web.Response:
        data = generate_latest(self.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _scrub(obj: Any) -> Any:
    """NaN and infinities become null (JSON has neither)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _scrub(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_scrub(v) for v in obj]
    return obj
