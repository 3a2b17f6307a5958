"""Fix "none"'s backward on an H200, one pass against two passes and cuDNN.

The one pass (kernels/attention_bwd_onepass.py) against the two passes (GPROJ_ONEPASS_BWD=0) and cuDNN's backward, per
shape and mask — the measurements behind the one pass's serving rule (attention_bwd_onepass.pays: full attention,
causal without GQA from CAUSAL_MIN_SEQLEN keys, 8192 at head dim 128 and 2048 at 64).

Each call goes through kernels/attention_bwd.backward (fix "none", its m, log2l from the Gluon forward); the one pass is
timed where that rule would not pick it too (``pays`` patched to True; the rest of ``serves`` still applies, and a
shape it excludes — seqlen not a multiple of 128, head dim not 64 / 128 — stops the script; the JSON's ``served`` says
what the rule picks). Checks the one pass
against the two passes first (dq, dk relative, dv bit for bit). Times: benchmarks/attention.py's kernel timer (summed
kernel durations, L2 flushed), backward TFLOP/s (2.5 × the forward's 4·B·H·N²·d, halved when causal).

    GPROJ_TRITON_AUTOTUNE=0 python3 benchmarks/onepass_ab.py --json out.json [--shapes "4,16,2048,128;1,16,8192,128,8"]

A shape is B,H,N,d[,G]: G query heads per kv head (GQA). Needs an sm_90 GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from unittest import mock

import torch

from lightning_gproj.kernels import attention_bwd as B
from lightning_gproj.kernels import attention_bwd_hopper as HB
from lightning_gproj.kernels import attention_bwd_onepass as OP
from lightning_gproj.kernels import attention_fwd as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import kernel_time  # noqa: E402


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4,16,2048,128;1,16,4096,128;1,16,8192,128;1,8,16384,128;4,16,2048,128,8;"
                                        "1,16,8192,128,8", help="';'-separated B,H,N,d[,G] (G query heads per kv head)")
    ap.add_argument("--causal", choices=("both", "0", "1"), default="both", help="which masks (default both)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    shapes = []
    for spec in args.shapes.split(";"):
        dims = [int(x) for x in spec.split(",")]
        if len(dims) not in (4, 5):
            ap.error(f"--shapes: {spec!r} is not B,H,N,d[,G]")
        shapes.append(dims)
    if not torch.cuda.is_available():
        sys.exit("onepass_ab.py needs an sm_90 GPU (CUDA is not available)")
    torch.manual_seed(0)
    rows = []
    for dims in shapes:
        b, h, n, d = dims[:4]
        hk = h // dims[4] if len(dims) > 4 else h
        for causal in {"both": (False, True), "0": (False,), "1": (True,)}[args.causal]:
            q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16)
            do = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
            tau = 1 / math.sqrt(d)
            o, m, l2 = F.forward(q, k, v, tau, causal)

            launched = []

            def counted(*a, real=OP.backward, **kw):
                launched.append(1)
                return real(*a, **kw)

            def run(one: bool):
                env = {"GPROJ_ONEPASS_BWD": "1" if one else "0"}
                with mock.patch.dict(os.environ, env), mock.patch.object(OP, "pays", lambda *a: True), \
                        mock.patch.object(OP, "backward", counted):
                    return B.backward(do, q, k, v, o, m, l2, tau, causal, "none")[:3]

            one = run(True)
            if len(launched) != 1:
                sys.exit(f"{b}x{h}x{n}x{d} hk={hk} causal={causal}: the one pass did not serve this call (it needs sm_90, a "
                         "seqlen that is a multiple of 128, head dim 64 or 128, deterministic algorithms off, "
                         "GPROJ_HOPPER_BWD and GPROJ_ONEPASS_BWD not 0)")
            two = run(False)
            if len(launched) != 1:
                sys.exit("GPROJ_ONEPASS_BWD=0 did not keep the two passes")
            errs = {"dq": _rel(one[0], two[0]), "dk": _rel(one[1], two[1]), "dv_equal": torch.equal(one[2], two[2])}
            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0) * 2.5
            t1 = kernel_time(lambda: run(True))
            t2 = kernel_time(lambda: run(False))
            qg, kg, vg = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
            from torch.nn.attention import SDPBackend, sdpa_kernel
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                                           enable_gqa=hk != h)
                    dot = do.transpose(1, 2)
                    tc = kernel_time(lambda: torch.autograd.grad(out, (qg, kg, vg), dot, retain_graph=True))
            except Exception as exc:  # cuDNN without GQA support in this torch
                print(f"cudnn: {exc.__class__.__name__}: {str(exc)[:200]}")
                tc = float("nan")
            served = HB.serves(q, k, v, do) and OP.serves(q, k, v, do, causal)  # what the package's rule picks
            row = {"shape": [b, h, n, d], "hk": hk, "causal": causal, "served": served,
                   "one_vs_two": errs, "one_pass_ms": t1, "two_pass_ms": t2, "cudnn_bwd_ms": tc,
                   "one_pass_tflops": flops / t1 / 1e9, "two_pass_tflops": flops / t2 / 1e9,
                   "cudnn_tflops": flops / tc / 1e9}
            rows.append(row)
            print(f"{b}x{h}x{n}x{d} hk={hk} causal={causal} served={row['served']}: dq {errs['dq']:.1e} dk "
                  f"{errs['dk']:.1e} dv equal {errs['dv_equal']} | bwd TFLOP/s one pass {row['one_pass_tflops']:.0f} "
                  f"two passes {row['two_pass_tflops']:.0f} cudnn {row['cudnn_tflops']:.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
