"""GradNormMonitor: global and per-layer gradient norms against a robust baseline (DESIGN.md §8).

Where it reads the gradients: ``on_before_optimizer_step``. In lightning 2.6.6 the precision plugin runs
the closure (forward + backward), then — for ``16-mixed`` — ``scaler.unscale_(optimizer)``, then the
``on_before_optimizer_step`` hooks, then gradient clipping, then ``optimizer.step``
(``plugins/precision/amp.py: MixedPrecision.optimizer_step`` and ``precision.py: _after_closure``). So
the hook sees the unscaled, unclipped gradients of the whole (accumulated) step; the tests check both.

Detection (:class:`~lightning_gproj.callbacks.detectors.ChangeDetector`, the same code that
``lightning_gproj.evaluate`` replays offline): robust ratio to the median of the window, CUSUM of the
robust z-score of log ‖g‖, log-slope growth; warn and critical levels; each alert names the layers whose
squared norm rose most. Alerts go through :class:`~lightning_gproj.callbacks.alerts.AlertDispatcher`.
:meth:`GradNormMonitor.observe` and :meth:`GradNormMonitor.observe_loss` are the pure detection steps
(no Trainer needed).

The training loss goes through the same detector (``loss_detector``): it is read in
``on_before_backward`` (the loss each backward starts from, divided by the GradScaler's scale under
``16-mixed``, summed over the micro-batches of the step: Lightning divides each by
``accumulate_grad_batches``), kept on the device, and copied to the host together with the norms.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from . import keys
from .alerts import Alert, AlertDispatcher
from .detectors import MAD_TO_STD, ChangeDetector, Detection, DetectorConfig, RobustBaseline, as_config
from .ranks import max_norms_mean_loss

from ._base import (
    Monitor,
    check_bool,
    check_callable,
    check_int,
    check_prefix,
    finite_max,
    fmt,
    format_table,
    guarded,
    log_to_loggers,
    step_index,
)
from ._sharded import Layout, clean_name, fsdp1_layouts, layout_of, squared_norm, sum_over_shards

def default_layer_of(name: str) -> str:
    """Group a parameter name into a layer: up to the first all-digit component, else its module.

    ``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3`` (a block of a ModuleList);
    ``model.layers.12.mlp.up_proj.weight`` -> ``model.layers.12``; ``transformer.wte.weight`` ->
    ``transformer.wte``; ``lm_head.weight`` -> ``lm_head``; a top-level parameter ``pos`` -> ``pos``.
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


@dataclasses.dataclass(frozen=True)
class GradNormStep:
    """One measurement, compared with the baseline built from the steps before it."""

    step: int
    optimizer: int
    norm: float
    layers: dict[str, float]
    median: float | None
    mad: float | None
    ema: float | None
    window: int
    layer_medians: dict[str, float | None]

    @property
    def ratio(self) -> float | None:
        """norm / baseline median (None without a baseline)."""
        return None if not self.median else self.norm / self.median


@dataclasses.dataclass
class _SeriesStats:
    """Last and peak value of a monitored series, and counts."""

    last: float | None = None
    peak: float | None = None
    peak_step: int | None = None
    steps: int = 0
    steps_above: int = 0
    nonfinite_steps: int = 0
    alerts: int = 0

    def add(self, step: int, value: float, detection: Detection, alerted: bool) -> None:
        self.steps += 1
        self.last = value
        if math.isfinite(value):
            if self.peak is None or value > self.peak:
                self.peak, self.peak_step = value, step
        else:
            self.nonfinite_steps += 1
        if detection.level is not None:
            self.steps_above += 1
        if alerted:
            self.alerts += 1


@dataclasses.dataclass
class _OptimizerState:
    """One optimizer's series: its gradient norms and (None with ``loss=False``) the loss it stepped on."""

    detector: ChangeDetector
    stats: _SeriesStats
    layer_baselines: dict[str, RobustBaseline]
    loss_detector: Optional[ChangeDetector]
    loss_stats: _SeriesStats = dataclasses.field(default_factory=_SeriesStats)
    layer_last: dict[str, float] = dataclasses.field(default_factory=dict)
    layer_peak: dict[str, float] = dataclasses.field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state_dict(),
            "stats": dataclasses.asdict(self.stats),
            "layer_baselines": {k: b.state_dict() for k, b in self.layer_baselines.items()},
            "layer_last": dict(self.layer_last),
            "layer_peak": dict(self.layer_peak),
            "loss": None if self.loss_detector is None else {
                "detector": self.loss_detector.state_dict(), "stats": dataclasses.asdict(self.loss_stats),
            },
        }

    def load_loss(self, state: Optional[dict[str, Any]]) -> None:
        if self.loss_detector is not None and state is not None:
            self.loss_detector.load_state_dict(state["detector"])
            self.loss_stats = _SeriesStats(**state["stats"])


#: Default detector of the global gradient norm (per measured step).
GRAD_NORM_DETECTOR = DetectorConfig(
    window=100, warmup=100, warn_ratio=4.0, critical_ratio=10.0, cusum_warn=25.0, cusum_drift=1.0,
    min_log_sigma=0.02, slope_window=100, slope_horizon=100,
)
#: Default detector of the training loss: critical at 3x the median of the last 100 steps, which is
#: Lightning's ``SpikeDetection`` default (``rtol=2``: |loss − mean| >= 2 · mean); warn at 1.5x or on a
#: sustained rise (CUSUM).
LOSS_DETECTOR = DetectorConfig(
    window=100, warmup=100, warn_ratio=1.5, critical_ratio=3.0, cusum_warn=25.0, cusum_drift=1.0,
    min_log_sigma=0.02, slope_window=100, slope_horizon=100,
)


class GradNormMonitor(Monitor):
    """Log gradient norms, track them against a robust baseline, and alert before they blow up.

    Every ``every_n_steps`` optimizer steps, in ``on_before_optimizer_step`` (after AMP unscaling,
    before gradient clipping; see the module docstring), over the parameters that optimizer steps:

    ``{p}/global``
        ‖g‖₂, the L2 norm of all their gradients (per-tensor norms in fp32, squares summed in fp64).
        Units of the loss per unit of parameter; the same quantity ``clip_grad_norm_`` clips.
    ``{p}/layer/{layer}``
        ‖g‖₂ of the parameters of one layer. Layers are groups of parameter names given by
        ``layer_of`` (default :func:`default_layer_of`: the top-level block, e.g. ``transformer.h.3``,
        or the owning module for parameters outside numbered blocks, e.g. ``transformer.wte``).
    ``{p}/baseline_median``, ``{p}/baseline_mad``
        Median and median absolute deviation (unscaled) of the global norm over the last ``window``
        measured steps before this one (finite values only). Same units as ``{p}/global``.
    ``{p}/ratio``
        ``global / baseline_median``. Dimensionless. Alerts above ``detector.warn_ratio`` /
        ``detector.critical_ratio``.
    ``{p}/robust_z``
        ``(global − median) / (1.4826 · MAD)``, a robust z-score (absent while MAD is 0).
    ``{p}/ema_ratio``
        ``global / EMA`` with the EMA (decay ``ema_decay``) of the previous measured norms: a shorter
        memory than the window. Dimensionless.
    ``{p}/cusum``
        One-sided CUSUM of the robust z-score of log ‖g‖ (allowance ``detector.cusum_drift``), in robust σ.
        Alerts above ``detector.cusum_warn`` / ``detector.cusum_critical``.
    ``{p}/log_slope``
        Growth factor of ‖g‖ per ``slope_horizon`` steps, from a least-squares fit of log ‖g‖ over
        the last ``slope_window`` measured steps. Alerts above ``slope_warn`` / ``slope_critical``.
    ``{p}/warnings``
        Alerts of this optimizer's gradient-norm detector so far (cumulative count, both levels; the loss
        detector's alerts are not counted here, see :attr:`alerts` and the summary's loss row).
    ``{p}/loss``, ``{p}/loss/ratio``, ``{p}/loss/cusum``
        The training loss of the step (see the module docstring: the sum over its micro-batches of the
        loss each backward started from, mean over ranks), its ratio to the median of the last
        ``loss_detector.window`` measured losses and its CUSUM; with ``loss=False``, absent.
        Alert signal ``{p}/loss``: what Lightning's ``SpikeDetection`` watches, through the same
        detector and actions (``actions=("skip",)`` drops a spiking step instead of raising). Units of
        the loss. A loss <= 0 is logged but kept out of the detector (it works on log(loss)).

    With several optimizers the names get ``opt{i}/`` after the prefix (``{p}/opt1/global``, ``{p}/opt1/loss``) and each
    optimizer has its own detectors; optimizer i's loss is the loss backpropagated since the optimizer step before
    its own (in a GAN's manual loop, the discriminator's loss and the generator's: two series, not one that
    alternates between them). ``{p}`` is ``prefix``. Values go to ``trainer.loggers`` at the
    measured step on global rank zero (see ``callbacks/_base.py`` for why not ``self.log``); with
    ``every_n_steps=1`` that is every step, whatever ``Trainer(log_every_n_steps)`` says.

    Alerts (:class:`~lightning_gproj.callbacks.alerts.Alert`, signal ``{p}/global``): the detector of
    :mod:`~lightning_gproj.callbacks.detectors` on the global norm, once ``warmup`` finite norms are in
    the window; one alert per level rise within an episode. It names the ``top_k`` layers whose squared
    norm rose most over their own baseline median, with their share of the rise of ‖g‖². Delivered by
    :class:`~lightning_gproj.callbacks.alerts.AlertDispatcher` (log warning on rank zero, every logger as
    ``alert/{p}/global``, ``on_alert``, ``actions``). Every alert is kept in :attr:`alerts`. Non-finite
    norms (e.g. fp16 overflow steps that the GradScaler skips) are logged, counted, kept out of the
    baseline and never alert.

    Across ranks (``sync_dist=True``): the per-tensor norms, the loss and their presence flags are
    gathered with one device-side ``all_gather`` before the single device → host copy the monitor
    makes anyway, then reduced — norms by their maximum over ranks (after DDP's all-reduce the
    gradients, hence the norms, are the same on every rank, so this changes nothing there but makes
    every rank see one series), the loss by its mean. Every rank then runs the same detectors on the
    same numbers, raises the same alerts and takes the same actions. ``sync_dist=False`` skips the
    gather; each rank then detects on its own values and the decision to act, when actions are
    configured, is reduced across ranks at every measured step (``reduce_boolean_decision``: one more
    collective and host sync per measured step). Sharded gradients (FSDP2 / DTensor, FSDP1 with
    ``use_orig_params=True``) give the same global norms on every rank: the local squares are summed
    over the shard group in one ``all_reduce`` first (``callbacks/_sharded.py``). FSDP1 with
    ``use_orig_params=False``: right global norm, no per-layer names. DeepSpeed ZeRO-2/3: not supported.
    Under DDP an error in this monitor on one rank only can leave the other ranks waiting in a collective.

    Never stops training by accident: an exception in a hook is reported once as a
    :class:`~lightning_gproj.callbacks.MonitorDisabledWarning` and the monitor switches itself off; a
    failing ``on_alert`` or action is logged once and ignored. At the end of training rank zero prints
    :meth:`summary`.

    State: :meth:`state_dict` holds every detector (baselines, CUSUM, episodes), the per-layer
    baselines, the counters and the alerts, so a run resumed from a Lightning checkpoint raises the
    same alerts at the same steps as an uninterrupted one (``state_key`` includes ``prefix``).

    Args:
        every_n_steps: measure every N optimizer steps (int >= 1); the baseline sees only these steps.
        detector: detector settings of the global norm (:class:`DetectorConfig`, windows in measured
            steps; default :data:`GRAD_NORM_DETECTOR`). Its ``window`` and ``ema_decay`` also set the
            per-layer baselines.
        loss: watch the training loss (bool).
        loss_detector: detector settings of the training loss (default :data:`LOSS_DETECTOR`).
        top_k: layers named in an alert (int >= 1).
        log_layers: log the per-layer norms (bool).
        layer_of: ``name -> layer`` grouping of parameter names (callable or None for the default).
        prefix: metric name prefix (non-empty str, no trailing '/').
        sync_dist: reduce the values over ranks before detecting (bool; see "Across ranks").
        print_summary: print the summary table at the end of training (bool).
        on_alert, actions, action_level, remediation, checkpoint_dir, rollback_every_n_steps,
            rollback_lr_factor: alert delivery and actions, see
            :class:`~lightning_gproj.callbacks.alerts.AlertDispatcher`.

    Raises:
        ValueError: an argument outside the accepted values (the message names it).
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        *,
        detector: DetectorConfig = GRAD_NORM_DETECTOR,
        loss: bool = True,
        loss_detector: DetectorConfig = LOSS_DETECTOR,
        top_k: int = 3,
        log_layers: bool = True,
        layer_of: Callable[[str], str] | None = None,
        prefix: str = "grad_norm",
        sync_dist: bool = True,
        print_summary: bool = True,
        on_alert: Optional[Callable[[Alert], Any]] = None,
        actions: Sequence[str] = (),
        action_level: str = "critical",
        remediation: str = "gproj",
        checkpoint_dir: Optional[str] = None,
        rollback_every_n_steps: int = 100,
        rollback_lr_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.every_n_steps = check_int("every_n_steps", every_n_steps, 1)
        self.detector = as_config("detector", detector, GRAD_NORM_DETECTOR)
        self.loss = check_bool("loss", loss)
        self.loss_detector = as_config("loss_detector", loss_detector, LOSS_DETECTOR)
        self.top_k = check_int("top_k", top_k, 1)
        self.log_layers = check_bool("log_layers", log_layers)
        check_callable("layer_of", layer_of, "a callable name -> layer")
        self.layer_of = default_layer_of if layer_of is None else layer_of
        self.prefix = check_prefix("prefix", prefix)
        self.sync_dist = check_bool("sync_dist", sync_dist)
        self.print_summary = check_bool("print_summary", print_summary)
        self.dispatcher = AlertDispatcher(
            type(self).__name__, self.prefix, on_alert, actions, action_level, remediation, checkpoint_dir,
            rollback_every_n_steps, rollback_lr_factor,
        )
        self._states: dict[int, _OptimizerState] = {}
        self._loss: torch.Tensor | None = None  # sum of this step's backward losses, on the device
        self._loss_nonpositive_warned = False
        self._loss_nonfinite_warned = False
        # Per fit (on_train_start clears them: a monitor reused on another model must not keep the first one's names)
        self._layer_names: dict[int, str] = {}  # id(param) -> layer
        self._fsdp1: Optional[dict[int, Layout]] = None  # id(param) -> Layout of FSDP1-sharded parameters

    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix)

    @property
    def alerts(self) -> list[Alert]:
        """Every alert raised, in order."""
        return self.dispatcher.alerts

    # ------------------------------------------------------------------ state (checkpoints)

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizers": {str(i): s.state_dict() for i, s in self._states.items()},
            "dispatcher": self.dispatcher.state_dict(),
        }

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        self._states = {}
        for idx, s in state_dict["optimizers"].items():
            state = self._new_state()
            state.detector.load_state_dict(s["detector"])
            state.stats = _SeriesStats(**s["stats"])
            for layer, b in s["layer_baselines"].items():
                state.layer_baselines.setdefault(layer, self._layer_baseline()).load_state_dict(b)
            state.layer_last, state.layer_peak = dict(s["layer_last"]), dict(s["layer_peak"])
            state.load_loss(s.get("loss"))
            self._states[int(idx)] = state
        if state_dict.get("loss") is not None:  # a checkpoint of 2026-12-03 or before: one loss series, optimizer 0's
            self._state(0).load_loss(state_dict["loss"])
        self.dispatcher.load_state_dict(state_dict["dispatcher"])

    def _new_state(self) -> _OptimizerState:
        return _OptimizerState(ChangeDetector(self.detector), _SeriesStats(), {},
                               ChangeDetector(self.loss_detector) if self.loss else None)

    def _state(self, opt_idx: int) -> _OptimizerState:
        state = self._states.get(opt_idx)
        if state is None:
            state = self._states[opt_idx] = self._new_state()
        return state

    def _layer_baseline(self) -> RobustBaseline:
        return RobustBaseline(self.detector.window, self.detector.ema_decay)

    def quiet(self) -> bool:
        """No detector of this monitor is in an alert episode."""
        detectors = [d for s in self._states.values() for d in (s.detector, s.loss_detector) if d is not None]
        return all(d.level is None for d in detectors)

    # ------------------------------------------------------------------ measurement

    def _layers_by_param(self, pl_module: "pl.LightningModule") -> dict[int, str]:
        if not self._layer_names:
            self._layer_names = {id(p): self.layer_of(clean_name(n)) for n, p in pl_module.named_parameters()}
        return self._layer_names

    def measure(
        self,
        pl_module: "pl.LightningModule",
        optimizer: torch.optim.Optimizer,
        model: Optional[torch.nn.Module] = None,
    ) -> tuple[float, dict[str, float]]:
        """(global norm, {layer: norm}) of the current gradients of ``optimizer``'s parameters.

        Sharded gradients (FSDP1 units found in ``model``, default ``pl_module``; DTensors) are reduced over
        their ranks (``callbacks/_sharded.py``): a collective that every rank must reach. A layer none of
        whose parameters has a gradient on any rank is left out."""
        norm, layers, _ = self._measure(pl_module, optimizer, model)
        return norm, layers

    def _measure(
        self,
        pl_module: "pl.LightningModule",
        optimizer: torch.optim.Optimizer,
        model: Optional[torch.nn.Module] = None,
        loss: torch.Tensor | None = None,
        trainer: "pl.Trainer | None" = None,
    ) -> tuple[float, dict[str, float], float | None]:
        """:meth:`measure` and the loss (None stays None) with one device → host copy; with ``trainer``
        distributed and ``sync_dist``, reduced across ranks first (see the class docstring)."""
        layer_by_param = self._layers_by_param(pl_module)
        if self._fsdp1 is None:
            self._fsdp1 = fsdp1_layouts(model if model is not None else pl_module)
        params = list({id(p): p for group in optimizer.param_groups for p in group["params"]}.values())
        if not params:  # the same on every rank: no collective is skipped on one rank only
            return math.nan, {}, None
        device = params[0].device
        # One (square, present) row per parameter, a missing gradient included as (0, 0), so that every
        # rank holds the same rows in the same order (the reductions below need it); the loss last.
        rows, groups = [], []
        for p in params:
            layout = layout_of(p, self._fsdp1)
            rows.append(squared_norm(p.grad, layout, device))
            groups.append(layout.groups)
        one = torch.ones((), dtype=torch.float64, device=device)
        rows.append(torch.zeros(2, dtype=torch.float64, device=device) if loss is None
                    else torch.stack([loss.detach().to(device, torch.float64).reshape(()), one]))
        groups.append(())
        table = sum_over_shards(torch.stack(rows), groups)
        n = len(params)
        if trainer is not None and self.sync_dist and trainer.world_size > 1:
            table = max_norms_mean_loss(trainer.strategy, table)
        host = table.cpu().tolist()  # the one device -> host copy
        sq: dict[str, float] = {}
        for p, (square, present) in zip(params, host[:n]):
            if present:
                layer = layer_by_param.get(id(p), "<unnamed>")
                sq[layer] = sq.get(layer, 0.0) + square
        loss_out = host[n][0] if host[n][1] else None
        if not sq:
            return math.nan, {}, loss_out
        return math.sqrt(sum(sq.values())), {layer: math.sqrt(v) for layer, v in sq.items()}, loss_out

    # ------------------------------------------------------------------ detection (online and offline)

    def _signal(self, opt_idx: int, several: bool) -> str:
        return keys.metric(self.prefix, f"opt{opt_idx}") if several else self.prefix

    def observe(
        self, step: int, norm: float, layers: dict[str, float], opt_idx: int = 0, several: bool = False
    ) -> tuple[GradNormStep, Detection, list[Alert]]:
        """Feed one measurement to the detector of optimizer ``opt_idx``: returns the measurement
        against its past, the detector's verdict, and the new alerts (not delivered). Pure bookkeeping:
        the same call replays logged norms offline (``lightning_gproj.evaluate``)."""
        state = self._state(opt_idx)
        base = state.detector.baseline
        m = GradNormStep(
            step=step,
            optimizer=opt_idx,
            norm=norm,
            layers=layers,
            median=base.median,
            mad=base.mad,
            ema=base.ema,
            window=len(base),
            layer_medians={k: (b.median if (b := state.layer_baselines.get(k)) else None) for k in layers},
        )
        detection = state.detector.update(step, norm)
        alerts = []
        if detection.new:
            drivers = self.drivers(m)
            parts = []
            for layer, lnorm, growth, share in drivers:
                g = "" if growth is None else f", {growth:.3g}x its median"
                parts.append(f"{layer} ({lnorm:.3g}{g}, {share:.0%} of the rise in |g|^2)")
            opt = f" (optimizer {opt_idx})" if several else ""
            detail = (
                f"Gradient norm{opt} {norm:.4g} vs baseline median {m.median:.4g} (MAD {m.mad:.3g}, last "
                f"{m.window} steps). Largest increases: {'; '.join(parts) or 'n/a'}."
            )
            alerts.append(Alert(
                step=step, signal=f"{self._signal(opt_idx, several)}/global", level=detection.level,
                statistic=detection.statistic, value=detection.score, threshold=detection.threshold,
                layers=tuple(d[0] for d in drivers), signal_value=norm, source=type(self).__name__, detail=detail,
            ))
        state.stats.add(step, norm, detection, bool(alerts))
        for layer, value in layers.items():
            state.layer_baselines.setdefault(layer, self._layer_baseline()).update(value)
            state.layer_last[layer] = value
            state.layer_peak[layer] = finite_max(state.layer_peak.get(layer), value)
        return m, detection, alerts

    def drivers(self, m: GradNormStep) -> list[tuple[str, float, float | None, float]]:
        """The ``top_k`` layers whose squared norm rose most over their own baseline median:
        ``(layer, norm, norm / own median, share of the rise of ‖g‖²)``."""
        rises = []
        for layer, norm in m.layers.items():
            med = m.layer_medians.get(layer)
            base = med if med is not None else 0.0
            rises.append((norm * norm - base * base, layer, norm, (norm / med) if med else None))
        total_rise = m.norm**2 - (m.median or 0.0) ** 2
        rises.sort(key=lambda r: r[0], reverse=True)
        return [
            (layer, norm, growth, rise / total_rise if total_rise > 0 else math.nan)
            for rise, layer, norm, growth in rises[: self.top_k]
        ]

    def observe_loss(self, step: int, loss: float, opt_idx: int = 0, several: bool = False
                     ) -> tuple[Detection, list[Alert]]:
        """Feed one training loss to the loss detector of optimizer ``opt_idx`` (``loss`` must be on): its verdict
        and the new alerts (not delivered). Offline as online (``lightning_gproj.evaluate``)."""
        if not self.loss:
            raise ValueError("observe_loss needs the loss series (loss=False switched it off)")
        state = self._state(opt_idx)
        base = state.loss_detector.baseline
        median, window = base.median, len(base)
        if math.isfinite(loss) and loss <= 0:
            # The detector works on log(value): a loss that can be zero or negative is not its kind of
            # series. Reported, kept out of the baseline, never alerted on (like a non-finite value).
            if not self._loss_nonpositive_warned:
                self._loss_nonpositive_warned = True
                rank_zero_info(f"GradNormMonitor: loss {loss:.4g} <= 0 at step {step}: the loss detector "
                               "only follows positive losses; such steps are left out (pass loss=False "
                               "for a loss that can be negative)")
            detection = Detection(step, loss, window, median, base.mad)
            state.loss_stats.add(step, loss, detection, False)
            return detection, []
        if not math.isfinite(loss) and not self._loss_nonfinite_warned:
            # Never an alert (a non-finite value has no log to compare), but never silent either: a NaN or inf
            # loss is where a divergence ends (a new-user pass found the run going NaN without a word).
            self._loss_nonfinite_warned = True
            rank_zero_warn(f"GradNormMonitor: the training loss is {loss} at step {step}: the run has diverged or "
                           "overflowed. Non-finite values never alert (docs/monitoring.md); later ones are counted in "
                           "the summary's non-finite column")
        detection = state.loss_detector.update(step, loss)
        alerts = []
        if detection.new:
            opt = f" (optimizer {opt_idx})" if several else ""
            alerts.append(Alert(
                step=step, signal=keys.metric(self._signal(opt_idx, several), "loss"), level=detection.level,
                statistic=detection.statistic, value=detection.score, threshold=detection.threshold,
                signal_value=loss, source=type(self).__name__,
                detail=f"Training loss{opt} {loss:.4g} vs baseline median {median:.4g} (last {window} steps).",
            ))
        state.loss_stats.add(step, loss, detection, bool(alerts))
        return detection, alerts

    # ------------------------------------------------------------------ hooks

    @guarded
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        if not self.loss:
            return
        loss = loss.detach()
        # Under 16-mixed Lightning hands the hooks the loss already multiplied by the GradScaler's scale.
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            scale = scaler._get_scale_async()  # the scale as a device tensor: dividing by it needs no sync
            loss = loss / (scaler.get_scale() if scale is None else scale.to(loss.device))
        self._loss = loss if self._loss is None else self._loss + loss

    @guarded
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        step = step_index(trainer)
        loss, self._loss = self._loss, None
        if step % self.every_n_steps:
            return
        opt_idx = next((i for i, o in enumerate(trainer.optimizers) if o is optimizer), 0)
        norm, layers, loss_value = self._measure(pl_module, optimizer, trainer.model, loss, trainer)
        several = len(trainer.optimizers) > 1
        alerts: list[Alert] = []
        metrics: dict[str, float] = {}
        if layers:
            m, detection, alerts = self.observe(step, norm, layers, opt_idx, several)
            metrics.update(self._metrics(m, detection, opt_idx, several))
        if loss_value is not None and self.loss:
            detection, loss_alerts = self.observe_loss(step, loss_value, opt_idx, several)
            alerts += loss_alerts
            key = keys.metric(self._signal(opt_idx, several), "loss")
            metrics[key] = loss_value
            for name, value in (("ratio", detection.ratio), ("cusum", detection.cusum)):
                if value is not None:
                    metrics[keys.detector_key(key, name)] = value
        log_to_loggers(trainer, metrics, step)
        agreed = self.sync_dist or trainer.world_size == 1
        self.dispatcher.deliver(trainer, alerts, step, agreed=agreed, optimizer=optimizer)

    @guarded
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._layer_names, self._fsdp1 = {}, None  # this fit's model (new-user pass 11: a reused monitor kept them)

    @guarded
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.dispatcher.run_actions(trainer, pl_module, step_index(trainer), self.quiet())

    def _metrics(self, m: GradNormStep, d: Detection, opt_idx: int, several: bool) -> dict[str, float]:
        p = self._signal(opt_idx, several)
        out = {keys.metric(p, "global"): m.norm}
        if m.median is not None:
            out[keys.metric(p, "baseline_median")] = m.median
            out[keys.metric(p, "baseline_mad")] = m.mad
            if m.median > 0:
                out[keys.metric(p, "ratio")] = m.norm / m.median
            if m.mad:
                out[keys.metric(p, "robust_z")] = (m.norm - m.median) / (MAD_TO_STD * m.mad)
        if m.ema:
            out[keys.metric(p, "ema_ratio")] = m.norm / m.ema
        if d.cusum is not None:
            out[keys.metric(p, "cusum")] = d.cusum
        if d.growth is not None:
            out[keys.metric(p, "log_slope")] = d.growth
        out[keys.metric(p, "warnings")] = float(self._states[opt_idx].stats.alerts)
        if self.log_layers:
            out.update({keys.metric(p, "layer", layer): v for layer, v in m.layers.items()})
        return out

    @guarded
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.print_summary and trainer.is_global_zero:
            rank_zero_info(self.summary())

    # ------------------------------------------------------------------ summary

    def summary(self, top_layers: int = 5) -> str:
        """Baseline, peak and alerts per optimizer and of the loss, and the layers with the largest peak norms."""
        if not self._states:
            return "GradNormMonitor: no gradient was measured."

        def row(name: str, s: _SeriesStats, base: RobustBaseline) -> list[str]:
            peak = "-" if s.peak is None else f"{fmt(s.peak)} (step {s.peak_step})"
            return [name, str(s.steps), fmt(base.median), fmt(base.mad), fmt(s.last), peak, str(s.alerts),
                    str(s.steps_above), str(s.nonfinite_steps)]

        several = len(self._states) > 1
        rows = [row(f"grad norm, optimizer {i}", s.stats, s.detector.baseline) for i, s in sorted(self._states.items())]
        rows += [row(f"loss, optimizer {i}" if several else "loss", s.loss_stats, s.loss_detector.baseline)
                 for i, s in sorted(self._states.items()) if s.loss_detector is not None and s.loss_stats.steps]
        head = ["series", "steps", "median", "MAD", "last", "peak", "alerts (warn + critical)", "steps above", "non-finite"]
        actions = self.dispatcher
        extra = f", {actions.skipped_steps} step(s) skipped" if "skip" in actions.actions else ""
        extra += f", {actions.rollbacks} rollback(s)" if "rollback" in actions.actions else ""
        d = self.detector
        out = [f"GradNormMonitor (window {d.window}, warn_ratio {d.warn_ratio}{extra}):", format_table(head, rows)]
        for idx, s in sorted(self._states.items()):
            top = sorted(s.layer_peak.items(), key=lambda kv: -kv[1] if not math.isnan(kv[1]) else math.inf)
            layer_rows = [
                [layer, fmt(s.layer_last.get(layer)), fmt(s.layer_baselines[layer].median), fmt(peak)]
                for layer, peak in top[:top_layers]
            ]
            out.append(format_table([f"layer (optimizer {idx})", "last", "median", "peak"], layer_rows))
        return "\n".join(out)
