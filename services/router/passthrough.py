"""The routes a Router passes to an engine of the request's model without placing them by
prefix: `POST /tokenize`, `/detokenize` and `/v1/embeddings` (vLLM's own endpoints). They
change no engine's cache that a later request could reuse (tokenizing computes no KV; vLLM's
pooling runner caches no prefix), so any engine serving the model takes them: the one with
the fewest requests in flight from this Router, skipping suspects, as the fallback picks.

The client's body reaches the engine as it is (its `model` renamed where it names an alias),
and the engine's answer reaches the client as it is, with `x-kvsched-instance`. Nothing is
reported to the Conductor: it placed nothing.
"""

from __future__ import annotations

import json
from typing import Final

from aiohttp import web

from kvsched.core.adapters import AdapterChange
from services.common.inference_api.openai_api import ApiError, read_json
from services.router.auth import Tenant
from services.router.client_ids import client_request_id
from services.router.lora import AdapterLoader
from services.router.pipeline import bad_gateway
from services.router.placer import Placer
from services.router.prepare import Preparer
from services.router.proxy import EngineFailed, EngineRefused, Upstream

ROUTES: Final = ("/tokenize", "/detokenize", "/v1/embeddings")


class PassThrough:
    """Serves `ROUTES` (see the module docstring)."""

    def __init__(
        self, preparer: Preparer, placer: Placer, upstream: Upstream, adapters: AdapterLoader
    ) -> None:
        self._adapters = adapters
        self._preparer = preparer
        self._placer = placer
        self._upstream = upstream

    async def serve(
        self, request: web.Request, tenant: Tenant, arrived: float, reply: dict[str, str]
    ) -> web.StreamResponse:
        """Relay `request` (of `tenant`, already authenticated) to an engine of its model;
        fills `reply` with our headers. Raises `ApiError` (400, 404 for a model no Router
        knows, 503 with no engine up, 502 when the engine fails)."""
        body = await read_json(request, self._preparer.max_body_bytes)
        asked = body.get("model")
        if asked is not None and not isinstance(asked, str):
            raise ApiError(400, "'model' must be a string", param="model")
        model = self._preparer.served_model(asked)
        if asked is not None and asked != model:
            body = {**body, "model": model}
        raw = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if (rid := client_request_id(request)) is not None:
            headers["x-request-id"] = reply["x-request-id"] = rid
        tried: list[str] = []
        for _ in (1, 2):
            instance = self._placer.any_instance(self._preparer.base_model(model), exclude=tried)
            reply["x-kvsched-instance"] = instance.instance_id
            if model in self._adapters.modules:  # an adapter's engine must hold it
                await self._adapters.change(
                    self._upstream.session, instance.url, AdapterChange(load=model)
                )
            self._placer.begin(instance.instance_id)
            try:
                response, _ = await self._upstream.relay(
                    request, instance.url + request.path, raw, headers, reply, count_events=False
                )
                return response
            except EngineRefused:
                self._placer.suspect(instance.instance_id)
                tried.append(instance.instance_id)
            except EngineFailed as exc:
                raise bad_gateway(f"The inference engine failed ({exc.kind}).") from None
            finally:
                self._placer.end(instance.instance_id)
        raise bad_gateway("The inference engine refused the connection.")
