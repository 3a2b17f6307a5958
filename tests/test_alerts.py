"""Detectors on constructed sequences with known change points, alert delivery and actions, the fp32
remediation, and the offline lead-time harness on synthetic traces.

Expected firing steps come from independent numpy re-computations of the documented statistics, and
the change points are built into the sequences, so "fires at the right step and not before" is
checked against both.
"""

from __future__ import annotations

import logging
import math
import re

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_gproj import GProjPlugin, swap_attention
from lightning_gproj.callbacks import (
    Alert,
    AlertDispatcher,
    ChangeDetector,
    DetectorConfig,
    GradNormMonitor,
    ZeroSumMonitor,
)
from lightning_gproj.evaluate import divergence_step, evaluate, main as evaluate_main
from lightning_gproj.report import load_logs

from _scripts import load_script

# benchmarks/lead_time.py: made-up runs (synthetic) and their CSV logs (write_csv)
lead_time = load_script("benchmarks/lead_time.py", "lead_time_benchmark")
synthetic, write_csv = lead_time.synthetic, lead_time.write_csv

# ------------------------------------------------------------------------------------ detectors


def noisy(n: int, seed: int, sigma: float = 0.05, level: float = 1.0) -> np.ndarray:
    return level * np.exp(np.random.default_rng(seed).normal(0.0, sigma, n))


def run(det: ChangeDetector, values) -> list:
    return [det.update(step, float(v)) for step, v in enumerate(values)]


def first_new(detections) -> tuple[int, str, str] | None:
    for d in detections:
        if d.new:
            return d.step, d.level, d.statistic
    return None


def test_ratio_detector_fires_at_the_jump_and_escalates():
    values = noisy(80, 0)
    values[50:] *= 5.0  # warn level (> 4x), not critical
    values[60:] *= 3.0  # 15x: critical
    det = ChangeDetector(DetectorConfig(window=30, warmup=10, warn_ratio=4.0, critical_ratio=10.0, cusum_warn=None))
    out = run(det, values)
    new = [(d.step, d.level, d.statistic) for d in out if d.new]
    assert new == [(50, "warn", "ratio"), (60, "critical", "ratio")]
    # independent: the ratio to the median of the previous <= 30 values
    for s in (49, 50, 60):
        assert out[s].ratio == pytest.approx(values[s] / np.median(values[max(0, s - 30):s]), rel=1e-12)
    assert all(d.level is None for d in out[:50])


def numpy_cusum(values: np.ndarray, window: int, warmup: int, k: float, min_sigma: float) -> np.ndarray:
    """The documented CUSUM, re-computed with numpy: S over the robust z of log(values)."""
    logs, s, out = np.log(values), 0.0, np.full(len(values), np.nan)
    for t in range(len(values)):
        past = logs[max(0, t - window):t]
        if len(past) >= warmup:
            med = np.median(past)
            sigma = max(1.4826 * np.median(np.abs(past - med)), min_sigma)
            s = max(0.0, s + (logs[t] - med) / sigma - k)
            out[t] = s
    return out


def test_cusum_fires_on_a_small_sustained_shift_and_not_before():
    values = noisy(300, 1, sigma=0.05)
    values[200:] *= math.exp(0.15)  # +3 sigma of log: no single value is far off (ratio 1.16)
    det = ChangeDetector(DetectorConfig(window=100, warmup=20, warn_ratio=4.0, critical_ratio=None, cusum_warn=12.0, cusum_drift=1.0))
    out = run(det, values)
    expected = numpy_cusum(values, 100, 20, 1.0, 0.02)
    np.testing.assert_allclose([d.cusum if d.cusum is not None else np.nan for d in out], expected, rtol=1e-9)
    crossing = int(np.argmax(expected > 12.0))
    assert 200 <= crossing < 215
    assert first_new(out) == (crossing, "warn", "cusum")
    assert max(d.ratio for d in out[20:]) < 4.0


def test_log_slope_fires_on_steady_growth():
    n, t0, rate = 400, 250, 0.01  # x e per 100 steps after t0
    values = noisy(n, 2, sigma=0.05)
    values[t0:] *= np.exp(rate * np.arange(n - t0))
    det = ChangeDetector(DetectorConfig(
        window=100, warmup=20, warn_ratio=None, critical_ratio=None, cusum_warn=None,
        slope_window=50, slope_horizon=100, slope_warn=2.0,
    ))
    out = run(det, values)
    expected = None
    for t in range(49, n):  # numpy polyfit over the last 50 values (this one included)
        slope = np.polyfit(np.arange(t - 49, t + 1), np.log(values[t - 49 : t + 1]), 1)[0]
        assert out[t].growth == pytest.approx(math.exp(slope * 100), rel=1e-9)
        if expected is None and t >= 20 and math.exp(slope * 100) > 2.0:
            expected = t
    assert expected is not None and expected > t0
    assert first_new(out) == (expected, "warn", "log_slope")


def test_floor_silences_rounding_noise_but_not_a_rise():
    """A quantity that is 0 in exact arithmetic, at rounding level (~1e-6, jumping 10x at random),
    then rising above the floor at step 60."""
    rng = np.random.default_rng(4)
    values = 1e-6 * 10.0 ** rng.uniform(-1, 1, 100)
    values[60:] = 0.02
    noisy_det = ChangeDetector(DetectorConfig(window=20, warmup=5, warn_ratio=3.0, cusum_warn=15.0))
    assert first_new(run(noisy_det, values[:60])) is not None  # without a floor: false alarms on noise
    det = ChangeDetector(DetectorConfig(window=20, warmup=5, warn_ratio=3.0, cusum_warn=15.0, floor=1e-3))
    out = run(det, values)
    assert first_new(out) == (60, "critical", "ratio")
    assert out[60].ratio == pytest.approx(20.0) and out[59].value == values[59]


def test_detector_ignores_non_finite_values_and_rejects_bad_arguments():
    det = ChangeDetector(DetectorConfig(window=5, warmup=2))
    for s, v in enumerate([1.0, 1.1, float("nan"), float("inf"), 0.9]):
        d = det.update(s, v)
        assert d.level is None
    assert list(det.baseline.values) == [1.0, 1.1, 0.9]
    for kwargs, name in (({"window": 1}, "window"), ({"warn_ratio": 0.5}, "warn_ratio"),
                         ({"cusum_warn": -1.0}, "cusum_warn"), ({"slope_window": 2}, "slope_window"),
                         ({"ema_decay": 0.0}, "ema_decay"), ({"window": 5, "warmup": 6}, "warmup"),
                         ({"floor": -1.0}, "floor")):
        with pytest.raises(ValueError, match=f"`{name}`"):
            ChangeDetector(DetectorConfig(**kwargs))



def test_a_partial_detector_mapping_that_contradicts_a_kept_default_names_the_argument_and_the_default():
    # GradNormMonitor's default warmup is 100: {"window": 50} alone keeps it, and warmup > window. The
    # error named `warmup` only (the user never set it) and neither the argument nor where 100 came from.
    with pytest.raises(ValueError) as err:
        GradNormMonitor(detector={"window": 50})
    assert re.fullmatch(r"`detector`: `warmup` \(100\) must not exceed `window` \(50\) \(warmup=100: the default "
                        r"this mapping keeps.*set warmup too\)", str(err.value))
    with pytest.raises(ValueError, match=r"^`loss_detector`: `warn_ratio` \(1\.5\) must not exceed `critical_ratio` "
                                         r"\(1\.2\) \(warn_ratio=1\.5: the default"):
        GradNormMonitor(loss_detector={"critical_ratio": 1.2})
    with pytest.raises(ValueError, match=r"^`detector`: `warmup` \(30\) must not exceed `window` \(20\) \(window=20: "):
        ZeroSumMonitor(detector={"warmup": 30})  # ZERO_SUM_DETECTOR's window is 20
    with pytest.raises(ValueError, match=r"^`loss_detector`: `warn_ratio` must be None or a finite number > 1, got 0.5$"):
        GradNormMonitor(loss_detector={"warn_ratio": 0.5})  # a field the mapping sets: no default to name
    monitor = GradNormMonitor(detector={"window": 50, "warmup": 50})  # both set: accepted
    assert (monitor.detector.window, monitor.detector.warmup, monitor.detector.warn_ratio) == (50, 50, 4.0)

def test_zero_sum_observe_groups_layers_and_names_the_strongest():
    zs = ZeroSumMonitor(detector=DetectorConfig(window=10, warmup=3, warn_ratio=3.0, critical_ratio=10.0, cusum_warn=None),
                        print_summary=False)
    alerts = []
    for step in range(10):
        jump = step >= 6
        metrics = {
            "gproj/a/leak_ratio": 0.01 * (20.0 if jump else 1.0 + 0.01 * (step % 2)),
            "gproj/b/leak_ratio": 0.02 * (5.0 if jump else 1.0 + 0.01 * (step % 2)),
            "gproj/c/leak_ratio": 0.03,
            "gproj/a/mean_key_norm": 100.0 * (step + 1),  # not in `detect`: never alerts
        }
        new, extra = zs.observe(step, metrics)
        alerts += new
        assert ("gproj/a/leak_ratio/cusum" in extra) == (step >= 3)
    assert len(alerts) == 1
    (a,) = alerts
    assert (a.step, a.signal, a.level, a.statistic, a.layers) == (6, "gproj/leak_ratio", "critical", "ratio", ("a", "b"))
    assert a.signal_value == pytest.approx(0.2)


# ------------------------------------------------------------------------------------ delivery and actions


class Spiky(pl.LightningModule):
    """loss = f(step) · sum(block(x)): the gradient norm is f(step) times a constant."""

    def __init__(self, factors, attention: bool = False) -> None:
        super().__init__()
        self.factors = factors
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])
        self.attn = SDPAAttention() if attention else None

    def training_step(self, batch, batch_idx):
        out = self.blocks[0](batch)
        if self.attn is not None:
            out = out + self.attn(batch).float()
        return self.factors[self.global_step] * out.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        x = torch.linspace(-1, 1, 2 * 16 * 8).reshape(2, 16, 8)
        return torch.utils.data.DataLoader([x] * 64, batch_size=None)


class SDPAAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = (t.reshape(2, 16, 1, 8).transpose(1, 2) for t in self.qkv(x).split(8, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 16, 8)


def spike_monitor(**kwargs) -> GradNormMonitor:
    """A GradNormMonitor on the gradient norm only, with a short warm-up (5 steps, window 10)."""
    return GradNormMonitor(detector=DetectorConfig(warmup=5, window=10), loss=False, print_summary=False, **kwargs)


def spike_factors(n: int, at: int) -> list[float]:
    return [1.0 + 0.05 * math.sin(s) + (99.0 if s >= at else 0.0) for s in range(n)]


def fit(module, callbacks, tmp_path, max_steps, **kwargs):
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=CSVLogger(tmp_path, name="logs", version=0),
        log_every_n_steps=1, callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, **kwargs,
    )
    trainer.fit(module)
    return trainer


def test_alert_reaches_log_loggers_user_function_and_stops_training(tmp_path, caplog):
    seen: list[Alert] = []
    monitor = spike_monitor(on_alert=seen.append, actions=("stop",))
    with caplog.at_level(logging.WARNING, logger="lightning_gproj.alerts"):
        trainer = fit(Spiky(spike_factors(30, 12)), [monitor], tmp_path, max_steps=30)
    assert [a.step for a in seen] == [12] and seen[0].level == "critical" and seen[0].layers[0] == "blocks.0"
    assert trainer.global_step == 13  # stopped after the alert's step
    messages = [r.getMessage() for r in caplog.records if r.name == "lightning_gproj.alerts"]
    assert any("CRITICAL at step 12" in m for m in messages) and any("stopping training after step 12" in m for m in messages)
    logged = load_logs(tmp_path / "logs" / "version_0")
    assert logged["alert/grad_norm/global"] == {12: 2.0}


def test_a_raising_action_or_user_function_does_not_stop_training(tmp_path, caplog):
    def broken(alert):
        raise RuntimeError("user function broke")

    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the checkpoint directory should be")
    monitor = spike_monitor(
        on_alert=broken, actions=("checkpoint",), action_level="warn", checkpoint_dir=str(blocker / "sub"),
    )
    factors = spike_factors(30, 12)
    factors[20:] = [1.0] * 10
    factors[26] = 500.0  # a second episode: the failures are not reported twice
    with caplog.at_level(logging.WARNING, logger="lightning_gproj.alerts"):
        trainer = fit(Spiky(factors), [monitor], tmp_path, max_steps=30)
    assert trainer.global_step == 30 and not monitor.disabled
    assert [a.step for a in monitor.alerts] == [12, 26]
    assert [entry[0] for entry in monitor.dispatcher.action_log] == ["checkpoint", "checkpoint"]
    assert all(entry[2].startswith("failed") for entry in monitor.dispatcher.action_log)
    failures = [r.getMessage() for r in caplog.records if "raised" in r.getMessage()]
    assert len([m for m in failures if "on_alert" in m]) == 1 and len([m for m in failures if "checkpoint" in m]) == 1


def test_checkpoint_action_saves_at_the_alert_step(tmp_path):
    monitor = spike_monitor(actions=("checkpoint",))
    fit(Spiky(spike_factors(16, 12)), [monitor], tmp_path, max_steps=16)
    path = tmp_path / "alert_checkpoints" / "alert-step=12.ckpt"
    assert path.exists()
    assert torch.load(path, weights_only=False)["global_step"] == 13  # saved after the optimizer step of step 12


def test_remediate_switches_the_driving_layer_from_the_next_step(tmp_path):
    model = Spiky(spike_factors(16, 12), attention=True)
    monitor = spike_monitor(actions=("remediate",), remediation="fp32")
    fit(model, [monitor], tmp_path, max_steps=16, plugins=[GProjPlugin("bf16-mixed", fix="none")])
    site = model.attn.forward.site
    assert monitor.alerts[0].step == 12
    assert "attn.qkv" in monitor.alerts[0].layers  # a parameter group inside the swapped module "attn"
    assert site.compute_dtype == torch.float32 and site.fix == "none"
    assert monitor.dispatcher.action_log == [("remediate", 12, "ok: attn")]

    monitor = spike_monitor(actions=("remediate",), top_k=5)
    model = Spiky(spike_factors(16, 12), attention=True)
    fit(model, [monitor], tmp_path / "g", max_steps=16, plugins=[GProjPlugin("bf16-mixed", fix="none")])
    assert model.attn.forward.site.fix == "gproj" and model.attn.forward.site.compute_dtype is None


def test_remediate_reaches_attention_swapped_at_the_root():
    # The root module's calls are recorded as "<root>" (the swap report's name for it), and it holds every layer.
    from lightning_gproj.callbacks.alerts import remediate

    for layers in (["<root>"], ["qkv"], []):
        attn = SDPAAttention()
        swap_attention(attn, fix="none")
        assert remediate(attn, layers, "gproj") == [""], layers
        assert attn.forward.site.fix == "gproj"
    nested = torch.nn.Sequential(SDPAAttention(), SDPAAttention())
    swap_attention(nested, fix="none")
    assert remediate(nested, ["1.qkv"], "gproj") == ["1"]  # a nested site: only the layer's own
    assert nested[0].forward.site.fix == "none" and nested[1].forward.site.fix == "gproj"


def test_fp32_site_runs_attention_in_fp32():
    torch.manual_seed(0)
    attn = SDPAAttention()
    swap_attention(attn, fix="none")
    x = torch.randn(2, 16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = attn(x)
        attn.forward.site.compute_dtype = torch.float32
        after = attn(x)
        q, k, v = (t.reshape(2, 16, 1, 8).transpose(1, 2) for t in attn.qkv(x).split(8, dim=-1))
    qf, kf, vf = q.float(), k.float(), v.float()  # the bf16 activations, upcast
    s = (qf @ kf.transpose(-1, -2) / math.sqrt(8)).masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf"))
    expected = (s.softmax(-1) @ vf).transpose(1, 2).reshape(2, 16, 8).to(torch.bfloat16)
    assert after.dtype == torch.bfloat16
    torch.testing.assert_close(after, expected, rtol=0, atol=0)
    assert not torch.equal(before, after)  # the bf16 kernel rounds differently


def test_dispatcher_rejects_bad_arguments():
    for kwargs, name in (({"actions": ("explode",)}, "actions"), ({"actions": "stop"}, "actions"),
                         ({"action_level": "info"}, "action_level"), ({"remediation": "fp8"}, "remediation"),
                         ({"on_alert": 3}, "on_alert")):
        with pytest.raises(ValueError, match=f"`{name}`"):
            AlertDispatcher("m", "p", **kwargs)
    with pytest.raises(ValueError, match="`actions`"):
        GradNormMonitor(actions=("nope",))
    with pytest.raises(ValueError, match="`probe_every_n_steps`"):
        ZeroSumMonitor(probe_every_n_steps=0)
    for bad in (-1, True, math.inf, math.nan, "0.1"):  # as DetectorConfig(floor=...) refuses them
        with pytest.raises(ValueError, match=re.escape("`floors['c2_residual']` must be a finite number >= 0")):
            ZeroSumMonitor(floors={"c2_residual": bad})
    assert ZeroSumMonitor(floors={"c2_residual": np.float32(0.5)}).floors["c2_residual"] == 0.5  # NumPy, as DetectorConfig


# ------------------------------------------------------------------------------------ offline harness


def test_harness_measures_lead_time_and_false_alarms_on_synthetic_traces(tmp_path, capsys):
    stressed = synthetic(0, 1600, leak_rise_at=800, blowup_at=1300)
    healthy = synthetic(0, 1600, leak_rise_at=None, blowup_at=None)
    # Independent: divergence = first step >= 100 above 10x the median of steps 100..500.
    grad = stressed["grad_norm/global"]
    median = float(np.median([grad[s] for s in range(100, 501)]))
    expected_div = next(s for s in range(100, 1600) if grad[s] > 10 * median)
    assert 1300 < expected_div < 1360
    assert divergence_step(grad) == (expected_div, pytest.approx(median))

    result = evaluate(stressed, healthy)
    assert result.divergence_step == expected_div and result.healthy_divergence_step is None
    # The leak detector (sampled every 50 steps) fires after the rise starts and well before the blowup.
    first_leak = result.first_alert_by_signal["gproj/leak_ratio"]
    assert 800 < first_leak < 1100 and first_leak % 50 == 0
    assert result.first_alert_step == first_leak
    assert result.lead_time == expected_div - first_leak >= 200
    assert result.false_alarms == 0

    # Online and offline agree: the same detector code replays the same numbers.
    zs = ZeroSumMonitor(print_summary=False)
    online = []
    for s, v in sorted(stressed["gproj/blocks.0.attn/leak_ratio"].items()):
        online += zs.observe(s, {"gproj/blocks.0.attn/leak_ratio": v})[0]
    assert [a.as_dict() for a in online] == [a for a in result.stressed_alerts if a["signal"] == "gproj/leak_ratio"]

    # The CLI on CSV log directories prints the same numbers.
    s_dir, h_dir = write_csv(tmp_path / "stressed", stressed), write_csv(tmp_path / "healthy", healthy)
    assert evaluate_main([str(s_dir), str(h_dir), "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert f"lead time: {result.lead_time} steps" in out and "false alarms (healthy twin): 0" in out
    assert (tmp_path / "out.json").exists()


def test_evaluate_cli_refuses_what_it_cannot_evaluate(tmp_path, capsys):
    """Bad arguments and logs without the monitors' series end with an error naming them (exit 2), never a traceback
    nor "false alarms: 0" for logs with nothing to replay (new-user pass 12)."""
    stressed = synthetic(0, 300, leak_rise_at=200, blowup_at=None)
    good = write_csv(tmp_path / "good", stressed)
    other = write_csv(tmp_path / "other", {"train_loss": {0: 1.0, 1: 0.9}})
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "section.json").write_text('{"GradNormMonitor": 3}')
    (tmp_path / "typo.json").write_text('{"GradNormMonitor": {"windw": 4}}')
    for argv, words in [
        ([str(other), str(good)], "the stressed logs hold no GradNormMonitor"),
        ([str(good), str(other)], "the healthy logs hold no GradNormMonitor"),
        ([str(good), str(good), "--config", str(tmp_path / "missing.json")], "--config"),
        ([str(good), str(good), "--config", str(tmp_path / "bad.json")], "--config"),
        ([str(good), str(good), "--config", str(tmp_path / "list.json")], "JSON object"),
        ([str(good), str(good), "--config", str(tmp_path / "section.json")], "`config['GradNormMonitor']` must be a dict"),
        ([str(good), str(good), "--config", str(tmp_path / "typo.json")], "`config['GradNormMonitor']`: "),
        ([str(good), str(good), "--baseline", "500", "100"], "--baseline"),
        ([str(good), str(good), "--factor", "-1"], "--factor"),
        ([str(good), str(good), "--json", str(tmp_path / "nonexistent" / "out.json")], "--json"),
    ]:
        try:
            code = evaluate_main(argv)
        except SystemExit as exc:  # argparse's own error exit
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and words in err and "Traceback" not in err, (argv, err)
    assert evaluate_main([str(good), str(good)]) == 0


def test_evaluate_replays_each_optimizers_series_into_its_own_detectors():
    """Logs of a run with two optimizers ({p}/opt{i}/global, {p}/opt{i}/loss) replay as the monitor ran online: each
    optimizer's norms and loss into its own detectors, the divergence read off optimizer 0's norm (they replayed
    nothing and read 'false alarms: 0'; review of session 27)."""
    base = synthetic(0, 1600, leak_rise_at=None, blowup_at=1300)["grad_norm/global"]
    calm = synthetic(1, 1600, leak_rise_at=None, blowup_at=None)["grad_norm/global"]
    stressed = {"grad_norm/opt0/global": base, "grad_norm/opt0/loss": calm,
                "grad_norm/opt1/global": calm, "grad_norm/opt1/loss": {s: 20 * v for s, v in calm.items()}}
    healthy = {k: calm for k in stressed}
    result = evaluate(stressed, healthy)
    assert result.divergence_step == divergence_step(base)[0] is not None
    assert set(result.first_alert_by_signal) == {"grad_norm/opt0/global"} and result.false_alarms == 0
    # online, the same numbers through observe(..., opt_idx, several=True) raise the same alerts
    online = GradNormMonitor(print_summary=False)
    alerts = []
    for step in sorted(base):
        for i in (0, 1):
            alerts += online.observe(step, stressed[f"grad_norm/opt{i}/global"][step], {}, i, True)[2]
            alerts += online.observe_loss(step, stressed[f"grad_norm/opt{i}/loss"][step], i, True)[1]
    assert [a.as_dict() for a in alerts] == result.stressed_alerts


def test_harness_counts_alerts_on_the_healthy_twin_as_false_alarms():
    stressed = synthetic(3, 900, leak_rise_at=300, blowup_at=700)
    healthy = synthetic(3, 900, leak_rise_at=300, blowup_at=None)  # a "healthy" twin whose leak rises too
    result = evaluate(stressed, healthy, {"GradNormMonitor": {"detector": {"warn_ratio": None, "cusum_warn": None}}})
    assert result.false_alarms == len(result.healthy_alerts) >= 1
    assert {a["signal"] for a in result.healthy_alerts} == {"gproj/leak_ratio"}
    with pytest.raises(ValueError, match="`config`"):
        evaluate(stressed, healthy, {"Other": {}})


@pytest.mark.parametrize("module", ["lightning_gproj.evaluate", "lightning_gproj.report"])
def test_every_cli_option_has_help(module, capsys):
    """`python -m ... --help` explains every option (argparse prints nothing after an option without help)."""
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    # one entry per option: "  --name METAVAR  help" and the help's continuation lines (deeper indent)
    entries = re.split(r"\n(?=  -)", text.split("options:\n")[1])
    assert len(entries) >= 3
    for entry in entries:
        option, _, rest = entry.strip().partition("  ")
        assert rest.strip(), (option, text)
