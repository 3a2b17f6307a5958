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
:meth:`GradNormMonitor.observe` is the pure detection step (no Trainer needed).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from .alerts import Alert, AlertDispatcher
from .detectors import MAD_TO_STD, ChangeDetector, Detection, RobustBaseline

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
class _OptimizerState:
    detector: ChangeDetector
    layer_baselines: dict[str, RobustBaseline]
    last: float | None = None
    peak: float | None = None
    peak_step: int | None = None
    steps: int = 0
    steps_above: int = 0
    nonfinite_steps: int = 0
    alerts: int = 0
    layer_last: dict[str, float] = dataclasses.field(default_factory=dict)
    layer_peak: dict[str, float] = dataclasses.field(default_factory=dict)


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
        ``global / baseline_median``. Dimensionless. Alerts above ``warn_ratio`` / ``critical_ratio``.
    ``{p}/robust_z``
        ``(global − median) / (1.4826 · MAD)``, a robust z-score (absent while MAD is 0).
    ``{p}/ema_ratio``
        ``global / EMA`` with the EMA (decay ``ema_decay``) of the previous measured norms: a shorter
        memory than the window. Dimensionless.
    ``{p}/cusum``
        One-sided CUSUM of the robust z-score of log ‖g‖ (allowance ``cusum_drift``), in robust σ.
        Alerts above ``cusum_warn`` / ``cusum_critical``.
    ``{p}/log_slope``
        Growth factor of ‖g‖ per ``slope_horizon`` steps, from a least-squares fit of log ‖g‖ over
        the last ``slope_window`` measured steps. Alerts above ``slope_warn`` / ``slope_critical``.
    ``{p}/warnings``
        Alerts raised so far (cumulative count, both levels).

    With several optimizers the names get ``opt{i}/`` after the prefix (``{p}/opt1/global``) and each
    optimizer has its own detector. ``{p}`` is ``prefix``. Values go to ``trainer.loggers`` at the
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

    Across ranks: after DDP's all-reduce every rank holds the same gradient, so every rank computes the
    same norms, baseline and alerts with no communication (and runs the same actions). Sharded gradients
    (FSDP2 / DTensor, FSDP1 with ``use_orig_params=True``) give the same global norms on every rank: the
    local squares are summed over the shard group in one ``all_reduce`` (``callbacks/_sharded.py``). FSDP1
    with ``use_orig_params=False``: right global norm, no per-layer names. DeepSpeed ZeRO-2/3: not supported.

    Never stops training by accident: an exception in a hook is reported once as a
    :class:`~lightning_gproj.callbacks.MonitorDisabledWarning` and the monitor switches itself off; a
    failing ``on_alert`` or action is logged once and ignored. At the end of training rank zero prints
    :meth:`summary`.

    Args:
        every_n_steps: measure every N optimizer steps (int >= 1); the baseline sees only these steps.
        window: length of the rolling baseline window, in measured steps (int >= 2).
        warn_ratio, critical_ratio: ratio thresholds (None or finite float > 1).
        warmup: finite norms needed in the window before any alert (int in [1, window]).
        cusum_warn, cusum_critical: CUSUM thresholds in robust σ (None or > 0).
        cusum_drift: CUSUM allowance per step in robust σ (>= 0).
        slope_window, slope_horizon, slope_warn, slope_critical: log-slope fit length (measured steps,
            >= 3), horizon (steps, >= 1) and growth-factor thresholds (None or > 1).
        ema_decay: decay of the EMA (float in (0, 1)).
        top_k: layers named in an alert (int >= 1).
        log_layers: log the per-layer norms (bool).
        layer_of: ``name -> layer`` grouping of parameter names (callable or None for the default).
        prefix: metric name prefix (non-empty str, no trailing '/').
        print_summary: print the summary table at the end of training (bool).
        on_alert, actions, action_level, remediation, checkpoint_dir: alert delivery, see
            :class:`~lightning_gproj.callbacks.alerts.AlertDispatcher`.

    Raises:
        ValueError: an argument outside the accepted values (the message names it).
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        window: int = 100,
        warn_ratio: float | None = 4.0,
        *,
        critical_ratio: float | None = 10.0,
        warmup: int = 100,
        cusum_warn: float | None = 25.0,
        cusum_critical: float | None = None,
        cusum_drift: float = 1.0,
        slope_window: int = 100,
        slope_horizon: int = 100,
        slope_warn: float | None = None,
        slope_critical: float | None = None,
        ema_decay: float = 0.9,
        top_k: int = 3,
        log_layers: bool = True,
        layer_of: Callable[[str], str] | None = None,
        prefix: str = "grad_norm",
        print_summary: bool = True,
        on_alert: Optional[Callable[[Alert], Any]] = None,
        actions: Sequence[str] = (),
        action_level: str = "critical",
        remediation: str = "gproj",
        checkpoint_dir: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.every_n_steps = check_int("every_n_steps", every_n_steps, 1)
        self.detector_args = dict(
            window=window, warmup=warmup, warn_ratio=warn_ratio, critical_ratio=critical_ratio,
            cusum_warn=cusum_warn, cusum_critical=cusum_critical, cusum_drift=cusum_drift,
            slope_window=slope_window, slope_horizon=slope_horizon, slope_warn=slope_warn,
            slope_critical=slope_critical, ema_decay=ema_decay,
        )
        ChangeDetector(**self.detector_args)  # validates
        self.window, self.warmup, self.ema_decay = window, warmup, ema_decay
        self.warn_ratio, self.critical_ratio = warn_ratio, critical_ratio
        self.top_k = check_int("top_k", top_k, 1)
        self.log_layers = check_bool("log_layers", log_layers)
        check_callable("layer_of", layer_of, "a callable name -> layer")
        self.layer_of = default_layer_of if layer_of is None else layer_of
        self.prefix = check_prefix("prefix", prefix)
        self.print_summary = check_bool("print_summary", print_summary)
        self.dispatcher = AlertDispatcher(
            type(self).__name__, on_alert, actions, action_level, remediation, checkpoint_dir
        )
        self._states: dict[int, _OptimizerState] = {}
        self._layer_names: dict[int, str] = {}  # id(param) -> layer
        self._fsdp1: Optional[dict[int, Layout]] = None  # id(param) -> Layout of FSDP1-sharded parameters

    @property
    def alerts(self) -> list[Alert]:
        """Every alert raised, in order."""
        return self.dispatcher.alerts

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
        layer_by_param = self._layers_by_param(pl_module)
        if self._fsdp1 is None:
            self._fsdp1 = fsdp1_layouts(model if model is not None else pl_module)
        device: Optional[torch.device] = None
        layers: list[str] = []
        rows: list[torch.Tensor] = []
        groups: list[tuple] = []
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                layout = layout_of(p, self._fsdp1)
                if p.grad is None and not layout.sharded:
                    continue  # a sharded parameter keeps its row on every rank: the reduction needs them all
                device = device or p.device
                layers.append(layer_by_param.get(id(p), "<unnamed>"))
                rows.append(squared_norm(p.grad, layout, device))
                groups.append(layout.groups)
        if not rows:
            return math.nan, {}
        host = sum_over_shards(torch.stack(rows), groups).cpu().tolist()  # one sync
        sq: dict[str, float] = {}
        for layer, (square, present) in zip(layers, host):
            if present:
                sq[layer] = sq.get(layer, 0.0) + square
        if not sq:
            return math.nan, {}
        return math.sqrt(sum(sq.values())), {layer: math.sqrt(v) for layer, v in sq.items()}

    # ------------------------------------------------------------------ detection (online and offline)

    def _signal(self, opt_idx: int, several: bool) -> str:
        return f"{self.prefix}/opt{opt_idx}" if several else self.prefix

    def observe(
        self, step: int, norm: float, layers: dict[str, float], opt_idx: int = 0, several: bool = False
    ) -> tuple[GradNormStep, Detection, list[Alert]]:
        """Feed one measurement to the detector of optimizer ``opt_idx``: returns the measurement
        against its past, the detector's verdict, and the new alerts (not delivered). Pure bookkeeping:
        the same call replays logged norms offline (``lightning_gproj.evaluate``)."""
        state = self._states.get(opt_idx)
        if state is None:
            state = self._states[opt_idx] = _OptimizerState(ChangeDetector(**self.detector_args), {})
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
        if detection.level is not None:
            state.steps_above += 1
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
            state.alerts += 1

        state.steps += 1
        state.last = norm
        if math.isfinite(norm):
            if state.peak is None or norm > state.peak:
                state.peak, state.peak_step = norm, step
        else:
            state.nonfinite_steps += 1
        for layer, value in layers.items():
            state.layer_baselines.setdefault(layer, RobustBaseline(self.window, self.ema_decay)).update(value)
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

    # ------------------------------------------------------------------ hooks

    @guarded
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        step = step_index(trainer)
        if step % self.every_n_steps:
            return
        opt_idx = next((i for i, o in enumerate(trainer.optimizers) if o is optimizer), 0)
        norm, layers = self.measure(pl_module, optimizer, trainer.model)
        if not layers:
            return
        several = len(trainer.optimizers) > 1
        m, detection, alerts = self.observe(step, norm, layers, opt_idx, several)
        log_to_loggers(trainer, self._metrics(m, detection, opt_idx, several), step)
        self.dispatcher.deliver(trainer, alerts)

    @guarded
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.dispatcher.run_actions(trainer, pl_module)

    def _metrics(self, m: GradNormStep, d: Detection, opt_idx: int, several: bool) -> dict[str, float]:
        p = self._signal(opt_idx, several)
        out = {f"{p}/global": m.norm}
        if m.median is not None:
            out[f"{p}/baseline_median"] = m.median
            out[f"{p}/baseline_mad"] = m.mad
            if m.median > 0:
                out[f"{p}/ratio"] = m.norm / m.median
            if m.mad:
                out[f"{p}/robust_z"] = (m.norm - m.median) / (MAD_TO_STD * m.mad)
        if m.ema:
            out[f"{p}/ema_ratio"] = m.norm / m.ema
        if d.cusum is not None:
            out[f"{p}/cusum"] = d.cusum
        if d.growth is not None:
            out[f"{p}/log_slope"] = d.growth
        out[f"{p}/warnings"] = float(self._states[opt_idx].alerts)
        if self.log_layers:
            out.update({f"{p}/layer/{layer}": v for layer, v in m.layers.items()})
        return out

    @guarded
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.print_summary and trainer.is_global_zero:
            rank_zero_info(self.summary())

    # ------------------------------------------------------------------ summary

    def summary(self, top_layers: int = 5) -> str:
        """Baseline, peak and alerts per optimizer, and the layers with the largest peak norms."""
        if not self._states:
            return "GradNormMonitor: no gradient was measured."
        rows = []
        for idx, s in sorted(self._states.items()):
            peak = "-" if s.peak is None else f"{fmt(s.peak)} (step {s.peak_step})"
            base = s.detector.baseline
            rows.append(
                [
                    str(idx),
                    str(s.steps),
                    fmt(base.median),
                    fmt(base.mad),
                    fmt(s.last),
                    peak,
                    str(s.alerts),
                    str(s.steps_above),
                    str(s.nonfinite_steps),
                ]
            )
        head = ["optimizer", "steps", "median", "MAD", "last", "peak", "warnings", "steps above", "non-finite"]
        out = [f"GradNormMonitor (window {self.window}, warn_ratio {self.warn_ratio}):", format_table(head, rows)]
        for idx, s in sorted(self._states.items()):
            top = sorted(s.layer_peak.items(), key=lambda kv: -kv[1] if not math.isnan(kv[1]) else math.inf)
            layer_rows = [
                [layer, fmt(s.layer_last.get(layer)), fmt(s.layer_baselines[layer].median), fmt(peak)]
                for layer, peak in top[:top_layers]
            ]
            out.append(format_table([f"layer (optimizer {idx})", "last", "median", "peak"], layer_rows))
        return "\n".join(out)
