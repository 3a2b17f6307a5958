"""Health statistics of the attention backward (DESIGN.md §8), recorded on request.

The op (`lightning_gproj.ops`) writes into :data:`RECORDER` while it is enabled; monitors
(`lightning_gproj.callbacks`) enable it for the steps they sample and drain it afterwards. Recording
is off by default and costs nothing then.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterator

import torch

#: Statistics reduced with ``max`` (instead of ``mean``) when a layer is called several times a step.
MAX_REDUCED = frozenset({"violation_max", "max_logit"})


class StatsRecorder:
    """Collects per-layer attention statistics between two :meth:`drain` calls.

    Values are 0-dim tensors (kept on their device until drained, so recording never synchronizes).
    """

    def __init__(self) -> None:
        self.enabled = False
        self._values: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))

    @contextlib.contextmanager
    def recording(self) -> Iterator["StatsRecorder"]:
        """Enable recording inside the block (restores the previous state on exit)."""
        previous, self.enabled = self.enabled, True
        try:
            yield self
        finally:
            self.enabled = previous

    def record(self, name: str, **values: torch.Tensor) -> None:
        """Add 0-dim tensors ``values`` for layer ``name`` (no-op while disabled)."""
        if not self.enabled:
            return
        for key, value in values.items():
            self._values[name][key].append(value.detach().float().reshape(()))

    def drain(self) -> dict[str, dict[str, float]]:
        """Return ``{layer: {statistic: value}}`` recorded since the last drain, and clear it.

        Several calls of one layer (gradient accumulation, activation checkpointing, a shared module) are
        averaged, except the statistics in :data:`MAX_REDUCED`, which take the maximum. A NaN marks a
        statistic undefined for that call (e.g. λ where every query row sees one key) and is left out of
        the mean; a statistic undefined in every call stays NaN.
        """
        out: dict[str, dict[str, float]] = {}
        for name, stats in self._values.items():
            out[name] = {}
            for key, values in stats.items():
                stacked = torch.stack(values)
                reduced = stacked.max() if key in MAX_REDUCED else stacked.nanmean()
                out[name][key] = float(reduced)
        self._values.clear()
        return out


#: The process-wide recorder that :func:`lightning_gproj.gproj_attn_func` writes into.
RECORDER = StatsRecorder()
