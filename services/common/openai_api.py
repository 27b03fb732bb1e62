"""OpenAI-compatible completions as vLLM reads them, for the Router and the simulated engine.

Both sides must turn a request body into the same prompt token ids (the Router hashes them to
place the request, the engine hashes them to cache it), so parsing, chat rendering and
tokenization live here once. Errors are `ApiError`s that render as OpenAI's error JSON
(`{"error": {"message", "type", "param", "code"}}`), never as a stack trace.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from tokenizers import Tokenizer

# The simulated engines model this one (its KV size and step times); only the tokenizer is a
# small stand-in (`kvsched/data/tokenizer/`).
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}  # completions: OpenAI's legacy default
MAX_BODY_BYTES = 32 << 20
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

Kind = Literal["completion", "chat"]


class ApiError(Exception):
    """A request the server refuses; `status` and the OpenAI error fields say why."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def response(self, headers: Mapping[str, str] | None = None) -> web.Response:
        """The error as an aiohttp response (with Retry-After on a 429)."""
        out = dict(headers or {})
        if self.retry_after_s is not None:
            out["Retry-After"] = str(max(1, round(self.retry_after_s + 0.4999)))
        return web.json_response(self.body(), status=self.status, headers=out)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type_="service_unavailable", code="service_unavailable")


def rate_limited(message: str, retry_after_s: float) -> ApiError:
    return ApiError(
        429,
        message,
        type_="rate_limit_error",
        code="rate_limit_exceeded",
        retry_after_s=retry_after_s,
    )


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object; raises `ApiError` 400 (or 413) otherwise."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes") from None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """What the serving path needs from a completion or chat-completion body."""

    kind: Kind
    model: str | None
    prompt_text: str | None  # rendered chat, or the completion prompt given as text
    prompt_ids: tuple[int, ...] | None  # the completion prompt given as token ids
    max_tokens: int
    stream: bool
    include_usage: bool
    session_id: str | None  # `user`, or `metadata.session_id` (a header may override it)
    cache_salt: str | None


def parse_request(kind: Kind, body: Mapping[str, Any]) -> CompletionRequest:
    """Validate the fields we read (others pass through untouched); raises `ApiError` 400."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    text: str | None = None
    ids: tuple[int, ...] | None = None
    if kind == "chat":
        text = render_chat(body.get("messages"))
    else:
        text, ids = _prompt(body.get("prompt"))
    n = body.get("n", 1)
    if n not in (1, None):
        raise bad_request("only n=1 is supported", "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS[kind]
    if not _is_int(max_tokens) or max_tokens < 1:
        raise bad_request("'max_tokens' must be a positive integer", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = bool(options.get("include_usage", False))
    return CompletionRequest(
        kind=kind,
        model=model,
        prompt_text=text,
        prompt_ids=ids,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        session_id=_session_of(body),
        cache_salt=_optional_str(body, "cache_salt"),
    )


def render_chat(messages: object) -> str:
    """The demo model's chat template: one `<|role|>` header line per message, then the
    assistant's header. Content may be a string or a list of `{"type": "text"}` parts."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    parts = ["<|begin_of_text|>"]
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if role not in _ROLES:
            raise bad_request(f"messages[{i}].role must be one of {sorted(_ROLES)}", "messages")
        parts.append(f"<|{role}|>\n{_content(message.get('content'), i)}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def check_length(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Refuse a request that cannot fit the model's context, in vLLM's words."""
    if prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            "messages" if prompt_tokens >= max_model_len else "max_tokens",
        )


class PromptTokenizer:
    """The model's tokenizer (HF `tokenizers`); thread-safe, so calls can run off the loop."""

    def __init__(self, path: str | Path | None = None) -> None:
        if path is None:
            ref = resources.files("kvsched").joinpath("data", "tokenizer", "tokenizer.json")
            self._tok = Tokenizer.from_str(ref.read_text(encoding="utf-8"))
        else:
            self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def prompt_ids(self, request: CompletionRequest) -> list[int]:
        """The prompt's token ids; raises `ApiError` 400 for ids outside the vocabulary."""
        if request.prompt_ids is not None:
            bad = next((t for t in request.prompt_ids if t >= self.vocab_size), None)
            if bad is not None:
                raise bad_request(f"token id {bad} is out of vocabulary", "prompt")
            return list(request.prompt_ids)
        assert request.prompt_text is not None
        return self.encode(request.prompt_text)


def _prompt(prompt: object) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return _prompt(prompt[0])  # a batch of one
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return None, tuple(prompt)
    raise bad_request(
        "'prompt' must be a string or a non-empty list of token ids (batches are not supported)",
        "prompt",
    )


def _content(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(f"messages[{i}].content parts must be text parts", "messages")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"messages[{i}].content[].text must be a string", "messages")
            texts.append(text)
        return "".join(texts)
    if content is None:
        return ""
    raise bad_request(f"messages[{i}].content must be a string or a list of parts", "messages")


def _session_of(body: Mapping[str, Any]) -> str | None:
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("session_id"), str):
        return str(metadata["session_id"]) or None
    user = body.get("user")
    return user if isinstance(user, str) and user else None


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string", key)
    return value or None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
