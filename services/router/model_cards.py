"""The Router's `GET /v1/models` and `GET /v1/models/{id}`: every served model's card, as
the engines list them (one answering instance of each model asked), the configured models'
own where none answers, and a card for each LoRA adapter and each alias.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Final

from aiohttp import web

from services.common.inference_api.openai_api import ApiError
from services.router.auth import Authenticator
from services.router.metrics import RouterMetrics
from services.router.placer import Placer
from services.router.prepare import Preparer
from services.router.proxy import EngineFailed, Upstream

# `/v1/models` asks one instance of each served model, up to this many models.
_MAX_MODELS_ASKED: Final = 64


class ModelCards:
    """The model routes of one Router (`models`, `model`)."""

    def __init__(
        self,
        preparer: Preparer,
        placer: Placer,
        upstream: Upstream,
        *,
        auth: Authenticator,
        metrics: RouterMetrics,
    ) -> None:
        self._preparer = preparer
        self._placer = placer
        self._upstream = upstream
        self._auth = auth
        self._metrics = metrics
        self._started_at = int(time.time())  # the configured models' `created`

    async def models(self, request: web.Request) -> web.Response:
        """Every served model: the `/v1/models` of one instance of each model the Conductor
        knows (merged, with a card for each alias), else the configured models."""
        try:
            self._auth.tenant_of(request.headers)
        except ApiError as err:
            self._metrics.requests.labels("/v1/models", str(err.status)).inc()
            return err.response()
        self._metrics.requests.labels("/v1/models", "200").inc()
        return web.json_response({"object": "list", "data": await self._cards()})

    async def model(self, request: web.Request) -> web.Response:
        """One model's card (`GET /v1/models/{id}`), or OpenAI's 404."""
        try:
            self._auth.tenant_of(request.headers)
            wanted = request.match_info["model"]
            card = next((c for c in await self._cards() if c.get("id") == wanted), None)
            if card is None:
                raise ApiError(404, f"The model `{wanted}` does not exist.",
                               type_="NotFoundError", param="model")  # fmt: skip
        except ApiError as err:
            self._metrics.requests.labels("/v1/models/{id}", str(err.status)).inc()
            return err.response()
        self._metrics.requests.labels("/v1/models/{id}", "200").inc()
        return web.json_response(card)

    async def _cards(self) -> list[dict[str, object]]:
        """The model cards of one answering instance of each served model, the configured
        model's own where none answers, then a card for each alias."""
        cards: dict[str, dict[str, object]] = {}
        asked: set[str] = set()
        for inst in self._placer.instances:
            if inst.model in asked or len(asked) >= _MAX_MODELS_ASKED:
                continue
            with contextlib.suppress(EngineFailed, ValueError, TypeError, KeyError):
                status, data, _ = await self._upstream.get(inst.url + "/v1/models")
                if status == 200:
                    listed = json.loads(data)["data"]
                    cards |= {c["id"]: c for c in listed if isinstance(c, dict) and "id" in c}
                    asked.add(inst.model)
        for name in self._preparer.tokenizers:
            cards.setdefault(name, self._own_card(name))
        for module in self._preparer.adapters.values():  # as vLLM lists a loaded one
            card = {**self._own_card(module.name), "root": module.path}
            cards.setdefault(module.name, card | {"parent": module.base_model})
        extra = {alias: {**cards[name], "id": alias, "root": name}
                 for alias, name in self._preparer.aliases.items() if name in cards}  # fmt: skip
        return [*cards.values(), *extra.values()]

    def _own_card(self, name: str) -> dict[str, object]:
        return {
            "id": name,
            "object": "model",
            "created": self._started_at,
            "owned_by": "kvsched",
            "max_model_len": self._preparer.max_model_len,
        }
