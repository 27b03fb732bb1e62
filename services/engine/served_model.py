"""The model an engine serves, as requests name it: its base model or one of its LoRA
adapters, and the tokenizer that turns a request's prompt into token ids."""

from __future__ import annotations

import asyncio

from kvsched.core.vllm_hashing import AdapterKey
from services.common.inference_api.openai_api import ApiError, CompletionRequest, PromptTokenizer
from services.engine.lora import Adapters

_INLINE_TOKENIZE_CHARS = 4096  # shorter prompts tokenize faster than a thread hand-off


class ServedModel:
    """The base model `name`, its LoRA `adapters` (None: LoRA is off) and its `tokenizer`."""

    def __init__(self, name: str, adapters: Adapters | None, tokenizer: PromptTokenizer) -> None:
        self.name = name
        self.adapters = adapters
        self.tokenizer = tokenizer

    def adapter(self, model: str | None) -> AdapterKey | None:
        """The LoRA adapter `model` names (None: the base model, or no model); raises
        vLLM's 404 for a model the engine does not serve."""
        if self.adapters is not None and model is not None:
            return self.adapters.key(model)
        if model is not None and model != self.name:
            raise ApiError(404, f"The model `{model}` does not exist.", type_="NotFoundError",
                           param="model")  # fmt: skip
        return None

    async def prompt_ids(self, req: CompletionRequest) -> list[int]:
        """The token ids of `req`'s prompt (a chat's as its template renders it)."""
        text = req.prompt_text
        if req.chat is None and (text is None or len(text) <= _INLINE_TOKENIZE_CHARS):
            return self.tokenizer.prompt_ids(req)
        # Long prompts and chats (their template renders too) take milliseconds: off the loop.
        return await asyncio.get_running_loop().run_in_executor(
            None, self.tokenizer.prompt_ids, req
        )
