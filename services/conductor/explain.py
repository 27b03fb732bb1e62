"""Explain: where a request would go and why, placed on the current term without changing
it (shared by the Explain RPC and the admin HTTP endpoint)."""

from __future__ import annotations

from collections.abc import Callable

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.decision import Decision
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.conductor import placement_messages
from services.conductor.term import CurrentTerm


class Explainer:
    """Explains requests on the current term; token ids are hashed by `hasher` as the
    engines do."""

    def __init__(
        self, current: CurrentTerm, hasher: VllmBlockHasher, clock: Callable[[], float]
    ) -> None:
        self.current = current
        self.hasher = hasher
        self.clock = clock  # policy seconds

    def explain(self, request: pb.ExplainRequest) -> Decision:
        """The decision `request` would get now, every candidate's costs included; changes
        nothing. Raises RequestError."""
        state = self.current().state
        req = placement_messages.explain_request(state, request, self.hasher)
        return state.scheduler.explain(req, self.clock())
