"""Lead time and false alarms of the monitors' default detectors (issue 4's evaluation).

    # real runs (the reproduction of issue 6): two Lightning log directories
    python benchmarks/lead_time.py --stressed LOGS/fix_none/version_0 --healthy LOGS/gproj/version_0

    # until they exist: SYNTHETIC traces only (made-up series, no training), to exercise the harness
    python benchmarks/lead_time.py --synthetic

Both forms call :func:`lightning_gproj.evaluate.evaluate`, which replays the logged series through
fresh ``GradNormMonitor`` / ``ZeroSumMonitor`` instances (``--config`` JSON for non-default settings),
i.e. the same detector code the monitors run online. Results go to ``benchmarks/results/``.

The synthetic pair: 1600 steps; the global grad norm is 1 × lognormal noise (σ_log 0.1) and, in the
stressed arm, grows ×1.05 per step from step 1300; a leak ratio sampled every 50 steps is 1e-2 ×
lognormal noise (σ_log 0.05) and, in the stressed arm, doubles every 100 steps from step 800. The
healthy twin has the same noise (same seed) and neither rise. These numbers say that the harness and
the detectors do what they are built to do on a made-up leak-before-blowup pattern; they say nothing
about real training, where the lead time is NOT MEASURED YET.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from lightning_gproj.evaluate import evaluate
from lightning_gproj.report import load_logs

REPO = Path(__file__).resolve().parents[1]


def synthetic(seed: int, steps: int, leak_rise_at: int | None, blowup_at: int | None) -> dict[str, dict[int, float]]:
    rng = np.random.default_rng(seed)
    grad = np.exp(rng.normal(0, 0.1, steps))
    leak = 1e-2 * np.exp(rng.normal(0, 0.05, steps))
    t = np.arange(steps)
    if blowup_at is not None:
        grad = grad * np.where(t >= blowup_at, 1.05 ** (t - blowup_at), 1.0)
    if leak_rise_at is not None:
        leak = leak * np.where(t >= leak_rise_at, 2.0 ** ((t - leak_rise_at) / 100), 1.0)
    return {
        "grad_norm/global": {int(s): float(grad[s]) for s in t},
        "grad_norm/layer/blocks.0": {int(s): float(grad[s]) for s in t},
        "gproj/blocks.0.attn/leak_ratio": {int(s): float(leak[s]) for s in t if s % 50 == 0},
    }


def write_csv(directory: Path, series: dict[str, dict[int, float]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    steps = sorted({s for values in series.values() for s in values})
    keys = sorted(series)
    with open(directory / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["epoch", "step", *keys])
        for s in steps:
            writer.writerow([0, s, *[repr(series[k][s]) if s in series[k] else "" for k in keys]])
    return directory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stressed")
    parser.add_argument("--healthy")
    parser.add_argument("--synthetic", action="store_true")
    parser.add_argument("--config", help="JSON {'GradNormMonitor': {...}, 'ZeroSumMonitor': {...}}")
    parser.add_argument("--out", help="result stem (default benchmarks/results/lead_time[_synthetic])")
    args = parser.parse_args()
    config = json.loads(Path(args.config).read_text()) if args.config else None
    if args.synthetic:
        work = Path(tempfile.mkdtemp(prefix="lead_time_synthetic_"))
        stressed_dir = write_csv(work / "stressed", synthetic(0, 1600, leak_rise_at=800, blowup_at=1300))
        healthy_dir = write_csv(work / "healthy", synthetic(0, 1600, leak_rise_at=None, blowup_at=None))
        stem = args.out or str(REPO / "benchmarks" / "results" / "lead_time_synthetic")
        header = "SYNTHETIC traces (made-up series, see benchmarks/lead_time.py); real lead time not measured yet.\n"
    elif args.stressed and args.healthy:
        stressed_dir, healthy_dir = Path(args.stressed), Path(args.healthy)
        stem = args.out or str(REPO / "benchmarks" / "results" / "lead_time")
        header = f"stressed: {stressed_dir}\nhealthy:  {healthy_dir}\n"
    else:
        parser.error("give --stressed and --healthy, or --synthetic")
    result = evaluate(load_logs(stressed_dir), load_logs(healthy_dir), config)
    text = header + result.text() + "\n"
    print(text, end="")
    Path(stem + ".txt").write_text(text)
    Path(stem + ".json").write_text(json.dumps(result.as_dict(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
