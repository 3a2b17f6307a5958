"""Alert records and their delivery: log warning, Lightning loggers, W&B alerts, a user function, actions.

One :class:`Alert` per (signal, step, level rise). :class:`AlertDispatcher` delivers it

1. as a ``WARNING`` on the ``lightning_gproj.alerts`` logger (global rank zero),
2. to every attached Lightning logger as the metric ``alert/{signal}`` = 1 (warn) or 2 (critical) at the
   alert's step (``python -m lightning_gproj.report`` marks these), and, for a ``WandbLogger``, also
   through W&B's alert API (``run.alert``: e-mail / Slack as set up in the W&B user settings),
3. to an optional user function ``on_alert(alert)`` (every rank),
4. to the configured actions, for alerts at or above ``action_level``:

   ``"skip"``        drop the optimizer step whose gradients raised the alert: every gradient of that
                     optimizer is set to None in ``on_before_optimizer_step`` (after AMP unscaling, before
                     clipping and ``optimizer.step``), so the step leaves parameters and optimizer state
                     (moments, step counts) untouched; the step still counts in ``global_step`` and the
                     LR schedule. Counted and logged as ``{prefix}/skipped_steps``. Only alerts raised
                     before the optimizer step can skip it (both monitors under automatic optimization,
                     GradNormMonitor under manual optimization);
   ``"rollback"``    restore the model and optimizer state of the last good checkpoint this dispatcher
                     wrote and continue from the current step with the following batches (the LR
                     schedule keeps its position), the learning rates multiplied by
                     ``rollback_lr_factor``; counted and logged as ``{prefix}/rollbacks``. A good
                     checkpoint is written every ``rollback_every_n_steps`` steps at the end of a batch
                     while no detector of the monitor is in an alert episode (only when ``"rollback"``
                     is configured; the previous one is then deleted);
   ``"checkpoint"``  ``trainer.save_checkpoint(DIR/alert-step={step}.ckpt)``, DIR = ``checkpoint_dir`` or
                     ``{trainer.default_root_dir}/alert_checkpoints`` (good checkpoints go there too);
   ``"stop"``        ``trainer.should_stop = True`` (Lightning ends the fit after this batch);
   ``"remediate"``   switch the swapped attention of the alert's layers, from the next step, to
                     ``fix="gproj"`` (``remediation="gproj"``) or to fp32 attention
                     (``remediation="fp32"``: q, k, v upcast, SDPA in fp32, output cast back; sets
                     ``Site.compute_dtype``). Layers whose attention is not swapped cannot be switched;
                     that is logged once.

   All but ``"skip"`` run at the end of the batch (after the optimizer step, where ``ModelCheckpoint``
   saves too), in the order given.

Across ranks every action acts identically on every rank: the decision to act is taken from values
reduced across ranks (the monitors reduce before detecting), or, where a monitor could not reduce its
values (``agreed=False``), reduced itself (:func:`~lightning_gproj.callbacks.ranks.any_rank`: any rank
that wants to act makes every rank act). Collective actions (checkpoint, rollback) therefore line up.

A user function, a logger or an action that raises is logged once (per function/logger/action) with its
traceback and training goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import WandbLogger

from . import keys
from ._base import check_callable, check_choice, check_float, check_int
from .detectors import LEVELS, level_rank
from .ranks import any_rank

log = logging.getLogger("lightning_gproj.alerts")

#: Accepted ``actions``.
ACTIONS = ("checkpoint", "stop", "remediate", "skip", "rollback")
#: Accepted ``remediation`` targets.
REMEDIATIONS = ("gproj", "fp32")
#: W&B alert level per alert level.
_WANDB_LEVEL = {"warn": "WARN", "critical": "ERROR"}


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Alert":
        """The inverse of :meth:`as_dict`."""
        return cls(**{**d, "layers": tuple(d.get("layers", ()))})


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
    """Whether the swapped attention at module ``path`` concerns the alert's ``layer`` (a module path, a parameter
    group, or the name its calls are recorded under: ``<root>`` for the root module): one inside the other. The
    root module holds every layer."""
    if not path or not layer or layer == path:
        return True
    return layer.startswith(path + ".") or path.startswith(layer + ".")


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
    """Delivers alerts and runs actions (see the module docstring). Built by the monitors from their arguments.

    Args:
        source: name of the owning monitor (in messages).
        prefix: the owning monitor's metric prefix (for ``{prefix}/skipped_steps`` and ``{prefix}/rollbacks``).
        on_alert: ``f(alert) -> None`` called for every alert on every rank, or None.
        actions: any of :data:`ACTIONS`.
        action_level: lowest level that triggers the actions: ``"warn"`` or ``"critical"``.
        remediation: ``"gproj"`` or ``"fp32"`` (used by ``"remediate"``).
        checkpoint_dir: where ``"checkpoint"`` and ``"rollback"`` write (None:
            ``{default_root_dir}/alert_checkpoints``).
        rollback_every_n_steps: cadence of the good checkpoints ``"rollback"`` restores, in optimizer
            steps (int >= 1).
        rollback_lr_factor: every learning rate is multiplied by it at each rollback, the LR schedulers'
            ``base_lrs`` too, so that the schedule keeps the reduced scale (float in (0, 1]).

    State (:meth:`state_dict`, saved in the monitor's checkpoint state): the alerts so far, the action
    log, the skip and rollback counts and the last good checkpoint.

    Raises:
        ValueError: an argument outside the accepted values (the message names it).
    """

    def __init__(
        self,
        source: str,
        prefix: str,
        on_alert: Optional[Callable[[Alert], Any]] = None,
        actions: Sequence[str] = (),
        action_level: str = "critical",
        remediation: str = "gproj",
        checkpoint_dir: Optional[str] = None,
        rollback_every_n_steps: int = 100,
        rollback_lr_factor: float = 1.0,
    ) -> None:
        check_callable("on_alert", on_alert, "a callable alert -> None")
        if isinstance(actions, str) or not all(isinstance(a, str) and a in ACTIONS for a in actions):
            raise ValueError(f"`actions` must be a sequence of {ACTIONS}, got {actions!r}")
        check_choice("action_level", action_level, LEVELS)
        check_choice("remediation", remediation, REMEDIATIONS)
        if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise ValueError(f"`checkpoint_dir` must be a path or None, got {checkpoint_dir!r}")
        self.source = source
        self.prefix = prefix
        self.on_alert = on_alert
        self.actions = tuple(dict.fromkeys(actions))
        self.action_level = action_level
        self.remediation = remediation
        self.checkpoint_dir = checkpoint_dir
        self.rollback_every_n_steps = check_int("rollback_every_n_steps", rollback_every_n_steps, 1)
        self.rollback_lr_factor = check_float(
            "rollback_lr_factor", rollback_lr_factor, above=0.0, below=1.0 + 1e-12, accepted="a number in (0, 1]"
        )
        #: Every alert delivered, in order.
        self.alerts: list[Alert] = []
        #: ``(action, alert step, result)`` of every action run ("ok: ..." or "failed: ...").
        self.action_log: list[tuple[str, int, str]] = []
        #: Optimizer steps dropped by ``"skip"``.
        self.skipped_steps = 0
        #: Rollbacks done by ``"rollback"``.
        self.rollbacks = 0
        #: ``(step, path)`` of the last good checkpoint written for ``"rollback"``, or None.
        self.last_good: Optional[tuple[int, str]] = None
        self._pending: list[Alert] = []
        self._act_step: Optional[int] = None
        self._failed: set[str] = set()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "alerts": [a.as_dict() for a in self.alerts],
            "action_log": [list(entry) for entry in self.action_log],
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
            "last_good": None if self.last_good is None else list(self.last_good),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alerts = [Alert.from_dict(a) for a in state["alerts"]]
        self.action_log = [tuple(entry) for entry in state["action_log"]]
        self.skipped_steps = int(state["skipped_steps"])
        self.rollbacks = int(state["rollbacks"])
        self.last_good = None if state["last_good"] is None else (int(state["last_good"][0]), str(state["last_good"][1]))

    # ------------------------------------------------------------------ delivery

    def _report_failure(self, what: str, exc: BaseException) -> None:
        if what not in self._failed:
            self._failed.add(what)
            log.warning(
                "%s: %s raised %s: %s; training goes on (further failures of it are not reported).",
                self.source, what, type(exc).__name__, exc, exc_info=exc,
            )

    def _log_metrics(self, trainer: "pl.Trainer", metrics: dict[str, float], step: int) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            try:
                logger.log_metrics(metrics, step=step)
            except Exception as exc:  # noqa: BLE001
                self._report_failure(f"logger {type(logger).__name__}", exc)

    def _wandb_alert(self, trainer: "pl.Trainer", alert: Alert) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                try:
                    logger.experiment.alert(
                        title=f"{alert.source or 'monitor'}: {alert.signal} {alert.level}",
                        text=alert.message(),
                        level=_WANDB_LEVEL[alert.level],
                    )
                except Exception as exc:  # noqa: BLE001
                    self._report_failure("W&B alert", exc)

    def deliver(
        self,
        trainer: "pl.Trainer",
        alerts: Sequence[Alert],
        step: int,
        *,
        agreed: bool = True,
        optimizer: Optional[torch.optim.Optimizer] = None,
    ) -> None:
        """Warn, log, call the user function; decide on the actions; skip the optimizer step if asked.

        Call at every step the monitor measured, on every rank, even without alerts. ``agreed``: every
        rank computed the same alerts (reduced values, or one process); when False and the run is
        distributed, the decision to act is reduced across ranks here (a collective: every rank must
        call). ``optimizer``: the optimizer about to step (from ``on_before_optimizer_step``), which
        ``"skip"`` drops; None where the step is already done.
        """
        metrics: dict[str, float] = {}
        for alert in alerts:
            self.alerts.append(alert)
            name = keys.alert_key(alert.signal)
            metrics[name] = float(max(level_rank(alert.level), metrics.get(name, 0)))
            if trainer.is_global_zero:
                log.warning(alert.message())
                self._wandb_alert(trainer, alert)
            if self.on_alert is not None:
                try:
                    self.on_alert(alert)
                except Exception as exc:  # noqa: BLE001 - a user function must not stop training
                    self._report_failure("on_alert", exc)
        if metrics:
            self._log_metrics(trainer, metrics, step)
        if not self.actions:
            return
        acting = [a for a in alerts if level_rank(a.level) >= level_rank(self.action_level)]
        act = bool(acting)
        if not agreed:
            act = any_rank(trainer, act)
        if not act:
            return
        self._pending += acting
        self._act_step = step
        if "skip" in self.actions:
            self._run("skip", step, lambda: self._skip(trainer, optimizer, step))

    def _run(self, action: str, step: int, fn: Callable[[], str]) -> None:
        try:
            self.action_log.append((action, step, f"ok: {fn()}"))
        except Exception as exc:  # noqa: BLE001 - an action must not stop training by accident
            self.action_log.append((action, step, f"failed: {type(exc).__name__}: {exc}"))
            self._report_failure(f"action {action!r}", exc)

    def run_actions(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", step: int, quiet: bool) -> None:
        """At the end of the batch, on every rank: run the queued actions, then write a good checkpoint
        for ``"rollback"`` if one is due and ``quiet`` (no detector of the monitor in an alert episode)."""
        act_step, self._act_step = self._act_step, None
        pending, self._pending = self._pending, []
        if act_step is not None:
            for action in self.actions:
                if action != "skip":
                    self._run(action, act_step, lambda: getattr(self, f"_do_{action}")(trainer, pl_module, pending, act_step))
        elif "rollback" in self.actions and quiet and step % self.rollback_every_n_steps == 0:
            self._run("save good checkpoint", step, lambda: self._save_good(trainer, step))

    # ------------------------------------------------------------------ actions

    def _directory(self, trainer: "pl.Trainer") -> str:
        return os.fspath(self.checkpoint_dir or os.path.join(trainer.default_root_dir, "alert_checkpoints"))

    def _skip(self, trainer: "pl.Trainer", optimizer: Optional[torch.optim.Optimizer], step: int) -> str:
        if optimizer is None:
            if "skip: too late" not in self._failed and trainer.is_global_zero:
                self._failed.add("skip: too late")
                log.warning(
                    "%s: cannot skip step %d: its optimizer step is already done (an alert raised after the "
                    "step, e.g. under manual optimization); logged only", self.source, step,
                )
            return "too late"
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        self.skipped_steps += 1
        if trainer.is_global_zero:
            log.warning("%s: skipped the optimizer step of step %d (%d so far)", self.source, step, self.skipped_steps)
        self._log_metrics(trainer, {keys.metric(self.prefix, "skipped_steps"): float(self.skipped_steps)}, step)
        return "gradients dropped"

    def _save_good(self, trainer: "pl.Trainer", step: int) -> str:
        path = os.path.join(self._directory(trainer), f"good-{_sanitize(self.source)}-step={step}.ckpt")
        trainer.save_checkpoint(path)  # collective; rank zero writes, then a barrier
        previous, self.last_good = self.last_good, (step, path)
        if previous is not None and previous[1] != path:
            trainer.strategy.remove_checkpoint(previous[1])
        return path

    def _do_rollback(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", alerts: list[Alert], step: int
    ) -> str:
        if self.last_good is None:
            if trainer.is_global_zero:
                log.warning("%s: cannot roll back at step %d: no good checkpoint written yet", self.source, step)
            return "no good checkpoint yet"
        good_step, path = self.last_good
        strategy = trainer.strategy
        lrs = [[group["lr"] for group in opt.param_groups] for opt in trainer.optimizers]
        # As Lightning's own restore does (strategies that load in load_checkpoint make the two
        # load_* calls no-ops). Our own file, written by this run: not an untrusted pickle.
        checkpoint = strategy.load_checkpoint(path, weights_only=False)
        strategy.load_model_state_dict(checkpoint, strict=True)
        strategy.load_optimizer_state_dict(checkpoint)
        factor = self.rollback_lr_factor
        # The optimizer state brings back the learning rates of the good step; keep the schedule's
        # current ones instead, scaled.
        for opt, opt_lrs in zip(trainer.optimizers, lrs):
            for group, lr in zip(opt.param_groups, opt_lrs):
                group["lr"] = lr * factor
        if factor != 1.0:
            for config in trainer.lr_scheduler_configs:
                base = getattr(config.scheduler, "base_lrs", None)
                if base is not None:
                    config.scheduler.base_lrs = [b * factor for b in base]
        self.rollbacks += 1
        if trainer.is_global_zero:
            log.warning(
                "%s: rolled back to the good checkpoint of step %d after step %d (alert on %s); learning rates x%g",
                self.source, good_step, step, alerts[0].signal if alerts else "another rank", factor,
            )
        self._log_metrics(trainer, {keys.metric(self.prefix, "rollbacks"): float(self.rollbacks)}, step)
        return f"restored {path}"

    def _do_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", alerts: list[Alert], step: int
    ) -> str:
        path = os.path.join(self._directory(trainer), f"alert-step={step}.ckpt")
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            log.warning("%s: saved checkpoint %s", self.source, path)
        return path

    def _do_stop(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", alerts: list[Alert], step: int) -> str:
        trainer.should_stop = True
        if trainer.is_global_zero:
            log.warning("%s: stopping training after step %d (alert on %s)", self.source, step,
                        alerts[0].signal if alerts else "another rank")
        return "should_stop"

    def _do_remediate(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", alerts: list[Alert], step: int
    ) -> str:
        # No alert here (another rank's decision, unreduced values): every swapped layer.
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
