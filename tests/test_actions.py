"""The ``"skip"`` and ``"rollback"`` actions, their agreement across ranks, and the W&B alert channel
(issue 15, points 2 and 4).

What a step did is read from the model itself — weights and SGD momentum buffers copied at the start
of every step, the learning rate the optimizer holds — never from the monitor's own bookkeeping. The
cross-rank tests run two CPU processes (``ddp_fork``, gloo) where only rank 1 sees the anomaly; each
rank writes what it did to a JSON file.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger, WandbLogger
from torch import nn

from lightning_gproj import stats
from lightning_gproj.callbacks import (
    ZERO_SUM_DETECTOR,
    Alert,
    AlertDispatcher,
    DetectorConfig,
    GradNormMonitor,
    ZeroSumMonitor,
)

from _monitors import fit

pytestmark = pytest.mark.usefixtures("recorder_off")

SHORT = DetectorConfig(window=8, warmup=5)  # critical at 10x the median of the last 8 steps
OFF = DetectorConfig(warn_ratio=None, critical_ratio=None, cusum_warn=None)  # never alerts


def factors(n: int, spikes: dict[int, float]) -> list[float]:
    return [(1.0 + 0.02 * (s % 3)) * spikes.get(s, 1.0) for s in range(n)]


class Trainable(pl.LightningModule):
    """loss = f(step) · (mean(block(x)²) + 1), trained by SGD with momentum (so a step changes the weights and
    the optimizer state). Copies both at the start of every step, and the learning rate."""

    def __init__(self, f: list[float], lr: float = 0.05, schedule: bool = False, rank_spike: dict[int, float] | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Linear(4, 4)
        self.f, self.lr, self.schedule = f, lr, schedule
        self.rank_spike = rank_spike or {}  # {step: factor} applied to rank 1's gradients only
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.momenta: dict[int, list[torch.Tensor]] = {}
        self.lrs: dict[int, float] = {}
        self.losses: dict[int, float] = {}

    def on_train_batch_start(self, batch, batch_idx):
        step = self.global_step
        self.weights[step] = {n: p.detach().clone() for n, p in self.named_parameters()}
        opt = self.trainer.optimizers[0]
        self.momenta[step] = [opt.state[p]["momentum_buffer"].clone() for p in self.parameters() if p in opt.state]
        self.lrs[step] = opt.param_groups[0]["lr"]

    def training_step(self, batch, batch_idx):
        loss = self.f[self.global_step] * (self.block(batch).pow(2).mean() + 1.0)
        self.losses[self.global_step] = float(loss)
        return loss

    def on_after_backward(self):
        # After DDP's all-reduce: a gradient anomaly on rank 1 alone.
        if self.global_rank == 1 and self.global_step in self.rank_spike:
            for p in self.parameters():
                p.grad.mul_(self.rank_spike[self.global_step])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.schedule:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        x = torch.linspace(-1.0, 1.0, 2 * 16 * 4).reshape(2, 16, 4)
        return torch.utils.data.DataLoader([x] * 64, batch_size=None)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- skip


def test_skip_drops_the_step_whose_gradients_spiked(tmp_path, caplog):
    model = Trainable(factors(18, {12: 50.0}))
    monitor = GradNormMonitor(detector=SHORT, loss=False, actions=("skip",), print_summary=False)
    with caplog.at_level(logging.WARNING, logger="lightning_gproj.alerts"):
        trainer, logged = fit(model, [monitor], tmp_path, max_steps=18)
    assert [(a.step, a.level) for a in monitor.alerts] == [(12, "critical")]
    w, m = model.weights, model.momenta
    # Step 12 left weights and momentum untouched; every other step moved both.
    assert same(w[13], w[12]) and all(torch.equal(a, b) for a, b in zip(m[13], m[12]))
    assert all(not same(w[s + 1], w[s]) for s in range(17) if s != 12)
    assert all(not torch.equal(m[s + 1][0], m[s][0]) for s in range(1, 17) if s != 12)
    assert trainer.global_step == 18  # the skipped step still counts
    assert monitor.dispatcher.skipped_steps == 1
    assert monitor.dispatcher.action_log == [("skip", 12, "ok: gradients dropped")]
    assert logged["grad_norm/skipped_steps"] == {12: 1.0}
    assert any("skipped the optimizer step of step 12" in r.getMessage() for r in caplog.records)
    assert "1 step(s) skipped" in monitor.summary()


def test_skip_on_a_loss_spike_replaces_spike_detection(tmp_path):
    """The loss through the same detector: a 5x loss spike (the gradient norm detector switched off)
    is skipped, as Lightning's SpikeDetection (rtol=2) would flag it."""
    model = Trainable(factors(16, {11: 5.0}))
    monitor = GradNormMonitor(detector=OFF, loss_detector=replace(SHORT, critical_ratio=3.0, warn_ratio=None),
                              actions=("skip",), print_summary=False)
    _, logged = fit(model, [monitor], tmp_path, max_steps=16)
    assert [(a.step, a.signal, a.level, a.statistic) for a in monitor.alerts] == [(11, "grad_norm/loss", "critical", "ratio")]
    assert same(model.weights[12], model.weights[11]) and not same(model.weights[11], model.weights[10])
    assert logged["grad_norm/loss"] == pytest.approx(model.losses, rel=1e-6)
    assert logged["alert/grad_norm/loss"] == {11: 2.0}


def test_skip_is_impossible_after_the_step_and_says_so(tmp_path, caplog):
    dispatcher = AlertDispatcher("M", "m", actions=("skip",))
    trainer = SimpleNamespace(is_global_zero=True, loggers=[], world_size=1)
    alert = Alert(3, "m/x", "critical", "ratio", 20.0, 10.0)
    with caplog.at_level(logging.WARNING, logger="lightning_gproj.alerts"):
        dispatcher.deliver(trainer, [alert], 3, optimizer=None)
    assert dispatcher.skipped_steps == 0 and dispatcher.action_log == [("skip", 3, "ok: too late")]
    assert any("cannot skip step 3" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- rollback


def test_rollback_restores_the_last_good_checkpoint_and_scales_the_learning_rate(tmp_path):
    steps, base_lr = 20, 0.05
    model = Trainable(factors(steps, {13: 50.0}), lr=base_lr, schedule=True)
    ckpt_dir = tmp_path / "ckpt"
    monitor = GradNormMonitor(
        detector=SHORT, loss=False, actions=("rollback",), rollback_every_n_steps=4, rollback_lr_factor=0.5,
        checkpoint_dir=str(ckpt_dir), print_summary=False,
    )
    _, logged = fit(model, [monitor], tmp_path, max_steps=steps)
    assert [(a.step, a.level) for a in monitor.alerts] == [(13, "critical")]
    w, m = model.weights, model.momenta
    # The step-12 good checkpoint holds the state after step 12, i.e. the one step 13 started from:
    # after the rollback, step 14 starts from exactly that state again (weights and momentum).
    assert same(w[14], w[13]) and all(torch.equal(a, b) for a, b in zip(m[14], m[13]))
    assert not same(w[15], w[14])
    # LambdaLR: lr(s) = base / (1 + 0.1 s); halved from the step after the rollback on, schedule kept.
    for s in range(steps):
        expected = base_lr / (1.0 + 0.1 * s) * (0.5 if s >= 14 else 1.0)
        assert model.lrs[s] == pytest.approx(expected, rel=1e-12), s
    assert monitor.dispatcher.rollbacks == 1 and monitor.dispatcher.last_good[0] == 16
    # Good checkpoints at 0, 4, 8, 12 (quiet), none at 13 (alert), then 16; only the newest is kept.
    assert sorted(os.listdir(ckpt_dir)) == ["good-GradNormMonitor-step=16.ckpt"]
    saved = [e for e in monitor.dispatcher.action_log if e[0] == "save good checkpoint"]
    assert [e[1] for e in saved] == [0, 4, 8, 12, 16]
    assert monitor.dispatcher.action_log[4][:2] == ("rollback", 13)
    assert monitor.dispatcher.action_log[4][2].endswith("good-GradNormMonitor-step=12.ckpt")
    assert logged["grad_norm/rollbacks"] == {13: 1.0}


def test_rollback_without_a_good_checkpoint_goes_on(caplog):
    dispatcher = AlertDispatcher("M", "m", actions=("rollback", "stop"))
    trainer = SimpleNamespace(is_global_zero=True, loggers=[], world_size=1, should_stop=False)
    with caplog.at_level(logging.WARNING, logger="lightning_gproj.alerts"):
        dispatcher.deliver(trainer, [Alert(3, "m/x", "critical", "ratio", 20.0, 10.0)], 3)
        dispatcher.run_actions(trainer, None, 3, quiet=False)
    assert dispatcher.action_log == [("rollback", 3, "ok: no good checkpoint yet"), ("stop", 3, "ok: should_stop")]
    assert trainer.should_stop and dispatcher.rollbacks == 0
    assert any("cannot roll back at step 3" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- across ranks


class Report(pl.Callback):
    """Writes, per rank, the monitors' actions and the model's weights at the start of every step."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        monitors = [c for c in trainer.callbacks if isinstance(c, (GradNormMonitor, ZeroSumMonitor))]
        data = {
            "actions": [e for mon in monitors for e in mon.dispatcher.action_log],
            "alerts": [a.as_dict() for mon in monitors for a in mon.alerts],
            "weights": {str(s): [t.flatten().tolist() for t in w.values()] for s, w in pl_module.weights.items()},
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(data))


def two_ranks(model, monitor, tmp_path: Path, steps: int) -> tuple[dict, dict]:
    out = tmp_path / "ranks"
    out.mkdir()
    fit(model, [monitor, Report(out)], tmp_path, max_steps=steps, strategy="ddp_fork", devices=2)
    return tuple(json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))


@pytest.mark.parametrize("sync_dist", [True, False])
def test_skip_acts_on_every_rank_when_one_rank_spikes(tmp_path, sync_dist):
    """sync_dist=True: the norms are gathered before detecting (the max over ranks); False: each rank
    detects on its own and the decision is reduced (any rank)."""
    steps = 14
    model = Trainable(factors(steps, {}), rank_spike={10: 100.0})
    monitor = GradNormMonitor(detector=SHORT, loss=False, actions=("skip",), sync_dist=sync_dist,
                              print_summary=False)
    r0, r1 = two_ranks(model, monitor, tmp_path, steps)
    assert r0["actions"] == r1["actions"] == [["skip", 10, "ok: gradients dropped"]]
    # Rank 0 saw the spike only through the gather: with sync_dist it alerted too; without, it acted
    # on rank 1's decision alone.
    assert [a["step"] for a in r1["alerts"]] == [10]
    assert [a["step"] for a in r0["alerts"]] == ([10] if sync_dist else [])
    # Both ranks dropped step 10 and stayed identical.
    for r in (r0, r1):
        assert r["weights"]["11"] == r["weights"]["10"] != r["weights"]["9"]
    assert r0["weights"] == r1["weights"]


class RankLeak(Trainable):
    """Records a leak ratio that jumps on rank 1 only, from step 8 on, as the op would on each rank."""

    def training_step(self, batch, batch_idx):
        jump = self.global_rank == 1 and self.global_step >= 8
        stats.RECORDER.record("layer0", leak_ratio=torch.tensor(1.0 if jump else 0.01 * (1 + 0.01 * (self.global_step % 2))))
        return super().training_step(batch, batch_idx)


def test_rollback_acts_on_every_rank_when_one_rank_alerts(tmp_path):
    steps = 12
    model = RankLeak(factors(steps, {}))
    monitor = ZeroSumMonitor(
        every_n_steps=2, probe_every_n_steps=None, detector=replace(ZERO_SUM_DETECTOR, warmup=2),
        actions=("rollback",), rollback_every_n_steps=2, checkpoint_dir=str(tmp_path / "ckpt"), print_summary=False,
    )
    r0, r1 = two_ranks(model, monitor, tmp_path, steps)
    for r in (r0, r1):
        assert [(a["step"], a["signal"], a["level"]) for a in r["alerts"]] == [(8, "gproj/leak_ratio", "critical")]
        assert [e[:2] for e in r["actions"]] == [["save good checkpoint", s] for s in (0, 2, 4, 6)] + [["rollback", 8]]
        # Rolled back to the state after step 6, i.e. the one step 7 started from.
        assert r["weights"]["9"] == r["weights"]["7"] != r["weights"]["8"]
    assert r0["weights"] == r1["weights"]


# ----------------------------------------------------------------------------- W&B channel


class FakeRun:
    def __init__(self, fail: bool = False) -> None:
        self.alerts: list[dict] = []
        self.logged: list[dict] = []
        self.fail = fail

    def alert(self, title: str, text: str, level: str | None = None) -> None:
        if self.fail:
            raise ConnectionError("W&B unreachable")
        self.alerts.append({"title": title, "text": text, "level": level})

    def log(self, metrics: dict) -> None:
        self.logged.append(metrics)


class FakeWandbLogger(WandbLogger):
    """A WandbLogger (for the dispatcher's isinstance check) that needs no wandb install."""

    def __init__(self, run: FakeRun) -> None:
        Logger.__init__(self)
        self._run = run

    @property
    def experiment(self) -> FakeRun:
        return self._run

    def log_metrics(self, metrics, step=None) -> None:
        self._run.log({**metrics, "trainer/global_step": step})


def test_alerts_reach_wandb_alert_api_on_rank_zero_only(caplog):
    run, other = FakeRun(), FakeRun()
    warn = Alert(5, "gproj/leak_ratio", "warn", "ratio", 3.5, 3.0, ("blocks.0.attn",), 0.02, "ZeroSumMonitor")
    critical = Alert(5, "grad_norm/global", "critical", "ratio", 12.0, 10.0, ("blocks.1",), 40.0, "GradNormMonitor")
    dispatcher = AlertDispatcher("ZeroSumMonitor", "gproj")
    zero = SimpleNamespace(is_global_zero=True, world_size=1, loggers=[FakeWandbLogger(run), CSVLoggerStub()])
    dispatcher.deliver(zero, [warn, critical], 5)
    assert run.alerts == [
        {"title": "ZeroSumMonitor: gproj/leak_ratio warn", "text": warn.message(), "level": "WARN"},
        {"title": "GradNormMonitor: grad_norm/global critical", "text": critical.message(), "level": "ERROR"},
    ]
    assert run.logged == [{"alert/gproj/leak_ratio": 1.0, "alert/grad_norm/global": 2.0, "trainer/global_step": 5}]
    rank1 = SimpleNamespace(is_global_zero=False, world_size=1, loggers=[FakeWandbLogger(other)])
    dispatcher.deliver(rank1, [critical], 6)
    assert other.alerts == [] and other.logged == []
    # An unreachable W&B is reported once and changes nothing else.
    broken = AlertDispatcher("M", "m")
    failing = SimpleNamespace(is_global_zero=True, world_size=1, loggers=[FakeWandbLogger(FakeRun(fail=True))])
    with caplog.at_level(logging.WARNING, logger="lightning_gproj.alerts"):
        broken.deliver(failing, [critical], 7)
        broken.deliver(failing, [critical], 8)
    assert len([r for r in caplog.records if "W&B alert raised ConnectionError" in r.getMessage()]) == 1
    assert len(broken.alerts) == 2


class CSVLoggerStub:
    """Any other logger: receives the metrics, not W&B alerts."""

    def __init__(self) -> None:
        self.logged: list[dict] = []

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append(metrics)
