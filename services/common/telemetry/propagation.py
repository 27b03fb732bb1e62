"""W3C trace context (``traceparent``/``tracestate``) carried in gRPC metadata."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
TRACE_KEYS: Final = frozenset((TRACEPARENT, TRACESTATE))

PROPAGATOR: Final = TraceContextTextMapPropagator()
_EMPTY_CONTEXT: Final = Context()  # server spans take their parent from the wire only

MetadataPairs = Sequence[tuple[str, str | bytes]]


class _MetadataGetter(Getter[MetadataPairs]):
    def get(self, carrier: MetadataPairs, key: str) -> list[str] | None:
        values = [v for k, v in carrier if k == key and isinstance(v, str)]
        return values or None

    def keys(self, carrier: MetadataPairs) -> list[str]:
        return [k for k, _ in carrier]


class _ListSetter(Setter[list[Any]]):
    def set(self, carrier: list[Any], key: str, value: str) -> None:
        carrier.append((key, value))


_GETTER: Final = _MetadataGetter()
SETTER: Final = _ListSetter()
"""Appends each header to a list of (key, value) pairs."""


def inject_metadata(
    metadata: Iterable[tuple[str, str]] = (), context: Context | None = None
) -> list[tuple[str, str]]:
    """``metadata`` plus ``traceparent``/``tracestate`` for the current span (or the span in
    ``context``); any trace headers already present are replaced.  Nothing is added when
    there is no valid span."""
    out = [(k, v) for k, v in metadata if k not in TRACE_KEYS]
    PROPAGATOR.inject(out, context=context, setter=SETTER)
    return out


def extract(metadata: MetadataPairs | None) -> Context:
    """The remote parent named by incoming metadata (an empty context when there is none)."""
    if not metadata:
        return _EMPTY_CONTEXT
    return PROPAGATOR.extract(metadata, context=_EMPTY_CONTEXT, getter=_GETTER)
