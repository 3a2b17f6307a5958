"""Behaviour both monitors share: through the plugin, argument checks, switching themselves off after an
error, summaries, pickling."""

from __future__ import annotations

import logging
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gproj import GProjPlugin, stats
from lightning_gproj.callbacks import DetectorConfig, GradNormMonitor, MonitorDisabledWarning, ZeroSumMonitor

from _monitors import B, N, AttnModel, LayeredModel, fit, loader, wobble

pytestmark = pytest.mark.usefixtures("recorder_off")


class SDPAAttention(nn.Module):
    """Causal self-attention through F.scaled_dot_product_attention, GPT-2 style fused biased qkv."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.reshape(*x.shape[:2], 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)


class SDPABlockModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].attn = SDPAAttention()
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.head(self.blocks[0].attn(batch)).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return loader(16, (B, N, 16))


def test_monitors_through_the_plugin_use_module_paths(tmp_path):
    """With GProjPlugin swapping SDPA, the op's stats and the key-bias signal share the layer name."""
    monitors = [ZeroSumMonitor(every_n_steps=1, print_summary=False), GradNormMonitor(print_summary=False)]
    trainer, logged = fit(SDPABlockModel(), monitors, tmp_path, max_steps=3, plugins=[GProjPlugin("bf16-mixed")])
    for stat in ("violation_median", "violation_max", "leak_removed_ratio", "mean_key_norm", "key_bias_grad_ratio"):
        series = logged[f"gproj/blocks.0.attn/{stat}"]
        assert sorted(series) == [0, 1, 2] and all(math.isfinite(v) for v in series.values()), stat
    # fix="gproj" removed the leak from dQ: it is logged as removed, and leak_ratio (alerted on) is absent
    assert "gproj/blocks.0.attn/leak_ratio" not in logged
    assert sorted(monitors[0].tracks) == ["blocks.0.attn"]
    assert {"grad_norm/layer/blocks.0", "grad_norm/layer/head"} <= set(logged)


@pytest.mark.parametrize(
    ("cls", "kwargs", "argument"),
    [
        (ZeroSumMonitor, {"every_n_steps": 0}, "every_n_steps"),
        (ZeroSumMonitor, {"every_n_steps": 2.5}, "every_n_steps"),
        (ZeroSumMonitor, {"key_bias": 1}, "key_bias"),
        (ZeroSumMonitor, {"sync_dist": "yes"}, "sync_dist"),
        (ZeroSumMonitor, {"prefix": ""}, "prefix"),
        (ZeroSumMonitor, {"recorder": object()}, "recorder"),
        (GradNormMonitor, {"every_n_steps": -1}, "every_n_steps"),
        (GradNormMonitor, {"detector": {"window": 1}}, "window"),
        (GradNormMonitor, {"detector": {"warn_ratio": 1.0}}, "warn_ratio"),
        (GradNormMonitor, {"detector": {"warn_ratio": float("inf")}}, "warn_ratio"),
        (GradNormMonitor, {"detector": {"window": 10, "warmup": 11}}, "warmup"),
        (GradNormMonitor, {"loss_detector": {"warmup": 0}}, "warmup"),
        (GradNormMonitor, {"detector": {"ema_decay": 1.0}}, "ema_decay"),
        (GradNormMonitor, {"detector": {"windw": 10}}, "detector"),
        (GradNormMonitor, {"detector": 10}, "detector"),
        (ZeroSumMonitor, {"detector": {"floor": -1.0}}, "floor"),
        (GradNormMonitor, {"actions": ("skip", "undo")}, "actions"),
        (GradNormMonitor, {"rollback_lr_factor": 1.5}, "rollback_lr_factor"),
        (ZeroSumMonitor, {"rollback_every_n_steps": 0}, "rollback_every_n_steps"),
        (GradNormMonitor, {"top_k": 0}, "top_k"),
        (GradNormMonitor, {"layer_of": "blocks"}, "layer_of"),
        (GradNormMonitor, {"prefix": "grad/"}, "prefix"),
    ],
)
def test_constructor_rejects_bad_arguments(cls, kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        cls(**kwargs)


def test_a_mapping_of_detector_fields_overrides_the_monitors_own_defaults():
    from dataclasses import replace

    from lightning_gproj.callbacks import GRAD_NORM_DETECTOR, LOSS_DETECTOR, ZERO_SUM_DETECTOR

    gn = GradNormMonitor(detector={"window": 200}, loss_detector={"critical_ratio": 2.0})
    assert gn.detector == replace(GRAD_NORM_DETECTOR, window=200)
    assert gn.loss_detector == replace(LOSS_DETECTOR, critical_ratio=2.0)
    assert ZeroSumMonitor(detector={"warmup": 3}).detector == replace(ZERO_SUM_DETECTOR, warmup=3)
    config = DetectorConfig(window=7, warmup=2)
    assert GradNormMonitor(detector=config).detector is config


@pytest.mark.parametrize(
    ("kwargs", "argument", "bad"),
    [({"detect": ("leak_ratio", "nope")}, "detect", "nope"), ({"floors": {"leek_ratio": 1e-2}}, "floors", "leek_ratio")],
)
def test_zero_sum_rejects_unknown_statistic_names(kwargs, argument, bad):
    with pytest.raises(ValueError, match=f"`{argument}`") as info:
        ZeroSumMonitor(**kwargs)
    message = str(info.value)
    assert repr(bad) in message and "'leak_ratio'" in message and "'probe_dq_error_max'" in message
    assert ZeroSumMonitor(detect=("probe_dq_error_max",), floors={"c2_residual": 0.0}).detect == ("probe_dq_error_max",)


@pytest.mark.parametrize(
    ("cls", "kwargs", "argument"),
    [
        (GradNormMonitor, {"warn_ratio": 10, "critical_ratio": 4}, "warn_ratio"),
        (ZeroSumMonitor, {"warn_ratio": 10, "critical_ratio": 4}, "warn_ratio"),
        (ZeroSumMonitor, {"cusum_warn": 30, "cusum_critical": 20}, "cusum_warn"),
        (GradNormMonitor, {"slope_warn": 5, "slope_critical": 2}, "slope_warn"),
    ],
)
def test_constructor_rejects_warn_above_critical(cls, kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`.*must not exceed"):
        cls(detector=kwargs)
    equal = {k: min(kwargs.values()) for k in kwargs}  # warn == critical stays accepted
    cls(detector=DetectorConfig(**equal))


def _break_zero_sum(monitor: ZeroSumMonitor, monkeypatch) -> None:
    def drain():
        raise RuntimeError("drain failed")

    monkeypatch.setattr(monitor.recorder, "drain", drain)


def _break_grad_norm(monitor: GradNormMonitor, monkeypatch) -> None:
    def measure(*args):
        raise RuntimeError("measure failed")

    monkeypatch.setattr(monitor, "_measure", measure)


@pytest.mark.parametrize(
    ("make", "model", "breaker"),
    [
        (lambda: ZeroSumMonitor(every_n_steps=1), AttnModel, _break_zero_sum),
        (lambda: GradNormMonitor(), lambda: LayeredModel([wobble(8, 0.1, 0.0)]), _break_grad_norm),
    ],
    ids=["zero_sum", "grad_norm"],
)
def test_a_failing_monitor_disables_itself_and_training_continues(tmp_path, monkeypatch, make, model, breaker):
    monitor = make()
    breaker(monitor, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, logged = fit(model(), [monitor], tmp_path, max_steps=5)
    assert trainer.global_step == 5
    assert monitor.disabled and "failed" in monitor.failure
    disabled = [w for w in caught if issubclass(w.category, MonitorDisabledWarning)]
    assert len(disabled) == 1 and type(monitor).__name__ in str(disabled[0].message)
    assert stats.RECORDER.enabled is False
    assert not [k for k in logged if k.startswith(("gproj/", "grad_norm/"))]


def test_summaries_are_printed_at_the_end_of_fit(tmp_path):
    handler_logger = logging.getLogger("lightning.pytorch")
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Collect(level=logging.INFO)
    handler_logger.addHandler(handler)
    try:
        fit(AttnModel(), [ZeroSumMonitor(every_n_steps=2), GradNormMonitor()], tmp_path, max_steps=3)
    finally:
        handler_logger.removeHandler(handler)
    zero_sum = [r for r in records if r.startswith("ZeroSumMonitor")]
    grad_norm = [r for r in records if r.startswith("GradNormMonitor")]
    assert len(zero_sum) == 1 and "layer0" in zero_sum[0] and "leak_ratio" in zero_sum[0]
    assert len(grad_norm) == 1 and "peak" in grad_norm[0] and "alerts (warn + critical)" in grad_norm[0]


def test_monitors_pickle_and_drive_the_recorder_of_their_process():
    """ddp_spawn pickles callbacks into the workers; the op there writes into that process's RECORDER."""
    import pickle

    zero_sum, grad_norm = pickle.loads(pickle.dumps([ZeroSumMonitor(), GradNormMonitor()]))
    assert zero_sum.recorder is stats.RECORDER
    assert grad_norm.detector.window == 100
