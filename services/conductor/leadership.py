"""Whether this Conductor serves writes, and who leads: what every piece that answers asks
before it changes anything, or tells a caller where to go instead."""

from __future__ import annotations

from services.common.store.interface import Guard
from services.conductor.election import Election, LeaderInfo


class Leadership:
    """This Conductor's standing: `serving` once it has caught up as the elected leader,
    until it loses the lease; `election` is its campaign (set when the Conductor starts)."""

    def __init__(self, self_id: str, election: Election) -> None:
        self.self_id = self_id
        self.election = election
        self.serving = False

    @property
    def leader(self) -> LeaderInfo | None:
        """The leader as last seen in etcd (None while there is none)."""
        return self.election.leader

    @property
    def is_leader(self) -> bool:
        """Elected (holding the leader key), whether or not serving yet."""
        return self.election.is_leader

    def guard(self) -> Guard | None:
        """What this term's etcd writes are guarded by; None when this Conductor does not
        lead (see `Election.guard`)."""
        return self.election.guard()

    def fenced(self) -> None:
        """etcd refused a guarded write: the term is over (see `Election.fenced`)."""
        self.election.fenced()
