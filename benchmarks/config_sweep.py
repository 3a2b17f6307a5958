"""Time this package's backward passes under each candidate launch config, one kernel at a time (issue 12).

For each shape and fix, the dQ kernel's and then the dK/dV kernel's config list is replaced by one
candidate (the other kernel keeps its first config), and the backward alone is timed
(``torch.autograd.grad`` on a stored forward, ``triton.testing.do_bench``, median ms). The forward's
candidates are timed the same way. Prints one JSON line per measurement; ``--json`` writes the list.

    GPROJ_TRITON_AUTOTUNE=0 python3 benchmarks/config_sweep.py --json sweep.json

Compiling dominates (one compile per config and constexpr variant); ``--warm K/N`` only compiles (runs
each measurement once, untimed) the K-th of every N of them, so N such processes started side by side
fill Triton's cache and the timing run after them finds every kernel compiled.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.testing import do_bench

from lightning_gproj import gproj_attn_func
from lightning_gproj.kernels import attention_bwd, attention_fwd

DQ = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2), (128, 64, 4, 2), (64, 64, 4, 3),
      (128, 32, 4, 4)]
DKDV = [(64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 4, 2), (128, 128, 8, 2), (64, 64, 8, 3), (64, 64, 4, 3),
        (32, 128, 4, 4)]
FWD = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 4, 2)]


def _cfg(bm, bn, w, s):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)


def _use(kernel, entry):
    kernel.configs = [_cfg(*entry)]
    kernel.cache = {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="4,16,2048,128,0;1,16,8192,128,1;2,16,4096,64,1")
    ap.add_argument("--fixes", default="none,gproj")
    ap.add_argument("--warm", default=None, help="K/N: only compile every N-th measurement from the K-th")
    args = ap.parse_args()
    warm_k, warm_n = map(int, args.warm.split("/")) if args.warm else (0, 1)
    counter = iter(range(10**6))

    def bench(fn):
        if next(counter) % warm_n != warm_k:
            return None
        if args.warm:
            fn()
            torch.cuda.synchronize()
            return float("nan")
        return do_bench(fn)

    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    dq_kernel, dkdv_kernel, fwd_kernel = attention_bwd._dq_kernel, attention_bwd._dkdv_kernel, attention_fwd._fwd_kernel
    rows = []
    for spec in args.shapes.split(";"):
        b, h, n, d, causal = map(int, spec.split(","))
        causal = bool(causal)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        base = dict(shape=[b, h, n, d], causal=causal)
        for fix in args.fixes.split(","):
            for name, kernel, entries in (("dq", dq_kernel, DQ), ("dkdv", dkdv_kernel, DKDV)):
                _use(dq_kernel, DQ[0])
                _use(dkdv_kernel, DKDV[0])
                for entry in entries:
                    _use(kernel, entry)
                    try:
                        out = gproj_attn_func(q, k, v, causal=causal, fix=fix)
                        t = bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
                        if t is None:
                            continue
                        rows.append(dict(base, fix=fix, kernel=name, config=entry, bwd_ms=t,
                                         bwd_tflops=2.5 * flops / t * 1e-9))
                    except Exception as e:  # report and go on
                        rows.append(dict(base, fix=fix, kernel=name, config=entry, error=repr(e)[:200]))
                    print(json.dumps(rows[-1]), flush=True)
        _use(dq_kernel, DQ[0])
        _use(dkdv_kernel, DKDV[0])
        with torch.no_grad():
            for entry in FWD:
                _use(fwd_kernel, entry)
                try:
                    t = bench(lambda: gproj_attn_func(q, k, v, causal=causal))
                    if t is None:
                        continue
                    rows.append(dict(base, kernel="fwd", config=entry, fwd_ms=t, fwd_tflops=flops / t * 1e-9))
                except Exception as e:  # report and go on
                    rows.append(dict(base, kernel="fwd", config=entry, error=repr(e)[:200]))
                print(json.dumps(rows[-1]), flush=True)
        if args.json and not args.warm:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
