"""vLLM's routes about the served model rather than a completion: `/v1/models`, `/tokenize`,
`/detokenize`, and the runtime LoRA routes `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`."""

from __future__ import annotations

import time

from aiohttp import web

from services.common.inference_api.openai_api import bad_request, parse_request, read_json
from services.engine.served_model import ServedModel


class ModelRoutes:
    """The handlers for `served`, a model of `max_model_len` tokens."""

    def __init__(self, served: ServedModel, max_model_len: int) -> None:
        self.served = served
        self.max_model_len = max_model_len

    async def models(self, request: web.Request) -> web.Response:
        model = self.served.name
        now = int(time.time())
        card = {"id": model, "object": "model", "created": now, "owned_by": "vllm",
                "root": model, "parent": None, "max_model_len": self.max_model_len,
                "permission": []}  # fmt: skip
        cards = [card]
        adapters = self.served.adapters
        for name, path in (adapters.paths if adapters else {}).items():
            cards.append({"id": name, "object": "model", "created": now, "owned_by": "vllm",
                          "root": path, "parent": model, "max_model_len": None,
                          "permission": []})  # fmt: skip
        return web.json_response({"object": "list", "data": cards})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime `POST /v1/load_lora_adapter` (plain-text success)."""
        assert self.served.adapters is not None  # (the route exists only then)
        return web.Response(text=self.served.adapters.load(await read_json(request)))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime `POST /v1/unload_lora_adapter`."""
        assert self.served.adapters is not None
        return web.Response(text=self.served.adapters.unload(await read_json(request)))

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/tokenize`: a `prompt` (text or ids) or chat `messages`."""
        body = await read_json(request)
        model = body.get("model")
        self.served.adapter(model if isinstance(model, str) else None)
        req = parse_request("chat" if "messages" in body else "completion", body)
        ids = await self.served.prompt_ids(req)
        return web.json_response(
            {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/detokenize`: the text of `tokens`."""
        body = await read_json(request)
        model = body.get("model")
        self.served.adapter(model if isinstance(model, str) else None)
        tokens = body.get("tokens")
        tokenizer = self.served.tokenizer
        vocab = tokenizer.vocab_size
        if not (isinstance(tokens, list) and all(_is_token(t, vocab) for t in tokens)):
            raise bad_request(f"'tokens' must be a list of token ids below {vocab}", "tokens")
        return web.json_response({"prompt": tokenizer.decode(tokens)})


def _is_token(value: object, vocab: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab
