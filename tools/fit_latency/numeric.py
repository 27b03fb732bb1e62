"""Small numeric helpers: straight-line fits with their quality, ranges, rounding."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.float64]

MS = 1e-3
US = 1e-6


@dataclass(frozen=True, slots=True)
class Fit:
    """A straight line y = intercept + slope·x with its quality on the fitted points."""

    intercept: float
    slope: float
    r2: float
    rms: float  # root-mean-square residual, units of y
    max_rel_err: float  # max |fit − y| / y over the fitted points
    points: int

    def max_rel_err_on(self, x: Array, y: Array) -> float:
        """Max relative error of this line on other points (e.g. a subset)."""
        return float(np.max(np.abs(self.intercept + self.slope * x - y) / y))


def _stats(x: Array, y: Array, intercept: float, slope: float) -> Fit:
    pred = intercept + slope * x
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    rms = math.sqrt(ss_res / len(x))
    return Fit(intercept, slope, r2, rms, float(np.max(np.abs(pred - y) / y)), len(x))


def fit_line(x: Array, y: Array) -> Fit:
    """Ordinary least squares with a free intercept."""
    design = np.column_stack([np.ones_like(x), x])
    (intercept, slope), *_ = np.linalg.lstsq(design, y, rcond=None)
    return _stats(x, y, float(intercept), float(slope))


def fit_slope_pinned(x: Array, y: Array, intercept: float) -> Fit:
    """Slope minimising the squared *relative* error with the intercept held fixed."""
    w = 1.0 / y**2
    slope = float((w * x * (y - intercept)).sum() / (w * x * x).sum())
    return _stats(x, y, intercept, slope)


def in_range(x: Array, bounds: tuple[int, int]) -> npt.NDArray[np.bool_]:
    return (x >= bounds[0]) & (x <= bounds[1])


def sig(value: float, digits: int = 4) -> float:
    """Round to a few significant digits for the shipped JSON."""
    if value == 0:
        return 0.0
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def value_at(x: Array, y: Array, at: float) -> float:
    return float(y[int(np.argmin(np.abs(x - at)))])
