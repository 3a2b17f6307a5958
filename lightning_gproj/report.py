"""``python -m lightning_gproj.report LOGDIR``: a PNG dashboard of a run's monitors.

Panels (log-scale where the values are positive): training loss; global gradient norm (with its
baseline median); zero-sum violation (median and max per layer); leak ratio (op, probe, and the leak
``fix="gproj"`` removed, per layer);
mean-key norm (per layer); C2 residual and key-bias gradient ratio (per layer). Alerts (the
``alert/{signal}`` metrics the monitors log) are marked on every panel as vertical lines, orange for
warn and red for critical.

LOGDIR is a Lightning log directory: a CSVLogger's ``metrics.csv`` (found below LOGDIR; exactly one, or
pass the file) or TensorBoard event files (needs the ``tensorboard`` package, read with its
``EventAccumulator``). Metric names are those of :mod:`lightning_gproj.callbacks` with their default
prefixes (``grad_norm``, ``gproj``); ``--grad-prefix``/``--zero-sum-prefix`` change them.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

from lightning_gproj.callbacks import keys

Series = dict[str, dict[int, float]]

#: Panels: (title, y label, metric-name suffixes after "{zero-sum prefix}/{layer}/").
_LAYER_PANELS = (
    ("Zero-sum violation", "ρ (median —, max ··)", ("violation_median", "violation_max")),
    # leak_removed_ratio: the λ a fix="gproj" run logs in place of leak_ratio (the leak GProj removed)
    ("Leak ratio", "λ (op —, probe ··, removed by gproj --)", ("leak_ratio", "probe_leak_ratio", "leak_removed_ratio")),
    ("Mean-key norm", "‖k̄‖", ("mean_key_norm",)),
    ("C2 residual / key-bias gradient", "‖Σ dK‖/‖dK‖ —, ‖∇b_k‖/‖∇W_k‖ ··", ("c2_residual", "key_bias_grad_ratio")),
)


# --------------------------------------------------------------------------------------- reading


def _read_csv(path: Path) -> Series:
    """The metrics of a CSVLogger ``metrics.csv``; ValueError naming the file when it holds no value with a step
    (empty, the header only, no ``step`` column, not a CSV): every consumer would otherwise read "nothing happened"."""
    out: Series = {}
    try:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                try:
                    step = int(float(row["step"]))
                except (KeyError, TypeError, ValueError):
                    continue
                for key, value in row.items():
                    if key in ("step", "epoch") or value in ("", None):
                        continue
                    try:
                        out.setdefault(key, {})[step] = float(value)
                    except (TypeError, ValueError):
                        continue
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path} is not a CSV file ({exc})") from None
    if not out:
        raise ValueError(f"{path} holds no metric value with a step (a CSVLogger metrics.csv has a 'step' column and "
                         f"a row per logged step); is the run logging yet?")
    return out


def _read_tensorboard(files: Sequence[Path]) -> Series:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as exc:
        raise RuntimeError(
            "reading TensorBoard event files needs the `tensorboard` package (pip install tensorboard); "
            "or log with lightning.pytorch.loggers.CSVLogger and pass its directory"
        ) from exc
    out: Series = {}
    for directory in sorted({f.parent for f in files}):
        acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for event in acc.Scalars(tag):
                out.setdefault(tag, {})[int(event.step)] = float(event.value)
    return out


def load_logs(logdir: str | os.PathLike) -> Series:
    """``{metric: {step: value}}`` from a CSVLogger ``metrics.csv`` (the file, or the one file below
    ``logdir``) or from TensorBoard event files below ``logdir``.

    Raises:
        FileNotFoundError: nothing readable below ``logdir``.
        ValueError: several ``metrics.csv`` below ``logdir`` (pass the version directory); a ``metrics.csv`` with no
            value with a step, or not a CSV.
        RuntimeError: only event files, and ``tensorboard`` is not installed.
    """
    path = Path(logdir)
    if path.is_file():
        return _read_csv(path) if path.suffix == ".csv" else _read_tensorboard([path])
    if not path.is_dir():
        raise FileNotFoundError(f"no such log directory: {path}")
    csvs = sorted(path.rglob("metrics.csv"))
    if len(csvs) > 1:
        listed = ", ".join(str(c.relative_to(path)) for c in csvs)
        raise ValueError(f"{path} holds several CSV logs ({listed}); pass one version directory")
    if csvs:
        return _read_csv(csvs[0])
    events = sorted(path.rglob("events.out.tfevents.*"))
    if events:
        return _read_tensorboard(events)
    raise FileNotFoundError(f"no metrics.csv and no TensorBoard event file below {path}")


# --------------------------------------------------------------------------------------- selecting


def alert_steps(series: Series) -> list[tuple[int, int, str]]:
    """``(step, level, signal)`` of every logged alert (``alert/{signal}``: 1 warn, 2 critical), by step."""
    out = []
    for key, values in series.items():
        signal = keys.parse_alert_key(key)
        if signal is not None:
            out += [(step, int(v), signal) for step, v in values.items() if v > 0]
    return sorted(out)


def loss_keys(series: Series, grad_prefix: str = "grad_norm") -> list[str]:
    """Training-loss metrics: names containing "loss" (``train_loss``, ``loss/train``, ``grad_norm/loss``), except
    detector statistics (``grad_norm/loss/ratio``, ``/cusum``), alert levels (``alert/...``), per-layer gradient norms
    (``{grad_prefix}/layer/...``) and validation or test ones (a ``val``, ``valid``, ``validation`` or ``test``
    part between ``/``, ``_`` or ``.``); step-level names preferred over ``*_epoch``."""
    held_out = {"val", "valid", "validation", "test"}
    names = [k for k in series if "loss" in k.lower() and not keys.is_detector_key(k) and keys.parse_alert_key(k) is None
             and not k.startswith(keys.metric(grad_prefix, "layer", ""))
             and not held_out.intersection(re.split(r"[/_.]", k.lower()))]
    step_level = [k for k in names if not k.endswith("_epoch")]
    return sorted(step_level or names)


def layer_series(series: Series, prefix: str, stat: str) -> dict[str, dict[int, float]]:
    """``{layer: {step: value}}`` for ``{prefix}/{layer}/{stat}``."""
    out = {}
    for key, values in series.items():
        parsed = keys.parse_layer_key(prefix, key)
        if parsed is not None and parsed[1] == stat:
            out[parsed[0]] = values
    return out


# --------------------------------------------------------------------------------------- drawing


def render(series: Series, out: str | os.PathLike, *, grad_prefix: str = "grad_norm", zero_sum_prefix: str = "gproj",
           title: Optional[str] = None):
    """Draw the dashboard of ``series`` into the PNG ``out``; returns the matplotlib Figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is a dependency of the report extra
        raise RuntimeError("the dashboard needs matplotlib: pip install \"lightning-gproj[report]\" (or pip install matplotlib)") from exc

    panels = 2 + len(_LAYER_PANELS)
    fig, axes = plt.subplots(panels, 1, figsize=(11, 2.6 * panels), sharex=True, squeeze=False)
    axes = axes[:, 0]

    def plot(ax, values: dict[int, float], label: str, style: str = "-") -> None:
        steps = sorted(s for s, v in values.items() if math.isfinite(v))
        if steps:
            ax.plot(steps, [values[s] for s in steps], style, label=label, linewidth=1.0, marker="." if len(steps) < 60 else None)

    ax = axes[0]
    for key in loss_keys(series, grad_prefix):
        plot(ax, series[key], key)
    ax.set_title("Training loss")
    ax = axes[1]
    if keys.metric(grad_prefix, "global") in series:
        plot(ax, series[keys.metric(grad_prefix, "global")], "‖g‖ global")
    if keys.metric(grad_prefix, "baseline_median") in series:
        plot(ax, series[keys.metric(grad_prefix, "baseline_median")], "baseline median", ":")
    ax.set_title("Gradient norm (after unscaling, before clipping)")
    for ax, (name, ylabel, stats) in zip(axes[2:], _LAYER_PANELS):
        for stat, style in zip(stats, ("-", ":", "--")):
            for layer, values in sorted(layer_series(series, zero_sum_prefix, stat).items()):
                plot(ax, values, f"{layer} {stat}", style)
        ax.set_title(name)
        ax.set_ylabel(ylabel, fontsize=8)

    marks = alert_steps(series)
    for ax in axes:
        ydata = [v for line in ax.get_lines() for v in line.get_ydata()]
        if ydata and min(ydata) > 0:
            ax.set_yscale("log")
        for step, level, _ in marks:
            ax.axvline(step, color="red" if level >= 2 else "orange", linewidth=0.8, alpha=0.7)
        if ax.get_lines():
            ax.legend(fontsize=6, loc="upper left", ncol=2)
        else:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="gray")
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("optimizer step")
    suffix = f"; {len(marks)} alert(s): " + ", ".join(f"{s}:{sig}" for s, _, sig in marks[:6]) if marks else "; no alert"
    fig.suptitle((title or "lightning-gproj monitors") + suffix, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_gproj.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("logdir", help="CSVLogger version directory (or its metrics.csv) or TensorBoard log directory")
    parser.add_argument("-o", "--out", help="PNG path (default: LOGDIR/dashboard.png)")
    parser.add_argument("--grad-prefix", default="grad_norm", help="GradNormMonitor prefix (default grad_norm)")
    parser.add_argument("--zero-sum-prefix", default="gproj", help="ZeroSumMonitor prefix (default gproj)")
    args = parser.parse_args(argv)
    try:
        series = load_logs(args.logdir)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logdir = Path(args.logdir)
    out = Path(args.out) if args.out else (logdir.parent if logdir.is_file() else logdir) / "dashboard.png"
    if not out.parent.is_dir():
        print(f"error: output directory {str(out.parent)!r} does not exist", file=sys.stderr)
        return 2
    try:
        render(series, out, grad_prefix=args.grad_prefix, zero_sum_prefix=args.zero_sum_prefix, title=str(args.logdir))
    except OSError as exc:
        print(f"error: cannot write {str(out)!r}: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # matplotlib missing: the install hint, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(series)} metrics, {len(alert_steps(series))} alert(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
