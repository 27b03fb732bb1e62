"""Meters the replay feeds while it runs: load balance over time and inter-token gaps."""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right

import numpy as np


class HotspotMeter:
    """Load balance over time, integrated exactly between changes, of two per-instance loads.

    Q_i(t), the prefill seconds queued on instance i (requests waiting, not the ones being
    prefilled; `set_queued`), gives the hotspot index: the time average over a window of
    max_i Q_i − mean_i Q_i, in seconds (`hotspot_index`). It is 0 when no request ever waits
    while another instance has less queued, and it cannot saturate.

    L_i(t), pending prefill tokens (queued or mid-prefill; `set`), gives the older companions,
    over the whole run: HPMR (time-weighted max/mean over instants with pending work, which
    reads near N whenever one cold start at a time is all the work), its coefficient of
    variation, the share of time some instance is hot (above 1.5 × the median and above one
    chunk), and each instance's time-averaged load."""

    def __init__(self, n: int, chunk_tokens: int) -> None:
        self.n = n
        self.chunk = chunk_tokens
        self.queued = [0.0] * n  # Q_i: queued prefill seconds, as of the last change
        # False when a source cannot say what is queued (a live engine without the field):
        # the index is then unknown (NaN), not 0.
        self.queued_known = True
        # The excess max Q − mean Q is piecewise constant: one entry per instant it changed,
        # with ∫ excess dt up to that instant, so any window's average is two look-ups.
        self._excess_t = array("d")
        self._excess_area = array("d")
        self._excess = array("d")
        self.loads = [0.0] * n
        self.last_t = 0.0
        self.started = False
        self.busy_s = 0.0  # time with pending work somewhere
        self.ratio_area = 0.0
        self.cv_area = 0.0
        self.hot_s = 0.0
        self.area = [0.0] * n  # ∫ L_i dt, brought up to date when L_i changes
        self._since = [0.0] * n
        self.elapsed_s = 0.0
        # Change log for the heatmap: time, slot, new value.
        self.log_t = array("d")
        self.log_slot = array("i")
        self.log_value = array("d")
        # The integrands depend only on the loads: worked out once per change of a load,
        # not once per event (`_rates`); None until then.
        self._rates: tuple[float, float, float, bool] | None = None

    def set(self, now: float, slot: int, value: float) -> None:
        """Instance `slot` has `value` pending prefill tokens from `now` on."""
        if now > self.last_t:
            self._integrate(now)
        elif not self.started:
            self.last_t = now
        self.started = True
        if self.loads[slot] != value:
            self.area[slot] += self.loads[slot] * (now - self._since[slot])
            self._since[slot] = now
            self.loads[slot] = value
            self._rates = None
            self.log_t.append(now)
            self.log_slot.append(slot)
            self.log_value.append(value)

    def set_queued(self, now: float, slot: int, seconds: float) -> None:
        """Instance `slot` has `seconds` of prefill queued (waiting, not admitted) from `now`
        on. Times must not go back; a call that changes nothing records nothing."""
        queued = self.queued
        if queued[slot] == seconds:
            return
        queued[slot] = seconds
        # O(N) per change, not per event: the queues change on submission, admission and
        # abort only. max ≥ mean in exact arithmetic; the clamp keeps rounding from below 0.
        excess = max(max(queued) - sum(queued) / self.n, 0.0)
        times, areas, values = self._excess_t, self._excess_area, self._excess
        if not times:
            times.append(now)
            areas.append(0.0)
            values.append(excess)
            return
        last = len(times) - 1
        if now <= times[last]:  # the same instant: the later value holds from it on
            values[last] = excess
            return
        times.append(now)
        areas.append(areas[last] + values[last] * (now - times[last]))
        values.append(excess)

    def excess_area(self, t: float) -> float:
        """∫ (max Q − mean Q) dt from time 0 (or the first change) up to `t`."""
        i = bisect_right(self._excess_t, t) - 1
        if i < 0:
            return 0.0
        return self._excess_area[i] + self._excess[i] * (t - self._excess_t[i])

    def hotspot_index(self, start: float, end: float) -> float:
        """Time average of max Q − mean Q over [start, end], in seconds of queued prefill;
        NaN for an empty window or when the queues were not known."""
        if not end > start or not self.queued_known:
            return math.nan
        return (self.excess_area(end) - self.excess_area(start)) / (end - start)

    def finish(self, now: float) -> None:
        if now > self.last_t:
            self._integrate(now)
        for slot, load in enumerate(self.loads):
            self.area[slot] += load * (now - self._since[slot])
            self._since[slot] = now

    def _integrate(self, now: float) -> None:
        dt = now - self.last_t
        self.last_t = now
        if not self.started:
            return
        self.elapsed_s += dt
        rates = self._rates
        if rates is None:
            rates = self._rates = self._rates_of(self.loads)
        mean, top, spread, hot = rates
        if mean > 0:
            self.busy_s += dt
            # The same expressions, in the same order, as with the loads at hand: bit-exact.
            self.ratio_area += dt * top / mean
            self.cv_area += dt * spread / mean
            if hot:
                self.hot_s += dt

    def _rates_of(self, loads: list[float]) -> tuple[float, float, float, bool]:
        """(mean, max, standard deviation, whether one instance is hot) of `loads`; a mean
        of 0 when nothing is pending anywhere."""
        total = sum(loads)
        if not total > 0:
            return 0.0, 0.0, 0.0, False
        mean = total / self.n
        var = max(sum([x * x for x in loads]) / self.n - mean * mean, 0.0)
        ordered = sorted(loads)
        mid = self.n // 2
        median = ordered[mid] if self.n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
        hot = ordered[-1] > 1.5 * median and ordered[-1] > self.chunk
        return mean, max(loads), math.sqrt(var), hot

    def summary(self, start: float, end: float) -> dict[str, float]:
        """The figures: the hotspot index over the window [start, end] (the measured span),
        the companions over the whole run, as they always were."""
        busy = self.busy_s or math.nan
        mean_area = sum(self.area) / self.n
        return {
            "hotspot_index": self.hotspot_index(start, end),
            "hotspot_pmr": self.ratio_area / busy,
            "hotspot_cv": self.cv_area / busy,
            "hot_time_share": self.hot_s / busy,
            "persistent_skew": max(self.area) / mean_area if mean_area > 0 else math.nan,
            "pending_time_share": self.busy_s / self.elapsed_s if self.elapsed_s else math.nan,
        }

    def heatmap(self, start: float, end: float, bins: int) -> np.ndarray:
        """Time-averaged pending prefill tokens per instance (rows) per time bin (columns)."""
        out = np.zeros((self.n, bins))
        if end <= start or not len(self.log_t):
            return out
        width = (end - start) / bins
        current = [0.0] * self.n
        since = [start] * self.n
        for t, slot, value in zip(self.log_t, self.log_slot, self.log_value, strict=True):
            _spread(out[slot], since[slot], min(t, end), current[slot], start=start, width=width)
            current[slot], since[slot] = value, max(t, start)
        for slot in range(self.n):
            _spread(out[slot], since[slot], end, current[slot], start=start, width=width)
        return out / width


def _spread(
    row: np.ndarray, t0: float, t1: float, value: float, *, start: float, width: float
) -> None:
    if value == 0 or t1 <= t0:
        return
    bins = len(row)
    b = int((t0 - start) // width)
    while t0 < t1 and b < bins:
        edge = start + (b + 1) * width
        seg_end = min(edge, t1)
        row[max(b, 0)] += value * (seg_end - t0)
        t0, b = seg_end, b + 1


class GapHistogram:
    """Log-binned histogram of individual inter-token gaps (seconds), for stutter percentiles."""

    LO, RATIO, BINS = 1e-4, 1.02, 1000

    def __init__(self) -> None:
        self.counts = [0.0] * self.BINS  # a list: one add per engine step must stay cheap
        self._inv_log_ratio = 1.0 / math.log(self.RATIO)

    def add(self, first: float, last: float, count: float) -> None:
        """`count` gaps spread evenly between `first` and `last`."""
        if count <= 0:
            return
        pieces = 1 if abs(last - first) <= 0.02 * first else min(4, max(1, int(count)))
        share = count / pieces
        step = (last - first) / pieces
        counts, lo, top = self.counts, self.LO, self.BINS - 1
        for k in range(pieces):
            value = first + step * (k + 0.5)
            b = 0 if value <= lo else min(int(math.log(value / lo) * self._inv_log_ratio), top)
            counts[b] += share

    def percentile(self, q: float) -> float:
        counts = np.array(self.counts)
        total = counts.sum()
        if total == 0:
            return math.nan
        idx = int(np.searchsorted(np.cumsum(counts), q / 100.0 * total))
        return float(self.LO * self.RATIO ** (min(idx, self.BINS - 1) + 0.5))
