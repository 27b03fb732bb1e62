"""A replay's SLO verdict as it runs, for a search that needs only whether attainment reaches
its target: a knee probe far past the knee would otherwise run on for hours of a core to
measure by how much it missed.

`SloVerdict` counts the measured calls that can no longer meet the SLO, by `summarize`'s
rules (refused; first token later than the TTFT objective; a decode slower than the TPOT
objective), and raises `TargetOutOfReach` from the replay's event loop once too many have
missed for attainment to reach the target. The verdict is then certain: a later event can
only add misses.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsched.core.cluster import SloConfig


class TargetOutOfReach(Exception):
    """Too many measured calls missed the SLO for the replay's attainment to reach its
    target."""


class SloVerdict:
    """The misses so far among the measured calls of one replay."""

    __slots__ = ("_measured", "_outputs", "_slo", "_target", "misses", "offered")

    def __init__(
        self, measured: Sequence[bool], outputs: Sequence[int], slo: SloConfig, target: float
    ) -> None:
        """`measured`: per call, whether it is in the measurement window; `outputs`: per call,
        its output tokens."""
        self._measured = measured
        self._outputs = outputs
        self._slo = slo
        self._target = target
        self.offered = sum(measured)
        self.misses = 0

    @property
    def attainment_bound(self) -> float:
        """The highest attainment the replay can still reach."""
        return (self.offered - self.misses) / self.offered if self.offered else float("nan")

    def refused(self, call: int) -> None:
        """`call` was refused for good."""
        if self._measured[call]:
            self._miss()

    def first_token(self, call: int, ttft_s: float) -> None:
        """`call`'s first token came `ttft_s` after its first arrival."""
        if self._measured[call] and ttft_s > self._slo.ttft_s:
            self._miss()

    def finished(self, call: int, ttft_s: float, decode_s: float) -> None:
        """`call` finished, `decode_s` after its first token; a late first token was counted
        already."""
        output = self._outputs[call]
        if (
            self._measured[call]
            and output > 1
            and ttft_s <= self._slo.ttft_s
            and decode_s / (output - 1) > self._slo.tpot_s
        ):
            self._miss()

    def _miss(self) -> None:
        self.misses += 1
        # The same ratio and comparison as a search's verdict on the finished replay's row.
        if not self.attainment_bound >= self._target:
            raise TargetOutOfReach
