"""H200 check of the rounding point of the dK correction (run 6, benchmarks/NOTES.md): C2 of the op's fp32
dk under autocast for fix none / gproj, Triton vs reference.py (fp32 gradients), and one backward timing.

    GPROJ_TRITON_AUTOTUNE=0 python3 benchmarks/c2_check.py
"""
import time, torch
from triton.testing import do_bench
from lightning_gproj import gproj_attn_func
from lightning_gproj.kernels import attention_bwd as B, attention_fwd as F, reference as R
t0 = time.time(); dev = "cuda"; torch.manual_seed(0)
def rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm()).item()
for causal in (False, True):
    q = torch.randn(2, 1024, 8, 128, device=dev, requires_grad=True)
    k = (torch.randn(2, 1024, 8, 128, device=dev) + 30.0).requires_grad_()
    v = torch.randn(2, 1024, 8, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(2, 1024, 8, 128, device=dev, dtype=torch.bfloat16)
    c2 = {}
    for fix in ("none", "gproj"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            o = gproj_attn_func(q, k, v, causal=causal, fix=fix)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
        c2[fix] = (dk.double().sum(1).norm() / dk.double().norm()).item()
    qb, kb, vb = q.detach().bfloat16(), k.detach().bfloat16(), v.detach()
    o_r, m_r, l_r = R.forward(qb, kb, vb, 128 ** -0.5, causal)
    g = B.backward(do, qb, kb, vb, o_r, m_r, l_r, 128 ** -0.5, causal, "gproj", False, grad_dtype=torch.float32)
    g_r = R.backward(do, qb, kb, vb, o_r, m_r, l_r, 128 ** -0.5, causal, "gproj", False, grad_dtype=torch.float32)
    print(f"[{time.time()-t0:.0f}s] causal={causal} C2 none={c2['none']:.2e} gproj={c2['gproj']:.2e}; Triton vs reference (fp32 grads) dq {rel(g[0], g_r[0]):.1e} dk {rel(g[1], g_r[1]):.1e} dv {rel(g[2], g_r[2]):.1e}", flush=True)
b, h, n, d = 1, 16, 8192, 128
q, k, v, do = (torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
o, m, l2 = F.forward(q, k, v, d ** -0.5, False)
for fix in ("none", "gproj"):
    fn = lambda: B.backward(do, q, k, v, o, m, l2, d ** -0.5, False, fix, False)
    fn()
    ms = do_bench(fn, warmup=20, rep=100, return_mode="median")
    print(f"[{time.time()-t0:.0f}s] bwd {fix} 1x16x8192x128 full (AUTOTUNE=0): {ms:.3f} ms, {4*b*h*n*n*d*2.5/ms*1e-9:.0f} TFLOP/s", flush=True)
