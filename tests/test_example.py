"""examples/gpt.py: the data module splits by file, the CLI builds and fits, the model learns."""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import pytest
import torch

from _scripts import REPO, load_script

gpt = load_script("examples/gpt.py", "gpt_example")

TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
        "--data.batch_size=8", "--data.max_bytes=200000", "--data.val_samples=16"]


def test_datamodule_uses_stdlib_and_splits_by_file():
    dm = gpt.ByteDataModule(block_size=32, batch_size=4, max_bytes=300_000, val_every=5)
    dm.setup("fit")
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = dm.train_files + dm.val_files
    assert dm.train_files and dm.val_files
    assert all(f.suffix == ".py" and f.resolve().parent == stdlib for f in files)
    assert not set(dm.train_files) & set(dm.val_files)
    # deterministic: the first files of the sorted stdlib listing, every 5th one held out
    listing = gpt.stdlib_source_files()
    assert sorted(files) == listing[:len(files)]
    assert dm.val_files == [f for i, f in enumerate(listing[:len(files)]) if i % 5 == 0]
    # windows are block_size + 1 contiguous bytes of the right split, reproducible from the seed
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 33) and batch.dtype == torch.int64
    assert bytes(batch[0].tolist()) in dm.train_set.data.numpy().tobytes()
    val = dm.val_set.data.numpy().tobytes()
    assert bytes(next(iter(dm.val_dataloader()))[0].tolist()) in val
    dm2 = gpt.ByteDataModule(block_size=32, batch_size=4, max_bytes=300_000, val_every=5)
    dm2.setup("fit")
    assert torch.equal(next(iter(dm2.train_dataloader())), batch)


def test_stdlib_subpackages_lists_every_stdlib_py_file_but_installed_packages():
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    expected = sorted(
        Path(d, f) for d, dirs, files in os.walk(stdlib)
        for f in files if f.endswith(".py") and not {"site-packages", "dist-packages"} & set(Path(d).relative_to(stdlib).parts)
    )
    listing = [f.resolve() for f in gpt.stdlib_source_files(subpackages=True)]
    assert sorted(listing) == [f.resolve() for f in expected]
    top = [f.resolve() for f in gpt.stdlib_source_files()]
    assert set(top) < set(listing) and len(listing) > 10 * len(top)
    dm = gpt.ByteDataModule(block_size=32, batch_size=4, max_bytes=3_000_000, stdlib_subpackages=True)
    dm.setup("fit")
    assert any(f.resolve().parent != stdlib for f in dm.train_files + dm.val_files)


def test_datamodule_takes_user_text(tmp_path):
    for i in range(4):
        (tmp_path / f"part{i}.txt").write_text(f"file {i} " * 100)
    dm = gpt.ByteDataModule(path=str(tmp_path), block_size=16, batch_size=2, val_every=2)
    dm.setup("fit")
    assert [f.name for f in dm.val_files] == ["part0.txt", "part2.txt"]
    assert [f.name for f in dm.train_files] == ["part1.txt", "part3.txt"]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_loss_finite_and_decreasing_on_a_repeated_batch(optimizer):
    torch.manual_seed(0)
    model = gpt.GPT(n_layer=2, n_head=2, n_embd=32, block_size=32, key_bias=True, optimizer=optimizer,
                    warmup_steps=1)
    model.trainer = type("T", (), {"estimated_stepping_batches": 20})()  # only read by the LR schedule
    opt = model.configure_optimizers()["optimizer"]
    if optimizer == "muon" and hasattr(torch.optim, "Muon"):
        assert isinstance(opt, gpt.CombinedOptimizer)
    batch = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = model.loss(batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses


def test_attention_calls_sdpa_causal_in_its_own_forward(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append(kwargs)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    attn = gpt.CausalSelfAttention(32, 4)
    attn(torch.randn(2, 8, 32))
    assert calls == [{"is_causal": True}]


def test_cli_short_fit_logs_val_loss(tmp_path):
    cli = gpt.main(TINY + ["--trainer.accelerator=cpu", "--trainer.max_steps=4",
                           "--trainer.val_check_interval=4", "--trainer.logger=false",
                           "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
                           "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path}"],
                   run=False)
    assert cli.model.hparams.block_size == cli.datamodule.hparams.block_size == 32
    cli.before_fit()  # the validation at step 0 that `fit` runs first
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    steps = [s for s, _ in cli.model.val_history]
    assert steps == [0, 4]
    assert all(math.isfinite(v) for _, v in cli.model.val_history)


def test_demo_config_parses():
    cli = gpt.main(["--config", str(REPO / "examples" / "configs" / "gpt_demo.yaml"),
                    "--trainer.logger=false"], run=False)
    assert isinstance(cli.model, gpt.GPT)


def test_monitor_settings_parse_from_yaml(tmp_path):
    """DetectorConfig from YAML: a partial mapping overrides the monitor's own defaults field by field."""
    from dataclasses import replace

    from lightning_gproj.callbacks import (
        GRAD_NORM_DETECTOR, LOSS_DETECTOR, ZERO_SUM_DETECTOR, GradNormMonitor, ZeroSumMonitor,
    )

    extra = tmp_path / "monitors.yaml"
    extra.write_text(
        "trainer:\n"
        "  callbacks:\n"
        "    - class_path: lightning_gproj.callbacks.ZeroSumMonitor\n"
        "      init_args:\n"
        "        detector: {window: 30, warmup: 5, warn_ratio: null}\n"
        "        actions: [skip, rollback]\n"
        "        rollback_lr_factor: 0.5\n"
        "    - class_path: lightning_gproj.callbacks.GradNormMonitor\n"
        "      init_args: {detector: {critical_ratio: 20}, loss_detector: {critical_ratio: 2.5}, loss: false}\n"
    )
    cli = gpt.main(["--config", str(REPO / "examples" / "configs" / "gpt_demo.yaml"), "--config", str(extra),
                    "--trainer.logger=false"], run=False)
    zs = next(c for c in cli.trainer.callbacks if isinstance(c, ZeroSumMonitor))
    gn = next(c for c in cli.trainer.callbacks if isinstance(c, GradNormMonitor))
    assert zs.detector == replace(ZERO_SUM_DETECTOR, window=30, warmup=5, warn_ratio=None)
    assert zs.dispatcher.actions == ("skip", "rollback") and zs.dispatcher.rollback_lr_factor == 0.5
    assert gn.detector == replace(GRAD_NORM_DETECTOR, critical_ratio=20.0)
    assert gn.loss_detector == replace(LOSS_DETECTOR, critical_ratio=2.5) and gn.loss is False


def test_repro_stress_config_parses_with_each_arm():
    cfg = str(REPO / "examples" / "configs" / "repro_stress.yaml")
    cli = gpt.main(["--config", cfg, "--trainer.logger=false"], run=False)
    assert cli.model.hparams.key_bias and cli.model.hparams.optimizer == "muon" and not cli.model.hparams.qk_norm
    plugin = cli.trainer.precision_plugin
    assert (plugin.fix, plugin.attention_dtype) == ("none", None)
    cli = gpt.main(["--config", cfg, "--trainer.logger=false", "--trainer.plugins.init_args.attention_dtype=fp32"],
                   run=False)
    assert cli.trainer.precision_plugin.attention_dtype == "fp32"


@pytest.mark.parametrize("key_bias_lr", [None, 0.25])
def test_key_bias_lr_gives_the_key_biases_their_own_adamw_group(key_bias_lr):
    model = gpt.GPT(n_layer=2, n_head=2, n_embd=32, block_size=32, key_bias=True, lr=1e-3, key_bias_lr=key_bias_lr)
    model.trainer = type("T", (), {"estimated_stepping_batches": 20})()
    opt = model.configure_optimizers()["optimizer"]
    key_biases = {id(b.attn.key_bias) for b in model.blocks}
    groups = [g for g in opt.param_groups if any(id(p) in key_biases for p in g["params"])]
    assert len(groups) == 1 and {id(p) for p in groups[0]["params"]} == key_biases
    assert groups[0]["weight_decay"] == 0.0
    assert groups[0]["initial_lr"] == (1e-3 if key_bias_lr is None else key_bias_lr)
    # every trainable parameter is optimized exactly once
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(ids) == sorted({id(p) for p in model.parameters()})


def test_repro_h200_config_parses():
    cli = gpt.main(["--config", str(REPO / "examples" / "configs" / "repro_h200.yaml"), "--trainer.logger=false",
                    "--trainer.accelerator=cpu"], run=False)
    hp = cli.model.hparams
    assert hp.key_bias and hp.optimizer == "muon" and not hp.qk_norm and hp.weight_decay == 0.0
    assert cli.datamodule.hparams.block_size == hp.block_size == 1024
    assert sum(p.numel() for p in cli.model.parameters()) > 10_000_000


def test_resume_keeps_the_key_bias_drift_origin_and_skips_step0_validation(tmp_path):
    """A run resumed from a checkpoint measures key_bias_drift from b_k(0) of the first run (zeros at
    init), not from the restored value, and does not validate the fresh weights as "step 0"."""
    import csv

    args = TINY + ["--model.key_bias=true", "--model.key_bias_lr=0.1", "--trainer.accelerator=cpu",
                   "--trainer.log_every_n_steps=1", "--trainer.val_check_interval=100",
                   "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
                   "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
                   f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.logger.init_args.name=run"]
    gpt.main(["fit"] + args + ["--trainer.max_steps=3", "--trainer.callbacks+=ModelCheckpoint",
                               "--trainer.callbacks.every_n_train_steps=3"])
    ckpt = next((tmp_path / "run" / "version_0" / "checkpoints").glob("*.ckpt"))
    b3 = torch.load(ckpt, weights_only=False)["state_dict"]["blocks.0.attn.key_bias"].double()
    gpt.main(["fit"] + args + ["--trainer.max_steps=6", f"--ckpt_path={ckpt}"])
    rows = list(csv.DictReader(open(tmp_path / "run" / "version_1" / "metrics.csv")))
    assert not any(r.get("val_loss") for r in rows)  # no validation of the unrestored weights
    drift = {int(r["step"]): float(r["key_bias_drift/blocks.0.attn"]) for r in rows
             if r.get("key_bias_drift/blocks.0.attn")}
    assert sorted(drift) == [3, 4, 5]
    # step 3 logs b_k before the 4th update, i.e. the checkpoint's b_k; b_k(0) = 0 at init
    assert b3.norm().item() > 0
    assert drift[3] == pytest.approx(b3.norm().item(), rel=1e-5)
