"""GradNormMonitor (callbacks/grad_norm.py), fitted on CPU: norms and baseline against an independent
computation, the alert at a spike, non-finite norms, AMP unscaling and clipping order, and the training
loss series."""

from __future__ import annotations

import logging
import math
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lightning_gproj.callbacks import DetectorConfig, GradNormMonitor, default_layer_of

from _monitors import B, E, LayeredModel, fit, loader, wobble


def test_grad_norm_logs_norms_and_baseline_matching_independent_computation(tmp_path):
    steps, window = 14, 5
    model = LayeredModel([wobble(steps, 0.3, 0.0), wobble(steps, 0.5, 1.0)])
    detector = DetectorConfig(window=window, warn_ratio=1e6, critical_ratio=None, cusum_warn=None, warmup=2, ema_decay=0.8)
    monitor = GradNormMonitor(detector=detector, loss=False, print_summary=False)
    trainer, logged = fit(model, [monitor], tmp_path, max_steps=steps)

    norms = [model.norms[s]["global"] for s in range(steps)]
    ema = None
    for s in range(steps):
        for layer in ("global", "layer/blocks.0", "layer/blocks.1", "layer/head"):
            expected = model.norms[s][layer.removeprefix("layer/")]
            assert logged[f"grad_norm/{layer}"][s] == pytest.approx(expected, rel=1e-6), (layer, s)
        past = np.array(norms[max(0, s - window) : s])
        if s == 0:
            assert s not in logged["grad_norm/baseline_median"]
        else:
            median = float(np.median(past))
            mad = float(np.median(np.abs(past - median)))
            assert logged["grad_norm/baseline_median"][s] == pytest.approx(median, rel=1e-6)
            assert logged["grad_norm/baseline_mad"][s] == pytest.approx(mad, rel=1e-5, abs=1e-9)
            assert logged["grad_norm/ratio"][s] == pytest.approx(norms[s] / median, rel=1e-6)
            assert logged["grad_norm/ema_ratio"][s] == pytest.approx(norms[s] / ema, rel=1e-6)
            if mad > 0:
                z = (norms[s] - median) / (1.4826 * mad)
                assert logged["grad_norm/robust_z"][s] == pytest.approx(z, rel=1e-5)
        ema = norms[s] if ema is None else 0.8 * ema + 0.2 * norms[s]
        assert logged["grad_norm/warnings"][s] == 0
    assert all(math.isfinite(v) for series in logged.values() for v in series.values())


def test_grad_norm_warns_exactly_at_the_spike_and_names_the_layer(tmp_path, caplog):
    steps, spikes = 22, {15: 200.0, 16: 150.0, 19: 300.0}  # 15-16: one episode; 19: a second one
    blocks1 = [f * spikes.get(s, 1.0) for s, f in enumerate(wobble(steps, 0.2, 1.0))]
    model = LayeredModel([wobble(steps, 0.2, 0.0), blocks1])
    detector = DetectorConfig(window=8, warn_ratio=10.0, critical_ratio=None, cusum_warn=None, warmup=5)
    monitor = GradNormMonitor(detector=detector, loss=False, print_summary=False)
    with caplog.at_level(logging.WARNING, logger="lightning_gproj.alerts"):
        trainer, logged = fit(model, [monitor], tmp_path, max_steps=steps)
    spike_warnings = [r.getMessage() for r in caplog.records if r.name == "lightning_gproj.alerts"]

    # Independently: the steps whose norm exceeds 10x the median of the previous <= 8 norms.
    norms = [model.norms[s]["global"] for s in range(steps)]
    above = [s for s in range(5, steps) if norms[s] > 10.0 * np.median(norms[max(0, s - 8) : s])]
    assert above == [15, 16, 19]
    assert [a.step for a in monitor.alerts] == [15, 19]
    assert len(spike_warnings) == 2
    assert "at step 15:" in spike_warnings[0] and "at step 19:" in spike_warnings[1]
    for msg, alert in zip(spike_warnings, monitor.alerts):
        assert alert.layers[0] == "blocks.1" and alert.signal == "grad_norm/global"
        assert (alert.level, alert.statistic, alert.threshold) == ("warn", "ratio", 10.0)
        step = alert.step
        assert alert.value == pytest.approx(norms[step] / np.median(norms[max(0, step - 8) : step]), rel=1e-6)
        assert "Largest increases: blocks.1 (" in msg
    assert [logged["grad_norm/warnings"][s] for s in (14, 15, 16, 18, 19, 21)] == [0, 1, 1, 1, 2, 2]
    assert logged["alert/grad_norm/global"] == {15: 1.0, 19: 1.0}
    assert monitor._states[0].stats.steps_above == 3
    summary = monitor.summary()
    row = next(line for line in summary.splitlines() if line.startswith("grad norm, optimizer 0"))
    # series, steps, median, MAD, last, peak "(step N)", alerts, steps above, non-finite (peak spans 3 tokens)
    assert "alerts (warn + critical)" in summary and row.split()[-3:] == ["2", "3", "0"]


def test_grad_norm_keeps_non_finite_norms_out_of_the_baseline(tmp_path, caplog):
    steps = 10
    factors = wobble(steps, 0.2, 0.0)
    factors[6] = float("inf")  # inf and nan gradients
    model = LayeredModel([factors])
    monitor = GradNormMonitor(detector=DetectorConfig(window=4, warmup=2, cusum_warn=None), loss=False,
                              print_summary=False)
    with caplog.at_level(logging.WARNING, logger="lightning_gproj.alerts"):
        trainer, logged = fit(model, [monitor], tmp_path, max_steps=steps)
    norms = [model.norms[s]["global"] for s in range(steps)]
    assert not math.isfinite(norms[6]) and not math.isfinite(logged["grad_norm/global"][6])
    finite = [n for n in norms if math.isfinite(n)]  # steps 0-5, 7-9: the window skips step 6
    assert logged["grad_norm/baseline_median"][8] == pytest.approx(float(np.median(finite[3:7])), rel=1e-6)
    assert logged["grad_norm/baseline_median"][9] == pytest.approx(float(np.median(finite[4:8])), rel=1e-6)
    assert monitor.alerts == [] and not [r for r in caplog.records if r.name == "lightning_gproj.alerts"]
    stats = monitor._states[0].stats
    assert stats.nonfinite_steps == 1 and stats.peak == pytest.approx(max(finite))


class AmpLayeredModel(LayeredModel):
    """Also records the gradients as the backward left them (scaled) and after clipping."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scaled: dict[int, tuple[float, float]] = {}
        self.clipped: dict[int, float] = {}

    def on_after_backward(self) -> None:
        scale = float(self.trainer.precision_plugin.scaler.get_scale())
        g = torch.cat([p.grad.flatten() for p in self.parameters()])
        self.scaled[self.global_step] = (float(torch.linalg.vector_norm(g)), scale)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # After optimizer.step; the next zero_grad is still to come: these are the clipped gradients.
        g = torch.cat([p.grad.flatten() for p in self.parameters()])
        self.clipped[self.global_step - 1] = float(torch.linalg.vector_norm(g))


def test_grad_norm_sees_unscaled_gradients_before_clipping(tmp_path):
    steps, clip = 4, 1e-2
    model = AmpLayeredModel([wobble(steps, 0.3, 0.0)])
    amp = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))
    trainer, logged = fit(
        model, [GradNormMonitor(print_summary=False)], tmp_path, max_steps=steps, plugins=[amp], gradient_clip_val=clip
    )
    for s in range(steps):
        scaled_norm, scale = model.scaled[s]
        assert scale > 1.0
        assert logged["grad_norm/global"][s] == pytest.approx(scaled_norm / scale, rel=1e-4)
        assert logged["grad_norm/global"][s] > 10 * clip  # so clipping changed the gradients ...
        assert model.clipped[s] == pytest.approx(clip, rel=1e-3)  # ... after the monitor read them


class LossModel(pl.LightningModule):
    """Positive loss, different per micro-batch; keeps every loss training_step returned."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(E, E)
        self.returned: dict[int, list[float]] = {}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.net(batch).float().pow(2).mean() + 0.1 * batch_idx  # fp32 under autocast too
        self.returned.setdefault(self.global_step, []).append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return loader(32, (B, E))


@pytest.mark.parametrize("amp", [False, True])
def test_grad_norm_logs_the_training_loss_of_the_step(tmp_path, amp):
    """The loss series: the mean over the step's micro-batches of what training_step returned, also
    under 16-mixed, where Lightning hands the backward hooks the GradScaler-scaled loss."""
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))] if amp else []
    model = LossModel()
    monitor = GradNormMonitor(loss_detector=DetectorConfig(window=4, warmup=2), print_summary=False)
    trainer, logged = fit(model, [monitor], tmp_path, max_steps=6, accumulate_grad_batches=3, plugins=plugins)
    expected = {s: sum(v) / len(v) for s, v in model.returned.items()}
    assert sorted(expected) == list(range(6)) and all(len(v) == 3 for v in model.returned.values())
    assert logged["grad_norm/loss"] == pytest.approx(expected, rel=1e-5)
    past = [expected[s] for s in range(2)]
    assert logged["grad_norm/loss/ratio"][2] == pytest.approx(expected[2] / float(np.median(past)), rel=1e-5)
    assert sorted(logged["grad_norm/loss/ratio"]) == [1, 2, 3, 4, 5] and sorted(logged["grad_norm/loss/cusum"]) == [2, 3, 4, 5]
    assert "loss" in monitor.summary()


def test_grad_norm_leaves_non_positive_losses_out_of_the_loss_detector(tmp_path):
    class Negative(LossModel):
        def training_step(self, batch, batch_idx):
            return -1.0 - super().training_step(batch, batch_idx)

    model = Negative()
    monitor = GradNormMonitor(loss_detector=DetectorConfig(window=4, warmup=2), print_summary=False)
    trainer, logged = fit(model, [monitor], tmp_path, max_steps=6)
    assert all(v <= 0 for v in logged["grad_norm/loss"].values())
    assert "grad_norm/loss/ratio" not in logged and monitor.alerts == []
    assert len(monitor._states[0].loss_detector.baseline) == 0


def test_grad_norm_warns_once_when_the_loss_turns_non_finite(tmp_path):
    """A NaN loss is where a divergence ends: no alert (no log to compare) but one warning, at the first such step;
    the run goes on and the later non-finite steps are counted (a new-user pass found it silent)."""
    class GoesNaN(LossModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if self.global_step >= 3 else loss

    monitor = GradNormMonitor(loss_detector=DetectorConfig(window=4, warmup=2), print_summary=False)
    with pytest.warns(UserWarning, match="the training loss is nan at step 3") as record:
        trainer, logged = fit(GoesNaN(), [monitor], tmp_path, max_steps=6)
    assert sum("the training loss is" in str(w.message) for w in record) == 1
    assert trainer.global_step == 6 and monitor.alerts == []
    assert monitor._states[0].loss_stats.nonfinite_steps == 3


class TwoOptimizers(pl.LightningModule):
    """A GAN-style manual loop: each batch, optimizer 0 steps on net a's loss, then optimizer 1 on 20× net b's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.a, self.b = nn.Linear(E, E), nn.Linear(E, E)
        self.returned: dict[int, dict[int, float]] = {0: {}, 1: {}}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        for i, (net, opt, scale) in enumerate(zip((self.a, self.b), self.optimizers(), (1.0, 20.0))):
            loss = scale * net(batch).pow(2).mean()
            self.returned[i][batch_idx] = float(loss)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=1e-2), torch.optim.SGD(self.b.parameters(), lr=1e-2)

    def train_dataloader(self):  # batches near a constant one: a healthy run, no loss spike
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader([1.0 + 0.05 * torch.randn(B, E, generator=g) for _ in range(32)],
                                           batch_size=None)


def test_grad_norm_with_two_optimizers_keeps_a_loss_series_per_optimizer(tmp_path):
    """Each optimizer's loss (what was backpropagated since the optimizer step before it) is its own series and
    detector, as its gradient norms are; one series fed both (1× and 20×, alternating) warned at every step of a
    healthy run (new-user pass 11)."""
    model = TwoOptimizers()
    monitor = GradNormMonitor(loss_detector=DetectorConfig(window=4, warmup=2), print_summary=False)
    trainer, logged = fit(model, [monitor], tmp_path, max_steps=12)  # 6 batches, 2 optimizer steps each
    for i in (0, 1):
        assert logged[f"grad_norm/opt{i}/loss"] == pytest.approx(model.returned[i], rel=1e-6)
        past = [model.returned[i][s] for s in range(2)]  # the warm-up: the ratio at step 2 is to their median
        assert logged[f"grad_norm/opt{i}/loss/ratio"][2] == pytest.approx(model.returned[i][2] / float(np.median(past)))
    assert "grad_norm/loss" not in logged and monitor.alerts == []
    summary = monitor.summary()
    assert "loss, optimizer 0" in summary and "loss, optimizer 1" in summary


def test_grad_norm_resumes_from_a_checkpoint_with_one_loss_series():
    """A checkpoint written before the loss series became per optimizer (its loss state at the top level) restores
    that state as optimizer 0's: the monitor's state then equals the one it was saved from."""
    config = DetectorConfig(window=4, warmup=2)
    saved = GradNormMonitor(loss_detector=config)
    for step, loss in enumerate([1.0, 1.1, 0.9, 1.0, 5.0]):
        saved.observe(step, 1.0 + 0.1 * step, {"a": 1.0})
        saved.observe_loss(step, loss)
    assert [a.signal for a in saved.alerts] == []  # observe does not deliver; the detectors hold the episode
    state = saved.state_dict()
    old = {"optimizers": {i: {k: v for k, v in s.items() if k != "loss"} for i, s in state["optimizers"].items()},
           "loss": state["optimizers"]["0"]["loss"], "dispatcher": state["dispatcher"]}
    resumed = GradNormMonitor(loss_detector=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a state it cannot read would warn
        resumed.load_state_dict(old)
    assert resumed.state_dict() == state and resumed._states[0].loss_detector.level == "warn"  # 5.0 vs median 1.0


def test_grad_norm_reused_on_another_model_names_its_layers(tmp_path):
    """A monitor passed to a second fit of another model names that model's layers (the name map was built once and
    kept: every gradient of the second model went to "<unnamed>"; new-user pass 11)."""
    monitor = GradNormMonitor(print_summary=False)
    for run in range(2):
        _, logged = fit(LayeredModel([[1.0] * 4, [2.0] * 4]), [monitor], tmp_path / str(run), max_steps=4)
        layers = {k.removeprefix("grad_norm/layer/") for k in logged if k.startswith("grad_norm/layer/")}
        assert layers == {"blocks.0", "blocks.1", "head"}, (run, layers)


def test_default_layer_of():
    assert default_layer_of("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert default_layer_of("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert default_layer_of("transformer.wte.weight") == "transformer.wte"
    assert default_layer_of("lm_head.weight") == "lm_head"
    assert default_layer_of("pos") == "pos"
