"""Lightning callbacks that watch BF16 attention training (DESIGN.md §8); no Triton imported here.

- :class:`ZeroSumMonitor`: zero-sum violation, leak ratio, mean-key/query norms (from
  :data:`lightning_gproj.stats.RECORDER`), the C2 residual and key-bias gradient (any model), and a
  probe of unswapped attention against float64, every N steps; alerts on their change.
- :class:`GradNormMonitor`: global and per-layer gradient norms and the training loss, robust
  baseline, CUSUM, log-slope; warn/critical alerts naming the layers.
- :class:`Alert`, :class:`AlertDispatcher`: alert records and their delivery (log warning, loggers,
  W&B alerts, user function, skip / rollback / checkpoint / stop / remediate actions, decided
  identically on every rank).
- :class:`ChangeDetector`, :class:`DetectorConfig`: the detector and its settings, shared with the
  offline replay (``lightning_gproj.evaluate``).
- :mod:`.keys`: the metric-key layout, built and parsed in one place.

Both monitors log to every Lightning logger, print a summary at the end of training, keep their state
in Lightning checkpoints (``state_dict``), and never stop a run by accident: a failing hook disables its
monitor with a :class:`MonitorDisabledWarning`.
"""

from ._base import MonitorDisabledWarning
from .alerts import ACTIONS, REMEDIATIONS, Alert, AlertDispatcher, attention_sites, remediate
from .capture import AttentionCapture, ProbeCapture, ProbeResult, probe_backward, reference_dq
from .detectors import ChangeDetector, Detection, DetectorConfig, RobustBaseline
from .grad_norm import GRAD_NORM_DETECTOR, LOSS_DETECTOR, GradNormMonitor, GradNormStep, default_layer_of
from .key_bias import KeyBias, find_key_biases
from .zero_sum import DEFAULT_DETECT, DEFAULT_FLOORS, ZERO_SUM_DETECTOR, ZeroSumMonitor

__all__ = [
    "ACTIONS",
    "Alert",
    "AlertDispatcher",
    "AttentionCapture",
    "ChangeDetector",
    "DEFAULT_DETECT",
    "DEFAULT_FLOORS",
    "Detection",
    "DetectorConfig",
    "GRAD_NORM_DETECTOR",
    "GradNormMonitor",
    "GradNormStep",
    "KeyBias",
    "LOSS_DETECTOR",
    "MonitorDisabledWarning",
    "ProbeCapture",
    "ProbeResult",
    "REMEDIATIONS",
    "RobustBaseline",
    "ZERO_SUM_DETECTOR",
    "ZeroSumMonitor",
    "attention_sites",
    "default_layer_of",
    "find_key_biases",
    "probe_backward",
    "reference_dq",
    "remediate",
]
