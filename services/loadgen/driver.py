"""Firing a trace's calls at live Routers: open loop at the trace's (scaled) timestamps, or
closed loop with turn k at finish(k−1) + its recorded gap, group starts drawn as the
simulator draws them. Times recorded here are policy seconds (wall seconds / time scale),
the clock the simulator's report uses."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from kvsched.sim.arrivals import draw_group_starts
from kvsched.sim.meters import GapHistogram
from kvsched.sim.records import Req
from kvsched.sim.traces.model import Trace
from services.loadgen.client import Outcome, complete
from services.loadgen.prompts import call_prompt

MAX_RETRIES = 20  # as the simulator's closed loop: an agent retries a 429


@dataclass(frozen=True)
class Target:
    """Where and how to send."""

    routers: tuple[str, ...]
    api_key: str
    model: str
    block_size: int
    vocab: int
    n_instances: int
    time_scale: float = 1.0
    timeout_s: float = 600.0
    max_in_flight: int = 2048


@dataclass
class LiveRun:
    """Everything the report needs from one live replay."""

    reqs: list[Req]
    outcomes: list[Outcome | None]
    gaps: GapHistogram
    group_start: dict[str, float]
    end_time: float  # policy seconds from the start
    wall_s: float
    instances: dict[str, int]  # instance id -> slot, in order of first use


class Driver:
    """One live replay of `trace`; `run()` once."""

    def __init__(
        self,
        trace: Trace,
        target: Target,
        *,
        closed_loop: bool,
        load: float,
        seed: int,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        if load <= 0:
            raise ValueError("load must be positive")
        self.trace = trace
        self.t = target
        self.closed_loop = closed_loop
        self.load = load
        self.seed = seed
        self.progress = progress
        self.reqs = [Req(c.index) for c in trace.calls]
        self.outcomes: list[Outcome | None] = [None] * len(trace.calls)
        self.gaps = GapHistogram()
        self.instances: dict[str, int] = {}
        self.group_start: dict[str, float] = {}
        self._dependents: dict[int, list[int]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._done = 0
        self._all_done = asyncio.Event()
        self._slots = asyncio.Semaphore(target.max_in_flight)
        self._router = itertools.cycle(target.routers)
        self._t0 = 0.0

    def now(self) -> float:
        """Policy seconds since the replay started."""
        return (time.monotonic() - self._t0) / self.t.time_scale

    async def run(self, http: aiohttp.ClientSession) -> LiveRun:
        self._t0 = time.monotonic()
        calls = self.trace.calls
        if not calls:
            self._all_done.set()
        if self.closed_loop:
            starts = draw_group_starts(calls, self.t.n_instances, self.load, self.seed)
            self.group_start = starts
            for call in calls:
                if call.after < 0:
                    self._at(starts[call.group] + call.start_offset_s, call.index, http)
                else:
                    self._dependents.setdefault(call.after, []).append(call.index)
        else:
            first = calls[0].timestamp_s if calls else 0.0
            for call in calls:
                self._at((call.timestamp_s - first) / self.load, call.index, http)
        await self._all_done.wait()
        end = self.now()
        return LiveRun(
            self.reqs,
            self.outcomes,
            self.gaps,
            self.group_start,
            end,
            time.monotonic() - self._t0,
            self.instances,
        )

    def _at(self, when: float, index: int, http: aiohttp.ClientSession) -> None:
        task = asyncio.ensure_future(self._fire(when, index, http))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fire(self, when: float, index: int, http: aiohttp.ClientSession) -> None:
        delay = when - self.now()
        if delay > 0:
            await asyncio.sleep(delay * self.t.time_scale)  # the call's arrival time
        call = self.trace.calls[index]
        req = self.reqs[index]
        if req.attempts == 0:
            req.arrival = self.now()
        req.attempts += 1
        body = {
            "model": self.t.model,
            "prompt": call_prompt(call, self.t.block_size, self.t.vocab),
            "max_tokens": max(call.output_tokens, 1),
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        async with self._slots:
            out = await complete(
                http,
                next(self._router),
                body,
                api_key=self.t.api_key,
                session=call.session,
                timeout_s=self.t.timeout_s,
            )
        if out.status == 429 and self.closed_loop and req.attempts <= MAX_RETRIES:
            self._at(self.now() + max(out.retry_after_s, 0.001), index, http)
            return
        self._record(index, out)
        for dep in self._dependents.pop(index, ()):
            self._at(self.now() + self.trace.calls[dep].gap_s, dep, http)
        self._done += 1
        if self.progress is not None:
            self.progress(self._done / len(self.reqs))
        if self._done == len(self.reqs):
            self._all_done.set()

    def _record(self, index: int, out: Outcome) -> None:
        req = self.reqs[index]
        self.outcomes[index] = out
        req.done = True
        scale = self.t.time_scale
        if not out.ok:
            req.rejected = True  # a 429, an error or a timeout: not served, as in the report
            req.finished_at = self.now()
            return
        req.slot = self.instances.setdefault(out.instance, len(self.instances))
        req.first_token_at = (out.first_token_at - self._t0) / scale
        req.finished_at = (out.finished_at - self._t0) / scale
        req.local_hit = out.cached_tokens
        for gap in out.gaps:
            self.gaps.add(gap / scale, gap / scale, 1)


def split_routers(text: str) -> Sequence[str]:
    return tuple(u.strip().rstrip("/") for u in text.split(",") if u.strip())
