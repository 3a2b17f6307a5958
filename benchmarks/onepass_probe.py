"""Does a one-pass attention backward pay once its dQ partials go out by TMA reduce-add? (issue 12, lever 1)

Run 10's one-pass backward added each (key block, query block) dQ partial into an fp32 buffer with
element-wise ``tl.atomic_add`` and ran no faster than the two-pass kernels (benchmarks/NOTES.md, run 10).
This probe replaces those atomics by a tensor descriptor's ``atomic_add`` (a TMA bulk reduce-add: the
tile goes to shared memory and one instruction adds it into global memory) and times, against the
package's two-pass backward (kernels/attention_bwd.backward) and cuDNN:

* ``none_1p``: one program per key block loops over the query blocks once: Sᵀ, P̃ᵀ, dV += P̃ᵀdO,
  dPᵀ, dS̃ᵀ, dK += dS̃ᵀQ, dQ partial dS̃K reduce-added (5 tile GEMMs per pair, the FA2/FA3 layout);
* ``gproj_1p``: the same main pass plus r_i and Σ_j P̃_ij (row atomics) and the P̃K partial
  (a second reduce-add stream), then a light correction pass once r is final (recompute Sᵀ,
  dK −= bf16(ρ∘P̃)ᵀQ: 2 GEMMs) and a finalize kernel dQ = τ(dS̃K − ρ∘P̃K): 8 GEMMs per pair in
  all, against 9 for the two-pass gproj.

Both are checked against the two-pass kernels (relative Frobenius error of dq, dk, dv) before timing.
Dense (batch, nheads, seqlen, headdim) contiguous bf16, nheads_q = nheads_k, seqlen a multiple of 128;
the exponent is the package's FMA-safe one (exp2((s − m)·τ·log2e − log2 l)) from its own forward.

    python3 benchmarks/onepass_probe.py --json out.json [--shapes "1,16,8192,128;..."] [--warm I/N]

(benchmarks/onepass_device.sh: compile in parallel processes first, then time.)

Needs a Hopper GPU and Triton with ``tl.make_tensor_descriptor`` and descriptor ``atomic_add``.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _rows(X, ZHN, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """A TMA descriptor over the (ZHN, HEAD_DIM) row-major view of X, ROWS rows per block."""
    return tl.make_tensor_descriptor(X, shape=[ZHN, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[ROWS, HEAD_DIM])


@triton.jit
def _main_inner(dk, dv, k, v, desc_q, desc_do, desc_dq, desc_pk, M, L2, DELTA, R, PS, base, col0, lo, hi, c,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, GPROJ: tl.constexpr):
    offs_n = col0 + tl.arange(0, BLOCK_N)
    for start_m in range(lo, hi, BLOCK_M):
        q = desc_q.load([base + start_m, 0])
        do = desc_do.load([base + start_m, 0])
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m = tl.load(M + base + offs_m)
        l2 = tl.load(L2 + base + offs_m)
        di = tl.load(DELTA + base + offs_m)
        s_t = tl.dot(k, q.T)
        p_t = tl.math.exp2((s_t - m[None, :]) * c - l2[None, :])
        if MASK:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        p16 = p_t.to(q.dtype)
        dv = tl.dot(p16, do, dv)
        dp_t = tl.dot(v, do.T)
        ds16 = (p_t * (dp_t - di[None, :])).to(q.dtype)
        dk = tl.dot(ds16, q, dk)
        desc_dq.atomic_add([base + start_m, 0], tl.dot(ds16.T, k))
        if GPROJ:
            tl.atomic_add(R + base + offs_m, tl.sum(ds16.to(tl.float32), 0), sem="relaxed")
            tl.atomic_add(PS + base + offs_m, tl.sum(p16.to(tl.float32), 0), sem="relaxed")
            desc_pk.atomic_add([base + start_m, 0], tl.dot(p16.T, k))
    return dk, dv


@triton.jit
def _main(Q, K, V, DO, M, L2, DELTA, DQ, PK, R, PS, DK, DV, tau, c, ZHN, N_CTX, HEAD_DIM: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, GPROJ: tl.constexpr):
    """One program per (key block, batch·head). GPROJ: dK stays fp32 and unscaled (DK is fp32) for the
    correction pass; otherwise DK, DV are the 16-bit outputs."""
    start_n = tl.program_id(0)
    off_hz = tl.program_id(1)
    desc_q, desc_do = _rows(Q, ZHN, HEAD_DIM, BLOCK_M), _rows(DO, ZHN, HEAD_DIM, BLOCK_M)
    desc_k, desc_v = _rows(K, ZHN, HEAD_DIM, BLOCK_N), _rows(V, ZHN, HEAD_DIM, BLOCK_N)
    desc_dq, desc_pk = _rows(DQ, ZHN, HEAD_DIM, BLOCK_M), _rows(PK, ZHN, HEAD_DIM, BLOCK_M)
    desc_dk, desc_dv = _rows(DK, ZHN, HEAD_DIM, BLOCK_N), _rows(DV, ZHN, HEAD_DIM, BLOCK_N)
    base = off_hz * N_CTX
    col0 = start_n * BLOCK_N
    k = desc_k.load([base + col0, 0])
    v = desc_v.load([base + col0, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    if CAUSAL:
        dk, dv = _main_inner(dk, dv, k, v, desc_q, desc_do, desc_dq, desc_pk, M, L2, DELTA, R, PS, base, col0,
                             col0, col0 + BLOCK_N, c, BLOCK_M, BLOCK_N, True, GPROJ)
        lo = col0 + BLOCK_N
    else:
        lo = 0
    dk, dv = _main_inner(dk, dv, k, v, desc_q, desc_do, desc_dq, desc_pk, M, L2, DELTA, R, PS, base, col0,
                         lo, N_CTX, c, BLOCK_M, BLOCK_N, False, GPROJ)
    if GPROJ:
        desc_dk.store([base + col0, 0], dk)
    else:
        desc_dk.store([base + col0, 0], (dk * tau).to(k.dtype))
    desc_dv.store([base + col0, 0], dv.to(v.dtype))


@triton.jit
def _corr_inner(dk, k, desc_q, M, L2, RHO, base, col0, lo, hi, c, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                MASK: tl.constexpr):
    offs_n = col0 + tl.arange(0, BLOCK_N)
    for start_m in range(lo, hi, BLOCK_M):
        q = desc_q.load([base + start_m, 0])
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m = tl.load(M + base + offs_m)
        l2 = tl.load(L2 + base + offs_m)
        rho = tl.load(RHO + base + offs_m)
        p_t = tl.math.exp2((tl.dot(k, q.T) - m[None, :]) * c - l2[None, :])
        if MASK:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        w = (p_t.to(q.dtype).to(tl.float32) * (-rho)[None, :]).to(q.dtype)
        dk = tl.dot(w, q, dk)
    return dk


@triton.jit
def _corr(Q, K, M, L2, RHO, DK32, DK, tau, c, ZHN, N_CTX, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """GProj's dK term once ρ is final: dK = τ (dK32 − Σ_i bf16(ρ_i P̃_ij) q_i), rounded once."""
    start_n = tl.program_id(0)
    off_hz = tl.program_id(1)
    desc_q = _rows(Q, ZHN, HEAD_DIM, BLOCK_M)
    desc_k, desc_dk32, desc_dk = _rows(K, ZHN, HEAD_DIM, BLOCK_N), _rows(DK32, ZHN, HEAD_DIM, BLOCK_N), _rows(
        DK, ZHN, HEAD_DIM, BLOCK_N)
    base = off_hz * N_CTX
    col0 = start_n * BLOCK_N
    k = desc_k.load([base + col0, 0])
    dk = desc_dk32.load([base + col0, 0])
    if CAUSAL:
        dk = _corr_inner(dk, k, desc_q, M, L2, RHO, base, col0, col0, col0 + BLOCK_N, c, BLOCK_M, BLOCK_N, True)
        lo = col0 + BLOCK_N
    else:
        lo = 0
    dk = _corr_inner(dk, k, desc_q, M, L2, RHO, base, col0, lo, N_CTX, c, BLOCK_M, BLOCK_N, False)
    desc_dk.store([base + col0, 0], (dk * tau).to(k.dtype))


@triton.jit
def _finalize(DQ, PK, R, PS, RHO, OUT, tau, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, GPROJ: tl.constexpr):
    """dQ = τ (dS̃K − ρ∘P̃K) rounded once (GPROJ; ρ = r / Σ_j P̃_ij also written for the dK pass), else τ dS̃K."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    dq = tl.load(DQ + offs)
    if GPROJ:
        rho = tl.load(R + rows) / tl.maximum(tl.load(PS + rows), 1.1754943508222875e-38)
        tl.store(RHO + rows, rho)
        dq = dq - rho[:, None] * tl.load(PK + offs)
    tl.store(OUT + offs, (dq * tau).to(OUT.dtype.element_ty))


def onepass_backward(q, k, v, do, m, l2, delta, tau, causal, gproj, bm, bn, warps, stages, corr_cfg=(64, 128, 8, 2)):
    """q, k, v, do: (B, H, N, d) contiguous; m, l2, delta: (B, H, N) fp32. Returns dq, dk, dv."""
    b, h, n, d = q.shape
    zhn = b * h * n
    dev = q.device
    dq32 = torch.zeros((b, h, n, d), dtype=torch.float32, device=dev)
    if gproj:
        pk = torch.zeros_like(dq32)
        r = torch.zeros((b, h, n), dtype=torch.float32, device=dev)
        ps = torch.zeros_like(r)
        rho = torch.empty_like(r)
        dk32 = torch.empty((b, h, n, d), dtype=torch.float32, device=dev)
    else:
        pk = r = ps = rho = dq32
        dk32 = torch.empty_like(k)
    dv = torch.empty_like(v)
    c = tau * LOG2E
    _main[(n // bn, b * h)](q, k, v, do, m, l2, delta, dq32, pk, r, ps, dk32, dv, tau, c, zhn, n, HEAD_DIM=d,
                            BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, GPROJ=gproj, num_warps=warps,
                            num_stages=stages)
    dq = torch.empty_like(q)
    _finalize[(zhn // 64,)](dq32, pk, r, ps, rho, dq, tau, HEAD_DIM=d, BLOCK=64, GPROJ=gproj, num_warps=4)
    if not gproj:
        return dq, dk32, dv
    dk = torch.empty_like(k)
    cbm, cbn, cw, cs = corr_cfg
    _corr[(n // cbn, b * h)](q, k, m, l2, rho, dk32, dk, tau, c, zhn, n, HEAD_DIM=d, BLOCK_M=cbm, BLOCK_N=cbn,
                             CAUSAL=causal, num_warps=cw, num_stages=cs)
    return dq, dk, dv


_CONFIGS = {  # head dim -> (BLOCK_M, BLOCK_N, warps, stages); each fits the H200's 227 KB of shared memory
    128: [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 2)],
    64: [(64, 128, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3)],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="1,16,8192,128;4,16,2048,128;2,16,4096,64")
    ap.add_argument("--fixes", default="none,gproj")
    ap.add_argument("--warm", default=None, metavar="I/N",
                    help="compile only: run part I of N of the (shape, causal, fix) jobs once at seqlen 512")
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    from lightning_gproj.kernels import attention_bwd, attention_fwd

    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    jobs = [(tuple(map(int, spec.split(","))), causal, fix) for spec in args.shapes.split(";")
            for causal in (False, True) for fix in args.fixes.split(",")]
    if args.warm:
        i, parts = map(int, args.warm.split("/"))
        jobs = [(shape[:2] + (512,) + shape[3:], causal, fix) for shape, causal, fix in jobs[i::parts]]
    rows = []
    for (b, h, n, d), causal, fix in jobs:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        tau = 1.0 / math.sqrt(d)
        qt, kt, vt, dot_ = (x.transpose(1, 2) for x in (q, k, v, do))  # (B, N, H, d) views for the package
        flops = 4 * b * h * n * n * d / (2 if causal else 1) * 2.5  # backward
        base = dict(shape=[b, h, n, d], causal=causal)
        o, m, l2 = attention_fwd.forward(qt, kt, vt, tau, causal)
        delta = (do.float() * o.transpose(1, 2).float()).sum(-1).contiguous()
        if not args.warm and fix == args.fixes.split(",")[0]:
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                t = do_bench(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))
            rows.append(dict(base, method="cudnn_bwd", ms=t, tflops=flops / t * 1e-9))
            print(rows[-1], flush=True)
            del out
        ref = attention_bwd.backward(dot_, qt, kt, vt, o, m, l2, tau, causal, fix=fix)[:3]
        if not args.warm:
            t = do_bench(lambda: attention_bwd.backward(dot_, qt, kt, vt, o, m, l2, tau, causal, fix=fix))
            rows.append(dict(base, method=f"{fix}_2pass_bwd", ms=t, tflops=flops / t * 1e-9))
            print(rows[-1], flush=True)
        refs = [x.transpose(1, 2).float() for x in ref]
        for bm, bn, warps, stages in _CONFIGS[d]:
            cfg = dict(bm=bm, bn=bn, warps=warps, stages=stages)
            if fix == "gproj" and stages > 2 and d == 128:
                continue  # over the shared-memory limit with the P̃K stream
            try:
                def run():
                    return onepass_backward(q, k, v, do, m, l2, delta, tau, causal, fix == "gproj", bm, bn,
                                            warps, stages)
                got = run()
                err = [((x.float() - y).norm() / y.norm()).item() for x, y in zip(got, refs)]
                if args.warm:
                    print(base, fix, cfg, "compiled", err, flush=True)
                    continue
                t = do_bench(run)
                rows.append(dict(base, method=f"{fix}_1p_bwd", **cfg, ms=t, tflops=flops / t * 1e-9,
                                 rel_err_vs_2pass=err))
            except Exception as e:  # report and go on
                rows.append(dict(base, method=f"{fix}_1p_bwd", **cfg, error=repr(e)[:400]))
            print(rows[-1] if rows else cfg, flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
        del q, k, v, do


if __name__ == "__main__":
    main()
