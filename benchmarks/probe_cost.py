"""Cost of ZeroSumMonitor's probe and C2 sampling on the example GPT (examples/gpt.py), unswapped SDPA.

    python benchmarks/probe_cost.py [--steps 30] [--precision bf16-mixed] [--batch-size 8] [--out benchmarks/results/probe_cost.json]

Two fits of the same model, data and seed, each alternating monitored and plain steps, so that every
monitored step is compared with its neighbours under the same machine load (the CPU is shared):

* ``probe``: ``ZeroSumMonitor(every_n_steps=10**9, probe_every_n_steps=2)``: even steps are probe steps
  (capture mode during the forward, slice + dO capture, recomputation in the user's kernel and in
  float64, gather and logging), odd steps plain;
* ``c2``: ``ZeroSumMonitor(every_n_steps=2, probe_every_n_steps=None)``: even steps sample the C2
  residual (capture mode + dK hooks) and the key-bias gradient, odd steps plain.

Step time = wall time from the first callback's ``on_train_batch_start`` to the last callback's
``on_train_batch_end`` (forward, backward, monitor hooks, optimizer step); medians over the steps after
``--warmup``. The extra time of a monitored step is amortized over the default cadence
(``probe_every_n_steps=500``, ``every_n_steps=50``):

    cost = (median monitored step − median plain step) / (cadence × median plain step)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_gproj.callbacks import ZeroSumMonitor, probe_backward

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROBE_EVERY = 500
DEFAULT_SAMPLE_EVERY = 50


def load_gpt():
    spec = importlib.util.spec_from_file_location("gpt_example", REPO / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class StepTimer(pl.Callback):
    """Start (``first=True``) or stop (``first=False``) the clock of each training batch."""

    def __init__(self, times: dict, first: bool) -> None:
        self.times, self.first = times, first

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first:
            self.times["start"] = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.first:
            self.times.setdefault("steps", []).append(time.perf_counter() - self.times["start"])


def run_arm(gpt, monitor, steps: int, precision: str, args) -> list[float]:
    pl.seed_everything(1337, verbose=False)
    model = gpt.GPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size, key_bias=True)
    data = gpt.ByteDataModule(block_size=args.block_size, batch_size=args.batch_size, max_bytes=300_000, train_samples=10_000)
    times: dict = {}
    callbacks = [StepTimer(times, True)] + ([monitor] if monitor else []) + [StepTimer(times, False)]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision=precision, max_steps=steps, logger=False, callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(model, datamodule=data)
    return times["steps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "probe_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    gpt = load_gpt()
    arms = {
        "probe": (lambda: ZeroSumMonitor(every_n_steps=10**9, probe_every_n_steps=2, print_summary=False), DEFAULT_PROBE_EVERY),
        "c2": (lambda: ZeroSumMonitor(every_n_steps=2, probe_every_n_steps=None, print_summary=False), DEFAULT_SAMPLE_EVERY),
    }
    result = {
        "command": "python benchmarks/probe_cost.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"
        ),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores (shared with other users), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        "shapes": f"examples/gpt.py GPT n_layer={args.n_layer} n_head={args.n_head} n_embd={args.n_embd} "
        f"block_size={args.block_size} key_bias=True, batch={args.batch_size}, {args.precision}, unswapped SDPA; "
        f"probe slice 1 batch row x 2 heads x {min(512, args.block_size)} queries",
    }
    for name, (make, cadence) in arms.items():
        monitor = make()
        times = run_arm(gpt, monitor, args.steps, args.precision, args)
        monitored = [t for i, t in enumerate(times) if i >= args.warmup and i % 2 == 0]
        plain = [t for i, t in enumerate(times) if i >= args.warmup and i % 2 == 1]
        m, p = statistics.median(monitored), statistics.median(plain)
        print(f"{name}: monitored step {m * 1e3:.1f} ms, plain step {p * 1e3:.1f} ms ({len(monitored)}/{len(plain)} steps)")
        result[name] = {
            "median_monitored_step_ms": m * 1e3,
            "median_plain_step_ms": p * 1e3,
            "extra_ms_per_monitored_step": (m - p) * 1e3,
            "default_cadence": cadence,
            "cost_at_default_cadence_pct": 100 * (m - p) / (cadence * p),
            "cost_if_every_step_pct": 100 * (m - p) / p,
        }
        if monitor.last_probe is not None:  # the recomputation alone, timed on the last captured slice
            _, cap, _ = monitor.last_probe
            recompute = []
            for _ in range(20):
                t0 = time.perf_counter()
                probe_backward(cap.q, cap.k, cap.v, cap.do, cap.attn_mask, cap.is_causal, cap.scale, cap.autocast_dtype)
                recompute.append(time.perf_counter() - t0)
            result[name]["median_recompute_ms"] = statistics.median(recompute) * 1e3
            result[name]["recompute_cost_at_default_cadence_pct"] = 100 * statistics.median(recompute) / (cadence * p)
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
