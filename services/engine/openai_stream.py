"""vLLM's response shapes for completions and chat completions, streamed and not.

Streamed chunks are assembled from pre-encoded byte pieces around each token's text, since an
engine writes one per request per step; the bodies match what vLLM sends field for field."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from services.common.inference_api.openai_api import ApiError, Kind

DONE = b"data: [DONE]\n\n"


def error_chunk(error: ApiError) -> bytes:
    """An error in the middle of a stream, as vLLM sends it (then `[DONE]`)."""
    return b"data: " + json.dumps(error.body(), separators=(",", ":")).encode() + b"\n\n"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass(frozen=True, slots=True)
class Shape:
    """One response's fixed parts (id, creation time, model, kind) and the pre-encoded bytes
    every streamed chunk of it starts and ends with."""

    kind: Kind
    model: str
    include_usage: bool
    id: str
    created: int
    head: bytes  # `data: {...,"choices":[{"index":0,` then the text or delta goes
    tail: bytes  # closes a chunk that does not finish the answer
    last_tail: bytes  # closes the chunk that does (finish_reason "length")

    @classmethod
    def new(cls, kind: Kind, model: str, include_usage: bool) -> Shape:
        chat = kind == "chat"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = (
            f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
            f'"model":{json.dumps(model)},"choices":[{{"index":0,'
        ).encode()
        usage_field = ',"usage":null' if include_usage else ""
        close = "}" if chat else ""  # chat text sits in a `delta` object
        # vLLM sets stop_reason on every completion chunk, and on chat's last one only.
        stop = "" if chat else ',"stop_reason":null'
        tail = f'{close},"logprobs":null,"finish_reason":null{stop}}}]{usage_field}}}\n\n'
        last = (
            f'{close},"logprobs":null,"finish_reason":"length","stop_reason":null}}]'
            f"{usage_field}}}\n\n"
        )
        return cls(kind, model, include_usage, rid, created, head, tail.encode(), last.encode())

    def role_chunk(self) -> bytes:
        """Chat streams open with the assistant's role and empty content."""
        return self.head + b'"delta":{"role":"assistant","content":""' + self.tail

    def chunk(self, text_json: bytes, last: bool) -> bytes:
        """One chunk carrying `text_json` (a JSON-encoded string); `last` finishes the answer."""
        opening = b'"delta":{"content":' if self.kind == "chat" else b'"text":'
        return self.head + opening + text_json + (self.last_tail if last else self.tail)

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
