"""A short real A/B pair for the monitors: examples/gpt.py, bf16-mixed on CPU, fix="gproj" vs fix="none".

    python benchmarks/monitor_pair.py gproj   # -> logs/monitor_pair/gproj/version_0/metrics.csv
    python benchmarks/monitor_pair.py none    # -> logs/monitor_pair/none/version_0/metrics.csv
    python -m lightning_gproj.evaluate logs/monitor_pair/none/version_0 logs/monitor_pair/gproj/version_0

150 steps (about 3-4 minutes per arm on 2 shared CPU cores): far too short to diverge, so it measures
no lead time; it shows what the signals look like in both arms and whether the healthy arm raises
alerts (false alarms) with the default detectors. Same seed and data in both arms.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from lightning_gproj import GProjPlugin
from lightning_gproj.callbacks import GradNormMonitor, ZeroSumMonitor

REPO = Path(__file__).resolve().parents[1]


def main(fix: str, steps: int = 150, save_dir: str = "logs/monitor_pair") -> None:
    spec = importlib.util.spec_from_file_location("gpt_example", REPO / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    pl.seed_everything(1337)
    model = gpt.GPT(n_layer=4, n_head=4, n_embd=128, block_size=128, qkv_bias=True)
    data = gpt.ByteDataModule(block_size=128, batch_size=32)
    monitors = [ZeroSumMonitor(every_n_steps=10), GradNormMonitor(every_n_steps=1)]
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=CSVLogger(save_dir, name=fix, version=0), log_every_n_steps=10,
        callbacks=monitors, enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
        num_sanity_val_steps=0, plugins=[GProjPlugin("bf16-mixed", fix=fix)],
    )
    trainer.fit(model, datamodule=data)
    print("alerts:", [a.message() for m in monitors for a in m.alerts])


if __name__ == "__main__":
    import argparse

    from lightning_gproj.ops import FIXES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fix", nargs="?", default="gproj", choices=FIXES, help="the arm (default gproj)")
    main(ap.parse_args().fix)
