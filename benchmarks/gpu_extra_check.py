"""Short GPU check: head dims 32 (fp16) / 96 / 256 against kernels/reference.py, and the causal
gproj_uniform backward time after the innermost-dim cumsum change (benchmarks/NOTES.md, run 3).

Usage: GPROJ_TRITON_AUTOTUNE=0 python benchmarks/gpu_extra_check.py
"""
from __future__ import annotations

import argparse
import time

import torch

from lightning_gproj.kernels import attention_bwd as B
from lightning_gproj.kernels import attention_fwd as F
from lightning_gproj.kernels import reference as R


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    for (b, nq, nk, h, hk, d, causal, dt) in [
        (1, 200, 333, 2, 2, 96, False, torch.bfloat16), (1, 130, 130, 2, 1, 256, True, torch.bfloat16),
        (1, 200, 200, 2, 2, 32, True, torch.float16),
    ]:
        t0 = time.time()
        try:
            q = torch.randn(b, nq, h, d, device=dev).to(dt)
            k = (torch.randn(b, nk, hk, d, device=dev) + 2).to(dt)
            v = torch.randn(b, nk, hk, d, device=dev).to(dt)
            do = torch.randn(b, nq, h, d, device=dev).to(dt)
            tau = d ** -0.5
            o, m, l2 = F.forward(q, k, v, tau, causal)
            o_r, m_r, l_r = R.forward(q, k, v, tau, causal)
            out = [f"o {rel(o, o_r):.1e}"]
            for fix in ("none", "gproj"):
                g = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False)
                g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False)
                out.append(fix + ":" + ",".join(f"{rel(x, y):.1e}" for x, y in zip(g[:3], g_r[:3])))
            print((nq, nk, h, hk, d, causal, str(dt)[6:]), f"{time.time() - t0:.1f}s", " ".join(out), flush=True)
        except Exception as exc:
            print((nq, nk, h, hk, d, causal, str(dt)[6:]), "ERROR", exc.__class__.__name__, str(exc)[:300], flush=True)
    from triton.testing import do_bench
    b, h, n, d = 1, 16, 8192, 128
    q, k, v, do = (torch.randn(b, n, h, d, device=dev).bfloat16() for _ in range(4))
    o, m, l2 = F.forward(q, k, v, d ** -0.5, True)
    fl = 2.5 * 4 * b * h * n * n * d * 0.5
    for fix in ("none", "gproj_uniform"):
        fn = lambda: B.backward(do, q, k, v, o, m, l2, d ** -0.5, True, fix, False)  # noqa: E731
        fn()
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        print(f"bwd {fix} 1x16x8192x128 causal: {ms:.3f} ms, {fl / ms * 1e-9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
