"""Time a running vLLM OpenAI server for `tools.fit_latency.engine_fit` (the I/O half).

Every probe is a `/v1/completions` request of random token ids (seeded; a fresh prompt each
time, so no block is ever a cache hit), `ignore_eos` so it decodes exactly the tokens asked
for, temperature 0. Each timing is the median of `repeats` runs after one warm-up request.
The engine should be otherwise idle: the probes measure its passes, not a queue.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from random import Random
from typing import Any

import aiohttp

from services.loadgen.prompts import RESERVED
from services.messenger.vllm_engine import cache_config
from tools.fit_latency.engine_fit import CachedProbe, DecodeProbe, PrefillProbe

PREFILL_TOKENS = (32, 256, 1024, 2048, 4096, 8192, 16384, 32768)
# Prompts on a cached prefix (cached, new tokens), the shape of an agent's next turn: they
# fit what reading a cached prefix costs beside its attention pairs (`prefill_ctx_s`).
CACHED_PREFILLS = tuple((c, n) for c in (2048, 8192, 16384, 32768) for n in (32, 256, 1024, 4096))
DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_CONTEXTS = (256, 4096)
SHORT_OUTPUT, LONG_OUTPUT = 8, 72


@dataclass(frozen=True, slots=True)
class EngineShape:
    """What the server says of itself: its served model, context and KV capacity."""

    model: str
    max_model_len: int
    block_size: int
    kv_capacity_tokens: int


class EngineProbes:
    """Sends the probes to one server (`url`, e.g. http://127.0.0.1:8000)."""

    def __init__(
        self, http: aiohttp.ClientSession, url: str, *, vocab: int, repeats: int, seed: int
    ) -> None:
        self._http = http
        self._url = url.rstrip("/")
        self._vocab = vocab
        self._repeats = repeats
        self._rng = Random(seed)
        self._model = ""

    async def shape(self) -> EngineShape:
        """The server's model, context and KV capacity (`vllm:cache_config_info`)."""
        async with self._http.get(f"{self._url}/v1/models") as resp:
            resp.raise_for_status()
            card = (await resp.json())["data"][0]
        async with self._http.get(f"{self._url}/metrics") as resp:
            resp.raise_for_status()
            config = cache_config(await resp.text())
        block = int(config["block_size"])
        self._model = str(card["id"])
        return EngineShape(
            model=self._model,
            max_model_len=int(card.get("max_model_len") or 0),
            block_size=block,
            kv_capacity_tokens=int(config["num_gpu_blocks"]) * block,
        )

    def _prompt(self, tokens: int) -> list[int]:
        return [self._rng.randrange(RESERVED, self._vocab) for _ in range(tokens)]

    async def _complete(
        self, tokens: int, output: int, *, prefix: Sequence[int] = (), hit: int = 0
    ) -> float:
        """Wall seconds of one request of `prefix` and then `tokens` fresh prompt tokens,
        `output` tokens out; `hit`: the cached prompt tokens the engine must report."""
        body: dict[str, Any] = {
            "model": self._model,
            "prompt": [*prefix, *self._prompt(tokens)],
            "max_tokens": output,
            "min_tokens": output,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        started = time.perf_counter()
        async with self._http.post(f"{self._url}/v1/completions", json=body) as resp:
            answer = await resp.json()
            elapsed = time.perf_counter() - started
            if resp.status != 200:
                raise RuntimeError(f"the engine answered {resp.status}: {answer}")
        usage = answer["usage"]
        if usage["completion_tokens"] != output:
            raise RuntimeError(f"asked for {output} tokens, the engine made {usage}")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if hit and cached < hit:
            raise RuntimeError(f"the engine reused {cached} prompt tokens, not {hit}")
        return elapsed

    async def _batch(self, batch: int, tokens: int, output: int) -> float:
        """Mean wall seconds of `batch` such requests sent at once."""
        times = await asyncio.gather(*(self._complete(tokens, output) for _ in range(batch)))
        return statistics.fmean(times)

    async def prefill(self, lengths: Sequence[int]) -> list[PrefillProbe]:
        await self._complete(lengths[0], 1)  # warm-up
        probes = []
        for n in lengths:
            runs = [await self._complete(n, 1) for _ in range(self._repeats)]
            probes.append(PrefillProbe(n, statistics.median(runs)))
        return probes

    async def cached(self, shapes: Sequence[tuple[int, int]]) -> list[CachedProbe]:
        """One request alone of `new` fresh tokens after a `cached`-token prefix that the
        request before it left in the cache (the engine's `cached_tokens` confirms it)."""
        probes = []
        for cached, new in shapes:
            runs = []
            for _ in range(self._repeats):
                prefix = self._prompt(cached)
                await self._complete(0, 1, prefix=prefix + self._prompt(8))
                runs.append(await self._complete(new, 1, prefix=prefix, hit=cached))
            probes.append(CachedProbe(cached, new, statistics.median(runs)))
        return probes

    async def decode(
        self, batches: Sequence[int], contexts: Sequence[int], short: int, long: int
    ) -> list[DecodeProbe]:
        await self._batch(batches[0], contexts[0], short)  # warm-up
        probes = []
        for context in contexts:
            for batch in batches:
                steps = []
                for _ in range(self._repeats):
                    brief = await self._batch(batch, context, short)
                    lengthy = await self._batch(batch, context, long)
                    steps.append((lengthy - brief) / (long - short))
                probes.append(DecodeProbe(batch, context, short, long, statistics.median(steps)))
        return probes


@dataclass(frozen=True, slots=True)
class ProbePlan:
    """The probes a server takes: prompts within its context, decode batches within half its
    KV capacity (no preemption)."""

    prefill: list[int]
    cached: list[tuple[int, int]]
    batches: list[int]
    contexts: list[int]


def probe_plan(shape: EngineShape) -> ProbePlan:
    room = shape.max_model_len - LONG_OUTPUT if shape.max_model_len else PREFILL_TOKENS[-1]
    half = shape.kv_capacity_tokens // 2
    contexts = [c for c in DECODE_CONTEXTS if c <= room]
    return ProbePlan(
        prefill=[n for n in PREFILL_TOKENS if n <= min(room, half)],
        cached=[(c, n) for c, n in CACHED_PREFILLS if c + n + 8 <= min(room, half)],
        batches=[b for b in DECODE_BATCHES if b * (max(contexts) + LONG_OUTPUT) <= half],
        contexts=contexts,
    )
