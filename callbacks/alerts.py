"""Alert records and their delivery: log warning, Lightning loggers, a user function, actions.

One :class:`Alert` per (signal, step, level rise). :class:`AlertDispatcher` delivers it

1. as a ``WARNING`` on the ``lightning_gproj.alerts`` logger (global rank zero),
2. to every attached Lightning logger as the metric ``alert/{signal}`` = 1 (warn) or 2 (critical) at the
   alert's step (``python -m lightning_gproj.report`` marks these),
3. to an optional user function ``on_alert(alert)`` (every rank),
4. to the configured actions, for alerts at or above ``action_level``, run at the end of the batch
   (after the optimizer step, where ``ModelCheckpoint`` saves too), on every rank — the monitors'
   values are identical on all ranks (DDP gradients are all-reduced, the zero-sum values are
   reduced), so every rank takes the same decision and collectives such as checkpointing line up:

   ``"checkpoint"``  ``trainer.save_checkpoint(DIR/alert-step={step}.ckpt)``, DIR = ``checkpoint_dir`` or
                     ``{trainer.default_root_dir}/alert_checkpoints``;
   ``"stop"``        ``trainer.should_stop = True`` (Lightning ends the fit after this batch);
   ``"remediate"``   switch the swapped attention of the alert's layers, from the next step, to
                     ``fix="gproj"`` (``remediation="gproj"``) or to fp32 attention
                     (``remediation="fp32"``: q, k, v upcast, SDPA in fp32, output cast back; sets
                     ``Site.compute_dtype``). Layers whose attention is not swapped cannot be switched;
                     that is logged once.

A user function or action that raises is logged once (per function/action) with its traceback and
training goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
import torch

from ._base import check_callable, check_choice
from .detectors import LEVELS, level_rank

log = logging.getLogger("lightning_gproj.alerts")

#: Accepted ``actions``.
ACTIONS = ("checkpoint", "stop", "remediate")
#: Accepted ``remediation`` targets.
REMEDIATIONS = ("gproj", "fp32")


@dataclasses.dataclass(frozen=True)
class Alert:
    """A detector fired.

    Attributes:
        step: optimizer step (Lightning's logging step axis) of the measurement.
        signal: the metric family, e.g. ``"grad_norm/global"`` or ``"gproj/leak_ratio"``.
        level: ``"warn"`` or ``"critical"``.
        statistic: what crossed its threshold: ``"ratio"``, ``"cusum"`` or ``"log_slope"``
            (see :mod:`lightning_gproj.callbacks.detectors`).
        value: that statistic's value; ``threshold``: the threshold it exceeded.
        layers: the layers driving it, strongest first (attention module paths for the zero-sum
            signals, parameter groups such as ``blocks.3`` for gradient norms).
        signal_value: the raw value of the signal at ``step`` (largest over ``layers``).
        source: the monitor that raised it.
        detail: a human-readable addition (e.g. the layers' shares of the gradient-norm rise).
    """

    step: int
    signal: str
    level: str
    statistic: str
    value: float
    threshold: float
    layers: tuple[str, ...] = ()
    signal_value: float = float("nan")
    source: str = ""
    detail: str = ""

    def message(self) -> str:
        layers = ", ".join(self.layers) if self.layers else "-"
        text = (
            f"{self.source or 'monitor'} {self.level.upper()} at step {self.step}: {self.signal} = "
            f"{self.signal_value:.4g}; {self.statistic} {self.value:.4g} > {self.threshold:.4g}; layers: {layers}"
        )
        return f"{text}. {self.detail}" if self.detail else text

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layers"] = list(self.layers)
        return d


def _sanitize(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text)


def attention_sites(module: torch.nn.Module) -> dict[str, Any]:
    """``{module path: Site}`` of the swapped attention inside ``module`` (not the keep-wrapped ones)."""
    from lightning_gproj.swap import sdpa  # no Triton: swap imports the op module only

    out = {}
    for path, m in module.named_modules():
        site = sdpa.swapped_site(m) or getattr(m, "_gproj_site", None)
        if site is not None and not site.keep:
            out[path] = site
    return out


def _matches(path: str, layer: str) -> bool:
    if layer == path:
        return True
    if path and layer.startswith(path + "."):
        return True
    return path.startswith(layer + ".") if layer else True


def remediate(module: torch.nn.Module, layers: Sequence[str], remediation: str) -> list[str]:
    """Switch the swapped attention of ``layers`` (all swapped layers when empty) inside ``module``:
    ``"gproj"`` sets ``site.fix = "gproj"``, ``"fp32"`` sets ``site.compute_dtype = torch.float32``.
    Returns the paths switched (those already in that state included)."""
    check_choice("remediation", remediation, REMEDIATIONS)
    switched = []
    for path, site in attention_sites(module).items():
        if layers and not any(_matches(path, layer) for layer in layers):
            continue
        if remediation == "gproj":
            site.fix = "gproj"
        else:
            site.compute_dtype = torch.float32
        switched.append(path)
    return switched


class AlertDispatcher:
    """Delivers alerts (see the module docstring). Built by the monitors from their arguments.

    Args:
        source: name of the owning monitor (in messages).
        on_alert: ``f(alert) -> None`` called for every alert on every rank, or None.
        actions: any of :data:`ACTIONS`.
        action_level: lowest level that triggers the actions: ``"warn"`` or ``"critical"``.
        remediation: ``"gproj"`` or ``"fp32"`` (used by ``"remediate"``).
        checkpoint_dir: where ``"checkpoint"`` writes (None: ``{default_root_dir}/alert_checkpoints``).

    Raises:
        ValueError: an argument outside the accepted values (the message names it).
    """

    def __init__(
        self,
        source: str,
        on_alert: Optional[Callable[[Alert], Any]] = None,
        actions: Sequence[str] = (),
        action_level: str = "critical",
        remediation: str = "gproj",
        checkpoint_dir: Optional[str] = None,
    ) -> None:
        check_callable("on_alert", on_alert, "a callable alert -> None")
        if isinstance(actions, str) or not all(isinstance(a, str) and a in ACTIONS for a in actions):
            raise ValueError(f"`actions` must be a sequence of {ACTIONS}, got {actions!r}")
        check_choice("action_level", action_level, LEVELS)
        check_choice("remediation", remediation, REMEDIATIONS)
        if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise ValueError(f"`checkpoint_dir` must be a path or None, got {checkpoint_dir!r}")
        self.source = source
        self.on_alert = on_alert
        self.actions = tuple(dict.fromkeys(actions))
        self.action_level = action_level
        self.remediation = remediation
        self.checkpoint_dir = checkpoint_dir
        #: Every alert delivered, in order.
        self.alerts: list[Alert] = []
        #: ``(action, alert step, result)`` of every action run ("ok: ..." or "failed: ...").
        self.action_log: list[tuple[str, int, str]] = []
        self._pending: list[Alert] = []
        self._failed: set[str] = set()

    def _report_failure(self, what: str, exc: BaseException) -> None:
        if what not in self._failed:
            self._failed.add(what)
            log.warning(
                "%s: %s raised %s: %s; training goes on (further failures of it are not reported).",
                self.source, what, type(exc).__name__, exc, exc_info=exc,
            )

    def deliver(self, trainer: "pl.Trainer", alerts: Sequence[Alert]) -> None:
        """Warn, log to the loggers, call the user function; queue actions for :meth:`run_actions`."""
        if not alerts:
            return
        metrics: dict[str, float] = {}
        for alert in alerts:
            self.alerts.append(alert)
            metrics[f"alert/{alert.signal}"] = float(max(level_rank(alert.level), metrics.get(f"alert/{alert.signal}", 0)))
            if trainer.is_global_zero:
                log.warning(alert.message())
            if self.on_alert is not None:
                try:
                    self.on_alert(alert)
                except Exception as exc:  # noqa: BLE001 - a user function must not stop training
                    self._report_failure("on_alert", exc)
            if self.actions and level_rank(alert.level) >= level_rank(self.action_level):
                self._pending.append(alert)
        if trainer.is_global_zero:
            step = alerts[0].step
            for logger in trainer.loggers:
                try:
                    logger.log_metrics(metrics, step=step)
                except Exception as exc:  # noqa: BLE001
                    self._report_failure(f"logger {type(logger).__name__}", exc)

    def run_actions(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Run the queued actions (call at the end of the batch, on every rank)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        for action in self.actions:
            try:
                result = getattr(self, f"_do_{action}")(trainer, pl_module, pending)
                self.action_log.append((action, pending[0].step, f"ok: {result}"))
            except Exception as exc:  # noqa: BLE001 - an action must not stop training by accident
                self.action_log.append((action, pending[0].step, f"failed: {type(exc).__name__}: {exc}"))
                self._report_failure(f"action {action!r}", exc)

    # ------------------------------------------------------------------ actions

    def _do_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", alerts: list[Alert]) -> str:
        directory = self.checkpoint_dir or os.path.join(trainer.default_root_dir, "alert_checkpoints")
        path = os.path.join(os.fspath(directory), f"alert-step={alerts[0].step}.ckpt")
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            log.warning("%s: saved checkpoint %s", self.source, path)
        return path

    def _do_stop(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", alerts: list[Alert]) -> str:
        trainer.should_stop = True
        if trainer.is_global_zero:
            log.warning("%s: stopping training after step %d (alert on %s)", self.source, alerts[0].step, alerts[0].signal)
        return "should_stop"

    def _do_remediate(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", alerts: list[Alert]) -> str:
        layers = sorted({layer for alert in alerts for layer in alert.layers})
        switched = remediate(pl_module, layers, self.remediation)
        if trainer.is_global_zero:
            if switched:
                log.warning(
                    "%s: attention of %s switched to %s from the next step",
                    self.source, ", ".join(p or "<root>" for p in switched),
                    "fix='gproj'" if self.remediation == "gproj" else "fp32",
                )
            elif "remediate: nothing swapped" not in self._failed:
                self._failed.add("remediate: nothing swapped")
                log.warning(
                    "%s: cannot remediate %s: no swapped attention there (use GProjPlugin / swap_attention)",
                    self.source, ", ".join(layers) or "the model",
                )
        return ", ".join(switched) or "nothing swapped"
