"""Plot the arms of the issue-6 reproduction side by side, one row per stress setting.

    python benchmarks/repro_plot.py OUT.png LOGROOT LABEL [LABEL ...]

Reads LOGROOT/LABEL-{none,gproj,fp32}/**/metrics.csv (the layout of examples/repro_arms.sh) and draws,
per LABEL: key-bias drift (max over layers), mean-key norm (max over layers), global grad norm (log
scale) and validation loss against the step.
"""

from __future__ import annotations

import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from repro_summary import load  # noqa: E402

ARMS = ("none", "gproj", "fp32")
PANELS = (
    ("key-bias drift ‖b_k(t) − b_k(0)‖ (max layer)", lambda k: k.startswith("key_bias_drift/"), "linear"),
    ("mean-key norm (max layer)", lambda k: k.startswith("gproj/") and k.endswith("/mean_key_norm"), "linear"),
    ("global grad norm", lambda k: k == "grad_norm/global", "log"),
    ("val loss (nats)", lambda k: k == "val_loss", "linear"),
)


def max_over(series: dict[str, dict[int, float]], keep) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, values in series.items():
        if keep(key):
            for step, v in values.items():
                out[step] = max(out.get(step, float("-inf")), v)
    return dict(sorted(out.items()))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="PNG path to write")
    parser.add_argument("root", help="LOGROOT: the folder holding LABEL-{none,gproj,fp32}/")
    parser.add_argument("labels", nargs="+", help="stress settings (LABEL), one row each")
    args = parser.parse_args(argv)
    out, root, labels = args.out, args.root, args.labels
    fig, axes = plt.subplots(len(labels), len(PANELS), figsize=(4.2 * len(PANELS), 3.2 * len(labels)), squeeze=False)
    for row, label in enumerate(labels):
        data = {arm: load(os.path.join(root, f"{label}-{arm}")) for arm in ARMS}
        for col, (title, keep, scale) in enumerate(PANELS):
            ax = axes[row][col]
            for arm in ARMS:
                s = max_over(data[arm], keep)
                if s:
                    ax.plot(list(s), list(s.values()), label=arm, marker="." if len(s) < 30 else None)
            ax.set_yscale(scale)
            ax.set_title(f"{label}: {title}", fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[row][0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=90)


if __name__ == "__main__":
    main(sys.argv[1:])
