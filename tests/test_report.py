"""``python -m lightning_gproj.report``: reading CSV logs, the PNG dashboard, clear errors."""

from __future__ import annotations

import csv
import sys

import lightning.pytorch as pl
import matplotlib.image
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_gproj import GProjPlugin
from lightning_gproj.callbacks import DetectorConfig, GradNormMonitor, ZeroSumMonitor
from lightning_gproj.report import alert_steps, layer_series, load_logs, loss_keys, main, render


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = (t.reshape(2, 8, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 8, 16)


class Model(pl.LightningModule):
    """One attention block; the loss is multiplied by 100 from step 30 on (a gradient-norm spike)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].attn = Attention()
        self.head = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        loss = self.head(self.blocks[0].attn(batch)).float().pow(2).mean()
        self.log("train_loss", loss)
        return loss * (100.0 if self.global_step >= 30 else 1.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        data = torch.randn(40, 2, 8, 16, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(list(data), batch_size=None)


def test_dashboard_from_a_real_run(tmp_path, capsys):
    torch.manual_seed(0)  # the weights (the data has its own generator)
    monitors = [
        # critical only: random batches reach 4x
        GradNormMonitor(detector=DetectorConfig(window=20, warmup=10, warn_ratio=None, cusum_warn=None), print_summary=False),
        ZeroSumMonitor(every_n_steps=5, probe_every_n_steps=None, print_summary=False),
    ]
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=36, logger=logger, log_every_n_steps=1, callbacks=monitors,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        plugins=[GProjPlugin("bf16-mixed", fix="none")],
    )
    trainer.fit(Model())
    series = load_logs(tmp_path / "run")  # the one metrics.csv below
    assert [a.step for a in monitors[0].alerts] == [30], [a.message() for a in monitors[0].alerts]
    assert alert_steps(series) == [(30, 2, "grad_norm/global")]
    leak = layer_series(series, "gproj", "leak_ratio")
    assert sorted(leak) == ["blocks.0.attn"] and sorted(leak["blocks.0.attn"]) == [0, 5, 10, 15, 20, 25, 30, 35]

    out = tmp_path / "dash.png"
    fig = render(series, out)
    image = matplotlib.image.imread(out)
    assert image.ndim == 3 and image.shape[0] > 500 and image.shape[1] > 500
    loss_ax, grad_ax, leak_ax = fig.axes[0], fig.axes[1], fig.axes[3]
    # the loss panel: the model's loss and the monitor's, not the loss detector's ratio / CUSUM or alert levels
    assert {"grad_norm/loss/ratio", "train_loss", "grad_norm/loss"} <= set(series)
    assert sorted(ln.get_label() for ln in loss_ax.get_lines() if not ln.get_label().startswith("_")) == [
        "grad_norm/loss", "train_loss"]
    line = grad_ax.get_lines()[0]
    assert list(line.get_xdata()) == sorted(series["grad_norm/global"])
    np.testing.assert_allclose(line.get_ydata(), [series["grad_norm/global"][s] for s in sorted(series["grad_norm/global"])])
    assert [ln.get_label() for ln in leak_ax.get_lines() if not ln.get_label().startswith("_")] == ["blocks.0.attn leak_ratio"]
    # the alert is marked on every panel, in red (critical)
    for ax in fig.axes:
        marks = [c for c in ax.get_lines() if list(c.get_xdata()) == [30, 30]]
        assert len(marks) == 1 and marks[0].get_color() == "red"

    # the command line's entry point (`python -m lightning_gproj.report DIR` calls main), in process
    assert main([str(tmp_path / "run" / "version_0")]) == 0
    assert (tmp_path / "run" / "version_0" / "dashboard.png").exists()
    assert "1 alert(s)" in capsys.readouterr().out


def test_leak_panel_shows_the_leak_a_gproj_run_removed(tmp_path):
    # A fix="gproj" run (the README demo) logs leak_removed_ratio, not leak_ratio: the panel read "not logged".
    values = {0: 4.0e-3, 10: 6.5e-3, 20: 5.0e-3}
    series = {"gproj/blocks.0.attn/leak_removed_ratio": dict(values), "grad_norm/global": {0: 1.0, 10: 0.9, 20: 0.8}}
    fig = render(series, tmp_path / "dash.png")
    leak_ax = fig.axes[3]
    assert leak_ax.get_title() == "Leak ratio"
    lines = [ln for ln in leak_ax.get_lines() if not ln.get_label().startswith("_")]
    assert [ln.get_label() for ln in lines] == ["blocks.0.attn leak_removed_ratio"] and lines[0].get_linestyle() == "--"
    assert list(lines[0].get_xdata()) == [0, 10, 20]
    np.testing.assert_array_equal(lines[0].get_ydata(), [4.0e-3, 6.5e-3, 5.0e-3])
    assert "not logged" not in [t.get_text() for t in leak_ax.texts]


def test_clear_errors(tmp_path, monkeypatch, capsys):
    for version in (0, 1):
        d = tmp_path / "two" / f"version_{version}"
        d.mkdir(parents=True)
        with open(d / "metrics.csv", "w", newline="") as f:
            csv.writer(f).writerows([["step", "loss"], [0, 1.0]])
    assert main([str(tmp_path / "two")]) == 2
    assert "several CSV logs" in capsys.readouterr().err
    assert load_logs(tmp_path / "two" / "version_1") == {"loss": {0: 1.0}}

    assert main([str(tmp_path / "missing")]) == 2
    assert "no such log directory" in capsys.readouterr().err

    missing_out = tmp_path / "nonexist" / "dir" / "x.png"
    assert main([str(tmp_path / "two" / "version_0"), "-o", str(missing_out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"output directory {str(missing_out.parent)!r} does not exist" in err
    assert not missing_out.parent.exists()

    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / "events.out.tfevents.1.host").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    with pytest.raises(RuntimeError, match="needs the `tensorboard` package"):
        load_logs(tb)
    assert main([str(tb)]) == 2

    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the dashboard's plotting library not installed
    assert main([str(tmp_path / "two" / "version_0")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the dashboard needs matplotlib: pip install") and "Traceback" not in err
    assert not (tmp_path / "two" / "version_0" / "dashboard.png").exists()


@pytest.mark.parametrize("content", [b"", b"step,loss\n", b"loss,epoch\n1.0,0\n", b"\x89PNG\r\n\x1a\n\x00\xff\xfe"],
                         ids=["empty", "header_only", "no_step_column", "binary"])
def test_a_metrics_csv_without_values_is_an_error(tmp_path, content, capsys):
    """No value with a step (or not a CSV at all) is an error naming the file, not an empty dashboard ("0 metrics")
    nor an evaluation of nothing (new-user pass 12)."""
    d = tmp_path / "version_0"
    d.mkdir()
    (d / "metrics.csv").write_bytes(content)
    with pytest.raises(ValueError, match="metrics.csv (holds no metric value with a step|is not a CSV file)"):
        load_logs(d)
    assert main([str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "metrics.csv" in err and not (d / "dashboard.png").exists()


def test_loss_panel_takes_training_losses_only():
    """The loss panel's series: every training loss however it is grouped, not the loss detector's statistics,
    alert levels, a layer named "loss", validation / test losses or the epoch aggregate of a step-level loss."""
    losses = ["train_loss", "loss/train", "losses/total", "train_loss/ce", "grad_norm/loss", "value_loss"]
    others = ["grad_norm/loss/ratio", "grad_norm/loss/cusum", "alert/grad_norm/loss", "grad_norm/layer/loss", "val_loss",
              "val/loss", "loss/val", "validation_loss", "test_loss", "train_loss_epoch", "grad_norm/global"]
    assert loss_keys({k: {0: 1.0} for k in losses + others}) == sorted(losses)
    assert loss_keys({"mine/layer/loss": {}, "grad_norm/layer/loss": {}}, grad_prefix="mine") == ["grad_norm/layer/loss"]
    assert loss_keys({"train_loss_epoch": {}}) == ["train_loss_epoch"]  # no step-level name: the epoch one
