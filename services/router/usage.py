"""Token counts from an engine's answer, read without touching what the client gets.

A non-streaming answer carries `usage` in its body. A chat or completions stream carries it
only when the client asked (`stream_options.include_usage`): vLLM then sends one last chunk
with `"choices": []` and the usage just before `data: [DONE]`, so only the stream's tail is
scanned, once, after it ended. A Responses stream ends with the whole response and its usage;
an Anthropic Messages stream's last usage (`message_delta`) counts what vLLM counted by then.
Without usage the Router reports its own estimates (see `proxy`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Usage:
    """The engine's own counts for one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens (0 when absent)


def from_usage(usage: object) -> Usage | None:
    """A `usage` object as OpenAI's chat and completions shape it, as its Responses API does
    (`input_tokens`, `input_tokens_details.cached_tokens`), or as Anthropic's Messages API does
    (`input_tokens` without the cache's `cache_read_input_tokens` and
    `cache_creation_input_tokens`), each as vLLM fills it; None when it is not one."""
    if not isinstance(usage, dict):
        return None
    if "input_tokens" in usage or "output_tokens" in usage:
        details = usage.get("input_tokens_details")
        read = _count(usage.get("cache_read_input_tokens"))
        cached = details.get("cached_tokens") if isinstance(details, dict) else read
        prompt = _count(usage.get("input_tokens")) + read
        prompt += _count(usage.get("cache_creation_input_tokens"))
        return Usage(prompt, _count(usage.get("output_tokens")), _count(cached))
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return Usage(
        _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")), _count(cached)
    )


def from_body(body: bytes) -> Usage | None:
    """The usage of a non-streaming answer's JSON body."""
    try:
        parsed: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return from_usage(parsed.get("usage")) if isinstance(parsed, dict) else None


def from_sse_tail(tail: bytes) -> Usage | None:
    """The last usage in the tail of an SSE stream (`data: {...}\\n\\n` events). The tail may
    start mid-event: what does not parse is skipped."""
    for piece in reversed(tail.replace(b"\r\n", b"\n").split(b"\n\n")):
        event = piece.strip()
        if not event.startswith(b"data:") or b'"usage"' not in event:
            continue
        try:
            parsed: Any = json.loads(event[5:])
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(parsed, dict):
            # (A Responses stream's usage is in its last event's `response`.)
            response = parsed.get("response")
            usage = response.get("usage") if isinstance(response, dict) else parsed.get("usage")
            found = from_usage(usage)
            if found is not None:
                return found
    return None


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
