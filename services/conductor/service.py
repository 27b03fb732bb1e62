"""The ConductorService: each RPC answered by the one part that owns it (instances, KV
events, placement, transfers, admin; see `*_rpcs.py`).

Every handler validates before it changes anything, maps refusals to gRPC status codes with
a message a person can act on (`rpc_status`), and sends writes that reach a standby back
with FAILED_PRECONDITION and the leader's address in the `kvsched-leader` trailer.
"""

from __future__ import annotations

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.api.conductor.v1 import conductor_service_pb2_grpc as pb_grpc

RPCS = tuple(m.name for m in pb.DESCRIPTOR.services_by_name["ConductorService"].methods)


def conductor_servicer(*parts: object) -> pb_grpc.ConductorServiceServicer:
    """The service as gRPC registers it, every RPC bound to its one handler among `parts`.
    Raises TypeError when an RPC has no handler, or more than one."""
    # The parts' own methods are bound as they are: gRPC tells a streaming handler by what
    # it is (an async generator function), which a forwarding wrapper would hide.
    return _Bound(parts)  # type: ignore[abstract]  # the handlers are bound per instance


class _Bound(pb_grpc.ConductorServiceServicer):
    def __init__(self, parts: tuple[object, ...]) -> None:
        for name in RPCS:
            owners = [part for part in parts if callable(getattr(part, name, None))]
            if len(owners) != 1:
                found = ", ".join(type(p).__name__ for p in owners) or "none"
                raise TypeError(f"RPC {name} needs exactly one handler; found {found}")
            setattr(self, name, getattr(owners[0], name))
