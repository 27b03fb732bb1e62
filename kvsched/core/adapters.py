"""Which LoRA adapters each instance holds, what placing an adapter's request there costs, and
what the instance must load (or unload) first.

An engine holds at most `capacity` adapters (vLLM's `--max-loras`: the adapters one batch
can run; more would swap weights in and out on every step). What it holds is its own word,
reported with its load (`AdapterReport`: vLLM's `/v1/models` lists them, `/metrics` names the
ones its requests use), plus what this Conductor placed there since: a load it ordered that no
report shows yet still takes a slot, and an adapter placed within `grace_s` is not unloaded
(its request may still be on the way to the engine). The records are the Conductor's, in
memory; reports rebuild them after a takeover. Pure: time comes in as `now`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatVec = npt.NDArray[np.float64]
BoolVec = npt.NDArray[np.bool_]

GRACE_S = 10.0  # a placed adapter's request reaches its engine well within this
# What a report or a request may name, as every boundary checks it (vLLM's --max-loras is
# far below the first).
MAX_ADAPTERS = 1024  # adapters one engine reports
MAX_ADAPTER_NAME = 256  # characters of an adapter's name


@dataclass(frozen=True, slots=True)
class AdapterReport:
    """An engine's adapters: how many it may hold (0: it serves none), the ones it holds, and
    the ones its running or waiting requests use."""

    capacity: int
    held: frozenset[str] = frozenset()
    busy: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class AdapterChange:
    """What an instance does before it serves a placed request: unload `unload` (a slot for
    the new one), then load `load` ("": nothing)."""

    load: str = ""
    unload: str = ""


NO_CHANGE = AdapterChange()


class AdapterSlots:
    """The adapters of `n` instance slots."""

    def __init__(self, n: int, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.capacity = [0] * n
        self._held: list[frozenset[str]] = [frozenset()] * n  # as last reported
        self._busy: list[frozenset[str]] = [frozenset()] * n
        self._placed: list[dict[str, float]] = [{} for _ in range(n)]  # adapter -> last time

    def report(self, slot: int, report: AdapterReport) -> None:
        """Replace what `slot` holds with its engine's report; loads placed since stay."""
        self.capacity[slot] = report.capacity
        self._held[slot] = report.held
        self._busy[slot] = report.busy

    def reported(self, slot: int) -> AdapterReport:
        """What `slot`'s engine last said of its adapters."""
        return AdapterReport(self.capacity[slot], self._held[slot], self._busy[slot])

    def reset(self, slot: int) -> None:
        """Forget `slot` (its instance left, or came back as a new process)."""
        self.capacity[slot] = 0
        self._held[slot] = self._busy[slot] = frozenset()
        self._placed[slot] = {}

    def holds(self, slot: int, now: float) -> set[str]:
        """The adapters `slot` holds: reported, or placed there within `grace_s`."""
        recent = {a for a, t in self._placed[slot].items() if now - t < self.grace_s}
        return recent | self._held[slot]

    def _victim(self, slot: int, now: float) -> str:
        """The adapter `slot` unloads to make room: held, used by no request the engine has
        and placed longest ago (ties by name); "" when every one is in use."""
        placed = self._placed[slot]
        idle = [
            (placed.get(a, -np.inf), a)
            for a in self.holds(slot, now) - self._busy[slot]
            if now - placed.get(a, -np.inf) >= self.grace_s
        ]
        return min(idle)[1] if idle else ""

    def retry_after_s(self, now: float) -> float:
        """Seconds until the first adapter placed within the grace passes it (one an engine
        runs may stay longer): when a slot may be freed."""
        waits = [
            self.grace_s - (now - t)
            for placed in self._placed
            for t in placed.values()
            if now - t < self.grace_s
        ]
        return min(waits, default=self.grace_s)

    def costs(self, adapter: str, load_s: float, now: float) -> tuple[BoolVec, FloatVec]:
        """Per slot: whether it can serve `adapter` now (holds it, has a slot free, or can
        unload an idle one), and the seconds its load costs: 0 where held, `load_s` into a
        free slot, twice that where another adapter must leave (its next request loads it
        again). Changes nothing."""
        n = len(self.capacity)
        able = np.zeros(n, dtype=bool)
        seconds = np.zeros(n)
        for slot in range(n):
            if self.capacity[slot] <= 0:
                continue
            held = self.holds(slot, now)
            if adapter in held:
                able[slot] = True
            elif len(held) < self.capacity[slot]:
                able[slot] = True
                seconds[slot] = load_s
            elif self._victim(slot, now):
                able[slot] = True
                seconds[slot] = 2.0 * load_s
        return able, seconds

    def place(self, slot: int, adapter: str, now: float) -> AdapterChange:
        """Record a request for `adapter` placed on `slot` (one `costs` found able); returns
        what the instance must do first. The load is said again until a report shows the
        adapter held: a request placed there meanwhile waits on the same load (vLLM loads
        an adapter once; a second load of it is refused as already loaded)."""
        held = self.holds(slot, now)
        unload = ""
        if adapter not in held and len(held) >= self.capacity[slot]:
            unload = self._victim(slot, now)
            self._held[slot] = self._held[slot] - {unload}
        # What is neither held nor recent is forgotten: the record stays as small as the slots.
        placed = self._placed[slot] = {
            a: t
            for a, t in self._placed[slot].items()
            if a in self._held[slot] or now - t < self.grace_s
        }
        placed[adapter] = now
        return AdapterChange("" if adapter in self._held[slot] else adapter, unload)
