"""Multi-turn workloads for `bench.router`'s cache-share rounds: sessions whose every turn
resends the whole conversation so far, so a router that keeps a session where its context is
cached finds most of the prompt there.

Each target gets the same workload under a salt of its own (the first word of every prompt),
so no target finds blocks another one left in the engines' caches; they are run one after the
other on the same engines. The cached share is the engines' own count: `cached_tokens` over
`prompt_tokens` in the responses' usage, over every request.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import aiohttp

SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class Workload:
    """S sessions of T turns, all at once (each session's turns one after the other)."""

    name: str
    sessions: int
    turns: int
    shared_prefix_words: int  # a system prompt every session starts with (0: none)
    system_words: int  # each session's own system prompt, after the shared one
    user_words: int  # a user message
    answer_tokens: int  # max_tokens of every turn
    seed: int = 0

    def scaled(self, factor: float) -> Workload:
        """Fewer sessions and turns (a smoke run), at least two of each."""
        return Workload(
            self.name,
            max(2, int(self.sessions * factor)),
            max(2, int(self.turns * factor)),
            self.shared_prefix_words,
            self.system_words,
            self.user_words,
            self.answer_tokens,
            self.seed,
        )


ROOMY = Workload(
    "roomy",
    sessions=16,
    turns=6,
    shared_prefix_words=0,
    system_words=400,
    user_words=60,
    answer_tokens=32,
)
SHARED_PREFIX = Workload(
    "shared_prefix",
    sessions=16,
    turns=6,
    shared_prefix_words=1500,
    system_words=100,
    user_words=60,
    answer_tokens=32,
)


@dataclass(frozen=True)
class ShareResult:
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    seconds: float

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_share": self.cached_share,
            "seconds": self.seconds,
        }


_SYLLABLES = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "da", "ve", "zu", "ho")


def _words(rng: random.Random, count: int) -> str:
    return " ".join(
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(count)
    )


async def run_workload(
    http: aiohttp.ClientSession,
    urls: list[str],
    workload: Workload,
    *,
    salt: str,
    model: str,
    key: str,
    sticky: bool = False,
) -> ShareResult:
    """Run every session of `workload` through `urls` (session i goes to `urls[i % n]` when
    `sticky`, else to `urls[0]`: a router), prompts salted with `salt`. Failed requests are
    counted and end their session."""
    rng = random.Random(workload.seed)
    shared = _words(rng, workload.shared_prefix_words)
    systems = [_words(rng, workload.system_words) for _ in range(workload.sessions)]
    users = [
        [_words(rng, workload.user_words) for _ in range(workload.turns)]
        for _ in range(workload.sessions)
    ]
    prompt_tokens = cached = requests = errors = 0
    headers = {"Authorization": f"Bearer {key}"}

    async def session(i: int) -> None:
        nonlocal prompt_tokens, cached, requests, errors
        url = f"{urls[i % len(urls) if sticky else 0]}/v1/completions"
        context = f"{salt} {shared}\n{systems[i]}"
        for turn in range(workload.turns):
            context += f"\nUser: {users[i][turn]}\nAssistant:"
            body = {"model": model, "prompt": context, "max_tokens": workload.answer_tokens}
            requests += 1
            sid = {SESSION_HEADER: f"{salt}-{i}"}
            async with http.post(url, json=body, headers={**headers, **sid}) as resp:
                if resp.status != 200:
                    errors += 1
                    return
                answer = await resp.json()
            usage = answer["usage"]
            prompt_tokens += usage["prompt_tokens"]
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            context += answer["choices"][0]["text"]

    start = asyncio.get_running_loop().time()
    await asyncio.gather(*(session(i) for i in range(workload.sessions)))
    seconds = asyncio.get_running_loop().time() - start
    return ShareResult(requests, errors, prompt_tokens, cached, seconds)
