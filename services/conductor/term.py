"""One leadership term's state, and the one place that says which term is current.

A Conductor that loses its lease drops everything it had not persisted: it rebuilds a new
`Term` from etcd and swaps it in whole, so no reader ever sees one term's registry with
another's outbox. The pieces that serve (RPCs, admin HTTP, transfers, metrics) hold a
`CurrentTerm` and ask it for the term each time they act, never keeping one across an await
they do not mean to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.conductor.cursors import EventCursors
from services.conductor.records import EtcdRecords, Holder, Outbox
from services.conductor.settings import ConductorSettings
from services.conductor.state import ConductorState


@dataclass(frozen=True, slots=True)
class Term:
    """What one leadership term owns: the registry around the core, the etcd writes it
    queued, the cursors of the KV event batches, and the prefix naming its transfers."""

    state: ConductorState
    outbox: Outbox
    cursors: EventCursors
    transfer_prefix: str
    persist_blocks: bool

    @staticmethod
    def build(settings: ConductorSettings, transfer_prefix: str) -> Term:
        """An empty term. `transfer_prefix` must be unique across terms and restarts: a
        Messenger still knows the last term's transfer ids."""
        outbox = Outbox()
        persist_blocks = settings.persist_blocks

        def records(holder: Holder) -> EtcdRecords:
            return EtcdRecords(outbox, holder, persist_blocks=persist_blocks)

        state = ConductorState(
            settings.cluster_config(),
            settings.policy,
            settings.seed,
            transfer_prefix=transfer_prefix,
            max_prompt_tokens=settings.max_prompt_tokens,
            max_sessions_per_tenant=settings.max_sessions_per_tenant,
            observer=records,
            pure=settings.pure_kernels,
        )
        return Term(state, outbox, EventCursors(state, outbox), transfer_prefix, persist_blocks)


CurrentTerm = Callable[[], Term]  # the term in force now


class TermHolder:
    """Holds the current term; `swap` replaces it whole."""

    def __init__(self, first: Term) -> None:
        self._current = first

    def current(self) -> Term:
        return self._current

    def swap(self, term: Term) -> None:
        """Make `term` current: from now on every piece reads and writes it."""
        self._current = term
