"""Summarize the three arms of the issue-6 stress (examples/configs/repro_stress.yaml) from CSV logs.

    python benchmarks/repro_summary.py OUT.json none=LOGDIR gproj=LOGDIR fp32=LOGDIR

Per arm: final val loss, key-bias drift ‖b_k(t) − b_k(0)‖ (last, per layer), and last / peak over
layers and steps of the mean-key norm, C2 residual and leak ratio (ZeroSumMonitor), peak global grad
norm, and the alerts logged online (``alert/...`` columns). Prints a Markdown table.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import sys


def load(logdir: str) -> dict[str, dict[int, float]]:
    path = logdir if logdir.endswith(".csv") else sorted(glob.glob(os.path.join(logdir, "**", "metrics.csv"), recursive=True))[-1]
    series: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            for k, v in row.items():
                if k not in ("step", "epoch") and v not in ("", None):
                    series.setdefault(k, {})[step] = float(v)
    return series


def _last(s: dict[int, float]) -> float:
    return s[max(s)]


def summarize(series: dict[str, dict[int, float]]) -> dict:
    def layers(stat: str) -> dict[str, dict[int, float]]:
        return {k.split("/")[1]: v for k, v in series.items() if k.startswith("gproj/") and k.endswith("/" + stat)}

    out: dict = {"val_loss": {str(s): v for s, v in sorted(series.get("val_loss", {}).items())}}
    out["final_val_loss"] = _last(series["val_loss"]) if "val_loss" in series else None
    out["final_train_loss"] = _last(series["train_loss"]) if "train_loss" in series else None
    drift = {k.split("/", 1)[1]: v for k, v in series.items() if k.startswith("key_bias_drift/")}
    out["key_bias_drift_last"] = {k: _last(v) for k, v in drift.items()}
    out["key_bias_drift_max_last"] = max(out["key_bias_drift_last"].values(), default=None)
    for stat in ("mean_key_norm", "c2_residual", "leak_ratio", "key_bias_grad_ratio", "violation_median"):
        per = layers(stat)
        out[stat] = {
            "last_max_over_layers": max((_last(v) for v in per.values()), default=None),
            "peak": max((x for v in per.values() for x in v.values()), default=None),
            "median": (sorted(x for v in per.values() for x in v.values()) or [None])[
                len([x for v in per.values() for x in v.values()]) // 2] if per else None,
        }
    g = series.get("grad_norm/global", {})
    out["grad_norm_peak"] = max(g.values()) if g else None
    out["grad_norm_peak_step"] = max(g, key=g.get) if g else None
    out["alerts"] = {k: {str(s): v for s, v in sorted(v.items())} for k, v in series.items() if k.startswith("alert/")}
    return out


def fmt(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.3g}"


def main(argv: list[str]) -> None:
    out_path, arms = argv[0], dict(a.split("=", 1) for a in argv[1:])
    result = {arm: summarize(load(d)) for arm, d in arms.items()}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print("| arm | final val loss | key-bias drift (last, max layer) | mean-key norm (last / peak) | "
          "C2 residual (median / peak) | leak ratio (median / peak) | peak grad norm (step) | online alerts |")
    print("|---|---|---|---|---|---|---|---|")
    for arm, r in result.items():
        n_alerts = sum(len(v) for v in r["alerts"].values())
        print(f"| {arm} | {fmt(r['final_val_loss'])} | {fmt(r['key_bias_drift_max_last'])} | "
              f"{fmt(r['mean_key_norm']['last_max_over_layers'])} / {fmt(r['mean_key_norm']['peak'])} | "
              f"{fmt(r['c2_residual']['median'])} / {fmt(r['c2_residual']['peak'])} | "
              f"{fmt(r['leak_ratio']['median'])} / {fmt(r['leak_ratio']['peak'])} | "
              f"{fmt(r['grad_norm_peak'])} ({r['grad_norm_peak_step']}) | {n_alerts} "
              f"{sorted(r['alerts']) if n_alerts else ''} |")


if __name__ == "__main__":
    main(sys.argv[1:])
