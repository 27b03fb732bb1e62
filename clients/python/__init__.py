"""Typed asyncio client for the kvsched Conductor that follows the leader (see `conductor`)."""

from clients.python.conductor import (
    ConductorClient,
    ConductorError,
    Interceptor,
    InvalidRequest,
    NotFound,
    PlacementStream,
    Rejected,
    Unavailable,
)

__all__ = [
    "ConductorClient",
    "ConductorError",
    "Interceptor",
    "InvalidRequest",
    "NotFound",
    "PlacementStream",
    "Rejected",
    "Unavailable",
]
