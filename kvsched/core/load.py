"""Per-instance load: charged when a placement is decided, corrected by engine reports.

Values live in numpy vectors indexed by instance slot, written element by element (writes are
frequent: every engine step reports); reads hand out a copy, made only after a write, so a
policy scores every instance with a handful of array operations instead of a Python loop over
instances and never sees a vector change under it. (A copy costs about a microsecond at 1,024
instances, where rebuilding the vector from a Python list cost 20: bench.index_scale.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvsched.core.adapters import AdapterReport

FloatVec = npt.NDArray[np.float64]

_FIELDS = (
    "pending_prefill_tokens",  # prompt tokens queued or mid-prefill, not yet computed
    "pending_prefill_s",  # estimated seconds to compute them (decode passes included)
    "waiting",  # requests not yet admitted to a batch
    "running",  # requests admitted (prefilling or decoding)
    "decode_tokens",  # context tokens of the requests decoding
    "free_blocks",  # KV blocks free or evictable
    "in_flight",  # routed here and not finished, as counted by the scheduler itself
)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """An engine's own view of its load at one instant (fields as in `_FIELDS`)."""

    pending_prefill_tokens: int
    pending_prefill_s: float
    waiting: int
    running: int
    decode_tokens: int
    free_blocks: int
    # The engine's LoRA adapters, where it said (None: it did not, and what it held stands).
    adapters: AdapterReport | None = None


class LoadTracker:
    """Load vectors for `n` slots. Reports overwrite; charges add until the next report."""

    def __init__(self, n: int, capacity_blocks: int) -> None:
        self._values: dict[str, FloatVec] = {name: np.zeros(n) for name in _FIELDS}
        self._values["free_blocks"][:] = float(capacity_blocks)
        self._arrays: dict[str, FloatVec] = {}  # copies handed out since the last write

    def _vec(self, name: str) -> FloatVec:
        arr = self._arrays.get(name)
        if arr is None:
            arr = self._arrays[name] = self._values[name].copy()
        return arr

    @property
    def pending_prefill_tokens(self) -> FloatVec:
        return self._vec("pending_prefill_tokens")

    @property
    def pending_prefill_s(self) -> FloatVec:
        return self._vec("pending_prefill_s")

    @property
    def waiting(self) -> FloatVec:
        return self._vec("waiting")

    @property
    def running(self) -> FloatVec:
        return self._vec("running")

    @property
    def decode_tokens(self) -> FloatVec:
        return self._vec("decode_tokens")

    @property
    def free_blocks(self) -> FloatVec:
        return self._vec("free_blocks")

    @property
    def in_flight(self) -> FloatVec:
        return self._vec("in_flight")

    def charge(self, slot: int, prefill_tokens: int, prefill_s: float, blocks: int) -> None:
        """Account a request just placed on `slot` before the engine reports it."""
        v = self._values
        v["pending_prefill_tokens"][slot] += prefill_tokens
        v["pending_prefill_s"][slot] += prefill_s
        v["waiting"][slot] += 1
        v["free_blocks"][slot] -= blocks
        v["in_flight"][slot] += 1
        self._arrays.clear()

    def finish(self, slot: int) -> None:
        """A request routed to `slot` ended (in any way)."""
        flight = self._values["in_flight"]
        flight[slot] = max(0.0, float(flight[slot]) - 1)
        self._arrays.clear()

    def report(self, slot: int, report: LoadReport) -> None:
        """Replace the engine-measured fields of `slot` with its report."""
        v = self._values
        v["pending_prefill_tokens"][slot] = report.pending_prefill_tokens
        v["pending_prefill_s"][slot] = report.pending_prefill_s
        v["waiting"][slot] = report.waiting
        v["running"][slot] = report.running
        v["decode_tokens"][slot] = report.decode_tokens
        v["free_blocks"][slot] = report.free_blocks
        self._arrays.clear()

    def reset(self, slot: int, capacity_blocks: int) -> None:
        """Forget a slot's load (instance removed or restarted)."""
        for name, values in self._values.items():
            values[slot] = float(capacity_blocks) if name == "free_blocks" else 0.0
        self._arrays.clear()
