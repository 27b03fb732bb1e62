"""The policy interface: a picker over the cluster state, plus its name, parameters and the
roles it wants.

A policy decides; it does not record. `decide` reads the cluster state and returns a
`Decision` whose terms say why; `kvsched.core.recording` then records the placement (load
charge, speculative index entries, session binding), completions and transfer outcomes, the
same for every policy. A policy's own follow-ups are hooks: `after_finish` returns transfers
to start, `after_transfer` updates what the policy alone keeps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from random import Random
from typing import Any, ClassVar

from kvsched.core.cluster import ClusterState, Role
from kvsched.core.decision import Completion, Decision, TransferPlan
from kvsched.core.request_view import RequestView

ParamValue = float | int | bool | str


class Policy(ABC):
    """Base class of every placement policy. Subclasses set `name`, document their rules in
    the class docstring and implement `decide`."""

    name: ClassVar[str]
    defaults: ClassVar[Mapping[str, ParamValue]] = {}
    # Whether placements follow session bindings (the Conductor then makes a changed binding
    # durable before it answers; for other policies a binding is only bookkeeping).
    affinity: ClassVar[bool] = False

    def __init__(self, cluster: ClusterState, params: Mapping[str, ParamValue] | None = None):
        unknown = set(params or {}) - set(self.defaults)
        if unknown:
            raise ValueError(
                f"policy {self.name!r} has no parameter(s) {sorted(unknown)}; "
                f"known: {sorted(self.defaults)}"
            )
        merged: dict[str, ParamValue] = dict(self.defaults)
        for key, value in (params or {}).items():
            merged[key] = type(self.defaults[key])(value)
        self.params: Mapping[str, ParamValue] = merged
        self.cluster = cluster

    @classmethod
    def roles(cls, n: int, params: Mapping[str, ParamValue] | None = None) -> tuple[Role, ...]:
        """Instance roles this policy wants on an n-instance cluster (all BOTH by default)."""
        return (Role.BOTH,) * n

    def param(self, key: str) -> Any:
        return self.params[key]

    @abstractmethod
    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        """Pick an instance for `view.req`. Changes no shared cluster state (the caller
        records the placement); only what the policy alone keeps (its cursor, its prefix
        heat, its resident-session tally)."""

    def after_finish(self, done: Completion, now: float) -> Sequence[TransferPlan]:
        """A request ended and was recorded. Returns transfers to start now (none by
        default); changes no shared cluster state."""
        return ()

    def after_transfer(self, plan: TransferPlan, moved: bool, now: float) -> None:
        """A transfer this policy ordered ended and was recorded (`moved`: its session was
        rebound to `plan.target`). Nothing to do by default."""
        return None
