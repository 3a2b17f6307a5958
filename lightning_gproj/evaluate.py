"""Lead time and false alarms of the monitors' detectors, replayed offline on logged runs.

    python -m lightning_gproj.evaluate STRESSED_LOGDIR HEALTHY_LOGDIR [--config monitors.json] [--json OUT]

Both arguments are Lightning log directories (CSVLogger ``metrics.csv`` or TensorBoard, as for
``python -m lightning_gproj.report``) of two runs that logged :class:`~lightning_gproj.GradNormMonitor`
and :class:`~lightning_gproj.ZeroSumMonitor` metrics: the stressed arm (e.g. ``fix="none"``) and its
healthy twin (same seed, GProj or fp32 attention).

The logged series are fed, step by step, to fresh monitors built with the given settings, through
the very methods the monitors use online (``GradNormMonitor.observe`` with the global and per-layer
norms, ``GradNormMonitor.observe_loss`` with the logged loss, ``ZeroSumMonitor.observe`` with the
zero-sum metrics of the step), so the detector code is the
same online and offline. Online the monitors also see the values of steps they did not log; the replay
sees what was logged, which is the same series when ``GradNormMonitor(every_n_steps=1)``.

Definitions (issue 4):

* divergence step D = the first step s >= ``baseline_start`` whose global grad norm exceeds ``factor``
  (10) × the median of the global grad norm over steps [``baseline_start``, ``baseline_end``]
  (100–500); None if no step does (with several optimizers, optimizer 0's norm; each optimizer's series are
  replayed into its own detectors);
* lead time = D − (step of the first alert of the stressed arm); positive = warned before;
* false alarms = number of alerts in the healthy twin (all steps).

``--config`` takes a JSON object ``{"GradNormMonitor": {...}, "ZeroSumMonitor": {...}}`` of keyword
arguments (detector settings as ``{"detector": {"window": 50, "warmup": 50}}``, the fields of
:class:`~lightning_gproj.callbacks.DetectorConfig`), so settings can be tuned offline and then used
online unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
from typing import Any, Optional, Sequence

from lightning_gproj.callbacks import Alert, GradNormMonitor, ZeroSumMonitor, keys
from lightning_gproj.report import Series, load_logs


def optimizer_prefixes(series: Series, prefix: str) -> list[str]:
    """The GradNormMonitor series heads in ``series``: ``[prefix]`` for one optimizer, ``[prefix/opt0, prefix/opt1,
    ...]`` where the run had several (the monitor's names then carry ``opt{i}/``)."""
    pattern = re.compile(re.escape(prefix) + r"/opt(\d+)/(global|loss)$")
    several = sorted({int(m.group(1)) for k in series if (m := pattern.match(k))})
    return [keys.metric(prefix, f"opt{i}") for i in several] or [prefix]


def replay(series: Series, grad_norm: GradNormMonitor, zero_sum: ZeroSumMonitor) -> list[Alert]:
    """Feed the logged ``series`` to the monitors' detectors in step order (with several optimizers, each one's norms
    and loss to its own detectors); returns their alerts."""
    heads = optimizer_prefixes(series, grad_norm.prefix)
    several = heads != [grad_norm.prefix]
    per_opt = []
    for head in heads:
        layer_head = keys.metric(head, "layer", "")
        per_opt.append((
            series.get(keys.metric(head, "global"), {}),
            series.get(keys.metric(head, "loss"), {}) if grad_norm.loss else {},
            {k: k[len(layer_head):] for k in series if k.startswith(layer_head)},
        ))
    zs_keys = [k for k in series if keys.parse_layer_key(zero_sum.prefix, k) is not None]
    steps = sorted({s for glob, loss, _ in per_opt for s in (*glob, *loss)} | {s for k in zs_keys for s in series[k]})
    alerts: list[Alert] = []
    for step in steps:
        for opt_idx, (glob, loss, layer_keys) in enumerate(per_opt):
            if step in glob:
                layers = {name: series[k][step] for k, name in layer_keys.items() if step in series[k]}
                _, _, new = grad_norm.observe(step, glob[step], layers, opt_idx, several)
                alerts += new
            if step in loss:
                _, new = grad_norm.observe_loss(step, loss[step], opt_idx, several)
                alerts += new
        metrics = {k: series[k][step] for k in zs_keys if step in series[k]}
        if metrics:
            new, _ = zero_sum.observe(step, metrics)
            alerts += new
    return alerts


def divergence_step(grad: dict[int, float], baseline_start: int = 100, baseline_end: int = 500,
                    factor: float = 10.0) -> tuple[Optional[int], Optional[float]]:
    """(first step >= ``baseline_start`` whose value exceeds ``factor`` × the median over
    [``baseline_start``, ``baseline_end``], that median); (None, None) without values in the range."""
    window = [v for s, v in grad.items() if baseline_start <= s <= baseline_end and v == v]
    if not window:
        return None, None
    median = statistics.median(window)
    for step in sorted(grad):
        if step >= baseline_start and grad[step] > factor * median:
            return step, median
    return None, median


@dataclasses.dataclass
class Evaluation:
    """Result of :func:`evaluate` (steps are optimizer steps)."""

    divergence_step: Optional[int]
    baseline_median: Optional[float]
    first_alert_step: Optional[int]
    lead_time: Optional[int]
    false_alarms: int
    healthy_divergence_step: Optional[int]
    stressed_alerts: list[dict[str, Any]]
    healthy_alerts: list[dict[str, Any]]
    first_alert_by_signal: dict[str, int]
    settings: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self) -> str:
        lines = [
            f"divergence step (grad norm > {self.settings['factor']:g}x median of steps "
            f"{self.settings['baseline_start']}-{self.settings['baseline_end']} = {self.baseline_median}): "
            f"{self.divergence_step}",
            f"first alert (stressed): {self.first_alert_step}",
            f"lead time: {self.lead_time} steps",
            f"false alarms (healthy twin): {self.false_alarms}"
            + (f"  (healthy twin diverged too, at step {self.healthy_divergence_step})" if self.healthy_divergence_step is not None else ""),
            "first alert by signal (stressed): "
            + (", ".join(f"{k} @ {v}" for k, v in sorted(self.first_alert_by_signal.items(), key=lambda kv: kv[1])) or "-"),
        ]
        for name, alerts in (("stressed", self.stressed_alerts), ("healthy", self.healthy_alerts)):
            for a in alerts[:20]:
                lines.append(
                    f"  {name}: step {a['step']} {a['level']} {a['signal']} {a['statistic']} "
                    f"{a['value']:.4g} > {a['threshold']:.4g} layers {', '.join(a['layers']) or '-'}"
                )
            if len(alerts) > 20:
                lines.append(f"  {name}: ... {len(alerts) - 20} more")
        return "\n".join(lines)


def evaluate(
    stressed: Series,
    healthy: Series,
    config: Optional[dict[str, dict[str, Any]]] = None,
    *,
    baseline_start: int = 100,
    baseline_end: int = 500,
    factor: float = 10.0,
) -> Evaluation:
    """Replay both runs through fresh monitors built from ``config`` and measure lead and false alarms."""
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise ValueError(f"`config` must be a dict (a JSON object) {{'GradNormMonitor': {{...}}, 'ZeroSumMonitor': "
                         f"{{...}}}}, got {type(config).__name__}")
    unknown = set(config) - {"GradNormMonitor", "ZeroSumMonitor"}
    if unknown:
        raise ValueError(f"`config` keys must be 'GradNormMonitor' and/or 'ZeroSumMonitor', got {sorted(unknown)}")

    for name, section in config.items():
        if not isinstance(section, dict):
            raise ValueError(f"`config[{name!r}]` must be a dict of {name}'s keyword arguments, got {section!r}")

    def monitors() -> tuple[GradNormMonitor, ZeroSumMonitor]:
        built = []
        for cls in (GradNormMonitor, ZeroSumMonitor):
            try:
                built.append(cls(print_summary=False, **config.get(cls.__name__, {})))
            except TypeError as exc:  # an argument the monitor does not take
                raise ValueError(f"`config[{cls.__name__!r}]`: {exc}") from None
        return built[0], built[1]

    gn, zs = monitors()
    for arm, series in (("stressed", stressed), ("healthy", healthy)):
        # logs without either monitor's series would replay to "no alert, no false alarm": say so instead
        if not any(k.startswith(f"{gn.prefix}/") or keys.parse_layer_key(zs.prefix, k) is not None for k in series):
            raise ValueError(
                f"the {arm} logs hold no GradNormMonitor ('{gn.prefix}/...') or ZeroSumMonitor ('{zs.prefix}/<layer>/"
                f"...') metrics (found: {sorted(series)[:8] or 'none'}); if the run used other prefixes, give them "
                f"in --config")
    stressed_alerts = replay(stressed, gn, zs)
    gn_h, zs_h = monitors()
    healthy_alerts = replay(healthy, gn_h, zs_h)
    def first_global(series: Series) -> dict[int, float]:  # the divergence is read off optimizer 0's global norm
        return series.get(keys.metric(optimizer_prefixes(series, gn.prefix)[0], "global"), {})

    div, median = divergence_step(first_global(stressed), baseline_start, baseline_end, factor)
    healthy_div, _ = divergence_step(first_global(healthy), baseline_start, baseline_end, factor)
    first = min((a.step for a in stressed_alerts), default=None)
    by_signal: dict[str, int] = {}
    for a in stressed_alerts:
        by_signal.setdefault(a.signal, a.step)
    return Evaluation(
        divergence_step=div,
        baseline_median=median,
        first_alert_step=first,
        lead_time=None if div is None or first is None else div - first,
        false_alarms=len(healthy_alerts),
        healthy_divergence_step=healthy_div,
        stressed_alerts=[a.as_dict() for a in stressed_alerts],
        healthy_alerts=[a.as_dict() for a in healthy_alerts],
        first_alert_by_signal=by_signal,
        settings={"baseline_start": baseline_start, "baseline_end": baseline_end, "factor": factor, "config": config},
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_gproj.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("stressed", help="log directory of the stressed arm")
    parser.add_argument("healthy", help="log directory of the healthy twin")
    parser.add_argument("--config", help="JSON file {'GradNormMonitor': {...}, 'ZeroSumMonitor': {...}}")
    parser.add_argument(
        "--baseline", type=int, nargs=2, default=(100, 500), metavar=("START", "END"),
        help="optimizer steps whose median global grad norm is the baseline of the divergence step (default 100 500)",
    )
    parser.add_argument(
        "--factor", type=float, default=10.0,
        help="the divergence step is the first step >= START whose global grad norm exceeds FACTOR x that "
             "median (default 10)",
    )
    parser.add_argument("--json", help="also write the result as JSON to this path")
    args = parser.parse_args(argv)
    if not 0 <= args.baseline[0] <= args.baseline[1]:
        parser.error(f"--baseline START END must satisfy 0 <= START <= END, got {args.baseline[0]} {args.baseline[1]}")
    if not (math.isfinite(args.factor) and args.factor > 1):
        parser.error(f"--factor must be a finite number > 1 (a multiple of the baseline median), got {args.factor}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json: the folder of {args.json} does not exist")
    config = None
    if args.config:
        try:
            with open(args.config) as f:
                config = json.load(f)
        except (OSError, ValueError) as exc:  # missing, unreadable, not JSON
            parser.error(f"--config {args.config}: {exc}")
    try:
        result = evaluate(
            load_logs(args.stressed), load_logs(args.healthy), config,
            baseline_start=args.baseline[0], baseline_end=args.baseline[1], factor=args.factor,
        )
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.text())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.as_dict(), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
