"""Cost of the monitors on the example GPT (examples/gpt.py): each arm alternates monitored and plain steps.

    python benchmarks/probe_cost.py [--steps 30] [--plugin gproj] [--batch-size 16] [--no-key-bias] [--arms grad_norm,zero_sum,probe]

One fit per arm, of the same model, data and seed, alternating monitored and plain steps, so that every
monitored step is compared with its neighbours under the same machine load (the CPU is shared):

* ``grad_norm``: ``GradNormMonitor(every_n_steps=2)`` with its loss detector: even steps measure the
  gradient norms and the loss (one host copy), run both detectors and log; odd steps only keep the
  loss of the backward (on the device);
* ``zero_sum``: ``ZeroSumMonitor(every_n_steps=2, probe_every_n_steps=None)``: even steps record the
  op's statistics (swapped attention, ``--plugin gproj``), the C2 residual (capture mode + dK hooks),
  the key-bias gradient and the max logit, run the detectors and log; odd steps plain;
* ``probe``: ``ZeroSumMonitor(every_n_steps=10**9, probe_every_n_steps=2)``: even steps are probe steps
  (capture mode during the forward, slice + dO capture, recomputation in the user's kernel and in
  float64, gather and logging), odd steps plain. Only unswapped SDPA is probed: with ``--plugin gproj``
  there is nothing to probe.

``--plugin gproj`` runs the demo's setting (``GProjPlugin("bf16-mixed", fix="gproj")``: swapped
attention, reference kernel on CPU); ``--plugin none`` plain SDPA under ``--precision``.

Step time = wall time from the first callback's ``on_train_batch_start`` to the last callback's
``on_train_batch_end`` (forward, backward, monitor hooks, optimizer step); medians over the steps after
``--warmup``. The extra time of a monitored step is amortized over the default cadence (GradNormMonitor
every step, ``every_n_steps=50``, ``probe_every_n_steps=500``):

    cost = (median monitored step − median plain step) / (cadence × median plain step)

and ``total_at_default_cadence_pct`` adds the arms' costs. The paired difference of wall times carries
the machine's step-to-step noise; ``cpu_*`` is the same with the process's CPU time per step
(``time.process_time``, less sensitive to other processes on a shared machine; run with ``--threads 1``
so that it is not inflated by threads waiting for a core); the wall time spent inside the monitor's
hooks (``hook_*``, amortized the same way) is a low-noise lower bound of the cost (all of it for
``grad_norm``, whose work is all in its hooks).
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

from lightning_gproj import GProjPlugin
from lightning_gproj.callbacks import GradNormMonitor, ZeroSumMonitor, probe_backward

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROBE_EVERY = 500
DEFAULT_SAMPLE_EVERY = 50
ARMS = {
    "grad_norm": (lambda: GradNormMonitor(every_n_steps=2, print_summary=False), 1),
    "zero_sum": (lambda: ZeroSumMonitor(every_n_steps=2, probe_every_n_steps=None, print_summary=False), DEFAULT_SAMPLE_EVERY),
    "probe": (lambda: ZeroSumMonitor(every_n_steps=10**9, probe_every_n_steps=2, print_summary=False), DEFAULT_PROBE_EVERY),
}


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
            self.times["cpu_start"] = time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.first:
            self.times.setdefault("steps", []).append(time.perf_counter() - self.times["start"])
            self.times.setdefault("cpu", []).append(time.process_time() - self.times["cpu_start"])
            self.times.setdefault("hooks", []).append(self.times.pop("in_hooks", 0.0))


HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


def time_hooks(monitor: pl.Callback, times: dict) -> None:
    """Add the wall time spent inside ``monitor``'s step hooks to ``times["in_hooks"]`` (Lightning looks
    the hooks up on the instance). Work the monitor causes outside its hooks (the capture mode during
    the forward, the op's statistics) is not in it; the paired step times include everything."""
    for name in HOOKS:
        hook = getattr(monitor, name)

        def timed(*args, _hook=hook, **kwargs):
            t0 = time.perf_counter()
            try:
                return _hook(*args, **kwargs)
            finally:
                times["in_hooks"] = times.get("in_hooks", 0.0) + time.perf_counter() - t0

        setattr(monitor, name, timed)


def run_arm(gpt, monitor, steps: int, precision: str, args) -> dict[str, list[float]]:
    pl.seed_everything(1337, verbose=False)
    model = gpt.GPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                    key_bias=args.key_bias)
    data = gpt.ByteDataModule(block_size=args.block_size, batch_size=args.batch_size, max_bytes=300_000, train_samples=10_000)
    times: dict = {}
    time_hooks(monitor, times)
    callbacks = [StepTimer(times, True), monitor, StepTimer(times, False)]
    precision_args = {"plugins": [GProjPlugin(precision, fix="gproj")]} if args.plugin == "gproj" else {"precision": precision}
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=callbacks, **precision_args,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(model, datamodule=data)
    return times


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
    parser.add_argument("--key-bias", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--plugin", choices=("none", "gproj"), default="none")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "probe_cost.json"))
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    gpt = load_gpt()
    arms = {name: ARMS[name] for name in args.arms.split(",")}
    result = {
        "command": "python benchmarks/probe_cost.py " + " ".join(
            (f"--{k.replace('_', '-')}" if v else f"--no-{k.replace('_', '-')}") if isinstance(v, bool)
            else f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items() if k != "out" and v is not None
        ),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores (shared with other users), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        "shapes": f"examples/gpt.py GPT n_layer={args.n_layer} n_head={args.n_head} n_embd={args.n_embd} "
        f"block_size={args.block_size} key_bias={args.key_bias}, batch={args.batch_size}, {args.precision}, "
        + ("GProjPlugin fix=gproj (swapped attention)" if args.plugin == "gproj" else "unswapped SDPA")
        + f"; probe slice 1 batch row x 2 heads x {min(512, args.block_size)} queries",
    }
    for name, (make, cadence) in arms.items():
        monitor = make()
        times = run_arm(gpt, monitor, args.steps, args.precision, args)

        def median(key: str, parity: int) -> float:
            return statistics.median(t for i, t in enumerate(times[key]) if i >= args.warmup and i % 2 == parity)

        def iqr(key: str, parity: int) -> float:
            q = statistics.quantiles([t for i, t in enumerate(times[key]) if i >= args.warmup and i % 2 == parity], n=4)
            return q[2] - q[0]

        m, p = median("steps", 0), median("steps", 1)
        cpu_m, cpu_p = median("cpu", 0), median("cpu", 1)
        monitored = [i for i in range(args.warmup, len(times["steps"])) if i % 2 == 0]
        plain = [i for i in range(args.warmup, len(times["steps"])) if i % 2 == 1]
        hooks_m, hooks_p = median("hooks", 0), median("hooks", 1)
        hooks_per_step = hooks_m / cadence + hooks_p * (cadence - 1) / cadence
        print(f"{name}: monitored step {m * 1e3:.1f} ms, plain step {p * 1e3:.1f} ms ({len(monitored)}/{len(plain)} steps)")
        result[name] = {
            "median_monitored_step_ms": m * 1e3,
            "median_plain_step_ms": p * 1e3,
            "extra_ms_per_monitored_step": (m - p) * 1e3,
            "default_cadence": cadence,
            "cost_at_default_cadence_pct": 100 * (m - p) / (cadence * p),
            "cost_if_every_step_pct": 100 * (m - p) / p,
            "median_cpu_ms_monitored_step": cpu_m * 1e3,
            "median_cpu_ms_plain_step": cpu_p * 1e3,
            "cpu_cost_at_default_cadence_pct": 100 * (cpu_m - cpu_p) / (cadence * cpu_p),
            "plain_step_iqr_ms": iqr("steps", 1) * 1e3,
            "plain_cpu_iqr_ms": iqr("cpu", 1) * 1e3,
            "median_hook_ms_monitored_step": hooks_m * 1e3,
            "median_hook_ms_plain_step": hooks_p * 1e3,
            "hook_cost_at_default_cadence_pct": 100 * hooks_per_step / p,
            "per_step_s": {key: times[key] for key in ("steps", "cpu", "hooks")},
        }
        if getattr(monitor, "last_probe", None) is not None:  # the recomputation alone, timed on the last captured slice
            _, cap, _ = monitor.last_probe
            recompute = []
            for _ in range(20):
                t0 = time.perf_counter()
                probe_backward(cap.q, cap.k, cap.v, cap.do, cap.attn_mask, cap.is_causal, cap.scale, cap.autocast_dtype)
                recompute.append(time.perf_counter() - t0)
            result[name]["median_recompute_ms"] = statistics.median(recompute) * 1e3
            result[name]["recompute_cost_at_default_cadence_pct"] = 100 * statistics.median(recompute) / (cadence * p)
    result["total_at_default_cadence_pct"] = sum(result[name]["cost_at_default_cadence_pct"] for name in arms)
    result["cpu_total_at_default_cadence_pct"] = sum(result[name]["cpu_cost_at_default_cadence_pct"] for name in arms)
    result["hook_total_at_default_cadence_pct"] = sum(result[name]["hook_cost_at_default_cadence_pct"] for name in arms)
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
