"""Continuum: session affinity whose KV outlives a tool call for a chosen time-to-live.

Source: "Continuum: Efficient and Robust Multi-Turn LLM Agent Scheduling with KV Cache
Time-to-Live" (arXiv 2511.02230, v4): §4.1–4.2 choose the TTL, §5.2 pins and unpins, §6.2
routes "with a simple session aware routing". When a turn ends in a tool call, its KV stays
pinned in the host's GPU memory for

    τ* = argmax over τ in {0} ∪ S of  P(τ) · (𝒯·η + Prefill-Reload(r)) − τ      (Eq. 2)

where S holds the tool-call durations seen (a turn's end to its session's next arrival), P
their empirical CDF, and Prefill-Reload(r) the seconds recomputing the context would take
(our latency model). While S holds at most 100 durations the paper uses the optimum for
exponential durations of mean 1 s (η = 1), τ = ln(B) for B > 1, else 0 (its value is not
printed; this is that optimum). 𝒯 is the mean queueing delay (TTFT less the prefill it
needed) of the last 100 returning turns that found less of their context than their previous
turn had built (evicted), 0 until one is seen, as in the paper; η, the programs'
"memoryfulness" (−Corr(k, N − k) of turns served and left), is taken as 1, the paper's own
cold-start assumption, as the number of turns a session will take is not known while it runs.
S is the last `window` durations (all of them in the paper), which keeps a decision's cost
bounded. One duration distribution serves every tool: the traces do not name
the tools (the paper keeps one per tool name when it can).

A pin is the engine's (stock vLLM cannot pin blocks: the simulator runs it, a live cluster
runs `continuum` as session affinity alone): the pinned blocks are evicted by nothing, count
against free memory for every other request, and are let go when the TTL ends with no
request of the session waiting, when the session's next turn is admitted, or when a request
cannot get memory while at most one other runs (the paper's guard against starving the queue;
the pin due last goes first).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from random import Random

import numpy as np

from kvsched.core.decision import Completion, Decision, RequestId, TransferKind, TransferPlan
from kvsched.core.policies.affinity import Sticky
from kvsched.core.request_view import RequestView

COLD_START_SAMPLES = 100  # the paper's K
EVICTED_WINDOW = 100  # returning turns that found their context evicted, for 𝒯


def retention_s(durations: Sequence[float], benefit_s: float) -> float:
    """Eq. 2's τ*: the TTL maximising P(τ) × `benefit_s` − τ over 0 and the seen durations,
    or, with at most COLD_START_SAMPLES of them, ln(benefit_s) (0 below 1 s)."""
    if len(durations) <= COLD_START_SAMPLES:
        return math.log(benefit_s) if benefit_s > 1.0 else 0.0
    taus = np.sort(np.asarray(durations, dtype=float))
    cdf = np.arange(1, len(taus) + 1) / len(taus)  # P(duration <= tau), ties at the last
    score = cdf * benefit_s - taus
    best = int(np.argmax(score))
    zero = float(np.count_nonzero(taus <= 0.0)) / len(taus) * benefit_s
    return float(taus[best]) if score[best] > zero and taus[best] > 0 else 0.0


class Continuum(Sticky):
    """Rules: `sticky`'s placement (a session's turns on its host, a new one where the fewest
    prompt tokens wait); after a turn that ended in a tool call, pin the session's context on
    its host for Eq. 2's TTL (module docstring)."""

    name = "continuum"
    defaults = {"window": 1000}

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.durations: deque[float] = deque(maxlen=int(self.param("window")))
        self.in_tool: set[str] = set()  # sessions whose last turn ended in a tool call
        self.evicted_delay_s: deque[float] = deque(maxlen=EVICTED_WINDOW)  # 𝒯's samples
        self.expected: dict[RequestId, int] = {}  # request -> tokens its session had built

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        sid = view.req.session_id
        session = self.cluster.sessions.get(sid) if sid is not None else None
        if session is not None and sid in self.in_tool:
            self.in_tool.discard(session.session_id)
            if math.isfinite(session.last_finish_at):
                self.durations.append(max(now - session.last_finish_at, 0.0))
        if session is not None and session.prompt_tokens:
            self.expected[view.req.request_id] = session.prompt_tokens
        return super().decide(view, now, rng)

    def queueing_s(self) -> float:
        """𝒯: the mean queueing delay of recent turns that found their context evicted."""
        samples = self.evicted_delay_s
        return sum(samples) / len(samples) if samples else 0.0

    def after_finish(self, done: Completion, now: float) -> Sequence[TransferPlan]:
        cost = self.cluster.cost
        built = self.expected.pop(done.request_id, 0)
        bs = self.cluster.block_size
        if done.ok and built and done.cached_tokens < (min(built, done.prompt_tokens) // bs) * bs:
            prefill = cost.prefill_one(done.prompt_tokens - done.cached_tokens, done.cached_tokens)
            ttft = done.first_token_at - done.arrival
            self.evicted_delay_s.append(max(ttft - prefill, 0.0))
        if not (done.tool_call and done.ok and done.session_id and done.block_hashes):
            return ()
        self.in_tool.add(done.session_id)
        context = done.prompt_tokens + done.output_tokens
        benefit = self.queueing_s() + cost.prefill_one(context, 0)  # η = 1
        ttl = retention_s(self.durations, benefit)
        if ttl <= 0.0:
            return ()
        host = done.instance
        return (
            TransferPlan(
                TransferKind.RETAIN,
                host,
                host,
                done.block_hashes,
                0,
                context,
                0,
                ttl,
                on_critical_path=False,
                session_id=done.session_id,
            ),
        )
