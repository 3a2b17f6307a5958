"""Multi-process runs of examples/gpt.py with GProjPlugin and both monitors, on CPU with gloo.

Each test runs ``examples/gpt.py fit --config examples/configs/<config>.yaml`` through LightningCLI with
``accelerator=cpu, devices=2``: this file, started as a script, is the CLI entry point, and Lightning's
subprocess launcher re-runs it for rank 1, as it re-runs ``gpt.py`` on two GPUs. Each rank writes what it
saw and what its monitors computed to a JSON file; the tests compare the ranks with each other, with the
reduction, with rank 0's CSV log, and with a single-process run of the same model on the same global batch.

* ``ddp``: ``gpt_ddp.yaml`` as committed (bf16-mixed: the plugin's reference kernel with the BF16 rounding
  points, so the zero-sum statistics are real bf16-level values).
* ``fsdp``: ``gpt_fsdp.yaml`` with :class:`CPUFSDPStrategy` (Lightning's ``FSDPStrategy``, FSDP1, made to
  accept a CPU) and precision ``32-true``, so that it can be compared with one process to fp32 rounding.
* ``fsdp2``: ``gpt_fsdp2.yaml`` (Lightning's ``ModelParallelStrategy``, FSDP2 ``fully_shard``), ``32-true``.
* ``single``: one process, ``gpt_ddp.yaml`` with ``devices=1, strategy=auto, data.batch_size=16`` (the
  reference command of docs/multi_gpu.md), ``32-true``; run in the test process.
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
import torch
from lightning.pytorch.strategies import FSDPStrategy

from _scripts import REPO, load_script

CONFIGS = REPO / "examples" / "configs"
OUT_ENV = "GPROJ_MULTI_PROCESS_OUT"  # where the worker ranks write; set by the test, inherited by rank 1
MODE_ENV = "GPROJ_MULTI_PROCESS_MODE"

# A tiny GPT and a short run; everything else comes from the committed config.
TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
        "--model.key_bias=true", "--data.max_bytes=200000", "--data.val_samples=16",
        "--data.train_samples=2000"]
STEPS, EVERY = 6, 2  # ZeroSumMonitor samples steps 0, 2, 4
FP32 = ["--trainer.plugins.init_args.precision=32-true"]
MODES = {
    "ddp": ("gpt_ddp.yaml", ["--validate_first=false"]),
    "fsdp": ("gpt_fsdp.yaml", ["--trainer.strategy.class_path=__main__.CPUFSDPStrategy", *FP32]),
    "fsdp2": ("gpt_fsdp2.yaml", FP32),
    "single": ("gpt_ddp.yaml", ["--trainer.devices=1", "--trainer.strategy=auto", "--data.batch_size=16", *FP32]),
}


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` on CPU, for these tests only. Lightning 2.6.6 refuses FSDPStrategy with
    ``accelerator="cpu"`` by an exact type check (a subclass passes), and torch's FSDP1 accepts a CPU module
    only with ``device_id=cpu`` (Lightning passes the device index, None on CPU); the wrap below is
    ``FSDPStrategy._setup_model``'s own with that one argument. Everything else is FSDPStrategy's code."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                        mixed_precision=self.mixed_precision_config,
                                        sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                                        **self.kwargs)


# ----------------------------------------------------------------------------- worker (both ranks)


def _run(out: Path, mode: str) -> None:
    """One rank of the fit (or the single process): the CLI of gpt.py on the mode's config, with recording
    wrappers around the monitors' public ``observe`` (what each rank computed after the reduction),
    ZeroSumMonitor's ``_reduce`` (each rank's own values before it), and a callback that records the
    windows of every step (checked against the batch itself), the loss, and the global gradient norm
    computed independently of the monitors."""
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    from lightning_gproj.callbacks import GradNormMonitor, ZeroSumMonitor

    gpt = load_script("examples/gpt.py", "gpt_example")
    config, extra = MODES[mode]
    seen: dict = {"zero_sum_raw": {}, "zero_sum": {}, "grad_norm": {}, "grad_norm_own": {}, "windows": {},
                  "loss": {}}

    class Record(Callback):
        def on_train_start(self, trainer, pl_module):
            self.order = list(trainer.train_dataloader.sampler)  # this rank's window indices, in order

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            size = batch.shape[0]
            windows = self.order[batch_idx * size:(batch_idx + 1) * size]
            dataset = trainer.datamodule.train_set
            assert torch.equal(batch.cpu(), torch.stack([dataset[i] for i in windows]))
            seen["windows"][str(trainer.global_step)] = windows

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["loss"][str(trainer.global_step - 1)] = float(outputs["loss"])  # this rank's own mean

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            """‖g‖ from ``param.grad``: squares of whatever this rank holds, summed over the ranks when
            the gradients are sharded (FSDP, FSDP2), else this rank's (DDP: all-reduced already)."""
            sq = torch.zeros((), dtype=torch.float64)
            for p in pl_module.parameters():
                if p.grad is not None:
                    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    sq += g.detach().double().pow(2).sum()
            if mode in ("fsdp", "fsdp2"):
                dist.all_reduce(sq)
            seen["grad_norm_own"][str(trainer.global_step)] = math.sqrt(float(sq))

    class RecordingCLI(gpt.GPTCLI):
        def before_fit(self) -> None:
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
            trainer.callbacks.append(Record())
            super().before_fit()

        def after_fit(self) -> None:
            trainer = self.trainer
            plugin = trainer.precision_plugin
            seen.update(
                rank=trainer.global_rank,
                world_size=trainer.world_size,
                strategy=type(trainer.strategy).__name__,
                backend=getattr(trainer.strategy, "_process_group_backend", None),
                plugin=type(plugin).__name__,
                precision=plugin.precision,
                swapped=[row.module_path for row in plugin.report.swapped],
                per_device_batch=self.datamodule.hparams.batch_size,
                global_step=trainer.global_step,
                log_dir=trainer.logger.log_dir if trainer.logger else None,
                disabled=[type(c).__name__ for c in trainer.callbacks if getattr(c, "disabled", False)],
                val_history=self.model.val_history,
                layer_names=sorted({layer for s in seen["grad_norm"].values() for layer in s["layers"]}),
            )
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(seen, indent=1))

    RecordingCLI(
        gpt.GPT, gpt.ByteDataModule,
        args=["fit", "--config", str(CONFIGS / config), *TINY, "--trainer.accelerator=cpu", "--trainer.devices=2",
              f"--trainer.max_steps={STEPS}", "--trainer.log_every_n_steps=1", "--trainer.enable_model_summary=false",
              f"--trainer.logger.init_args.save_dir={out}", *extra],
        save_config_kwargs={"overwrite": True},
    )


def _worker(out: Path, mode: str) -> None:
    torch.set_num_threads(1)  # two ranks on a 2-core CI machine
    _run(out, mode)


# ----------------------------------------------------------------------------- tests


def _read_csv(path: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in ("", None):
                    out.setdefault(key, {})[int(row["step"])] = float(value)
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    """The single-process reference run (mode ``single``), in this process."""
    out = tmp_path_factory.mktemp("single")
    _run(out, "single")
    return json.loads((out / "rank0.json").read_text())


def _launch(tmp_path: Path, mode: str) -> tuple[list[dict], float]:
    env = {**os.environ, OUT_ENV: str(tmp_path), MODE_ENV: mode, "OMP_NUM_THREADS": "1"}
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=170)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)], elapsed


def _check_windows(ranks: list[dict], single: dict) -> None:
    """Step s on one device with batch 16 sees windows 16s … 16s+15 (the dataset's order); on two ranks
    with batch 8 each, rank r sees every other one of exactly those, starting at r."""
    for step in map(str, range(STEPS)):
        whole = single["windows"][step]
        assert whole == list(range(16 * int(step), 16 * int(step) + 16))
        for r, seen in enumerate(ranks):
            assert seen["windows"][step] == whole[r::2], (r, step)


def test_ddp_fit_monitors_agree_across_ranks(tmp_path, single):
    from lightning_gproj.callbacks.zero_sum import MAX_REDUCED

    ranks, elapsed = _launch(tmp_path, "ddp")
    r0, r1 = ranks
    _check_windows(ranks, single)

    # Both processes ran the configured DDP fit, on gloo, with the plugin's bf16-mixed, and swapped.
    for r, seen in enumerate(ranks):
        assert seen["rank"] == r and seen["world_size"] == 2 and seen["global_step"] == STEPS
        assert seen["strategy"] == "DDPStrategy" and seen["backend"] == "gloo"
        assert seen["plugin"] == "GProjMixedPrecision" and seen["precision"] == "bf16-mixed"
        assert seen["swapped"] == ["blocks.0.attn", "blocks.1.attn"]
        assert seen["per_device_batch"] == 8  # gpt_ddp.yaml: 2 x 8 = the demo's global batch 16
        assert seen["disabled"] == []

    # ZeroSumMonitor: each rank recorded its own statistics (its own half of the batch)...
    sampled = [str(s) for s in range(0, STEPS, EVERY)]
    assert sorted(r0["zero_sum_raw"], key=int) == sorted(r1["zero_sum_raw"], key=int) == sampled
    # fix="gproj": the op logs the leak it removed as leak_removed_ratio (leak_ratio is fix="none"'s)
    stats = ("violation_median", "violation_max", "leak_removed_ratio", "mean_key_norm", "c2_residual",
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


@pytest.mark.parametrize("mode, strategy, plugin", [
    ("fsdp", "CPUFSDPStrategy", "GProjFSDPPrecision"),
    ("fsdp2", "ModelParallelStrategy", "GProjPrecision"),
])
def test_sharded_fit_matches_one_process(tmp_path, single, mode, strategy, plugin):
    """FSDP1 (Lightning's FSDPStrategy) and FSDP2 (ModelParallelStrategy) fits of the example GPT with the
    plugin and both monitors, in fp32: the same windows per step as one process with the global batch, the
    same losses, validation at step 0 and gradient norms to fp32 rounding; the monitors' global and
    per-layer norms are the global ones (not a shard's) and the same on both ranks."""
    ranks, elapsed = _launch(tmp_path, mode)
    r0, r1 = ranks
    for r, seen in enumerate(ranks):
        assert seen["rank"] == r and seen["world_size"] == 2 and seen["global_step"] == STEPS
        assert seen["strategy"] == strategy and seen["plugin"] == plugin and seen["precision"] == "32-true"
        assert seen["swapped"] == ["blocks.0.attn", "blocks.1.attn"] and seen["per_device_batch"] == 8
        assert seen["disabled"] == []  # neither monitor broke under the strategy
        # The validation at step 0 runs inside fit (gpt.py's ValidateAtStart): validate() before fit
        # crashed FSDP ('weight' must be 2-D). Same windows, same mean as one process.
        assert [s for s, _ in seen["val_history"]] == [0]
        assert seen["val_history"][0][1] == pytest.approx(single["val_history"][0][1], rel=1e-6)
        assert seen["layer_names"] == single["layer_names"]  # the model's names, no wrapper components
    _check_windows(ranks, single)
    for step in map(str, range(STEPS)):
        assert r0["grad_norm"][step] == r1["grad_norm"][step]  # bit-identical on both ranks
        norm = r0["grad_norm"][step]["global"]
        assert norm == pytest.approx(r0["grad_norm_own"][step], rel=1e-6)
        # fp32 rounding of the same sums in another order (measured: <= 1e-7 relative over the 6 steps; a
        # systematic difference such as weight decay lost on sharded matrices shows at ~1e-6 by step 1)
        assert norm == pytest.approx(single["grad_norm"][step]["global"], rel=1e-6)
        for layer, value in single["grad_norm"][step]["layers"].items():
            assert r0["grad_norm"][step]["layers"][layer] == pytest.approx(value, rel=1e-6, abs=1e-7 * norm), (step, layer)
        assert (r0["loss"][step] + r1["loss"][step]) / 2 == pytest.approx(single["loss"][step], abs=2e-6)
    # ZeroSumMonitor's key-bias signals, before its mean over ranks: already global, hence equal on both
    # ranks (a shard's norm would differ between them).
    for step in map(str, range(0, STEPS, EVERY)):
        own0, own1 = r0["zero_sum_raw"][step], r1["zero_sum_raw"][step]
        keys = [k for k in own0 if "key_bias_grad" in k]
        assert len(keys) == 4  # norm and ratio of both layers
        assert {k: own0[k] for k in keys} == {k: own1[k] for k in keys}
    print(f"{mode} fit of 2 processes: {elapsed:.1f} s")


def test_fsdp_config_parses_and_the_strategy_accepts_the_plugin():
    """The GPU configs through the CLI's parser and instantiation, stopping before the Trainer (which
    Lightning refuses to build with FSDPStrategy on CPU): for gpt_fsdp.yaml the strategy then takes the
    plugin the way the Trainer's connector hands it over. FSDPPrecision's own behaviour under the plugin:
    tests/test_plugin.py::test_fsdp_strategy_accepts_a_plugin_built_on_fsdp_precision."""
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

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

    # gpt_fsdp2.yaml: ModelParallelStrategy over a data-parallel mesh of 2 (its CPU fit is above)
    fsdp2 = ParseOnly(gpt.GPT, gpt.ByteDataModule, args=["--config", str(CONFIGS / "gpt_fsdp2.yaml")], run=False)
    kwargs = fsdp2.trainer_kwargs
    assert isinstance(kwargs["strategy"], ModelParallelStrategy) and kwargs["devices"] == 2
    assert (kwargs["strategy"]._data_parallel_size, kwargs["strategy"]._tensor_parallel_size) == (2, 1)
    assert kwargs["accelerator"] == "gpu" and type(kwargs["plugins"][0]).__name__ == "GProjMixedPrecision"
    assert [type(c) for c in kwargs["callbacks"]] == [ZeroSumMonitor, GradNormMonitor]
    assert fsdp2.datamodule.hparams.batch_size * 2 == 16


if __name__ == "__main__":
    _worker(Path(os.environ[OUT_ENV]), os.environ[MODE_ENV])
