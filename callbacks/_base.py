"""Plumbing shared by the monitors: hooks that never fail a run, direct logging, argument checks, tables.

Why the monitors write to ``trainer.loggers`` themselves instead of calling ``pl_module.log``: a value
logged with ``self.log(..., on_step=True)`` stays in Lightning's result collection and is written again
at every later logging step until the key is logged anew (checked on lightning 2.6.6). A monitor that
samples every 50 steps while the Trainer writes every 10 would put the same stale number under four
later steps. Lightning's own sampled callbacks (``LearningRateMonitor``, ``DeviceStatsMonitor``) log to
``trainer.loggers`` with an explicit step for the same reason; so do these. Every Lightning logger
(CSV, TensorBoard, W&B, ...) receives them, at exactly the step they were measured.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


class MonitorDisabledWarning(RuntimeWarning):
    """A monitor hit an error in one of its hooks and switched itself off; training goes on."""


def guarded(hook: _F) -> _F:
    """Run a callback hook so that no exception escapes it.

    The first exception switches the monitor off (:meth:`Monitor._disable`) and is reported once as a
    :class:`MonitorDisabledWarning`; every later hook call is then a no-op. ``BaseException``\\ s that
    are not ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) pass through: they stop the run on
    purpose.
    """

    @functools.wraps(hook)
    def wrapper(self: "Monitor", *args: Any, **kwargs: Any) -> Any:
        if self.disabled:
            return None
        try:
            return hook(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a monitor must never stop training
            self._disable(hook.__name__, exc)
            return None

    return wrapper  # type: ignore[return-value]


class Monitor(Callback):
    """Base of the monitors: failure handling and logging helpers (no hooks of its own)."""

    def __init__(self) -> None:
        super().__init__()
        #: True once a hook raised; the monitor does nothing afterwards.
        self.disabled = False
        #: ``"hook: ExceptionType: message"`` of the error that disabled the monitor, else None.
        self.failure: str | None = None

    def _disable(self, where: str, exc: BaseException) -> None:
        self.disabled = True
        self.failure = f"{where}: {type(exc).__name__}: {exc}"
        try:
            self._on_disable()
        except Exception:  # noqa: BLE001 - cleanup is best effort; the warning below matters more
            log.debug("%s cleanup after failure raised", type(self).__name__, exc_info=True)
        log.debug("%s disabled", type(self).__name__, exc_info=exc)
        # Warned on every rank where it happens (not rank zero only): a failure on rank 3 alone is worth
        # seeing. It happens once per monitor because the monitor is off afterwards.
        warnings.warn(
            f"{type(self).__name__} disabled itself after an error in {self.failure}. "
            "Training continues without this monitor.",
            MonitorDisabledWarning,
            stacklevel=3,
        )

    def _on_disable(self) -> None:
        """Undo global side effects when the monitor switches off (subclasses override)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (Lightning calls it when a fit resumes from a checkpoint).

        A state this code cannot read (e.g. from another version) is reported with one warning and the
        monitor keeps the state it had: a resume never fails because of a monitor."""
        before = self.state_dict()
        try:
            self._load_state(state_dict)
        except Exception as exc:  # noqa: BLE001 - a monitor must never stop training
            self._load_state(before)
            warnings.warn(
                f"{type(self).__name__} could not restore its state from the checkpoint "
                f"({type(exc).__name__}: {exc}); it goes on from a fresh state.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError


def step_index(trainer: "pl.Trainer") -> int:
    """The 0-based index of the current optimizer step, on the step axis Lightning's loggers use.

    Lightning writes ``self.log`` values at ``fit_loop.epoch_loop._batches_that_stepped`` (the number of
    batches that ran an optimizer step so far); ``LearningRateMonitor`` logs at the same value. It equals
    ``trainer.global_step`` for one optimizer, and counts each batch once with several.
    """
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    value = getattr(epoch_loop, "_batches_that_stepped", None)
    return int(trainer.global_step if value is None else value)


def log_to_loggers(trainer: "pl.Trainer", metrics: Mapping[str, float], step: int) -> None:
    """Send ``metrics`` to every logger of the trainer at ``step`` (global rank zero only)."""
    if not metrics or not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=step)


def finite_max(a: float | None, b: float) -> float:
    """max(a, b) that ignores NaN (a peak should not be erased by a NaN sample; inf is kept)."""
    if a is None or math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return max(a, b)


def format_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Fixed-width text table: first column left-aligned, the others right-aligned."""
    rows = [list(header)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]

    def line(r: list[str]) -> str:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        return "  ".join(cells).rstrip()

    out = [line(rows[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows[1:]]
    return "\n".join(out)


def fmt(value: float | None) -> str:
    """Short number for tables: 3 significant digits, '-' when absent."""
    return "-" if value is None else f"{value:.3g}"


# --------------------------------------------------------------------------- argument checks


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int in [minimum, maximum], else raise ValueError naming ``name``."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    ok = ok and value >= minimum and (maximum is None or value <= maximum)
    if not ok:
        accepted = f"an int >= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"
        raise ValueError(f"`{name}` must be {accepted}, got {value!r}")
    return int(value)


def check_float(
    name: str, value: Any, *, above: float | None = None, below: float | None = None, accepted: str = ""
) -> float:
    """Return ``float(value)`` if it is a finite real number in the open interval (above, below)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (above is None or value > above) and (below is None or value < below)
    if not ok:
        raise ValueError(f"`{name}` must be {accepted or 'a finite number'}, got {value!r}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """Return ``value`` if it is one of ``choices``, else raise ValueError naming ``name``."""
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {choices}, got {value!r}")
    return value


def check_callable(name: str, value: Any, accepted: str) -> Callable[..., Any] | None:
    """Return ``value`` if it is None or callable, else raise ValueError naming ``name`` (``accepted``
    describes the call, e.g. ``"a callable name -> layer"``)."""
    if value is not None and not callable(value):
        raise ValueError(f"`{name}` must be {accepted} or None, got {value!r}")
    return value


def check_prefix(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value or value.endswith("/"):
        raise ValueError(f"`{name}` must be a non-empty string without a trailing '/', got {value!r}")
    return value
