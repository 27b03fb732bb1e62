"""vLLM's response shapes for completions and chat completions, streamed and not.

Streamed chunks are assembled from pre-encoded byte pieces around each token's text, since an
engine writes one per request per step; the bodies match what vLLM sends field for field."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from services.common.openai_api import Kind

DONE = b"data: [DONE]\n\n"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass(frozen=True, slots=True)
class Shape:
    """One response's fixed parts: its id, creation time, model and kind."""

    kind: Kind
    model: str
    include_usage: bool
    id: str
    created: int

    @classmethod
    def new(cls, kind: Kind, model: str, include_usage: bool) -> Shape:
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        return cls(kind, model, include_usage, prefix + uuid.uuid4().hex, int(time.time()))

    def _head(self) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return (
            f'data: {{"id":"{self.id}","object":"{obj}","created":{self.created},'
            f'"model":{json.dumps(self.model)},"choices":[{{"index":0,'
        ).encode()

    def _tail(self, finish: str | None) -> bytes:
        reason = f'"{finish}"' if finish else "null"
        usage_field = ',"usage":null' if self.include_usage else ""
        if self.kind == "chat":
            return f',"logprobs":null,"finish_reason":{reason}}}]{usage_field}}}\n\n'.encode()
        return (
            f',"logprobs":null,"finish_reason":{reason},"stop_reason":null}}]{usage_field}}}\n\n'
        ).encode()

    def role_chunk(self) -> bytes:
        """Chat streams open with the assistant's role and empty content."""
        return self._head() + b'"delta":{"role":"assistant","content":""}' + self._tail(None)

    def chunk(self, text_json: bytes, finish: str | None) -> bytes:
        """One chunk carrying `text_json` (a JSON-encoded string)."""
        if self.kind == "chat":
            return self._head() + b'"delta":{"content":' + text_json + b"}" + self._tail(finish)
        return self._head() + b'"text":' + text_json + self._tail(finish)

    def usage_chunk(self, prompt: int, completion: int, cached: int) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(prompt, completion, cached),
        }
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def full(self, text: str, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        """The non-streamed response."""
        choice: dict[str, Any]
        if self.kind == "chat":
            obj = "chat.completion"
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        else:
            obj = "text_completion"
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(prompt, completion, cached),
        }
