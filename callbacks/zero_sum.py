"""ZeroSumMonitor: the attention health signals of DESIGN.md §8, sampled every N optimizer steps.

Four sources:

* the op's statistics: on a sampled step the monitor enables :data:`lightning_gproj.stats.RECORDER`
  from ``on_train_batch_start`` until the backward is done, then drains it (the op fills it from
  ``gproj_attn_func(..., stats_name=LAYER)``; see docs/architecture.md, "Stats contract"). A model
  without swapped attention records nothing, and nothing is logged for these signals;
* the key-bias gradient, for any model whatever its kernel: the gradient of a key bias is exactly
  Σ_j dK_j (summed over batch and positions), which conservation law C2 (DESIGN.md §2) makes 0 in exact
  arithmetic. It is read from ``param.grad`` in ``on_before_optimizer_step`` (after every backward of the
  step, after AMP unscaling, before clipping), so it needs no hook and includes gradient accumulation
  (:mod:`.key_bias` finds the biases and reduces sharded gradients);
* the C2 residual ‖Σ_j dK_j‖ / ‖dK‖_F, for any model whatever its kernel, from a hook on the gradient of
  k of every attention call of the sampled steps (:mod:`.capture`);
* the probe, for attention the op does not serve (SDPA with any backend): every ``probe_every_n_steps``
  one layer's slice is recomputed in the user's kernel and in float64 (:mod:`.capture`).

Values are reduced across ranks (:mod:`.ranks`) before each statistic listed in ``detect`` runs through a
change detector (:mod:`.detectors`); alerts are delivered, and actions taken, by :mod:`.alerts`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_gproj import stats as _stats

from . import keys
from .alerts import Alert, AlertDispatcher
from .capture import AttentionCapture, ProbeCapture, ProbeResult, compiled_fullgraph, probe_backward
from .detectors import ChangeDetector, Detection, DetectorConfig, as_config, level_rank
from .key_bias import KeyBias, find_key_biases, key_bias_values, uses_rotary
from .ranks import RankRows, reduce_values

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
from ._sharded import Layout, clean_name, fsdp1_layouts, layout_of

#: Order of the columns of the summary table (statistics not seen are left out). ``violation_max`` is
#: logged, not summarized: a near-one-hot row has a Σ_j |dS̃_ij| of rounding noise and ρ_i ≈ 1, so the
#: max sits at 1 on healthy runs and would read as an alarm.
_SUMMARY_STATS = (
    "violation_median",
    "leak_ratio",
    "leak_removed_ratio",
    "mean_key_norm",
    "mean_query_norm",
    "max_logit",
    "key_bias_grad_ratio",
    "c2_residual",
    "probe_dq_error",
    "probe_leak_ratio",
)

@dataclasses.dataclass
class _Track:
    """Last and peak value of one statistic of one layer, and the step of each."""

    last: float | None = None
    last_step: int | None = None
    peak: float | None = None
    peak_step: int | None = None
    samples: int = 0

    def add(self, value: float, step: int) -> None:
        self.last, self.last_step, self.samples = value, step, self.samples + 1
        new_peak = finite_max(self.peak, value)
        if new_peak != self.peak:
            self.peak, self.peak_step = new_peak, step


#: Every statistic name ZeroSumMonitor logs (the names ``detect`` and ``floors`` accept).
STATISTICS = _SUMMARY_STATS + ("violation_max", "key_bias_grad_norm", "probe_dq_error_max")
#: Statistics reduced over ranks (and over a step's calls, in the recorder) by their maximum; the
#: others by their mean.
MAX_REDUCED = _stats.MAX_REDUCED | {"probe_dq_error_max"}
#: Statistics alerted on by default (the others are logged only; see ``detect``).
DEFAULT_DETECT = ("leak_ratio", "c2_residual", "key_bias_grad_ratio", "probe_leak_ratio", "probe_dq_error")
#: Default detector floors (see ``DetectorConfig.floor``): below these, values are rounding level and
#: their relative jumps must not alert. Each sits between what a healthy bf16 GProj run shows and what
#: an uncorrected kernel does (the measurements they come from: docs/monitoring.md, "Detectors").
#: Unchanged after the accelerated H200 divergence (docs/reproduction.md), where they warned ahead of it
#: with no false alarm on the healthy arms.
DEFAULT_FLOORS = {
    "leak_ratio": 1e-2,
    "c2_residual": 3e-3,
    "key_bias_grad_ratio": 3e-4,
    "probe_leak_ratio": 1e-2,
    "probe_dq_error": 1e-3,
}
#: Default detector settings, per sample (``every_n_steps`` apart); floors per statistic come from
#: ``floors`` / :data:`DEFAULT_FLOORS`.
ZERO_SUM_DETECTOR = DetectorConfig(
    window=20, warmup=10, warn_ratio=3.0, critical_ratio=10.0, cusum_warn=15.0, cusum_drift=1.0,
    min_log_sigma=0.25, slope_window=10, slope_horizon=100,
)


class ZeroSumMonitor(Monitor):
    """Log the zero-sum health signals of the attention backward every ``every_n_steps`` steps, and alert.

    Logged metrics (DESIGN.md §8), ``{p}`` = ``prefix``, ``{layer}`` = the ``stats_name`` given to
    ``gproj_attn_func`` (the swapped module's path; default ``"attention"``) or, for SDPA calls not
    served by the op, the path of the innermost module making the call; ``{attn}`` = the attention
    module's path:

    ``{p}/{layer}/violation_median``
        Median over query rows of ρ_i = |r_i| / Σ_j |dS̃_ij|, r_i = Σ_j dS̃_ij over the valid keys of
        row i, dS̃ the 16-bit dS the GEMMs consumed. Dimensionless, in [0, 1]. Exactly 0 in exact
        arithmetic (conservation law C1); the BF16 rounding of dS makes it nonzero. Backward, op only.
    ``{p}/{layer}/violation_max``
        Maximum over rows of ρ_i (the maximum over the step's calls of the layer). Dimensionless.
    ``{p}/{layer}/leak_ratio``
        λ = ‖τ r ∘ (P K)‖_F / ‖dQ_gproj‖_F: the share of the query gradient that is leak, logged where the
        op returns it in dQ (``fix="none"``). Dimensionless. Backward, op only.
    ``{p}/{layer}/leak_removed_ratio``
        The same λ where ``fix="gproj"`` removed the leak before returning dQ (logged, never alerted on:
        the optimizer does not see it). Dimensionless. Backward, op only.
    ``{p}/{layer}/mean_key_norm``
        Mean over (batch, head) of ‖mean_j k_j‖: the mean-key norm ‖k̄‖ the leak grows with. Units of k
        (the attention's key activations, before the softmax scale). Forward, op only.
    ``{p}/{layer}/mean_query_norm``
        Mean over (batch, head) of ‖mean_i q_i‖. Units of q. Forward, op only.
    ``{p}/{layer}/max_logit``
        max over (batch, head, i, j) of τ·s_ij, the largest attention logit (scaled score) of the step's
        calls of the layer (max over calls, and over ranks), from the forward kernel's row max (no extra
        pass over the scores). What QK-clip-style training (MuonClip) caps. Units of the logits.
        Forward, op only; logged, not alerted on by default (add it to ``detect``).
    ``{p}/{layer}/c2_residual``
        ‖Σ_j dK_j‖₂ / ‖dK‖_F from a hook on the gradient of k (any kernel: op calls and SDPA calls not
        served by the op; ``c2=True``): the key gradient summed over key positions per (batch row, head),
        L2 norm over all of them, relative to the key gradient's Frobenius norm; mean over the layer's
        calls in the step. Dimensionless. Exactly 0 in exact arithmetic whatever the mask (C2); measured:
        float64 ~1e-15, FA3-class bf16 0.6–4.9%, P-weighted GProj 1e-7–1e-5 (DESIGN.md §8).
    ``{p}/{attn}/key_bias_grad_norm``
        ‖∇b_k‖₂, the L2 norm of the key bias's gradient = ‖Σ_{batch, j} dK_j‖, in loss units per unit of
        key. 0 in exact arithmetic (C2) whatever kernel computed it: any value is rounding error, which
        Adam-style optimizers turn into full-size steps of the bias (the mean key drifts).
    ``{p}/{attn}/key_bias_grad_ratio``
        ‖∇b_k‖₂ / ‖∇W_k‖_F, the key bias gradient relative to the layer's key weight gradient.
        Dimensionless. The numerator is the same sum as c2_residual's; the denominator also scales with
        the layer's input norm, so compare it over time within a layer. "0 in exact arithmetic" holds
        only when the bias reaches the scores as one shared offset of all keys (no RoPE / QK-norm after
        it); otherwise it is a plain gradient statistic.
    ``{p}/{layer}/probe_dq_error``, ``probe_dq_error_max``, ``probe_leak_ratio``
        Probe mode (``probe_every_n_steps``), for SDPA calls not served by the op (unswapped models,
        whatever backend SDPA picks: flash, cuDNN, efficient, math): on one layer per probe step (round
        robin), a slice of batch row 0, ``probe_heads`` heads and ``probe_queries`` queries is captured
        with its incoming dO, and its dQ recomputed by SDPA autograd in the captured dtype and in
        float64. dq_error: mean over the probed heads of ‖dQ_kernel − dQ_fp64‖_F / ‖dQ_fp64‖_F;
        dq_error_max: the largest head; leak_ratio: the part of the dQ error along τ(PK)_i per row
        (λ of DESIGN.md §8 measured from outside; see
        :class:`~lightning_gproj.callbacks.capture.ProbeResult`). Dimensionless. Note: the slice is
        recomputed on its own, so a backend that picks its algorithm by shape may differ from the full
        call.
    ``{p}/{layer}/{stat}/cusum``, ``.../ratio``
        For the statistics in ``detect``: the detector's CUSUM (robust σ) and ratio to the median of the
        last ``window`` samples (see :mod:`~lightning_gproj.callbacks.detectors`).

    Alerts: each statistic in ``detect`` of each layer has a
    :class:`~lightning_gproj.callbacks.detectors.ChangeDetector` (settings ``detector``, windows in
    samples, floor from ``floors``);
    the layers whose detector rose in level at a step make one
    :class:`~lightning_gproj.callbacks.alerts.Alert` per statistic (signal ``{p}/{stat}``, layers
    strongest first), delivered as described in :mod:`~lightning_gproj.callbacks.alerts`.

    Sampling: step s (0-based optimizer step, Lightning's logging step axis) is sampled when
    ``s % every_n_steps == 0``, probed when ``s % probe_every_n_steps == 0``; every micro-batch of an
    accumulated step is recorded (the probe takes the first). Values go to ``trainer.loggers`` at step s
    directly (not through ``self.log``, which would re-write a stale value at every later logging step;
    see ``callbacks/_base.py``), on global rank zero. The capture mode and module hooks exist only
    during the forward of sampled and probed steps; other steps cost nothing.

    Across ranks: the values of every rank are gathered with one torchmetrics ``Metric`` (state
    ``dist_reduce_fx="cat"``; ``compute()`` syncs) and reduced: max for :data:`MAX_REDUCED`
    (``violation_max``, ``probe_dq_error_max``, ``max_logit``), mean for the rest (mean of per-rank
    medians for ``violation_median``). Every rank gets the reduced values, so every rank raises the same
    alerts and runs the same actions. All ranks must sample the same layers, as DDP already requires; if
    the sets differ (or with ``sync_dist=False``), each rank keeps its own values (warned once) and the
    decision to act is reduced across ranks by the dispatcher instead (any rank acting makes all act).
    The key-bias signals of sharded gradients (FSDP2 / DTensor, FSDP1 with ``use_orig_params=True``)
    are global norms before that reduction: the squares of the key parts each rank holds are summed
    over the shard group (``callbacks/_sharded.py``; this all-reduce runs whatever ``sync_dist`` says).

    State: :meth:`state_dict` holds every detector, the summary's tracks, the probe's round robin and
    the alerts, so a run resumed from a Lightning checkpoint raises the same alerts at the same steps as
    an uninterrupted one (``state_key`` includes ``prefix``).

    Never stops training by accident: an exception in a hook is reported once as a
    :class:`~lightning_gproj.callbacks.MonitorDisabledWarning`, the recorder and capture are restored,
    and the monitor switches itself off; a failing ``on_alert`` or action is logged once and ignored.
    Under DDP an error on one rank only can leave the other ranks waiting in the gather; set
    ``sync_dist=False`` if that is a concern.

    Args:
        every_n_steps: sample every N optimizer steps (int >= 1).
        key_bias: log the key-bias gradient signals (bool).
        c2: log the C2 residual from a hook on the gradient of k (bool).
        probe_every_n_steps: probe cadence in optimizer steps (int >= 1) or None (no probe).
        probe_heads: query heads in the probe slice (int >= 1).
        probe_queries: queries in the probe slice (int >= 1).
        probe_layers: glob patterns (``fnmatch``) over layer paths restricting the probe's round robin
            (e.g. ``["blocks.0.attn", "blocks.11.*"]``); None = every SDPA layer. With many layers the
            round robin visits each one every ``n_layers × probe_every_n_steps`` steps, which is what
            its detector's ``warmup`` counts in; restricting the probe shortens that.
        detect: statistics to alert on (sequence of statistic names).
        floors: ``{statistic: floor}`` overriding :data:`DEFAULT_FLOORS` (values below a floor count as
            the floor in the detector, so rounding-level noise cannot alert).
        detector: detector settings (:class:`~lightning_gproj.callbacks.detectors.DetectorConfig`,
            windows in samples; default :data:`ZERO_SUM_DETECTOR`); its ``floor`` applies to the
            statistics without one in ``floors``.
        sync_dist: reduce the values over ranks before detecting and logging (bool).
        prefix: metric name prefix (non-empty str, no trailing '/').
        print_summary: print the summary table at the end of training (bool).
        recorder: the :class:`~lightning_gproj.stats.StatsRecorder` to drive; default
            :data:`lightning_gproj.stats.RECORDER`, the one the op writes into.
        on_alert, actions, action_level, remediation, checkpoint_dir, rollback_every_n_steps,
            rollback_lr_factor: alert delivery and actions, see
            :class:`~lightning_gproj.callbacks.alerts.AlertDispatcher`.

    Raises:
        ValueError: an argument outside the accepted values (the message names it).
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        *,
        key_bias: bool = True,
        c2: bool = True,
        probe_every_n_steps: Optional[int] = 500,
        probe_heads: int = 2,
        probe_queries: int = 512,
        probe_layers: Optional[Sequence[str]] = None,
        detect: Sequence[str] = DEFAULT_DETECT,
        floors: Optional[dict[str, float]] = None,
        detector: DetectorConfig = ZERO_SUM_DETECTOR,
        sync_dist: bool = True,
        prefix: str = "gproj",
        print_summary: bool = True,
        recorder: _stats.StatsRecorder | None = None,
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
        self.key_bias = check_bool("key_bias", key_bias)
        self.c2 = check_bool("c2", c2)
        self.probe_every_n_steps = None if probe_every_n_steps is None else check_int(
            "probe_every_n_steps", probe_every_n_steps, 1
        )
        self.probe_heads = check_int("probe_heads", probe_heads, 1)
        self.probe_queries = check_int("probe_queries", probe_queries, 1)
        if probe_layers is not None and (
            isinstance(probe_layers, str) or not all(isinstance(x, str) and x for x in probe_layers)
        ):
            raise ValueError(f"`probe_layers` must be None or a sequence of glob patterns over layer paths, got {probe_layers!r}")
        self.probe_layers = None if probe_layers is None else tuple(probe_layers)
        if isinstance(detect, str) or not all(isinstance(d, str) and d for d in detect):
            raise ValueError(f"`detect` must be a sequence of statistic names such as {DEFAULT_DETECT}, got {detect!r}")
        unknown = [d for d in detect if d not in STATISTICS]
        if unknown:
            raise ValueError(f"`detect` has unknown statistic names {unknown}; accepted: {STATISTICS}")
        self.detect = tuple(detect)
        if floors is not None and not (isinstance(floors, dict) and all(isinstance(k, str) for k in floors)):
            raise ValueError(f"`floors` must be None or a dict statistic -> number >= 0, got {floors!r}")
        unknown = [k for k in (floors or {}) if k not in STATISTICS]
        if unknown:
            raise ValueError(f"`floors` has unknown statistic names {unknown}; accepted: {STATISTICS}")
        # each value as DetectorConfig(floor=...) takes it: a finite real number >= 0 (NumPy's too; not a bool)
        floors = {k: check_float(f"floors[{k!r}]", v, above=-1e-300, accepted="a finite number >= 0")
                  for k, v in (floors or {}).items()}
        #: Detector floor per statistic (DEFAULT_FLOORS updated with ``floors``).
        self.floors = {**DEFAULT_FLOORS, **floors}
        self.detector = as_config("detector", detector, ZERO_SUM_DETECTOR)
        self.sync_dist = check_bool("sync_dist", sync_dist)
        self.prefix = check_prefix("prefix", prefix)
        self.print_summary = check_bool("print_summary", print_summary)
        if recorder is not None and not isinstance(recorder, _stats.StatsRecorder):
            raise ValueError(f"`recorder` must be a lightning_gproj.stats.StatsRecorder or None, got {recorder!r}")
        self.dispatcher = AlertDispatcher(
            type(self).__name__, self.prefix, on_alert, actions, action_level, remediation, checkpoint_dir,
            rollback_every_n_steps, rollback_lr_factor,
        )
        # The default is looked up at use, not stored: under ddp_spawn the callback is pickled into each
        # worker, where the op writes into that process's own lightning_gproj.stats.RECORDER.
        self._recorder = recorder
        #: Key biases found at ``on_train_start`` (empty with ``key_bias=False``).
        self.key_biases: list[KeyBias] = []
        self._fsdp1: dict[int, Layout] = {}  # id(param) -> Layout of FSDP1-sharded parameters
        #: ``{layer: {statistic: _Track}}``: last and peak of every logged value.
        self.tracks: dict[str, dict[str, _Track]] = {}
        #: ``{metric: ChangeDetector}`` of the detected statistics.
        self.detectors: dict[str, ChangeDetector] = {}
        #: SDPA layers seen by the capture, in order of first appearance (the probe's round robin).
        self.sdpa_layers: list[str] = []
        #: The last probe: ``(step, ProbeCapture, ProbeResult)``, for inspection.
        self.last_probe: Optional[tuple[int, ProbeCapture, ProbeResult]] = None
        self._probes = 0
        self._names: dict[int, str] = {}
        self._fullgraph = False  # torch.compile(fullgraph=True): C2 and the probe not sampled (on_train_start)
        self._capture: Optional[AttentionCapture] = None
        self._capture_step: Optional[int] = None
        self._recording_step: int | None = None  # step whose recording we started, while it runs
        self._previous_enabled = False
        self._paused: bool | None = None  # the recorder's state while a validation inside a sampled step runs
        self._gather = RankRows()

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
            "detectors": {key: det.state_dict() for key, det in self.detectors.items()},
            "tracks": {layer: {stat: dataclasses.asdict(t) for stat, t in ts.items()} for layer, ts in self.tracks.items()},
            "sdpa_layers": list(self.sdpa_layers),
            "probes": self._probes,
            "dispatcher": self.dispatcher.state_dict(),
        }

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        self.detectors = {}
        for key, det in state_dict["detectors"].items():
            parsed = keys.parse_layer_key(self.prefix, key)
            if parsed is not None:
                self._detector(key, parsed[1]).load_state_dict(det)
        self.tracks = {
            layer: {stat: _Track(**t) for stat, t in ts.items()} for layer, ts in state_dict["tracks"].items()
        }
        self.sdpa_layers[:] = state_dict["sdpa_layers"]
        self._probes = int(state_dict["probes"])
        self.dispatcher.load_state_dict(state_dict["dispatcher"])

    def _detector(self, key: str, stat: str) -> ChangeDetector:
        det = self.detectors.get(key)
        if det is None:
            floor = self.floors.get(stat, self.detector.floor)
            det = self.detectors[key] = ChangeDetector(dataclasses.replace(self.detector, floor=floor))
        return det

    def quiet(self) -> bool:
        """No detector of this monitor is in an alert episode."""
        return all(det.level is None for det in self.detectors.values())

    # ------------------------------------------------------------------ recorder on / off

    @property
    def recorder(self) -> _stats.StatsRecorder:
        """The recorder this monitor drives (``lightning_gproj.stats.RECORDER`` unless one was given)."""
        return _stats.RECORDER if self._recorder is None else self._recorder

    def _start_recording(self, step: int) -> None:
        self._previous_enabled = self.recorder.enabled
        self.recorder.enabled = True
        self._recording_step = step

    def _stop_recording(self) -> dict[str, dict[str, float]]:
        """Restore the recorder's previous state and return what it holds."""
        self.recorder.enabled = self._previous_enabled
        self._recording_step, self._paused = None, None
        return self.recorder.drain()

    def _stop_capture(self) -> None:
        if self._capture is not None:
            self._capture.stop()

    def _on_disable(self) -> None:
        try:
            self._stop_capture()
        finally:
            self._capture = None
            if self._recording_step is not None:
                self._stop_recording()

    def _sampled(self, step: int) -> bool:
        return step % self.every_n_steps == 0

    def _probe_allowed(self, layer: str) -> bool:
        return self.probe_layers is None or any(fnmatch.fnmatchcase(layer, p) for p in self.probe_layers)

    def _probed(self, step: int) -> bool:
        return self.probe_every_n_steps is not None and step % self.probe_every_n_steps == 0

    # ------------------------------------------------------------------ hooks

    @guarded
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # FSDP1 wraps the LightningModule from outside: its units are found from trainer.model.
        root = getattr(trainer, "model", None)
        self._fsdp1 = fsdp1_layouts(root if root is not None else pl_module)
        shape_of = (lambda p: layout_of(p, self._fsdp1).shape) if self._fsdp1 else None
        self.key_biases = find_key_biases(pl_module, shape_of) if self.key_bias else []
        if self.key_biases and uses_rotary(pl_module):
            rank_zero_info(
                "ZeroSumMonitor: the model uses rotary embeddings, so a key bias is not a shared key offset "
                "and its gradient need not vanish; key-bias signals are off (the C2 residual still applies)."
            )
            self.key_biases = []
        self._names = {id(m): clean_name(path) for path, m in pl_module.named_modules()}
        self._fullgraph = compiled_fullgraph(pl_module)
        if self._fullgraph and (self.c2 or self.probe_every_n_steps is not None):
            rank_zero_warn(
                "ZeroSumMonitor: the model (or a part of it) is compiled with torch.compile(fullgraph=True), and a "
                "gradient hook inside the compiled graph is a side effect Dynamo refuses, so the C2 residual and the "
                "probe are not sampled (the op's statistics and the key-bias signals still are); compile with "
                "fullgraph=False for them (each sampled step then runs a variant with a graph break at each "
                "attention call)."
            )

    @guarded
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        step = step_index(trainer)
        if self._recording_step is not None and self._recording_step != step:
            # The step we sampled ended without reaching our drain point (e.g. skipped): drop its values.
            self._stop_recording()
        if self._capture_step is not None and self._capture_step != step:
            self._stop_capture()
            self._capture, self._capture_step = None, None
        sampled, probed = self._sampled(step), self._probed(step)
        if self._recording_step is None and sampled:
            self._start_recording(step)
        if ((sampled and self.c2) or probed) and not self._fullgraph:  # no gradient hook Dynamo would refuse
            if self._capture is None:
                probe_layer = None
                if probed:
                    candidates = [name for name in self.sdpa_layers if self._probe_allowed(name)]
                    probe_layer = candidates[self._probes % len(candidates)] if candidates else ""
                self._capture = AttentionCapture(
                    self._names, self.sdpa_layers, c2=sampled and self.c2, probe_layer=probe_layer,
                    probe_heads=self.probe_heads, probe_queries=self.probe_queries, probe_filter=self._probe_allowed,
                )
                self._capture_step = step
            self._capture.start()  # every micro-batch's forward

    @guarded
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        self._stop_capture()  # the forward is over; the gradient hooks fire in the backward

    @guarded
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        step = step_index(trainer)
        sampled, probed = self._sampled(step), self._probed(step)
        if not (sampled or probed):
            return
        values: dict[str, float | torch.Tensor] = {}
        # Automatic optimization: every backward of the step (all accumulated micro-batches) is done
        # here. Manual optimization drains at on_train_batch_end instead, after all user backwards.
        if pl_module.automatic_optimization:
            values.update(self._capture_values(step))
            if self._recording_step == step:
                values.update(self._flatten(self._stop_recording()))
        if sampled and self.key_biases:
            values.update(self._key_bias_values(optimizer, trainer.strategy.root_device))
        self._emit(trainer, pl_module, values, step, optimizer)

    @guarded
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Validation can run inside an accumulated step (val_check_interval in batches): its forwards are not the step's.
        if self._recording_step is not None:
            self._paused, self.recorder.enabled = self.recorder.enabled, False

    @guarded
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._paused is not None:
            self.recorder.enabled, self._paused = self._paused, None

    @guarded
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = step_index(trainer)
        self._stop_capture()  # e.g. a step whose training_step returned None (no backward)
        if not pl_module.automatic_optimization and (self._recording_step == step or self._capture_step == step):
            values = self._capture_values(step)
            if self._recording_step == step:
                values.update(self._flatten(self._stop_recording()))
            self._emit(trainer, pl_module, values, step)
        self.dispatcher.run_actions(trainer, pl_module, step, self.quiet())

    @guarded
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._on_disable()
        if self.print_summary and trainer.is_global_zero:
            rank_zero_info(self.summary())

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        # Not guarded by design: restoring the recorder and leaving the capture mode must also happen
        # after the monitor disabled itself, and must not mask the run's own exception.
        try:
            self._on_disable()
        except Exception:  # noqa: BLE001
            pass

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.on_exception(trainer, pl_module, RuntimeError("teardown"))

    # ------------------------------------------------------------------ values

    def _flatten(self, stats: dict[str, dict[str, float]]) -> dict[str, float]:
        return {keys.metric(self.prefix, layer, key): value for layer, d in stats.items() for key, value in d.items()}

    def _capture_values(self, step: int) -> dict[str, torch.Tensor]:
        """C2 residuals and the probe of the capture of ``step`` (then dropped)."""
        capture = self._capture
        if capture is None or self._capture_step != step:
            return {}
        capture.stop()
        self._capture, self._capture_step = None, None
        out = {keys.metric(self.prefix, layer, "c2_residual"): v for layer, v in capture.c2_residuals().items()}
        if capture.probe_layer is not None:
            self._probes += 1
            cap = capture.probe
            if cap is not None and cap.do is not None:
                result = probe_backward(cap.q, cap.k, cap.v, cap.do, cap.attn_mask, cap.is_causal, cap.scale, cap.autocast_dtype)
                self.last_probe = (step, cap, result)
                out[keys.metric(self.prefix, cap.layer, "probe_dq_error")] = result.dq_error
                out[keys.metric(self.prefix, cap.layer, "probe_dq_error_max")] = result.dq_error_max
                out[keys.metric(self.prefix, cap.layer, "probe_leak_ratio")] = result.leak_ratio
        return out

    def _key_bias_values(self, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, torch.Tensor]:
        """Key-bias signals of the biases ``optimizer`` steps (several optimizers: each sees its own),
        global over ranks for sharded gradients (every rank takes part)."""
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        biases = [kb for kb in self.key_biases if id(kb.bias) in stepped]
        out: dict[str, torch.Tensor] = {}
        for layer, (bias_norm, weight_norm) in key_bias_values(biases, self._fsdp1, device).items():
            out[keys.metric(self.prefix, layer, "key_bias_grad_norm")] = bias_norm
            if weight_norm is not None:
                out[keys.metric(self.prefix, layer, "key_bias_grad_ratio")] = bias_norm / weight_norm
        return out

    def _emit(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        values: dict[str, float | torch.Tensor],
        step: int,
        optimizer: Optional[torch.optim.Optimizer] = None,
    ) -> None:
        """Reduce, detect, log and deliver one sample. Runs on every rank at every sampled step (the
        gather and, where it fails, the dispatcher's decision are collectives)."""
        distributed = trainer.world_size > 1
        if not values and not distributed:
            return
        device = trainer.strategy.root_device
        names = sorted(values)
        flat = torch.zeros(len(names), dtype=torch.float32, device=device)
        for i, name in enumerate(names):
            flat[i] = torch.as_tensor(values[name]).reshape(())  # a device-side copy, no host sync
        agreed = not distributed
        if distributed and self.sync_dist:
            flat, agreed = self._reduce(flat, names, device)
        metrics = dict(zip(names, flat.tolist()))  # one device -> host copy for all values
        alerts, extra = self.observe(step, metrics)
        for name, value in metrics.items():
            parsed = keys.parse_layer_key(self.prefix, name)
            if parsed is not None:
                self.tracks.setdefault(parsed[0], {}).setdefault(parsed[1], _Track()).add(value, step)
        log_to_loggers(trainer, {**metrics, **extra}, step)
        self.dispatcher.deliver(trainer, alerts, step, agreed=agreed, optimizer=optimizer)

    def _reduce(self, flat: torch.Tensor, names: list[str], device: torch.device) -> tuple[torch.Tensor, bool]:
        """Mean (max for :data:`MAX_REDUCED`) over ranks, see :func:`.ranks.reduce_values`."""
        stats = [keys.parse_layer_key(self.prefix, name) for name in names]
        by_max = [p is not None and p[1] in MAX_REDUCED for p in stats]
        return reduce_values(self._gather, flat.to(device), names, by_max, type(self).__name__)

    # ------------------------------------------------------------------ detection (online and offline)

    def observe(self, step: int, metrics: dict[str, float]) -> tuple[list[Alert], dict[str, float]]:
        """Feed one step's metrics (``{prefix}/{layer}/{stat}`` → value) to the detectors of the
        statistics in ``detect``. Returns the new alerts (not delivered) and the detector metrics to
        log (``…/{stat}/cusum``, ``…/{stat}/ratio``). The same call replays logged series offline."""
        fired: dict[str, list[tuple[float, str, Detection]]] = {}
        extra: dict[str, float] = {}
        for key in sorted(metrics):
            parsed = keys.parse_layer_key(self.prefix, key)
            if parsed is None or parsed[1] not in self.detect:
                continue
            layer, stat = parsed
            det = self._detector(key, stat)
            d = det.update(step, metrics[key])
            if d.cusum is not None:
                extra[keys.detector_key(key, "cusum")] = d.cusum
            if d.ratio is not None:
                extra[keys.detector_key(key, "ratio")] = d.ratio
            if d.new:
                fired.setdefault(stat, []).append((level_rank(d.level), layer, d))
        alerts = []
        for stat, hits in fired.items():
            hits.sort(key=lambda h: (h[0], h[2].score / h[2].threshold), reverse=True)
            _, _, top = hits[0]
            alerts.append(Alert(
                step=step, signal=keys.metric(self.prefix, stat), level=top.level, statistic=top.statistic,
                value=top.score, threshold=top.threshold, layers=tuple(h[1] for h in hits),
                signal_value=top.value, source=type(self).__name__,
                detail=f"baseline median {top.median:.4g} over the last {top.window} samples",
            ))
        return alerts, extra

    # ------------------------------------------------------------------ summary

    def summary(self) -> str:
        """Per layer, ``last / peak`` of each signal seen (the table printed at the end of training)."""
        if not self.tracks:
            what = "no attention statistics were recorded (no gproj_attn_func with stats enabled in the model?)"
            if self.key_bias and not self.key_biases:
                what += " and no key bias was found"
            return f"ZeroSumMonitor: {what}; nothing was logged."
        stats = [s for s in _SUMMARY_STATS if any(s in t for t in self.tracks.values())]
        stats += sorted({s for t in self.tracks.values() for s in t} - set(stats) - {"key_bias_grad_norm", "violation_max"})
        rows = []
        for layer in sorted(self.tracks):
            t = self.tracks[layer]
            samples = max(tr.samples for tr in t.values())
            cells = [f"{fmt(t[s].last)} / {fmt(t[s].peak)}" if s in t else "-" for s in stats]
            rows.append([layer, str(samples), *cells])
        table = format_table(["layer", "samples", *stats], rows)
        alerts = f"; {len(self.alerts)} alert(s)" if self.alerts else ""
        note = ""
        if any(s.startswith(("c2_residual", "probe_")) for s in stats):
            # a layer whose calls all fell back still gets these rows: they measure whatever kernel ran
            note = ("\nc2_residual and probe_* measure every SDPA call, also those the op did not serve (fallbacks, "
                    "unswapped layers); the other columns come from op calls only.")
        return f"ZeroSumMonitor (last / peak per layer, every {self.every_n_steps} steps{alerts}):\n{table}{note}"
