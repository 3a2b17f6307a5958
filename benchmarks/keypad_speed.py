"""Right key padding (``seqlens_k``) on the GPU: kernel time of our forward and backward with and without it.

Issue 16's bar: a feature costs no more than 10% over the same kernel without it, and skipped work shows as time
saved. Per shape of benchmarks/attention.py and method (gproj, none), the forward and the backward (ms, GPU time by
attention.kernel_time) of:

* ``dense``: no seqlens_k;
* ``keep 1``: seqlens_k = seqlen in every batch row (the key-padding variant's own cost: nothing is padded);
* ``keep 1/2``: every batch row keeps the first half of its keys (the kernels skip the rest);
* ``tl.dot keep 1``: as ``keep 1`` with GPROJ_HOPPER_FWD=0 and GPROJ_HOPPER_BWD=0 (the tl.dot kernels, which served
  key padding alone before the Gluon ones did).

Usage (device machine): GPROJ_TRITON_AUTOTUNE=0 python benchmarks/keypad_speed.py [--shapes 0,1,3] [--out DIR]
Writes DIR/keypad_speed.json and DIR/keypad_speed.md (DIR: benchmarks/results).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention  # noqa: E402
from _methods import env_info, make  # noqa: E402

ARMS = (("dense", None, {}), ("keep 1", 1.0, {}), ("keep 1/2", 0.5, {}),
        ("tl.dot keep 1", 1.0, {"GPROJ_HOPPER_FWD": "0", "GPROJ_HOPPER_BWD": "0"}))


def time_arm(shape, method, keep, env):
    b, h, n, d, causal = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    seqlens_k = None if keep is None else torch.full((b,), max(1, int(n * keep)), dtype=torch.int32, device="cuda")
    with mock.patch.dict(os.environ, env):
        run = make(method, q, k, v, do, causal, seqlens_k=seqlens_k)
        run.fwd()
        fwd = attention.kernel_time(run.fwd)
        bwd = attention.kernel_time(run.bwd)
    return fwd, bwd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0,1,3", help="indices into benchmarks/attention.py's SHAPES")
    ap.add_argument("--methods", default="gproj,none")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    rows = []
    for i in (int(s) for s in args.shapes.split(",")):
        shape = attention.SHAPES[i]
        for method in args.methods.split(","):
            row = {"shape": list(shape[:4]), "causal": shape[4], "method": method}
            for arm, keep, env in ARMS:
                row[arm] = time_arm(shape, method, keep, env)
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "keypad_speed.json"), "w") as f:
        json.dump({"env": env_info(), "rows": rows}, f, indent=1)
    lines = ["| B×H×N×d | causal | method | " + " | ".join(f"{a} fwd / bwd ms" for a, _, _ in ARMS)
             + " | keep 1 / dense fwd, bwd |", "|---" * (4 + len(ARMS)) + "|"]
    for r in rows:
        cells = [f"{r[a][0]:.3f} / {r[a][1]:.3f}" for a, _, _ in ARMS]
        ratio = f"{r['keep 1'][0] / r['dense'][0]:.3f}, {r['keep 1'][1] / r['dense'][1]:.3f}"
        lines.append(f"| {'×'.join(map(str, r['shape']))} | {r['causal']} | {r['method']} | " + " | ".join(cells)
                     + f" | {ratio} |")
    with open(os.path.join(args.out, "keypad_speed.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
