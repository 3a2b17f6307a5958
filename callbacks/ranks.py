"""Cross-rank reductions of the monitors, so that every rank detects on the same numbers and every
action is decided identically on every rank (never by one rank alone).

* :func:`reduce_values` — ZeroSumMonitor's values: one torchmetrics all-gather of every rank's row,
  then the mean (or the max) over ranks, checked to hold the same keys on every rank.
* :func:`max_norms_mean_loss` — GradNormMonitor's per-parameter norms and the loss: one device-side
  all-gather, before the single device → host copy the monitor makes anyway (no extra host sync).
* :func:`any_rank` — a decision taken on unreduced values, made common: true on every rank if it is on
  any (a collective with a host sync).

Sharded parameters (FSDP) are summed over their shard groups first (:mod:`._sharded`); these
functions see whole-parameter values.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Sequence

import lightning.pytorch as pl
import torch
import torchmetrics
from torchmetrics.utilities import dim_zero_cat


class RankRows(torchmetrics.Metric):
    """Gathers one row of values per rank (``dist_reduce_fx="cat"``); :meth:`compute` syncs across ranks
    (torchmetrics' all-gather over the default process group) and returns the rows concatenated."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("rows", default=[], dist_reduce_fx="cat")
        self.mismatch_warned = False

    def update(self, row: torch.Tensor) -> None:
        self.rows.append(row.reshape(-1))

    def compute(self) -> torch.Tensor:
        return dim_zero_cat(self.rows)


def reduce_values(
    gather: RankRows, flat: torch.Tensor, names: Sequence[str], by_max: Sequence[bool], source: str
) -> tuple[torch.Tensor, bool]:
    """Every rank's ``flat`` (values named ``names``, same length) gathered through ``gather`` and
    reduced: max over ranks where ``by_max``, mean of the non-NaN values elsewhere (NaN where every rank
    has NaN). Returns ``(values, True)``, identical on every rank; ``(this rank's flat, False)`` when the
    ranks' name lists differ (warned once per ``gather``). Collective: every rank must call it."""
    device = flat.device
    gather = gather.to(device)
    n = len(names)
    tag = zlib.crc32("\n".join(names).encode()) % (1 << 24)  # exact in float32
    header = torch.tensor([float(n), float(tag)], device=device)
    gather.update(torch.cat([header, flat]))
    rows = gather.compute()
    gather.reset()
    if rows.numel() % (n + 2) == 0:
        rows = rows.reshape(-1, n + 2)
        if bool((rows[:, 0] == n).all()) and bool((rows[:, 1] == tag).all()):
            values = rows[:, 2:]
            is_max = torch.tensor(list(by_max), dtype=torch.bool, device=device)
            # NaN marks a statistic undefined on that rank (e.g. λ where every row sees one key): left out
            return torch.where(is_max, values.max(dim=0).values, values.nanmean(dim=0)), True
    if not gather.mismatch_warned:
        gather.mismatch_warned = True
        warnings.warn(
            f"{source}: ranks recorded different sets of layers; logging each rank's own values "
            "without reduction where they differ (the decision to act is still reduced across ranks).",
            RuntimeWarning,
            stacklevel=3,
        )
    return flat, False


def max_norms_mean_loss(strategy: "pl.strategies.Strategy", table: torch.Tensor) -> torch.Tensor:
    """``table`` (n + 1, 2) = (value, present) rows: n parameter norms then the loss. Gathered from every
    rank on the device (no host sync) and reduced: each norm row by its max over ranks (the same on
    every rank after DDP's all-reduce; a NaN anywhere stays NaN), the loss by its mean over the ranks
    that have one. Collective: every rank must call it with a table of the same shape."""
    n = table.shape[0] - 1
    every = strategy.all_gather(table).reshape(-1, n + 1, 2)
    weight = every[:, n, 1]
    loss = (every[:, n, 0] * weight).sum() / weight.sum().clamp_min(1.0)
    return torch.cat([every[:, :n].amax(dim=0), torch.stack([loss, weight.amax()]).reshape(1, 2)])


def any_rank(trainer: "pl.Trainer", decision: bool) -> bool:
    """``decision`` made common: True on every rank if it is True on any (a no-op in one process)."""
    if trainer.world_size == 1:
        return decision
    return trainer.strategy.reduce_boolean_decision(decision, all=False)
