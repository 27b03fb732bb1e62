"""The Finish report: what a Router tells the Conductor when a request it placed has ended,
built from how the request went alone (the pipeline sends it, in the background).

Counts come from the engine's usage when the answer carries it: always without streaming,
and on a stream when the client asked for `include_usage`. Otherwise the Router estimates
rather than parse every chunk: cached tokens as the Conductor expected them, output tokens
as the number of SSE events (one token each, less `[DONE]` and the chat role chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsched.api.conductor.v1 import conductor_service_pb2 as cpb
from services.common.inference_api.openai_api import CompletionRequest
from services.common.serving.durations import duration
from services.router.placement import Placement, PlacementQuery
from services.router.proxy import Relayed


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """How one request ended."""

    req: CompletionRequest
    query: PlacementQuery
    placement: Placement  # where it was sent: the decode instance after a hand-off
    relayed: Relayed | None  # None: the engine refused or failed before answering
    arrived: float  # perf_counter() when the request came in
    ended: float  # perf_counter() when it ended
    prefill_instance_id: str = ""  # the instance that ran its prefill, after a hand-off


def finish_report(outcome: RequestOutcome) -> cpb.FinishRequest | None:
    """The Conductor's `FinishRequest` for `outcome`; None when the local fallback placed the
    request (the Conductor never saw it)."""
    placement, relayed, query = outcome.placement, outcome.relayed, outcome.query
    if not placement.by_conductor:
        return None
    usage = relayed.usage if relayed is not None else None
    if usage is not None:
        output, cached = usage.completion_tokens, usage.cached_tokens
    elif relayed is not None:
        extra = 1 + (1 if outcome.req.kind == "chat" else 0)
        output = max(relayed.events - extra, 0)
        cached = placement.expected_cached_tokens
    else:
        output, cached = 0, 0
    first = relayed.first_byte_at if relayed is not None else None
    # A non-streaming answer has no visible first token: its end-to-end time bounds it.
    ttft = (first if first is not None and outcome.req.stream else outcome.ended) - outcome.arrived
    prefill = outcome.prefill_instance_id
    return cpb.FinishRequest(
        request_id=query.request_id,
        session_id=query.session_id,
        instance_id=prefill or placement.instance_id,
        decode_instance_id=placement.instance_id if prefill else "",
        prompt_tokens=query.prompt_tokens,
        output_tokens=output,
        cached_tokens=min(cached, query.prompt_tokens),
        packed_block_hashes=query.packed_hashes,
        time_to_first_token=duration(ttft),
        end_to_end=duration(outcome.ended - outcome.arrived),
        ok=relayed is not None and relayed.ok,
    )
