"""Typed asyncio client for the kvsched Conductor that follows the leader (see `conductor`)."""

from clients.python.channels import Interceptor, tls_credentials
from clients.python.conductor import ConductorClient
from clients.python.errors import ConductorError, InvalidRequest, NotFound, Rejected, Unavailable
from clients.python.packed_hashes import pack_hashes, unpack_hashes
from clients.python.placement_stream import PlacementStream
from clients.python.stream_batches import BatchLimits

__all__ = [
    "BatchLimits",
    "ConductorClient",
    "ConductorError",
    "Interceptor",
    "InvalidRequest",
    "NotFound",
    "PlacementStream",
    "Rejected",
    "Unavailable",
    "pack_hashes",
    "tls_credentials",
    "unpack_hashes",
]
