"""One streamed completion through a Router, timed the way DESIGN defines the metrics."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass(slots=True)
class Outcome:
    """What one request did (wall-clock times from `time.monotonic()`)."""

    status: int = 0
    sent_at: float = 0.0
    first_token_at: float = -1.0
    finished_at: float = -1.0
    chunks: int = 0
    gaps: list[float] = field(default_factory=list)  # between successive content chunks
    cached_tokens: int = 0
    completion_tokens: int = 0
    instance: str = ""
    retry_after_s: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.first_token_at >= 0 and not self.error


async def complete(
    http: aiohttp.ClientSession,
    router: str,
    body: dict[str, Any],
    *,
    api_key: str,
    session: str,
    timeout_s: float,
) -> Outcome:
    """POST a streaming completion and read it to the end; never raises for a bad answer."""
    out = Outcome(sent_at=time.monotonic())
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if session:
        headers["x-session-id"] = session
    try:
        async with http.post(
            f"{router}/v1/completions",
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            out.status = resp.status
            out.instance = resp.headers.get("x-kvsched-instance", "")
            if resp.status != 200:
                out.retry_after_s = float(resp.headers.get("Retry-After", "0") or 0)
                out.error = (await resp.text())[:200]
                return out
            await _read_stream(resp, out)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    return out


async def _read_stream(resp: aiohttp.ClientResponse, out: Outcome) -> None:
    last = 0.0
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        now = time.monotonic()
        payload = line[6:].strip()
        if payload == b"[DONE]":
            out.finished_at = now
            return
        # Only the usage chunk is parsed: the rest are counted, which keeps the generator
        # cheap next to the cluster it measures on the same cores.
        if b'"usage":{' in payload or b'"usage": {' in payload:
            usage = json.loads(payload).get("usage") or {}
            out.completion_tokens = int(usage.get("completion_tokens", 0))
            details = usage.get("prompt_tokens_details") or {}
            out.cached_tokens = int(details.get("cached_tokens", 0) or 0)
            if b'"choices":[]' in payload or b'"choices": []' in payload:
                continue
        out.chunks += 1
        if out.first_token_at < 0:
            out.first_token_at = now
        else:
            out.gaps.append(now - last)
        last = now
    out.error = "stream ended without [DONE]"
