"""Multi-process runs of examples/gpt.py with GProjPlugin and both monitors (issue 7, CPU part).

``test_ddp_fit_monitors_agree_across_ranks`` runs ``examples/gpt.py fit --config
examples/configs/gpt_ddp.yaml`` through LightningCLI with Lightning's own ``strategy: ddp`` on
``accelerator=cpu, devices=2`` (gloo): this file, started as a script, is the CLI entry point, and
Lightning's subprocess launcher re-runs it for rank 1, as it re-runs ``gpt.py`` on two GPUs. Each rank
writes what its monitors computed to a JSON file; the test compares the ranks, the reduction and rank 0's
CSV log. ``test_fsdp_config_parses_and_the_strategy_accepts_the_plugin`` parses gpt_fsdp.yaml (Lightning
refuses FSDPStrategy on CPU, so no Trainer is built; see tests/test_plugin.py).
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _scripts import REPO, load_script

CONFIGS = REPO / "examples" / "configs"
OUT_ENV = "GPROJ_MULTI_PROCESS_OUT"  # where the worker ranks write; set by the test, inherited by rank 1

# A tiny GPT and a short run; everything else comes from the committed config.
TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
        "--model.key_bias=true", "--data.max_bytes=200000", "--data.val_samples=16",
        "--data.train_samples=2000"]
STEPS, EVERY = 6, 2  # ZeroSumMonitor samples steps 0, 2, 4


# ----------------------------------------------------------------------------- worker (both ranks)


def _worker(out: Path) -> None:
    """One rank of the DDP fit: the CLI of gpt.py on gpt_ddp.yaml, with recording wrappers around the
    monitors' public ``observe`` (what each rank computed after the reduction) and ZeroSumMonitor's
    ``_reduce`` (each rank's own values before it)."""
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_gproj.callbacks import GradNormMonitor, ZeroSumMonitor

    gpt = load_script("examples/gpt.py", "gpt_example")
    seen: dict = {"zero_sum_raw": {}, "zero_sum": {}, "grad_norm": {}, "grad_norm_own": {}}

    class OwnGradNorm(Callback):
        """The global gradient norm computed here from ``param.grad``, independently of the monitor."""

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            sq = sum(float(p.grad.detach().double().pow(2).sum()) for p in pl_module.parameters() if p.grad is not None)
            seen["grad_norm_own"][str(trainer.global_step)] = math.sqrt(sq)

    class RecordingCLI(gpt.GPTCLI):
        def before_fit(self) -> None:  # no validation at step 0: not what is checked here
            trainer = self.trainer
            zs = next(c for c in trainer.callbacks if isinstance(c, ZeroSumMonitor))
            gn = next(c for c in trainer.callbacks if isinstance(c, GradNormMonitor))
            zs.every_n_steps = EVERY
            zs.print_summary = gn.print_summary = False
            observe_zs, observe_gn, reduce_zs = zs.observe, gn.observe, zs._reduce

            def zs_observe(step, metrics):
                seen["zero_sum"][str(step)] = dict(metrics)
                return observe_zs(step, metrics)

            def zs_reduce(flat, keys, device):
                seen["zero_sum_raw"][str(trainer.global_step)] = dict(zip(keys, flat.tolist()))
                return reduce_zs(flat, keys, device)

            def gn_observe(step, norm, layers, *args):
                seen["grad_norm"][str(step)] = {"global": norm, "layers": dict(layers)}
                return observe_gn(step, norm, layers, *args)

            zs.observe, zs._reduce, gn.observe = zs_observe, zs_reduce, gn_observe
            trainer.callbacks.append(OwnGradNorm())

        def after_fit(self) -> None:
            trainer = self.trainer
            plugin = trainer.precision_plugin
            seen.update(
                rank=trainer.global_rank,
                world_size=trainer.world_size,
                strategy=type(trainer.strategy).__name__,
                backend=trainer.strategy._process_group_backend,
                plugin=type(plugin).__name__,
                precision=plugin.precision,
                swapped=[row.module_path for row in plugin.report.swapped],
                per_device_batch=self.datamodule.hparams.batch_size,
                global_step=trainer.global_step,
                log_dir=trainer.logger.log_dir if trainer.logger else None,
                zero_sum_disabled=any(getattr(c, "disabled", False) for c in trainer.callbacks),
            )
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(seen, indent=1))

    torch.set_num_threads(1)  # two ranks on a 2-core CI machine
    RecordingCLI(
        gpt.GPT, gpt.ByteDataModule,
        args=["fit", "--config", str(CONFIGS / "gpt_ddp.yaml"), *TINY,
              "--trainer.accelerator=cpu", "--trainer.devices=2", f"--trainer.max_steps={STEPS}",
              "--trainer.log_every_n_steps=1", "--trainer.enable_model_summary=false",
              f"--trainer.logger.init_args.save_dir={out}", "--validate_first=false"],
        save_config_kwargs={"overwrite": True},
    )


# ----------------------------------------------------------------------------- tests


def _read_csv(path: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in ("", None):
                    out.setdefault(key, {})[int(row["step"])] = float(value)
    return out


def test_ddp_fit_monitors_agree_across_ranks(tmp_path):
    from lightning_gproj.callbacks.zero_sum import MAX_REDUCED

    env = {**os.environ, OUT_ENV: str(tmp_path), "OMP_NUM_THREADS": "1"}
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=170)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    r0, r1 = ranks

    # Both processes ran the configured DDP fit, on gloo, with the plugin's bf16-mixed, and swapped.
    for r, seen in enumerate(ranks):
        assert seen["rank"] == r and seen["world_size"] == 2 and seen["global_step"] == STEPS
        assert seen["strategy"] == "DDPStrategy" and seen["backend"] == "gloo"
        assert seen["plugin"] == "GProjMixedPrecision" and seen["precision"] == "bf16-mixed"
        assert seen["swapped"] == ["blocks.0.attn", "blocks.1.attn"]
        assert seen["per_device_batch"] == 8  # gpt_ddp.yaml: 2 x 8 = the demo's global batch 16
        assert not seen["zero_sum_disabled"]

    # ZeroSumMonitor: each rank recorded its own statistics (its own half of the batch)...
    sampled = [str(s) for s in range(0, STEPS, EVERY)]
    assert sorted(r0["zero_sum_raw"], key=int) == sorted(r1["zero_sum_raw"], key=int) == sampled
    stats = ("violation_median", "violation_max", "leak_ratio", "mean_key_norm", "c2_residual",
             "key_bias_grad_ratio")
    keys = set(r0["zero_sum_raw"]["0"])
    for layer in ("blocks.0.attn", "blocks.1.attn"):
        for stat in stats:
            assert f"gproj/{layer}/{stat}" in keys
    assert not any("probe" in k for k in keys)  # the float64 probe is for unswapped SDPA only
    for step in sampled:
        own0, own1 = r0["zero_sum_raw"][step], r1["zero_sum_raw"][step]
        assert own0.keys() == own1.keys()
        # bf16 rounding: a real, non-zero violation; the ranks saw different windows
        assert all(0 < own0[f"gproj/blocks.{i}.attn/violation_median"] < 1e-1 for i in (0, 1))
        assert own0["gproj/blocks.0.attn/violation_median"] != own1["gproj/blocks.0.attn/violation_median"]
        # ...and after the torchmetrics gather both ranks hold the same values, bit for bit:
        assert r0["zero_sum"][step] == r1["zero_sum"][step]
        for key, value in r0["zero_sum"][step].items():
            by_max = key.rpartition("/")[2] in MAX_REDUCED  # violation_max, max_logit, ...
            expected = max(own0[key], own1[key]) if by_max else (own0[key] + own1[key]) / 2
            assert value == pytest.approx(expected, rel=1e-6, abs=1e-12), key
    # the key-bias gradient is read after DDP's all-reduce: already the same on both ranks
    kb = "gproj/blocks.0.attn/key_bias_grad_norm"
    assert r0["zero_sum_raw"]["0"][kb] == pytest.approx(r1["zero_sum_raw"]["0"][kb], rel=1e-6)

    # GradNormMonitor: every step, the same norms on both ranks, equal to param.grad's norm.
    steps = [str(s) for s in range(STEPS)]
    assert sorted(r0["grad_norm"], key=int) == sorted(r1["grad_norm"], key=int) == steps
    for step in steps:
        assert r0["grad_norm"][step] == r1["grad_norm"][step]
        # the monitor takes fp32 norms per parameter, this sums squares in float64: fp32 rounding apart
        assert r0["grad_norm"][step]["global"] == pytest.approx(r0["grad_norm_own"][step], rel=1e-6)
        assert r1["grad_norm"][step]["global"] == pytest.approx(r1["grad_norm_own"][step], rel=1e-6)
        assert 0 < r0["grad_norm"][step]["global"] < 1e3

    # What rank 0 logged (the only rank that writes) is what rank 1 computed.
    logged = _read_csv(Path(r0["log_dir"]) / "metrics.csv")
    for step in sampled:
        for key, value in r1["zero_sum"][step].items():
            assert logged[key][int(step)] == pytest.approx(value, rel=1e-12, abs=0), key
    assert {s: logged["grad_norm/global"][int(s)] for s in steps} == pytest.approx(
        {s: r1["grad_norm"][s]["global"] for s in steps}, rel=1e-12)
    assert logged["grad_norm/layer/blocks.1"][3] == pytest.approx(r1["grad_norm"]["3"]["layers"]["blocks.1"], rel=1e-12)
    print(f"DDP fit of 2 processes: {elapsed:.1f} s")


def test_fsdp_config_parses_and_the_strategy_accepts_the_plugin():
    """gpt_fsdp.yaml through the CLI's parser and instantiation, stopping before the Trainer (which
    Lightning refuses to build with FSDPStrategy on CPU); then the strategy takes the plugin the way the
    Trainer's connector hands it over. FSDPPrecision's own behaviour under the plugin:
    tests/test_plugin.py::test_fsdp_strategy_accepts_a_plugin_built_on_fsdp_precision."""
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_gproj import GProjPlugin
    from lightning_gproj.callbacks import GradNormMonitor, ZeroSumMonitor

    gpt = load_script("examples/gpt.py", "gpt_example")

    class ParseOnly(gpt.GPTCLI):
        def instantiate_trainer(self, **kwargs):
            self.trainer_kwargs = self._get(self.config_init, "trainer", default={})
            return None

    cli = ParseOnly(gpt.GPT, gpt.ByteDataModule, args=["--config", str(CONFIGS / "gpt_fsdp.yaml")], run=False)
    kwargs = cli.trainer_kwargs
    assert kwargs["accelerator"] == "gpu" and kwargs["devices"] == 2 and kwargs.get("precision") is None
    (plugin,) = kwargs["plugins"]
    assert isinstance(plugin, GProjPlugin) and isinstance(plugin, FSDPPrecision)
    assert type(plugin).__name__ == "GProjFSDPPrecision" and plugin._gproj_base is FSDPPrecision
    assert plugin.precision == "bf16-mixed" and plugin.fix == "gproj"
    strategy = kwargs["strategy"]
    assert isinstance(strategy, FSDPStrategy)
    strategy.precision_plugin = plugin  # what Trainer(strategy=..., plugins=[plugin]) does on a GPU
    assert strategy.precision_plugin is plugin
    assert [type(c) for c in kwargs["callbacks"]] == [ZeroSumMonitor, GradNormMonitor]
    assert cli.datamodule.hparams.batch_size * kwargs["devices"] == 16  # the demo's global batch
    assert isinstance(cli.model, gpt.GPT)

    # gpt_ddp.yaml: the same CLI path with accelerator=cpu is the fit above; here, its GPU settings
    ddp = ParseOnly(gpt.GPT, gpt.ByteDataModule, args=["--config", str(CONFIGS / "gpt_ddp.yaml")], run=False)
    assert ddp.trainer_kwargs["strategy"] == "ddp" and ddp.trainer_kwargs["devices"] == 2
    assert ddp.trainer_kwargs["accelerator"] == "gpu"
    assert type(ddp.trainer_kwargs["plugins"][0]).__name__ == "GProjMixedPrecision"
    assert ddp.datamodule.hparams.batch_size * 2 == 16


if __name__ == "__main__":
    _worker(Path(os.environ[OUT_ENV]))
