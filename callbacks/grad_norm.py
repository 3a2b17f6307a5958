"""GradNormMonitor: global and per-layer gradient norms against a robust baseline (DESIGN.md §8).

Where it reads the gradients: ``on_before_optimizer_step``. In lightning 2.6.6 the precision plugin runs
the closure (forward + backward), then — for ``16-mixed`` — ``scaler.unscale_(optimizer)``, then the
``on_before_optimizer_step`` hooks, then gradient clipping, then ``optimizer.step``
(``plugins/precision/amp.py: MixedPrecision.optimizer_step`` and ``precision.py: _after_closure``). So
the hook sees the unscaled, unclipped gradients of the whole (accumulated) step; the tests check both.

The baseline is deliberately simple (median and MAD over a rolling window, plus an EMA ratio); the
full early-warning work (CUSUM, log-slope, alerts and actions) is a later issue. It plugs in at
:meth:`GradNormMonitor.check` (returns an alert or None) and :meth:`GradNormMonitor.on_alert` (acts
on one); the per-step values it needs are in :class:`GradNormStep`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ._base import (
    Monitor,
    check_bool,
    check_float,
    check_int,
    check_prefix,
    finite_max,
    fmt,
    format_table,
    guarded,
    log_to_loggers,
    step_index,
)

#: MAD -> standard deviation for normally distributed data.
_MAD_TO_STD = 1.4826


class GradNormSpikeWarning(UserWarning):
    """The global gradient norm exceeded ``warn_ratio`` × its baseline median."""


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


class RobustBaseline:
    """Median and MAD of the last ``window`` values, and an EMA, of a positive series.

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


@dataclasses.dataclass(frozen=True)
class GradNormAlert:
    """A spike: the measurement, the threshold it crossed, and the layers driving it."""

    measurement: GradNormStep
    threshold: float
    drivers: list[tuple[str, float, float | None, float]]  # (layer, norm, ×own median, share of rise)

    def message(self) -> str:
        m = self.measurement
        parts = []
        for layer, norm, growth, share in self.drivers:
            g = "" if growth is None else f", {growth:.3g}x its median"
            parts.append(f"{layer} ({norm:.3g}{g}, {share:.0%} of the rise in |g|^2)")
        opt = f" (optimizer {m.optimizer})" if m.optimizer else ""
        return (
            f"GradNormMonitor: gradient norm{opt} {m.norm:.4g} at step {m.step} is {m.ratio:.3g}x the "
            f"baseline median {m.median:.4g} (MAD {m.mad:.3g}, last {m.window} steps; threshold "
            f"{self.threshold:.4g}). Largest increases: {'; '.join(parts) or 'n/a'}."
        )


@dataclasses.dataclass
class _OptimizerState:
    baseline: RobustBaseline
    layer_baselines: dict[str, RobustBaseline]
    last: float | None = None
    peak: float | None = None
    peak_step: int | None = None
    steps: int = 0
    steps_above: int = 0
    nonfinite_steps: int = 0
    above: bool = False  # the previous measured step was above the threshold (one warning per episode)
    layer_last: dict[str, float] = dataclasses.field(default_factory=dict)
    layer_peak: dict[str, float] = dataclasses.field(default_factory=dict)


class GradNormMonitor(Monitor):
    """Log gradient norms, keep a robust baseline of the global norm, and warn on spikes.

    Every ``every_n_steps`` optimizer steps, in ``on_before_optimizer_step`` (after AMP unscaling,
    before gradient clipping; see the module docstring), over the parameters that optimizer steps:

    ``{p}/global``
        ‖g‖₂, the L2 norm of all their gradients (per-tensor norms in fp32, summed in fp64 on the host).
        Units of the loss per unit of parameter; the same quantity ``clip_grad_norm_`` clips.
    ``{p}/layer/{layer}``
        ‖g‖₂ of the parameters of one layer. Layers are groups of parameter names given by
        ``layer_of`` (default :func:`default_layer_of`: the top-level block, e.g. ``transformer.h.3``,
        or the owning module for parameters outside numbered blocks, e.g. ``transformer.wte``).
    ``{p}/baseline_median``, ``{p}/baseline_mad``
        Median and median absolute deviation (unscaled) of the global norm over the last ``window``
        measured steps before this one (finite values only). Same units as ``{p}/global``.
    ``{p}/ratio``
        ``global / baseline_median``; the warning fires when it exceeds ``warn_ratio``. Dimensionless.
    ``{p}/robust_z``
        ``(global − median) / (1.4826 · MAD)``, a robust z-score (absent while MAD is 0).
    ``{p}/ema_ratio``
        ``global / EMA`` with the EMA (decay ``ema_decay``) of the previous measured norms: a shorter
        memory than the window. Dimensionless.
    ``{p}/warnings``
        Warnings emitted so far (cumulative count).

    With several optimizers the names get ``opt{i}/`` after the prefix (``{p}/opt1/global``) and each
    optimizer has its own baseline. ``{p}`` is ``prefix``. Values go to ``trainer.loggers`` at the
    measured step on global rank zero (see ``callbacks/_base.py`` for why not ``self.log``); with
    ``every_n_steps=1`` that is every step, whatever ``Trainer(log_every_n_steps)`` says.

    Warning: a :class:`GradNormSpikeWarning` (rank zero) when the global norm is finite, at least
    ``warmup`` finite norms are in the window, and ``global > warn_ratio × baseline_median``. It names
    the ``top_k`` layers whose squared norm rose most over their own baseline median, with their share
    of the rise of ‖g‖². One warning per episode: consecutive steps above the threshold count in
    ``steps_above`` but warn once. Every alert is kept in :attr:`alerts`. Non-finite norms (e.g. fp16
    overflow steps that the GradScaler skips) are logged, counted, and kept out of the baseline.

    Across ranks: after DDP's all-reduce every rank holds the same gradient, so no reduction is
    needed and every rank computes the same baseline. With sharded gradients (FSDP, DeepSpeed ZeRO-2/3)
    each rank sees its shard only — not supported yet.

    Never stops training: an exception in a hook is reported once as a
    :class:`~lightning_gproj.callbacks.MonitorDisabledWarning` and the monitor switches itself off.
    At the end of training rank zero prints :meth:`summary` (baseline, peak, warnings, top layers).

    Args:
        every_n_steps: measure every N optimizer steps (int >= 1); the baseline sees only these steps.
        window: length of the rolling baseline window, in measured steps (int >= 2).
        warn_ratio: warn above this multiple of the baseline median (finite float > 1).
        warmup: finite norms needed in the window before any warning (int in [1, window]).
        ema_decay: decay of the EMA (float in (0, 1)).
        top_k: layers named in a warning (int >= 1).
        log_layers: log the per-layer norms (bool).
        layer_of: ``name -> layer`` grouping of parameter names (callable or None for the default).
        prefix: metric name prefix (non-empty str, no trailing '/').
        print_summary: print the summary table at the end of training (bool).

    Raises:
        ValueError: an argument outside the accepted values (the message names it).
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        window: int = 100,
        warn_ratio: float = 10.0,
        *,
        warmup: int = 20,
        ema_decay: float = 0.9,
        top_k: int = 3,
        log_layers: bool = True,
        layer_of: Callable[[str], str] | None = None,
        prefix: str = "grad_norm",
        print_summary: bool = True,
    ) -> None:
        super().__init__()
        self.every_n_steps = check_int("every_n_steps", every_n_steps, 1)
        self.window = check_int("window", window, 2)
        self.warn_ratio = check_float("warn_ratio", warn_ratio, above=1.0, accepted="a finite number > 1")
        self.warmup = check_int("warmup", warmup, 1, self.window)
        self.ema_decay = check_float(
            "ema_decay", ema_decay, above=0.0, below=1.0, accepted="a number in the open interval (0, 1)"
        )
        self.top_k = check_int("top_k", top_k, 1)
        self.log_layers = check_bool("log_layers", log_layers)
        if layer_of is not None and not callable(layer_of):
            raise ValueError(f"`layer_of` must be a callable name -> layer or None, got {layer_of!r}")
        self.layer_of = default_layer_of if layer_of is None else layer_of
        self.prefix = check_prefix("prefix", prefix)
        self.print_summary = check_bool("print_summary", print_summary)
        #: Every alert raised, in order.
        self.alerts: list[GradNormAlert] = []
        self._states: dict[int, _OptimizerState] = {}
        self._layer_names: dict[int, str] = {}  # id(param) -> layer

    # ------------------------------------------------------------------ measurement

    def _layers_by_param(self, pl_module: "pl.LightningModule") -> dict[int, str]:
        if not self._layer_names:
            self._layer_names = {id(p): self.layer_of(n) for n, p in pl_module.named_parameters()}
        return self._layer_names

    def measure(
        self, pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> tuple[float, dict[str, float]]:
        """(global norm, {layer: norm}) of the current gradients of ``optimizer``'s parameters."""
        layer_by_param = self._layers_by_param(pl_module)
        layers: list[str] = []
        norms: list[torch.Tensor] = []
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None or id(p) in seen:
                    continue
                seen.add(id(p))
                g = p.grad.detach()
                if g.is_sparse:
                    g = g.coalesce().values()
                layers.append(layer_by_param.get(id(p), "<unnamed>"))
                norms.append(torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32)))
        if not norms:
            return math.nan, {}
        device = norms[0].device
        host = torch.stack([n.to(device, torch.float64) for n in norms]).cpu().tolist()  # one sync
        sq: dict[str, float] = {}
        for layer, n in zip(layers, host):
            sq[layer] = sq.get(layer, 0.0) + n * n
        return math.sqrt(sum(sq.values())), {layer: math.sqrt(v) for layer, v in sq.items()}

    # ------------------------------------------------------------------ detection (open for CUSUM etc.)

    def check(self, m: GradNormStep) -> GradNormAlert | None:
        """Return an alert when ``m`` is a spike against its baseline, else None (no side effects)."""
        if not math.isfinite(m.norm) or m.window < self.warmup or not m.median:
            return None
        threshold = self.warn_ratio * m.median
        if m.norm <= threshold:
            return None
        rises = []
        for layer, norm in m.layers.items():
            med = m.layer_medians.get(layer)
            base = med if med is not None else 0.0
            rises.append((norm * norm - base * base, layer, norm, (norm / med) if med else None))
        total_rise = m.norm**2 - m.median**2
        rises.sort(key=lambda r: r[0], reverse=True)
        drivers = [(layer, norm, growth, rise / total_rise) for rise, layer, norm, growth in rises[: self.top_k]]
        return GradNormAlert(m, threshold, drivers)

    def on_alert(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", alert: GradNormAlert) -> None:
        """Act on an alert: warn on rank zero (override or extend for other actions)."""
        rank_zero_warn(alert.message(), category=GradNormSpikeWarning)

    # ------------------------------------------------------------------ hooks

    @guarded
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        step = step_index(trainer)
        if step % self.every_n_steps:
            return
        opt_idx = next((i for i, o in enumerate(trainer.optimizers) if o is optimizer), 0)
        state = self._states.get(opt_idx)
        if state is None:
            state = self._states[opt_idx] = _OptimizerState(RobustBaseline(self.window, self.ema_decay), {})
        norm, layers = self.measure(pl_module, optimizer)
        if not layers:
            return
        base = state.baseline
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

        alert = self.check(m)
        above = alert is not None
        if above:
            state.steps_above += 1
            if not state.above:  # first step of an episode
                self.alerts.append(alert)
                self.on_alert(trainer, pl_module, alert)
        state.above = above

        state.steps += 1
        state.last = norm
        if math.isfinite(norm):
            if state.peak is None or norm > state.peak:
                state.peak, state.peak_step = norm, step
        else:
            state.nonfinite_steps += 1
        base.update(norm)
        for layer, value in layers.items():
            state.layer_baselines.setdefault(layer, RobustBaseline(self.window, self.ema_decay)).update(value)
            state.layer_last[layer] = value
            state.layer_peak[layer] = finite_max(state.layer_peak.get(layer), value)

        log_to_loggers(trainer, self._metrics(m, opt_idx, len(trainer.optimizers) > 1), step)

    def _metrics(self, m: GradNormStep, opt_idx: int, several: bool) -> dict[str, float]:
        p = f"{self.prefix}/opt{opt_idx}" if several else self.prefix
        out = {f"{p}/global": m.norm}
        if m.median is not None:
            out[f"{p}/baseline_median"] = m.median
            out[f"{p}/baseline_mad"] = m.mad
            if m.median > 0:
                out[f"{p}/ratio"] = m.norm / m.median
            if m.mad:
                out[f"{p}/robust_z"] = (m.norm - m.median) / (_MAD_TO_STD * m.mad)
        if m.ema:
            out[f"{p}/ema_ratio"] = m.norm / m.ema
        out[f"{p}/warnings"] = float(sum(1 for a in self.alerts if a.measurement.optimizer == opt_idx))
        if self.log_layers:
            out.update({f"{p}/layer/{layer}": v for layer, v in m.layers.items()})
        return out

    @guarded
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.print_summary and trainer.is_global_zero:
            rank_zero_info(self.summary())

    # ------------------------------------------------------------------ summary

    def summary(self, top_layers: int = 5) -> str:
        """Baseline, peak and warnings per optimizer, and the layers with the largest peak norms."""
        if not self._states:
            return "GradNormMonitor: no gradient was measured."
        rows = []
        for idx, s in sorted(self._states.items()):
            warned = sum(1 for a in self.alerts if a.measurement.optimizer == idx)
            peak = "-" if s.peak is None else f"{fmt(s.peak)} (step {s.peak_step})"
            rows.append(
                [
                    str(idx),
                    str(s.steps),
                    fmt(s.baseline.median),
                    fmt(s.baseline.mad),
                    fmt(s.last),
                    peak,
                    str(warned),
                    str(s.steps_above),
                    str(s.nonfinite_steps),
                ]
            )
        head = ["optimizer", "steps", "median", "MAD", "last", "peak", "warnings", "steps above", "non-finite"]
        out = [f"GradNormMonitor (window {self.window}, warn_ratio {self.warn_ratio:g}):", format_table(head, rows)]
        for idx, s in sorted(self._states.items()):
            top = sorted(s.layer_peak.items(), key=lambda kv: -kv[1] if not math.isnan(kv[1]) else math.inf)
            layer_rows = [
                [layer, fmt(s.layer_last.get(layer)), fmt(s.layer_baselines[layer].median), fmt(peak)]
                for layer, peak in top[:top_layers]
            ]
            out.append(format_table([f"layer (optimizer {idx})", "last", "median", "peak"], layer_rows))
        return "\n".join(out)
