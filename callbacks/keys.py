"""Metric keys of the monitors, built and parsed here and nowhere else.

Layouts (``{p}``: a monitor's ``prefix``; ``{layer}``: a module path or ``stats_name``):

``{p}/{layer}/{stat}``
    a per-layer statistic of :class:`~lightning_gproj.callbacks.ZeroSumMonitor` (``stat`` one of its
    ``STATISTICS``);
``{p}/{layer}/{stat}/{detector}``
    a detector statistic of that series, ``detector`` in :data:`DETECTOR_STATS`;
``{p}/global``, ``{p}/layer/{layer}``, ``{p}/loss``, ``{p}/{name}``
    :class:`~lightning_gproj.callbacks.GradNormMonitor`'s series (``{p}/loss/{detector}`` for the loss);
``{p}/skipped_steps``, ``{p}/rollbacks``
    counters of the ``"skip"`` and ``"rollback"`` actions;
``alert/{signal}``
    an alert's level (1 warn, 2 critical) at its step; ``signal`` is ``{p}/{stat}``, ``{p}/global`` or
    ``{p}/loss``.

Used by the monitors (online), ``lightning_gproj.evaluate`` (offline replay) and
``lightning_gproj.report`` (dashboard).
"""

from __future__ import annotations

from typing import Optional

#: Detector statistics logged beside a detected series (``{key}/{detector}``).
DETECTOR_STATS = ("cusum", "ratio")
_ALERT = "alert/"


def metric(prefix: str, *parts: str) -> str:
    """``{prefix}/{part}/...``."""
    return "/".join((prefix, *parts))


def detector_key(key: str, detector: str) -> str:
    """``{key}/{detector}``: the detector statistic ``detector`` (one of :data:`DETECTOR_STATS`) of ``key``."""
    if detector not in DETECTOR_STATS:
        raise ValueError(f"`detector` must be one of {DETECTOR_STATS}, got {detector!r}")
    return f"{key}/{detector}"


def is_detector_key(key: str) -> bool:
    return key.rpartition("/")[2] in DETECTOR_STATS


def parse_layer_key(prefix: str, key: str) -> Optional[tuple[str, str]]:
    """``(layer, stat)`` of ``{prefix}/{layer}/{stat}``; None for any other key (detector keys included)."""
    head = prefix + "/"
    if not key.startswith(head) or is_detector_key(key):
        return None
    layer, _, stat = key[len(head):].rpartition("/")
    if not layer or not stat:
        return None
    return layer, stat


def alert_key(signal: str) -> str:
    return _ALERT + signal


def parse_alert_key(key: str) -> Optional[str]:
    """The signal of ``alert/{signal}``, else None."""
    return key[len(_ALERT):] if key.startswith(_ALERT) else None
