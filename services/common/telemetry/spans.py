"""What server and client spans share: their name and RPC attributes, taken from the full
method, and how one ends with a gRPC status."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import grpc
from opentelemetry.trace import Span, Status, StatusCode

ATTR_RPC_SYSTEM: Final = "rpc.system"
ATTR_RPC_SERVICE: Final = "rpc.service"
ATTR_RPC_METHOD: Final = "rpc.method"
ATTR_GRPC_STATUS_CODE: Final = "rpc.grpc.status_code"


@dataclass(frozen=True, slots=True)
class MethodInfo:
    """A span's name and attributes for one RPC method."""

    name: str
    attributes: Mapping[str, str]


def method_info(full_method: str) -> MethodInfo:
    """`/package.Service/Method` → name `package.Service/Method` and the rpc.* attributes."""
    name = full_method.lstrip("/")
    service, _, method = name.rpartition("/")
    return MethodInfo(
        name,
        {ATTR_RPC_SYSTEM: "grpc", ATTR_RPC_SERVICE: service, ATTR_RPC_METHOD: method},
    )


def end_with_code(span: Span, code: grpc.StatusCode, description: str | None) -> None:
    """Record the status code (an error status unless OK) and end the span."""
    span.set_attribute(ATTR_GRPC_STATUS_CODE, code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, description or code.name))
    span.end()
