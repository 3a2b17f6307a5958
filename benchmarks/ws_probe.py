"""Does Triton's Hopper warp specialization pay for an attention forward on this GPU? (issue 12, lever 4)

A minimal FMA-safe attention forward (bf16, (batch, nheads, seqlen, headdim) contiguous, no GProj: the
forward has none), written with on-device tensor descriptors (TMA) and its key loop as
``tl.range(..., warp_specialize=WS)``, timed with WS off and on over a small config grid against cuDNN's
SDPA forward and this package's own forward (``gproj_attn_func``). Each config's output is checked
against SDPA (max abs error) before it is timed; a config that does not compile is reported, not fatal.

    python3 benchmarks/ws_probe.py --json out.json

Needs a Hopper GPU and Triton with ``tl.make_tensor_descriptor`` and ``tl.range(warp_specialize=)``.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.language as tl


@triton.jit
def _rows(X, ZHN, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """A TMA descriptor over the (ZHN, HEAD_DIM) row-major view of X, ROWS rows per block."""
    return tl.make_tensor_descriptor(X, shape=[ZHN, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[ROWS, HEAD_DIM])


@triton.jit
def _probe_inner(acc, l_i, m_i, q, desc_k, desc_v, base, lo, hi, offs_m, c,
                 BLOCK_N: tl.constexpr, MASK: tl.constexpr, WS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([base + start_n, 0])
        s = tl.dot(q, k.T)
        if MASK:
            s = tl.where(offs_m[:, None] >= start_n + offs_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2((s - m_new[:, None]) * c)  # FMA-safe: exact 0 at the max
        alpha = tl.math.exp2((m_i - m_new) * c)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = desc_v.load([base + start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _probe_fwd(Q, K, V, O, sm_scale, ZHN, N_CTX, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WS: tl.constexpr, CMODE: tl.constexpr):
    """CMODE (causal only): 0 = two loops (off-diagonal unmasked, diagonal masked), both WS; 1 = one loop
    over [0, row0 + BLOCK_M) masking every block; 2 = two loops, only the off-diagonal one WS."""
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    desc_q, desc_o = _rows(Q, ZHN, HEAD_DIM, BLOCK_M), _rows(O, ZHN, HEAD_DIM, BLOCK_M)
    desc_k, desc_v = _rows(K, ZHN, HEAD_DIM, BLOCK_N), _rows(V, ZHN, HEAD_DIM, BLOCK_N)
    base = off_hz * N_CTX
    row0 = start_m * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    q = desc_q.load([base + row0, 0])
    c = sm_scale * 1.4426950408889634
    if CAUSAL and CMODE == 1:
        acc, l_i, m_i = _probe_inner(acc, l_i, m_i, q, desc_k, desc_v, base, 0, row0 + BLOCK_M, offs_m, c,
                                     BLOCK_N, True, WS)
    elif CAUSAL:
        acc, l_i, m_i = _probe_inner(acc, l_i, m_i, q, desc_k, desc_v, base, 0, row0, offs_m, c, BLOCK_N, False, WS)
        acc, l_i, m_i = _probe_inner(acc, l_i, m_i, q, desc_k, desc_v, base, row0, row0 + BLOCK_M, offs_m, c,
                                     BLOCK_N, True, WS and CMODE == 0)
    else:
        acc, l_i, m_i = _probe_inner(acc, l_i, m_i, q, desc_k, desc_v, base, 0, N_CTX, offs_m, c, BLOCK_N, False, WS)
    desc_o.store([base + row0, 0], (acc / l_i[:, None]).to(q.dtype))


@triton.jit
def _probe_dkdv(Q, K, V, DO, LSE2, DELTA, DK, DV, sm_scale, ZHN, N_CTX, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WS: tl.constexpr):
    """Plain dK/dV pass (FA2 layout, no GProj): one program per key block loops over query blocks;
    LSE2 = log2 Σ_j exp2(s_ij·τ·log2e) per row, DELTA = rowsum(dO∘O)."""
    start_n = tl.program_id(0)
    off_hz = tl.program_id(1)
    desc_q, desc_do = _rows(Q, ZHN, HEAD_DIM, BLOCK_M), _rows(DO, ZHN, HEAD_DIM, BLOCK_M)
    desc_k, desc_v = _rows(K, ZHN, HEAD_DIM, BLOCK_N), _rows(V, ZHN, HEAD_DIM, BLOCK_N)
    desc_dk, desc_dv = _rows(DK, ZHN, HEAD_DIM, BLOCK_N), _rows(DV, ZHN, HEAD_DIM, BLOCK_N)
    base = off_hz * N_CTX
    col0 = start_n * BLOCK_N
    offs_n = col0 + tl.arange(0, BLOCK_N)
    k = desc_k.load([base + col0, 0])
    v = desc_v.load([base + col0, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    c = sm_scale * 1.4426950408889634
    lo = col0 if CAUSAL else 0
    for start_m in tl.range(lo, N_CTX, BLOCK_M, warp_specialize=WS):
        q = desc_q.load([base + start_m, 0])
        do = desc_do.load([base + start_m, 0])
        offs_m = start_m + tl.arange(0, BLOCK_M)
        lse = tl.load(LSE2 + base + offs_m)
        di = tl.load(DELTA + base + offs_m)
        p_t = tl.math.exp2(tl.dot(k, q.T) * c - lse[None, :])
        if CAUSAL:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, do.T)
        ds_t = p_t * (dp_t - di[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    desc_dk.store([base + col0, 0], (dk * sm_scale).to(k.dtype))
    desc_dv.store([base + col0, 0], dv.to(v.dtype))


def probe_dkdv(q, k, v, do, lse2, delta, causal, bm, bn, warps, stages, ws):
    b, h, n, d = q.shape
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _probe_dkdv[(n // bn, b * h)](q, k, v, do, lse2, delta, dk, dv, 1.0 / math.sqrt(d), b * h * n, n, HEAD_DIM=d,
                                  BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, WS=ws, num_warps=warps, num_stages=stages)
    return dk, dv


def _bwd_inputs(q, k, v, causal):
    """do, the float32 row statistics and the float64-free autograd reference dk, dv (fp32 math)."""
    b, h, n, d = q.shape
    do = torch.randn_like(q)
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse2 = (torch.logsumexp(s, -1) * 1.4426950408889634).contiguous()
    p = torch.softmax(s, -1)
    o = p @ v.float()
    delta = (do.float() * o.to(q.dtype).float()).sum(-1).contiguous()
    dv = p.transpose(-1, -2) @ do.float()
    dp = do.float() @ v.float().transpose(-1, -2)
    dk = (p * (dp - delta[..., None])).transpose(-1, -2) @ q.float() / math.sqrt(d)
    return do, lse2, delta, dk, dv


def probe(q, k, v, causal, bm, bn, warps, stages, ws, cmode=0):
    b, h, n, d = q.shape
    o = torch.empty_like(q)
    grid = (n // bm, b * h)
    _probe_fwd[grid](q, k, v, o, 1.0 / math.sqrt(d), b * h * n, n, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
                     CAUSAL=causal, WS=ws, CMODE=cmode, num_warps=warps, num_stages=stages)
    return o


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="4,16,2048,128;1,16,8192,128;2,16,4096,64")
    ap.add_argument("--what", default="fwd,bwd", help="fwd and/or bwd (the dK/dV pass)")
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    from lightning_gproj import gproj_attn_func

    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    rows = []
    for spec in args.shapes.split(";"):
        b, h, n, d = map(int, spec.split(","))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        for causal in (False, True):
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                t = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            base = dict(shape=[b, h, n, d], causal=causal)
            rows.append(dict(base, method="cudnn", ms=t, tflops=flops / t * 1e-9))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            t = do_bench(lambda: gproj_attn_func(qt, kt, vt, causal=causal))
            rows.append(dict(base, method="gproj_fwd", ms=t, tflops=flops / t * 1e-9))
            print(rows[-2], rows[-1], flush=True)
            if "fwd" in args.what:
                if causal:
                    grid = [(128, bn, 4, 2, ws, cm) for bn in (64, 128) for cm in (0, 1, 2) for ws in (False, True)]
                else:
                    grid = [(128, bn, w, st, ws, 0) for bn, w, st in ((64, 4, 2), (128, 4, 2), (128, 8, 3))
                            for ws in (False, True)]
                for bm, bn, warps, stages, ws, cm in grid:
                    cfg = dict(bm=bm, bn=bn, warps=warps, stages=stages, ws=ws, cmode=cm)
                    try:
                        o = probe(q, k, v, causal, bm, bn, warps, stages, ws, cm)
                        err = (o.float() - ref.float()).abs().max().item()
                        t = do_bench(lambda: probe(q, k, v, causal, bm, bn, warps, stages, ws, cm))
                        rows.append(dict(base, method="probe_fwd", **cfg, ms=t, tflops=flops / t * 1e-9, max_abs_err=err))
                    except Exception as e:  # report and go on
                        rows.append(dict(base, method="probe_fwd", **cfg, error=repr(e)[:300]))
                    print(rows[-1], flush=True)
            if "bwd" in args.what:
                do, lse2, delta, dk_ref, dv_ref = _bwd_inputs(q, k, v, causal)
                for name, fn in (("cudnn", None), ("none", "none"), ("gproj", "gproj")):
                    qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))
                    dot = do.transpose(1, 2)
                    if fn is None:
                        def fb():
                            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                                F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (qg, kg, vg)),
                                                               is_causal=causal).backward(do)
                    else:
                        def fb():
                            gproj_attn_func(qg, kg, vg, causal=causal, fix=fn).backward(dot)
                    t = do_bench(fb)
                    rows.append(dict(base, method=f"{name}_fwdbwd", ms=t, tflops=3.5 * flops / t * 1e-9))
                    print(rows[-1], flush=True)
                for bm in (64, 128):
                    for warps in (4, 8):
                        for stages in (2, 3):
                            for ws in (False, True):
                                cfg = dict(bm=bm, bn=128, warps=warps, stages=stages, ws=ws)
                                try:
                                    dk, dv = probe_dkdv(q, k, v, do, lse2, delta, causal, bm, 128, warps, stages, ws)
                                    err = max(((dk.float() - dk_ref).norm() / dk_ref.norm()).item(),
                                              ((dv.float() - dv_ref).norm() / dv_ref.norm()).item())
                                    t = do_bench(lambda: probe_dkdv(q, k, v, do, lse2, delta, causal, bm, 128, warps,
                                                                    stages, ws))
                                    rows.append(dict(base, method="probe_dkdv", **cfg, ms=t,
                                                     tflops=2 * flops / t * 1e-9, rel_err=err))
                                except Exception as e:  # report and go on
                                    rows.append(dict(base, method="probe_dkdv", **cfg, error=repr(e)[:300]))
                                print(rows[-1], flush=True)
                del do, lse2, delta, dk_ref, dv_ref
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
