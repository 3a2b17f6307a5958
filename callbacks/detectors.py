"""Online change detectors over one positive series; pure Python, so the same code runs online (in the
monitors) and offline (``lightning_gproj.evaluate`` replays logged series through it).

:class:`ChangeDetector` compares each new value with the values *before* it:

``ratio``
    value / median of the last ``window`` finite values (robust baseline). Dimensionless.
``ema_ratio``
    value / EMA of the previous values (decay ``ema_decay``): a shorter memory. Dimensionless; logged,
    not alerted on.
``cusum``
    one-sided CUSUM of the robust z-score of log(value): z = (log x − median(log window)) /
    max(1.4826 · MAD(log window), ``min_log_sigma``); S ← max(0, S + z − ``cusum_drift``). In units of
    robust standard deviations. Catches a sustained rise of a few σ that no single value shows.
``log_slope``
    least-squares slope of log(value) against the step over the last ``slope_window`` values, reported
    as the growth factor per ``slope_horizon`` steps, exp(slope · horizon). Dimensionless. Catches a
    steady exponential rise (the drift of the mean key, DESIGN.md §8).

Levels: ``"warn"`` when any statistic crosses its warn threshold, ``"critical"`` when any crosses its
critical one (None disables a threshold). Nothing fires before ``warmup`` finite values are in the
window. An *episode* is a run of consecutive values at a level; :meth:`ChangeDetector.update` reports
a new alert only when the level rises within an episode (None → warn, warn → critical, None →
critical), so a sustained excursion alerts once per level. Non-finite values are reported but never
added to the baseline and never alert (a NaN/inf gradient is the GradScaler's business).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Optional

from ._base import check_float, check_int

#: Alert levels, lowest first.
LEVELS = ("warn", "critical")
#: MAD -> standard deviation for normally distributed data.
MAD_TO_STD = 1.4826
_TINY = 1e-30


def level_rank(level: Optional[str]) -> int:
    """0 for None, 1 for "warn", 2 for "critical" (the number logged as ``alert/...``)."""
    return 0 if level is None else LEVELS.index(level) + 1


class RobustBaseline:
    """Median and MAD of the last ``window`` values, and an EMA, of a series.

    :meth:`update` adds a value; the properties describe the values added *before* it, so a step is
    always compared with its past. Non-finite values are never added.
    """

    def __init__(self, window: int, ema_decay: float) -> None:
        self.values: collections.deque[float] = collections.deque(maxlen=window)
        self.ema_decay = ema_decay
        self.ema: float | None = None

    def __len__(self) -> int:
        return len(self.values)

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    @property
    def mad(self) -> float | None:
        """Median absolute deviation from the median (unscaled; × 1.4826 estimates σ)."""
        med = self.median
        return None if med is None else statistics.median(abs(v - med) for v in self.values)

    def update(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.values.append(value)
        self.ema = value if self.ema is None else self.ema_decay * self.ema + (1.0 - self.ema_decay) * value


@dataclasses.dataclass(frozen=True)
class Detection:
    """The outcome of one :meth:`ChangeDetector.update`.

    ``level``/``statistic``/``score``/``threshold``: the highest level reached at this value and the
    statistic that reached it (its value and threshold), None when nothing fired. ``new``: this value
    starts an alert (the level rose within the episode). The other fields are the statistics (None while
    undefined).
    """

    step: int
    value: float
    window: int
    median: float | None = None
    mad: float | None = None
    ratio: float | None = None
    ema_ratio: float | None = None
    cusum: float | None = None
    growth: float | None = None
    level: str | None = None
    statistic: str | None = None
    score: float | None = None
    threshold: float | None = None
    new: bool = False

    def statistics(self) -> dict[str, float]:
        """The defined statistics by name (ratio, ema_ratio, cusum, log_slope, baseline_median, baseline_mad)."""
        out = {
            "baseline_median": self.median,
            "baseline_mad": self.mad,
            "ratio": self.ratio,
            "ema_ratio": self.ema_ratio,
            "cusum": self.cusum,
            "log_slope": self.growth,
        }
        return {k: v for k, v in out.items() if v is not None}


def _check_threshold(name: str, value: object, above: float) -> float | None:
    if value is None:
        return None
    return check_float(name, value, above=above, accepted=f"None or a finite number > {above:g}")


class ChangeDetector:
    """Robust-baseline ratio, CUSUM and log-slope detector of a positive series (see module docstring).

    Args:
        window: values in the rolling baseline (int >= 2).
        warmup: finite values needed in the window before anything fires (int in [1, window]).
        warn_ratio, critical_ratio: thresholds of ``ratio`` (None or > 1).
        cusum_warn, cusum_critical: thresholds of ``cusum`` in robust σ (None or > 0).
        cusum_drift: allowance k subtracted from each z (float >= 0).
        min_log_sigma: floor of the robust σ of log(value) (float > 0), so that a near-constant series
            does not turn rounding noise into large z.
        slope_window: values in the log-slope fit (int >= 3).
        slope_horizon: steps over which the growth factor is expressed (int >= 1).
        slope_warn, slope_critical: thresholds of the growth factor (None or > 1).
        ema_decay: EMA decay (float in (0, 1)).
        floor: values below it are treated as equal to it (float >= 0): rounding-level noise of a
            quantity that is 0 in exact arithmetic (e.g. the C2 residual of a GProj run, ~1e-6) then
            cannot alert by its relative jumps; a rise above the floor still does. ``Detection.value``
            keeps the raw value.

    Raises:
        ValueError: an argument outside the accepted values (the message names it).
    """

    def __init__(
        self,
        *,
        window: int = 100,
        warmup: int = 20,
        warn_ratio: float | None = 4.0,
        critical_ratio: float | None = 10.0,
        cusum_warn: float | None = 25.0,
        cusum_critical: float | None = None,
        cusum_drift: float = 1.0,
        min_log_sigma: float = 0.02,
        slope_window: int = 50,
        slope_horizon: int = 100,
        slope_warn: float | None = None,
        slope_critical: float | None = None,
        ema_decay: float = 0.9,
        floor: float = 0.0,
    ) -> None:
        self.window = check_int("window", window, 2)
        self.warmup = check_int("warmup", warmup, 1, self.window)
        self.warn_ratio = _check_threshold("warn_ratio", warn_ratio, 1.0)
        self.critical_ratio = _check_threshold("critical_ratio", critical_ratio, 1.0)
        self.cusum_warn = _check_threshold("cusum_warn", cusum_warn, 0.0)
        self.cusum_critical = _check_threshold("cusum_critical", cusum_critical, 0.0)
        self.cusum_drift = check_float("cusum_drift", cusum_drift, above=-1e-300, accepted="a finite number >= 0")
        self.min_log_sigma = check_float("min_log_sigma", min_log_sigma, above=0.0, accepted="a finite number > 0")
        self.slope_window = check_int("slope_window", slope_window, 3)
        self.slope_horizon = check_int("slope_horizon", slope_horizon, 1)
        self.slope_warn = _check_threshold("slope_warn", slope_warn, 1.0)
        self.slope_critical = _check_threshold("slope_critical", slope_critical, 1.0)
        for low, high in (("warn_ratio", "critical_ratio"), ("cusum_warn", "cusum_critical"),
                          ("slope_warn", "slope_critical")):
            lo, hi = getattr(self, low), getattr(self, high)
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"`{low}` ({lo:g}) must not exceed `{high}` ({hi:g})")
        self.ema_decay = check_float(
            "ema_decay", ema_decay, above=0.0, below=1.0, accepted="a number in the open interval (0, 1)"
        )
        self.floor = check_float("floor", floor, above=-1e-300, accepted="a finite number >= 0")
        self.baseline = RobustBaseline(self.window, self.ema_decay)
        self._log_window: collections.deque[float] = collections.deque(maxlen=self.window)
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=self.slope_window - 1)
        self.cusum = 0.0
        self._episode = 0  # highest level rank reached in the current episode

    # ------------------------------------------------------------------ statistics

    def _growth(self, step: int, log_value: float) -> float | None:
        points = list(self._recent) + [(step, log_value)]
        if len(points) < self.slope_window:
            return None
        n = len(points)
        mean_t = sum(t for t, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        sxx = sum((t - mean_t) ** 2 for t, _ in points)
        if sxx == 0:
            return None
        slope = sum((t - mean_t) * (y - mean_y) for t, y in points) / sxx
        return math.exp(min(700.0, slope * self.slope_horizon))

    def update(self, step: int, value: float) -> Detection:
        """Compare ``value`` (measured at ``step``) with the past, then add it to the baseline."""
        raw = float(value)
        base = self.baseline
        n = len(base)
        if not math.isfinite(raw):
            return Detection(step, raw, n, base.median, base.mad)
        value = max(raw, self.floor)
        log_value = math.log(max(value, _TINY))
        median, mad = base.median, base.mad
        ratio = value / median if median else None
        ema_ratio = value / base.ema if base.ema else None
        cusum = None
        if n >= self.warmup:
            log_median = statistics.median(self._log_window)
            log_mad = statistics.median(abs(v - log_median) for v in self._log_window)
            sigma = max(MAD_TO_STD * log_mad, self.min_log_sigma)
            self.cusum = max(0.0, self.cusum + (log_value - log_median) / sigma - self.cusum_drift)
            cusum = self.cusum
        growth = self._growth(step, log_value)

        level, statistic, score, threshold = None, None, None, None
        if n >= self.warmup:
            checks = (
                ("critical", "ratio", ratio, self.critical_ratio),
                ("critical", "cusum", cusum, self.cusum_critical),
                ("critical", "log_slope", growth, self.slope_critical),
                ("warn", "ratio", ratio, self.warn_ratio),
                ("warn", "cusum", cusum, self.cusum_warn),
                ("warn", "log_slope", growth, self.slope_warn),
            )
            for lvl, stat, x, thr in checks:
                if thr is not None and x is not None and x > thr:
                    level, statistic, score, threshold = lvl, stat, x, thr
                    break
        rank = level_rank(level)
        new = rank > self._episode
        self._episode = rank and max(rank, self._episode)

        base.update(value)
        self._log_window.append(log_value)
        self._recent.append((step, log_value))
        return Detection(
            step, raw, n, median, mad, ratio, ema_ratio, cusum, growth, level, statistic, score, threshold, new
        )
