"""Monitors resume from a Lightning checkpoint: a run stopped and resumed raises the same alerts, at the
same steps, with the same detector values, as the same run uninterrupted (issue 15, point 1).

The model's gradients, loss and recorded zero-sum values depend on the step only (its optimizer never
changes the parameters), so both runs see the same series; the spike sits after the restart, within
the warm-up a fresh detector would need, so a monitor that forgot its state at the restart would miss it.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_gproj import stats
from lightning_gproj.callbacks import ChangeDetector, DetectorConfig, GradNormMonitor, ZeroSumMonitor

from _monitors import fit

pytestmark = pytest.mark.usefixtures("recorder_off")

STEPS, STOP, SPIKE = 20, 10, 14  # fresh detectors after STOP would be warm only at step >= 16


def factor(step: int) -> float:
    return (1.0 + 0.1 * ((step * 7) % 5)) * (30.0 if step == SPIKE else 1.0)


class StepModel(pl.LightningModule):
    """loss = factor(step) · Σ block(x)², parameters never updated; records a leak ratio per step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights in every run
        self.block = nn.Linear(4, 4)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        step = self.global_step
        leak = 0.01 * (1.0 + 0.05 * (step % 3)) * (40.0 if step == SPIKE else 1.0)
        stats.RECORDER.record("layer0", leak_ratio=torch.tensor(leak), violation_max=torch.tensor(0.1 + 0.01 * step))
        return factor(step) * self.block(batch).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        x = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
        return torch.utils.data.DataLoader([x] * 64, batch_size=None)


def monitors() -> list[pl.Callback]:
    short = DetectorConfig(window=8, warmup=6, warn_ratio=4.0, critical_ratio=10.0, cusum_warn=25.0)
    return [
        ZeroSumMonitor(every_n_steps=2, probe_every_n_steps=None, print_summary=False,
                       detector=DetectorConfig(window=6, warmup=3, warn_ratio=3.0, critical_ratio=10.0, min_log_sigma=0.25)),
        GradNormMonitor(detector=short, loss_detector=short, print_summary=False),
    ]


def run(tmp_path: Path, max_steps: int, ckpt_path: str | None = None):
    callbacks = monitors()
    trainer, logged = fit(StepModel(), callbacks, tmp_path, max_steps, ckpt_path=ckpt_path)
    return trainer, callbacks, logged


def test_resumed_run_raises_the_same_alerts_at_the_same_steps(tmp_path):
    _, whole, whole_logged = run(tmp_path / "whole", STEPS)
    expected = [a.as_dict() for m in whole for a in m.alerts]
    # The spike raises an alert in each series (leak ratio, grad norm, loss), and nothing else does.
    assert sorted((a["step"], a["signal"]) for a in expected) == [
        (SPIKE, "gproj/leak_ratio"), (SPIKE, "grad_norm/global"), (SPIKE, "grad_norm/loss")
    ]

    first, _, _ = run(tmp_path / "part", STOP)
    ckpt = tmp_path / "stop.ckpt"
    first.save_checkpoint(ckpt)
    states = torch.load(ckpt, weights_only=True)["callbacks"]  # plain containers: loads without pickle
    assert set(states) == {"ZeroSumMonitor{'prefix': 'gproj'}", "GradNormMonitor{'prefix': 'grad_norm'}"}
    resumed_trainer, resumed, resumed_logged = run(tmp_path / "resumed", STEPS, ckpt_path=str(ckpt))
    assert resumed_trainer.global_step == STEPS
    assert [a.as_dict() for m in resumed for a in m.alerts] == expected

    # Every detector statistic logged after the restart matches the uninterrupted run's.
    a, b = whole_logged, resumed_logged
    compared = 0
    for key in a:
        if key.endswith(("/cusum", "/ratio", "baseline_median", "/warnings")):
            after = {s: v for s, v in a[key].items() if s >= STOP}
            assert {s: b[key][s] for s in after} == pytest.approx(after, rel=1e-12), key
            compared += len(after)
    assert compared > 40

    # Without the restored state the spike falls inside a fresh warm-up and goes unseen: monitors whose
    # state_key differs (another prefix) get nothing restored from the same checkpoint.
    unrestored = monitors()
    for m in unrestored:
        m.prefix = m.prefix + "_other"  # a different state_key: Lightning restores nothing into it
    fit(StepModel(), unrestored, tmp_path / "unrestored", STEPS, ckpt_path=str(ckpt))
    assert [a for m in unrestored for a in m.alerts] == []


def test_detector_state_round_trip_continues_identically():
    config = DetectorConfig(window=10, warmup=4, slope_window=5, slope_warn=1.5)
    values = [1.0 + 0.01 * (i % 4) for i in range(12)] + [1.0 * 1.3**i for i in range(12)]
    whole = ChangeDetector(config)
    expected = [whole.update(s, v) for s, v in enumerate(values)]
    part = ChangeDetector(config)
    for s, v in enumerate(values[:9]):
        part.update(s, v)
    restored = ChangeDetector(config)
    restored.load_state_dict(part.state_dict())
    assert [restored.update(s, v) for s, v in enumerate(values) if s >= 9] == expected[9:]
    assert any(d.new for d in expected[9:])


def test_an_unreadable_state_warns_and_keeps_the_monitor_usable():
    zero_sum, grad_norm = ZeroSumMonitor(print_summary=False), GradNormMonitor(print_summary=False)
    zero_sum.observe(0, {"gproj/a/leak_ratio": 0.1})
    grad_norm.observe(0, 1.0, {"a": 1.0})
    for monitor in (zero_sum, grad_norm):
        before = monitor.state_dict()
        with pytest.warns(RuntimeWarning, match="could not restore its state"):
            monitor.load_state_dict({"detectors": {"gproj/a/leak_ratio": {"nonsense": 1}}, "optimizers": {"0": {}}})
        assert monitor.state_dict() == before and not monitor.disabled
