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

The settings are one :class:`DetectorConfig`; a detector's state round-trips through
:meth:`ChangeDetector.state_dict` (the monitors put it in Lightning checkpoints).
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

    def state_dict(self) -> dict:
        return {"values": list(self.values), "ema": self.ema}

    def load_state_dict(self, state: dict) -> None:
        self.values.clear()
        self.values.extend(float(v) for v in state["values"])
        self.ema = None if state["ema"] is None else float(state["ema"])

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


@dataclasses.dataclass(frozen=True)
class DetectorConfig:
    """Settings of one :class:`ChangeDetector` (one configuration object shared by every monitor and
    the offline replay; usable from YAML under ``LightningCLI``, e.g. ``detector: {window: 50}``).

    Attributes:
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
        ValueError: a field outside the accepted values (the message names it).
    """

    window: int = 100
    warmup: int = 20
    warn_ratio: Optional[float] = 4.0
    critical_ratio: Optional[float] = 10.0
    cusum_warn: Optional[float] = 25.0
    cusum_critical: Optional[float] = None
    cusum_drift: float = 1.0
    min_log_sigma: float = 0.02
    slope_window: int = 50
    slope_horizon: int = 100
    slope_warn: Optional[float] = None
    slope_critical: Optional[float] = None
    ema_decay: float = 0.9
    floor: float = 0.0

    def __post_init__(self) -> None:
        # Normalized in place (ints stay ints, numbers become floats) so that equal settings compare equal.
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        put("window", check_int("window", self.window, 2))
        put("warmup", check_int("warmup", self.warmup, 1))
        if self.warmup > self.window:
            raise _Conflict(f"`warmup` ({self.warmup}) must not exceed `window` ({self.window})", ("warmup", "window"))
        put("warn_ratio", _check_threshold("warn_ratio", self.warn_ratio, 1.0))
        put("critical_ratio", _check_threshold("critical_ratio", self.critical_ratio, 1.0))
        put("cusum_warn", _check_threshold("cusum_warn", self.cusum_warn, 0.0))
        put("cusum_critical", _check_threshold("cusum_critical", self.cusum_critical, 0.0))
        put("cusum_drift", check_float("cusum_drift", self.cusum_drift, above=-1e-300, accepted="a finite number >= 0"))
        put("min_log_sigma", check_float("min_log_sigma", self.min_log_sigma, above=0.0, accepted="a finite number > 0"))
        put("slope_window", check_int("slope_window", self.slope_window, 3))
        put("slope_horizon", check_int("slope_horizon", self.slope_horizon, 1))
        put("slope_warn", _check_threshold("slope_warn", self.slope_warn, 1.0))
        put("slope_critical", _check_threshold("slope_critical", self.slope_critical, 1.0))
        for low, high in (("warn_ratio", "critical_ratio"), ("cusum_warn", "cusum_critical"),
                          ("slope_warn", "slope_critical")):
            lo, hi = getattr(self, low), getattr(self, high)
            if lo is not None and hi is not None and lo > hi:
                raise _Conflict(f"`{low}` ({lo:g}) must not exceed `{high}` ({hi:g})", (low, high))
        put("ema_decay", check_float(
            "ema_decay", self.ema_decay, above=0.0, below=1.0, accepted="a number in the open interval (0, 1)"
        ))
        put("floor", check_float("floor", self.floor, above=-1e-300, accepted="a finite number >= 0"))


class _Conflict(ValueError):
    """Two fields of a :class:`DetectorConfig` that contradict each other (``fields``), each valid alone."""

    def __init__(self, message: str, fields: tuple[str, str]) -> None:
        super().__init__(message)
        self.fields = fields


def as_config(name: str, value: object, base: DetectorConfig | None = None) -> DetectorConfig:
    """``value`` if it is a :class:`DetectorConfig`; a mapping of some of its fields (JSON, a plain
    dict) applied to ``base`` (default ``DetectorConfig()``), as LightningCLI merges a partial YAML
    mapping into a default; else a ValueError naming ``name``."""
    if isinstance(value, DetectorConfig):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(DetectorConfig)})
        if unknown:
            raise ValueError(f"`{name}` has unknown fields {unknown}; accepted: the fields of DetectorConfig")
        base = base or DetectorConfig()
        try:
            return dataclasses.replace(base, **value)
        except ValueError as exc:
            # Name the argument, and the conflicting fields the mapping did not set: a field left out keeps
            # the monitor's default, which may contradict the new values (e.g. window 50 under
            # GradNormMonitor's default warmup 100).
            kept = [f for f in getattr(exc, "fields", ()) if f not in value]
            note = ""
            if kept:
                defaults = ", ".join(f"{f}={getattr(base, f)!r}" for f in kept)
                note = (f" ({defaults}: the default this mapping keeps, since it does not set "
                        f"{'it' if len(kept) == 1 else 'them'}; set {' and '.join(kept)} too)")
            raise ValueError(f"`{name}`: {exc}{note}") from None
    raise ValueError(f"`{name}` must be a DetectorConfig or a dict of its fields, got {value!r}")


class ChangeDetector:
    """Robust-baseline ratio, CUSUM and log-slope detector of a positive series (see module docstring).

    Args:
        config: the settings (:class:`DetectorConfig`; default ``DetectorConfig()``).

    State (:meth:`state_dict` / :meth:`load_state_dict`): the baseline window, the EMA, the CUSUM, the
    log-slope points and the current episode's level, as plain Python numbers and lists, so a
    checkpoint restores a detector exactly where it stopped (the settings come from ``config``).
    """

    def __init__(self, config: DetectorConfig | None = None) -> None:
        self.config = DetectorConfig() if config is None else as_config("config", config)
        c = self.config
        self.window, self.warmup, self.floor = c.window, c.warmup, c.floor
        self.baseline = RobustBaseline(c.window, c.ema_decay)
        self._log_window: collections.deque[float] = collections.deque(maxlen=c.window)
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=c.slope_window - 1)
        self.cusum = 0.0
        self._episode = 0  # highest level rank reached in the current episode

    @property
    def level(self) -> Optional[str]:
        """The highest level of the current episode (None when the last value was below every threshold)."""
        return None if self._episode == 0 else LEVELS[self._episode - 1]

    def state_dict(self) -> dict:
        return {
            "baseline": self.baseline.state_dict(),
            "log_window": list(self._log_window),
            "recent": [[t, y] for t, y in self._recent],
            "cusum": self.cusum,
            "episode": self._episode,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (windows longer than this config's keep their newest values)."""
        self.baseline.load_state_dict(state["baseline"])
        self._log_window.clear()
        self._log_window.extend(float(v) for v in state["log_window"])
        self._recent.clear()
        self._recent.extend((int(t), float(y)) for t, y in state["recent"])
        self.cusum = float(state["cusum"])
        self._episode = int(state["episode"])

    # ------------------------------------------------------------------ statistics

    def _growth(self, step: int, log_value: float) -> float | None:
        points = list(self._recent) + [(step, log_value)]
        if len(points) < self.config.slope_window:
            return None
        n = len(points)
        mean_t = sum(t for t, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        sxx = sum((t - mean_t) ** 2 for t, _ in points)
        if sxx == 0:
            return None
        slope = sum((t - mean_t) * (y - mean_y) for t, y in points) / sxx
        return math.exp(min(700.0, slope * self.config.slope_horizon))

    def update(self, step: int, value: float) -> Detection:
        """Compare ``value`` (measured at ``step``) with the past, then add it to the baseline."""
        raw = float(value)
        c = self.config
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
            sigma = max(MAD_TO_STD * log_mad, c.min_log_sigma)
            self.cusum = max(0.0, self.cusum + (log_value - log_median) / sigma - c.cusum_drift)
            cusum = self.cusum
        growth = self._growth(step, log_value)

        level, statistic, score, threshold = None, None, None, None
        if n >= self.warmup:
            checks = (
                ("critical", "ratio", ratio, c.critical_ratio),
                ("critical", "cusum", cusum, c.cusum_critical),
                ("critical", "log_slope", growth, c.slope_critical),
                ("warn", "ratio", ratio, c.warn_ratio),
                ("warn", "cusum", cusum, c.cusum_warn),
                ("warn", "log_slope", growth, c.slope_warn),
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
