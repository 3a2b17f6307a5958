"""Host time per call against GPU time per call of our kernels (issue 12): is a short call CPU-bound?

For each shape: the forward through attention_fwd.forward with the Gluon kernel (default on sm_90) and with the
tl.dot one (GPROJ_HOPPER_FWD=0), and the gproj backward with the Gluon passes and without
(GPROJ_HOPPER_BWD=0): host µs per call (wall time of N back-to-back calls with no synchronization between them,
over N) and GPU µs per call (CUDA events around the same N calls after a synchronize). When host ≥ GPU the
GPU waits for the launches, and do_bench timings of that call measure Python, not the kernel.

``--profile N``: instead, the first shape's forward and gproj backward (default paths): host and GPU µs per call over
50 calls (as above), then the same calls under cProfile and the N functions with the most internal time.

Usage: python benchmarks/launch_overhead.py [--calls 200] [--profile N]   (H200; run alone on the GPU)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch

from lightning_gproj.kernels import attention_bwd as B
from lightning_gproj.kernels import attention_fwd as F

SHAPES = [(4, 16, 2048, 128, True), (2, 16, 4096, 64, True), (4, 16, 2048, 128, False), (1, 16, 8192, 128, True)]


def per_call(fn, calls):
    """(host µs, GPU µs) per call of ``fn`` over ``calls`` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / calls * 1e3


def profile(top: int) -> int:
    """Host time per call and the ``top`` functions by internal time of the first shape's forward and gproj
    backward (module docstring)."""
    b, h, n, d, causal = SHAPES[0]
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    tau = d ** -0.5
    o, m, l2 = F.forward(q, k, v, tau, causal)
    for what, fn in (("fwd", lambda: F.forward(q, k, v, tau, causal)),
                     ("bwd gproj", lambda: B.backward(do, q, k, v, o, m, l2, tau, causal, "gproj"))):
        host, gpu = per_call(fn, 50)
        print(f"{b}x{h}x{n}x{d} causal={causal} {what}: host {host:.0f} µs/call, GPU {gpu:.0f} µs/call", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
        print(out.getvalue(), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile the first shape's calls instead")
    args = ap.parse_args(argv)
    if args.profile:
        return profile(args.profile)
    for b, h, n, d, causal in SHAPES:
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        tau = d ** -0.5
        o, m, l2 = F.forward(q, k, v, tau, causal)
        for what, env, fn in (
            ("fwd gluon", ("GPROJ_HOPPER_FWD", "1"), lambda: F.forward(q, k, v, tau, causal)),
            ("fwd tl.dot", ("GPROJ_HOPPER_FWD", "0"), lambda: F.forward(q, k, v, tau, causal)),
            ("bwd gproj gluon", ("GPROJ_HOPPER_BWD", "1"), lambda: B.backward(do, q, k, v, o, m, l2, tau, causal, "gproj")),
            ("bwd gproj tl.dot", ("GPROJ_HOPPER_BWD", "0"), lambda: B.backward(do, q, k, v, o, m, l2, tau, causal, "gproj")),
        ):
            os.environ[env[0]] = env[1]
            host, gpu = per_call(fn, args.calls)
            os.environ.pop(env[0])
            print(f"{b}x{h}x{n}x{d} causal={causal} {what}: host {host:.0f} µs/call, GPU {gpu:.0f} µs/call"
                  f"{'  <- CPU-bound' if host >= 0.9 * gpu else ''}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
