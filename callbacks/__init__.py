"""Lightning callbacks that watch BF16 attention training (DESIGN.md §8); no Triton imported here.

- :class:`ZeroSumMonitor`: zero-sum violation, leak ratio, mean-key/query norms (from
  :data:`lightning_gproj.stats.RECORDER`) and the key-bias gradient (any model), every N steps.
- :class:`GradNormMonitor`: global and per-layer gradient norms, robust baseline, spike warnings.

Both log to every Lightning logger, print a summary at the end of training, and never stop a run: a
failing hook disables its monitor with a :class:`MonitorDisabledWarning`.
"""

from ._base import MonitorDisabledWarning
from .grad_norm import GradNormAlert, GradNormMonitor, GradNormSpikeWarning, RobustBaseline, default_layer_of
from .zero_sum import KeyBias, ZeroSumMonitor, find_key_biases

__all__ = [
    "GradNormAlert",
    "GradNormMonitor",
    "GradNormSpikeWarning",
    "KeyBias",
    "MonitorDisabledWarning",
    "RobustBaseline",
    "ZeroSumMonitor",
    "default_layer_of",
    "find_key_biases",
]
