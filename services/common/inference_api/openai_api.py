"""OpenAI-compatible completions as vLLM reads them, for the Router and the simulated engine.

Both sides must turn a request body into the token ids a real vLLM engine would feed its model
(the Router hashes them to place the request, the engine hashes them to cache it), so parsing,
chat rendering (`chat_prompt`) and tokenization live here once. Errors are `ApiError`s that
render as OpenAI's error JSON, never as a stack trace.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from services.common.inference_api.chat_content_format import ContentFormatOption
from services.common.inference_api.chat_prompt import ChatRenderer, ChatRequest, parse_chat
from services.common.inference_api.model_tokenizer import ModelTokenizer
from services.common.inference_api.request_fields import check_fields
from services.common.serving.api_errors import (
    ApiError,
    bad_request,
    rate_limited,
    unavailable,
)

__all__ = [
    "DEFAULT_MAX_TOKENS", "DEFAULT_MODEL", "MAX_BODY_BYTES", "ApiError", "CompletionRequest",
    "Kind", "PromptTokenizer", "bad_request", "body_cut_short", "body_too_large", "check_length",
    "decode_json", "parse_request", "rate_limited", "read_json", "unavailable",
]  # fmt: skip

# The simulated engines model this one (its KV size and step times); only the tokenizer is a
# small stand-in (`kvsched/data/tokenizer/`).
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}  # completions: OpenAI's legacy default
MAX_BODY_BYTES = 32 << 20

Kind = Literal["completion", "chat"]


async def read_json(request: web.Request, max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request body as a JSON object; raises `ApiError` 400 (or 413 over `max_bytes`)
    otherwise, and 400 for a body cut short (the client may still read the answer)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise body_too_large(max_bytes)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(max_bytes) from None
    except (ConnectionError, HttpProcessingError):  # the body ended before its Content-Length
        raise body_cut_short() from None
    return decode_json(raw)


def body_too_large(max_bytes: int) -> ApiError:
    """The 413 for a request body over `max_bytes`."""
    return ApiError(413, f"request body over {max_bytes} bytes")


def body_cut_short() -> ApiError:
    return bad_request("the request body ended before its Content-Length")


def decode_json(raw: bytes | bytearray) -> dict[str, Any]:
    """`raw` as a JSON object; raises `ApiError` 400 for anything else (invalid JSON or
    UTF-8, NaN or Infinity, nesting too deep, not an object)."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # json's C parser recurses once per nested array or object
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """What the serving path needs from a completion or chat-completion body."""

    kind: Kind
    model: str | None
    prompt_text: str | None  # the completion prompt given as text (a batch's first)
    prompt_ids: tuple[int, ...] | None  # the completion prompt given as token ids
    # A batch's other prompts (vLLM serves each, in one answer), as text or token ids.
    more_prompts: tuple[str | tuple[int, ...], ...]
    chat: ChatRequest | None  # a chat request's prompt, rendered by `PromptTokenizer`
    # Whether the tokenizer adds its special tokens (BOS): vLLM's default is yes for a
    # completion, no for a chat (its template writes BOS).
    add_special_tokens: bool
    max_tokens: int
    n: int  # choices per prompt
    stream: bool
    include_usage: bool
    session_id: str | None  # the body's (`_session_of`); a session header overrides it
    cache_salt: str | None


def parse_request(kind: Kind, body: Mapping[str, Any]) -> CompletionRequest:
    """Validate the fields we read and the sampling fields OpenAI defines (`request_fields`;
    others pass through untouched); raises `ApiError` 400. A chat's messages are checked when
    rendered (`PromptTokenizer.prompt_ids`)."""
    check_fields(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    text: str | None = None
    ids: tuple[int, ...] | None = None
    more: tuple[str | tuple[int, ...], ...] = ()
    chat: ChatRequest | None = None
    if kind == "chat":
        chat = parse_chat(body)
    else:
        first, *rest = _prompts(body)
        text, ids = (first, None) if isinstance(first, str) else (None, first)
        more = tuple(rest)
    if body.get("truncate_prompt_tokens") is not None:
        # vLLM would cut the prompt to that many tokens; hashing the cut prompt is not done.
        raise bad_request("'truncate_prompt_tokens' is not supported", "truncate_prompt_tokens")
    add_special_tokens = body.get("add_special_tokens", kind == "completion")
    if not isinstance(add_special_tokens, bool):
        raise bad_request("'add_special_tokens' must be a boolean", "add_special_tokens")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS[kind]
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = bool(options.get("include_usage", False))
    return CompletionRequest(
        kind=kind,
        model=model,
        prompt_text=text,
        prompt_ids=ids,
        more_prompts=more,
        chat=chat,
        add_special_tokens=add_special_tokens,
        max_tokens=max_tokens,
        n=body.get("n") or 1,  # an integer of at least 1 (`check_fields`)
        stream=stream,
        include_usage=include_usage,
        session_id=_session_of(body),
        cache_salt=_optional_str(body, "cache_salt"),
    )


def check_length(
    prompt_tokens: int, max_tokens: int, max_model_len: int, *, at_least: bool = False
) -> int:
    """The output tokens a request can get, or a 400 in vLLM's words for what vLLM refuses:
    a prompt that leaves no room for output, `max_tokens` beyond the context. A prompt plus
    `max_tokens` over the context is served, as vLLM does, with the output cut short.
    `at_least`: `prompt_tokens` is a lower bound (the prompt was not tokenized), and the
    message says so."""
    if prompt_tokens >= max_model_len:
        count = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {count} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
        )
    if max_tokens > max_model_len:
        raise bad_request(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            "max_tokens",
        )
    return min(max_tokens, max_model_len - prompt_tokens)


class PromptTokenizer:
    """A model's tokenizer and chat templates as vLLM loads them (`model_tokenizer`): the
    token ids vLLM feeds its model for a request. Thread-safe, so calls can run off the event
    loop."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        chat_template: str | None = None,
        content_format: ContentFormatOption = "auto",
    ) -> None:
        """`path`: a tokenizer directory or a file in one; `None`: the demo model's.
        `chat_template`, `content_format`: as vLLM's `--chat-template` (the template's text)
        and `--chat-template-content-format`. Raises `ValueError` (see `ModelTokenizer`,
        `ChatRenderer`)."""
        self.model = ModelTokenizer(path)
        self._chat = ChatRenderer(self.model, chat_template, content_format)
        self.vocab_size = self.model.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.model.encode(text, add_special_tokens)

    def _encode_prompt(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """`encode`, or a 400 for text that is not Unicode: JSON's `\\ud800` escapes decode to
        lone surrogates, which the tokenizer refuses with a TypeError."""
        try:
            return self.encode(text, add_special_tokens)
        except TypeError:
            raise bad_request(
                f"'{param}' is not valid Unicode (it contains a lone surrogate)", param
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode(ids)

    def render_chat(self, chat: ChatRequest) -> str:
        """A chat request's prompt text; raises `ApiError` 400 (malformed messages, media
        parts, a template that refuses them)."""
        return self._chat.render(chat)

    def batch_ids(self, request: CompletionRequest) -> list[list[int]]:
        """Each prompt's token ids, a batch's first first (`prompt_ids`); raises as it does."""
        out = [self.prompt_ids(request)]
        for prompt in request.more_prompts:
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            out.append(self.prompt_ids(replace(request, prompt_text=text, prompt_ids=ids)))
        return out

    def prompt_ids(self, request: CompletionRequest) -> list[int]:
        """The (first) prompt's token ids; raises `ApiError` 400 (ids outside the
        vocabulary, and see `render_chat`)."""
        ids = request.prompt_ids
        if request.chat is not None:
            if request.chat.forwarded_ids is None:
                text = self.render_chat(request.chat)
                return self._encode_prompt(text, request.add_special_tokens, "messages")
            ids = request.chat.forwarded_ids
        if ids is None:
            assert request.prompt_text is not None
            return self._encode_prompt(request.prompt_text, request.add_special_tokens, "prompt")
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of vocabulary", "prompt")
        return list(ids)  # token ids are the prompt as they are, as vLLM takes them


# Completion fields vLLM would use that no prompt here can follow, and why.
_COMPLETION_REFUSALS = {
    # vLLM's words for a model without FIM rendering.
    "suffix": "suffix is only supported for models with FIM completion rendering",
    # vLLM takes them only when started with --enable-prompt-embeds; nothing to hash here.
    "prompt_embeds": "'prompt_embeds' is not supported",
}


def _prompts(body: Mapping[str, Any]) -> list[str | tuple[int, ...]]:
    """The completion's prompts: one, or a batch (a list of texts or of token-id lists)."""
    for key, refusal in _COMPLETION_REFUSALS.items():
        if body.get(key) is not None:
            raise bad_request(refusal, key)
    prompt = body.get("prompt")
    batch = prompt if isinstance(prompt, list) and prompt and _is_batch(prompt) else [prompt]
    prompts = [_prompt_of(p) for p in batch]
    if any(p == "" for p in prompts):
        raise bad_request(
            "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )
    return prompts


def _is_batch(prompt: list[Any]) -> bool:
    """Whether a list prompt is a batch of prompts rather than one prompt's token ids."""
    return all(isinstance(p, str | list) for p in prompt)


def _prompt_of(prompt: object) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return tuple(prompt)
    raise bad_request(
        "'prompt' must be a string, a non-empty list of token ids, or a list of those",
        "prompt",
    )


def _session_of(body: Mapping[str, Any]) -> str | None:
    """The session a body names: `metadata.session_id`, else OpenAI's `prompt_cache_key`
    (the key its prompt cache routes by; agent CLIs set it to their session), else `user`."""
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("session_id"), str):
        return str(metadata["session_id"]) or None
    for key in ("prompt_cache_key", "user"):
        value = body.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string", key)
    return value or None


def _refuse_constant(name: str) -> float:
    # Python's json reads NaN and Infinity, which JSON does not have: a client sending them
    # means no number the engine could use.
    raise ValueError(f"{name} is not a JSON value")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
