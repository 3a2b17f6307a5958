"""Summarize the three arms of the issue-6 stress (examples/configs/repro_stress.yaml) from CSV logs.

    python benchmarks/repro_summary.py OUT.json none=LOGDIR gproj=LOGDIR fp32=LOGDIR

Per arm: final val loss, key-bias drift ‖b_k(t) − b_k(0)‖ (last, per layer), and last / peak over
layers and steps of the mean-key norm, C2 residual and leak ratio (ZeroSumMonitor), peak global grad
norm, and the alerts logged online (``alert/...`` columns). Prints a Markdown table, then the same
quantities at the last step every arm reached (arms stopped by a time limit end at different steps):
val loss at the last validation step all arms share at or before it, key-bias drift, peak mean-key norm, and the grad-norm
growth (peak after step 500 over the median of steps 100–500), with each arm's ratio to the fp32 arm's.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

from lightning_gproj.report import layer_series, load_logs


def load(logdir: str) -> dict[str, dict[int, float]]:
    """Metric -> {step: value} of one arm: :func:`lightning_gproj.report.load_logs` of the folder, or,
    where it holds several ``version_N`` folders (a run resumed from its checkpoints logs each segment
    to a new version), of each version in order, merged (a later version wins a step logged twice)."""
    versions = sorted(glob.glob(os.path.join(logdir, "version_*")), key=_version_number)
    if len(versions) < 2:
        return load_logs(logdir)
    series: dict[str, dict[int, float]] = {}
    for version in versions:
        try:
            segment = load_logs(version)
        except ValueError:  # a segment that logged nothing (a resume cut before its first step): nothing to merge
            continue
        for key, values in segment.items():
            series.setdefault(key, {}).update(values)
    return series


def _version_number(path: str) -> int:
    suffix = os.path.basename(path)[len("version_"):]
    return int(suffix) if suffix.isdigit() else -1


def _last(s: dict[int, float]) -> float:
    return s[max(s)]


def summarize(series: dict[str, dict[int, float]]) -> dict:
    out: dict = {"val_loss": {str(s): v for s, v in sorted(series.get("val_loss", {}).items())}}
    out["final_val_loss"] = _last(series["val_loss"]) if "val_loss" in series else None
    out["final_train_loss"] = _last(series["train_loss"]) if "train_loss" in series else None
    drift = {k.split("/", 1)[1]: v for k, v in series.items() if k.startswith("key_bias_drift/")}
    out["key_bias_drift_last"] = {k: _last(v) for k, v in drift.items()}
    out["key_bias_drift_max_last"] = max(out["key_bias_drift_last"].values(), default=None)
    for stat in ("mean_key_norm", "c2_residual", "leak_ratio", "key_bias_grad_ratio", "violation_median"):
        per = layer_series(series, "gproj", stat)
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


def _upto(s: dict[int, float], step: int) -> dict[int, float]:
    return {k: v for k, v in s.items() if k <= step}


def at_common_step(all_series: dict[str, dict[str, dict[int, float]]]) -> dict:
    """The comparison at the last step every arm logged (see the module docstring)."""
    common = min(max(s["train_loss"]) for s in all_series.values())
    val_steps = set.intersection(*(set(_upto(s.get("val_loss", {}), common)) for s in all_series.values()))
    val_step = max(val_steps, default=None)
    out: dict = {"step": common, "val_step": val_step, "arms": {}}
    for arm, series in all_series.items():
        val = _upto(series.get("val_loss", {}), val_step) if val_step is not None else {}
        drift = [_upto(v, common) for k, v in series.items() if k.startswith("key_bias_drift/")]
        mk = [_upto(v, common) for k, v in series.items() if k.startswith("gproj/") and k.endswith("/mean_key_norm")]
        g = _upto(series.get("grad_norm/global", {}), common)
        early = sorted(v for s, v in g.items() if 100 <= s <= 500)
        late = [v for s, v in g.items() if s > 500]
        out["arms"][arm] = {
            "val_loss": _last(val) if val else None,
            "val_step": max(val) if val else None,
            "key_bias_drift_max": max((_last(d) for d in drift if d), default=None),
            "mean_key_norm_peak": max((x for d in mk for x in d.values()), default=None),
            "grad_norm_growth": (max(late) / early[len(early) // 2]) if early and late else None,
        }
    ref = out["arms"].get("fp32")
    if ref:
        for r in out["arms"].values():
            for key in ("key_bias_drift_max", "mean_key_norm_peak"):
                r[key + "_vs_fp32"] = r[key] / ref[key] if r[key] is not None and ref[key] else None
            r["val_loss_minus_fp32"] = (r["val_loss"] - ref["val_loss"]) if r["val_loss"] is not None and ref["val_loss"] is not None else None
    return out


def fmt(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.3g}"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="JSON path to write")
    parser.add_argument("arms", nargs="+", metavar="ARM=LOGDIR", help="each arm's CSV log directory, e.g. none=logs/x")
    args = parser.parse_args(argv)
    if not all("=" in a for a in args.arms):
        parser.error(f"arms must be ARM=LOGDIR, got {[a for a in args.arms if '=' not in a]}")
    out_path, arms = args.out, dict(a.split("=", 1) for a in args.arms)
    all_series = {arm: load(d) for arm, d in arms.items()}
    result = {arm: summarize(series) for arm, series in all_series.items()}
    common = at_common_step(all_series)
    with open(out_path, "w") as f:
        json.dump({**result, "at_common_step": common}, f, indent=1)
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
    print(f"\nAt step {common['step']}, the last step every arm reached:\n")
    print("| arm | val loss (step) | − fp32 | key-bias drift (max layer) | ÷ fp32 | peak mean-key norm | ÷ fp32 | "
          "grad-norm growth (peak after 500 / median 100–500) |")
    print("|---|---|---|---|---|---|---|---|")
    for arm, r in common["arms"].items():
        print(f"| {arm} | {fmt(r['val_loss'])} ({r['val_step']}) | {fmt(r.get('val_loss_minus_fp32'))} | "
              f"{fmt(r['key_bias_drift_max'])} | {fmt(r.get('key_bias_drift_max_vs_fp32'))} | "
              f"{fmt(r['mean_key_norm_peak'])} | {fmt(r.get('mean_key_norm_peak_vs_fp32'))} | {fmt(r['grad_norm_growth'])} |")


if __name__ == "__main__":
    main(sys.argv[1:])
