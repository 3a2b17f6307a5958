"""GPU smoke check of the Triton kernels against kernels/reference.py (run on the device machine).

Usage: python benchmarks/gpu_check.py [--quick-speed] [--skip-cases] [--ds-formats bf16,e4m3,e5m2]
       [--cases base,features,dropout,varlen,hopper,hopper_bwd,hopper_varlen,hopper_ragged,hopper_keypad,hopper_dropout]
(the cases include sliding windows and softcap, every fix, and their constant checks)

Prints relative Frobenius differences Triton vs reference (same rounding points: expect <~1e-3,
mostly 0), the constant checks of DESIGN.md §5, and (with --quick-speed) a few fwd+bwd timings.

Packed sequences (varlen, issue 16): ragged lengths with an empty and a length-1 sequence, GQA,
Nq ≠ Nk, causal and not, every fix: Triton vs reference (expect <~1e-3),
C2 per sequence of the fp32 dk (expect a few 1e-8 for gproj), and cross-sequence independence
(NaN in one sequence's keys must leave the others bit-identical).
"""
from __future__ import annotations

import argparse
import time

import torch

from lightning_gproj.kernels import attention_bwd as B
from lightning_gproj.kernels import attention_fwd as F
from lightning_gproj.kernels import attention_bwd_hopper as HB
from lightning_gproj.kernels import attention_bwd_onepass as OP
from lightning_gproj.kernels import attention_fwd_hopper as HF
from lightning_gproj.kernels import reference as R


def rel(a, b):
    a, b = a.double(), b.double()
    n = b.norm().item()
    return (a - b).norm().item() / (n if n > 0 else 1.0)


def varlen_check(dev):
    """Packed sequences through the Triton kernels vs kernels/reference.py (see the module docstring)."""
    lens_q = [700, 0, 1, 129, 2048, 333, 64]
    lens_k = [900, 17, 1, 0, 2048, 200, 64]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    vl = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    h, hk, d = 8, 2, 128
    q = torch.randn(sum(lens_q), h, d, device=dev).bfloat16()
    k = (torch.randn(sum(lens_k), hk, d, device=dev) + 2.0).bfloat16()
    v = torch.randn(sum(lens_k), hk, d, device=dev).bfloat16()
    do = torch.randn_like(q)
    tau = d ** -0.5
    for causal in (False, True):
        t0 = time.time()
        o, m, l2 = F.forward(q, k, v, tau, causal, **vl)
        o_r, m_r, l_r = R.forward(q, k, v, tau, causal, **vl)
        fin = torch.isfinite(l_r)
        row = [f"o {rel(o, o_r):.1e} m {(m - m_r).abs().max().item():.1e} log2l {(l2 - l_r)[fin].abs().max().item():.1e}"]
        for fix in ("none", "gproj", "gproj_uniform"):
            g = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, **vl)
            g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, **vl)
            dk32 = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False, grad_dtype=torch.float32,
                              **vl)[1].double()
            c2 = max((dk32[a:e].sum(0).norm(dim=-1) / dk32[a:e].norm(dim=(0, 2))).max().item()
                     for a, e in zip(cu_k[:-1].tolist(), cu_k[1:].tolist()) if e - a > 1 and dk32[a:e].norm() > 0)
            nan = any(torch.isnan(x).any().item() for x in g[:3])
            row.append(f"{fix}:" + ",".join(f"{rel(x, y):.1e}" for x, y in zip(g[:3], g_r[:3]))
                       + f" C2/seq {c2:.1e}" + (" NAN" if nan else ""))
        # independence: NaN keys/values in the 2048-token sequence change nothing elsewhere
        k0, k1, q0, q1 = cu_k[4].item(), cu_k[5].item(), cu_q[4].item(), cu_q[5].item()
        kp, vp = k.clone(), v.clone()
        kp[k0:k1], vp[k0:k1] = float("nan"), float("nan")
        fp = F.forward(q, kp, vp, tau, causal, **vl)
        gp = B.backward(do, q, kp, vp, *fp, tau, causal, "gproj", **vl)
        gc = B.backward(do, q, k, v, o, m, l2, tau, causal, "gproj", **vl)
        rows = torch.ones(q.shape[0], dtype=torch.bool, device=dev)
        rows[q0:q1] = False
        keys = torch.ones(k.shape[0], dtype=torch.bool, device=dev)
        keys[k0:k1] = False
        same = (torch.equal(fp[0][rows], o[rows]) and torch.equal(gp[0][rows], gc[0][rows])
                and torch.equal(gp[1][keys], gc[1][keys]) and torch.equal(gp[2][keys], gc[2][keys]))
        torch.cuda.synchronize()
        print(f"varlen causal={causal} {time.time() - t0:.1f}s", " ".join(row), f"independent={same}", flush=True)


def hopper_varlen_check(dev, softcap=0.0, window=(-1, -1)):
    """Packed sequences through the sm_90 Gluon kernels (one cu_seqlens for queries and keys; tiles that cross into
    the next sequence): the forward and both backward passes against reference.py and against the tl.dot kernels
    (GPROJ_HOPPER_FWD=0 / GPROJ_HOPPER_BWD=0), fix none and gproj, causal and not, with ``softcap`` / ``window``;
    independence: one sequence's k, v scaled by 100 (finite: the Gluon tiles multiply the next sequence's masked
    values by an exact 0, so a NaN there would spread, as in every FlashAttention kernel) leave the others'
    o, dq, dk, dv bit-identical."""
    import os
    from unittest import mock
    worst = 0.0
    lens = [700, 0, 1, 129, 2048, 333, 64, 128, 255]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    vl = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    feat = dict(softcap=softcap, window_size=window)
    for h, hk, d, dt in ((8, 2, 128, torch.bfloat16), (4, 4, 64, torch.float16)):
        total = sum(lens)
        q = torch.randn(total, h, d, device=dev, dtype=dt)
        k = (torch.randn(total, hk, d, device=dev) + 2.0).to(dt)
        v = torch.randn(total, hk, d, device=dev, dtype=dt)
        do = torch.randn(total, h, d, device=dev, dtype=dt)
        tau = d ** -0.5
        served = (HF.serves_varlen(q[None], k[None], v[None], (cu, cu, max(lens), max(lens))),
                  HB.serves_varlen(q[None], k[None], v[None], do[None], (cu, cu, max(lens), max(lens))))
        for causal in (False, True):
            t0 = time.time()
            o, m, l2 = F.forward(q, k, v, tau, causal, **vl, **feat)
            with mock.patch.dict(os.environ, {"GPROJ_HOPPER_FWD": "0"}):
                o_t, m_t, l_t = F.forward(q, k, v, tau, causal, **vl, **feat)
            o_r, m_r, l_r = R.forward(q, k, v, tau, causal, **vl, **feat)
            fin = torch.isfinite(l_r)
            row = [f"served fwd/bwd={served} o vs reference {rel(o, o_r):.1e} vs tl.dot {rel(o, o_t):.1e} m "
                   f"{(m - m_t).abs().max().item():.1e} log2l {(l2 - l_t)[fin].abs().max().item():.1e}"]
            worst = max(worst, rel(o, o_r))
            for fix in ("none", "gproj"):
                g = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, **vl, **feat)
                with mock.patch.dict(os.environ, {"GPROJ_HOPPER_BWD": "0"}):
                    g_t = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, **vl, **feat)
                g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, **vl, **feat)
                errs = [rel(x, y) for x, y in zip(g[:3], g_r[:3])]
                worst = max(worst, *errs)
                nan = any(torch.isnan(x).any().item() for x in g[:3])
                row.append(f"{fix}: vs reference " + "/".join(f"{e:.1e}" for e in errs) + " vs tl.dot "
                           + "/".join(f"{rel(x, y):.1e}" for x, y in zip(g[:3], g_t[:3])) + (" NAN" if nan else ""))
            k0, k1 = cu[4].item(), cu[5].item()
            kp, vp = k.clone(), v.clone()
            kp[k0:k1], vp[k0:k1] = kp[k0:k1] * 100, vp[k0:k1] * 100
            fp = F.forward(q, kp, vp, tau, causal, **vl, **feat)
            gp = B.backward(do, q, kp, vp, *fp, tau, causal, "gproj", **vl, **feat)
            gc = B.backward(do, q, k, v, o, m, l2, tau, causal, "gproj", **vl, **feat)
            keep = torch.ones(total, dtype=torch.bool, device=dev)
            keep[k0:k1] = False
            same = all(torch.equal(x[keep], y[keep]) for x, y in ((fp[0], o), (gp[0], gc[0]), (gp[1], gc[1]), (gp[2], gc[2])))
            torch.cuda.synchronize()
            print(f"hopper_varlen h={h} hk={hk} d={d} {str(dt)[6:]} causal={causal} softcap={softcap} window={window} "
                  f"{time.time() - t0:.1f}s", "; ".join(row), f"independent={same}", flush=True)
    print("hopper_varlen worst rel diff vs reference (o, grads):", worst, flush=True)


#: hopper_ragged: seqlens that are not a multiple of 128 (the Gluon kernels' edge variant), (B, N, H, Hk, d, causal, dtype).
RAGGED_FWD = [(2, 1000, 8, 2, 128, True, torch.bfloat16), (1, 333, 4, 4, 64, False, torch.float16),
              (2, 200, 4, 1, 128, False, torch.bfloat16), (2, 1000, 8, 2, 128, False, "bhsd"),
              (3, 1000, 16, 4, 64, False, torch.float16),  # 384 tiles: more than one per SM (persistent grid)
              (3, 600, 16, 4, 64, True, torch.float16)]  # 5 blocks a head, causal: the odd block alone in its item
RAGGED_BWD = [(2, 1000, 8, 2, 128, False, torch.bfloat16), (2, 1000, 8, 2, 128, True, torch.bfloat16),
              (1, 333, 4, 4, 128, True, torch.float16), (2, 777, 8, 8, 128, True, "bhsd"),
              (1, 333, 4, 4, 64, True, torch.float16), (2, 1000, 8, 1, 64, False, torch.bfloat16)]  # d 64: run 30


def _inputs(dev, b, n, h, hk, d, dt, heads_major=""):
    """q, do (b, n, h, d) and k, v (b, n, hk, d) in dt, keys offset by 2 (the leak's channel), drawn in that order; the
    tensors named in ``heads_major`` ("qv", "kv") in (B, H, N, d) memory, as Hugging Face models hand them over."""
    q = torch.randn(b, n, h, d, device=dev, dtype=dt)
    k = (torch.randn(b, n, hk, d, device=dev) + 2.0).to(dt)
    v = torch.randn(b, n, hk, d, device=dev, dtype=dt)
    x = {"q": q, "k": k, "v": v}
    for name in heads_major:
        x[name] = x[name].transpose(1, 2).contiguous().transpose(1, 2)
    do = torch.randn(b, n, h, d, device=dev, dtype=dt)
    return x["q"], x["k"], x["v"], do


def hopper_check(dev, softcap=0.0, window=(-1, -1), shapes=None):
    """The sm_90 Gluon forward (kernels/attention_fwd_hopper.py) through attention_fwd.forward's dispatch:
    o, m, log2l against reference.py and against the tl.dot forward (GPROJ_HOPPER_FWD=0), the backward fed
    its m and log2l against reference.py's backward, and the constant checks of DESIGN.md §5 (o exact); with
    ``softcap`` > 0 every call caps its logits (m, log2l: of the capped logits), ``window`` (flash-attn's
    window_size) every call has that sliding window."""
    import os
    from unittest import mock
    worst = 0.0
    for (b, n, h, hk, d, causal, dt) in shapes or [
            (2, 1024, 8, 2, 128, False, torch.bfloat16), (2, 1024, 8, 2, 128, True, torch.bfloat16),
            (1, 512, 4, 4, 64, True, torch.float16), (2, 256, 4, 1, 128, False, torch.float16),
            (1, 384, 2, 2, 64, False, torch.bfloat16), (2, 1024, 8, 2, 128, True, "bhsd"),
            (4, 2048, 16, 4, 128, False, torch.bfloat16), (4, 2048, 16, 4, 128, True, torch.bfloat16),
            (3, 640, 16, 4, 128, True, torch.bfloat16)]:
        # the last three: 1024 tiles, ~8 per program on the persistent grid; 5 blocks a head (odd: a padding slot)
        heads_major = dt == "bhsd"  # q, v in (B, H, N, d) memory, as Hugging Face models hand them over
        dt = torch.bfloat16 if heads_major else dt
        q, k, v, do = _inputs(dev, b, n, h, hk, d, dt, "qv" if heads_major else "")
        tau = d ** -0.5
        served = HF.serves(q, k, v)
        o, m, l2 = F.forward(q, k, v, tau, causal, softcap=softcap, window_size=window)
        with mock.patch.dict(os.environ, {"GPROJ_HOPPER_FWD": "0"}):  # the tl.dot forward; restores the variable
            o_t, m_t, l_t = F.forward(q, k, v, tau, causal, softcap=softcap, window_size=window)
        o_r, m_r, l_r = R.forward(q, k, v, tau, causal, softcap=softcap, window_size=window)
        g = B.backward(do, q, k, v, o, m, l2, tau, causal, "gproj", False, softcap=softcap, window_size=window)
        g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, "gproj", False, softcap=softcap, window_size=window)
        errs = [rel(x, y) for x, y in zip(g[:3], g_r[:3])]
        worst = max(worst, rel(o, o_r), *errs)
        print(f"hopper {(b, n, h, hk, d, causal, str(dt)[6:], 'q,v (B,H,N,d) memory' if heads_major else '')} softcap={softcap} window={window} served={served}: vs reference o {rel(o, o_r):.1e} "
              f"m {(m - m_r).abs().max().item():.1e} log2l {(l2 - l_r).abs().max().item():.1e}; vs tl.dot o "
              f"{rel(o, o_t):.1e} m {(m - m_t).abs().max().item():.1e} log2l {(l2 - l_t).abs().max().item():.1e}; "
              f"gproj backward from its m, log2l dq/dk/dv " + "/".join(f"{e:.1e}" for e in errs), flush=True)
    for cval, dt in ((133120.0, torch.bfloat16), (1000.0, torch.bfloat16), (1000.0, torch.float16)):
        for causal in (False, True):
            x = torch.full((1, 1024, 2, 128), cval, device=dev, dtype=dt)
            o, m, l2 = F.forward(x, x, x, 128 ** -0.5, causal, softcap=softcap, window_size=window)
            print(f"hopper constant {cval} {str(dt)[6:]} causal={causal} softcap={softcap} window={window} served={HF.serves(x, x, x)}: "
                  f"nan={torch.isnan(o).any().item()} exact={(o.float() == cval).all().item()}", flush=True)
    print("hopper worst rel diff vs reference (o, grads):", worst, flush=True)


def hopper_bwd_check(dev, softcap=0.0, window=(-1, -1), shapes=None):
    """The sm_90 Gluon backward passes (kernels/attention_bwd_hopper.py) through attention_bwd.backward's dispatch:
    dq, dk, dv against reference.py and against the tl.dot kernels (GPROJ_HOPPER_BWD=0) for fix none, gproj (own
    GEMM and folded dK term) and gproj_uniform; GQA, fp16, heads-major q / v, a do that needs a copy; an fp32 dk (C2: |Σ_j dk_j| relative
    to Σ_j |dk_j|, expect ~1e-7 for gproj on both paths; with softcap not a law); head dim 64 full and causal;
    where the persistent dK/dV kernel can serve a call (fix none and gproj_uniform, no window), its dk, dv, looping on
    4 programs, against one block per program (GPROJ_BWD_PERSISTENT=0), bit for bit; where fix none takes the one pass
    (kernels/attention_bwd_onepass.py), against the two passes (dv bit for bit; dq, dk to the order of fp32 sums: D
    comes from another kernel) and dq against its own rerun (its reduce-adds land in any order).
    ``softcap`` > 0: every call with that logit softcap; ``window``: with that sliding window."""
    import os
    from unittest import mock
    worst = 0.0
    for (b, n, h, hk, d, causal, dt) in shapes or [
            (2, 1024, 8, 2, 128, False, torch.bfloat16), (2, 1024, 8, 2, 128, True, torch.bfloat16),
            (1, 512, 4, 4, 128, True, torch.float16), (2, 1024, 8, 8, 128, True, "bhsd"), (1, 384, 2, 2, 64, False, torch.bfloat16),
            (3, 640, 4, 2, 128, True, torch.bfloat16),  # 5 key blocks: the persistent dK/dV pass's odd causal pairs
            (1, OP.CAUSAL_MIN_SEQLEN[128], 4, 4, 128, True, torch.bfloat16),  # causal rows long enough for the one pass
            (1, OP.CAUSAL_MIN_SEQLEN[64], 4, 4, 64, True, torch.bfloat16)]:  # at d 64: its dQ partials split by keys
        odd = dt == "bhsd"  # q, v in (B, H, N, d) memory, do a strided slice (copied for the kernel)
        dt = torch.bfloat16 if odd else dt
        q = torch.randn(b, n, h, d, device=dev, dtype=dt)
        k = (torch.randn(b, n, hk, d, device=dev) + 2.0).to(dt)
        v = torch.randn(b, n, hk, d, device=dev, dtype=dt)
        do = torch.randn(b, n, h, d, device=dev, dtype=dt)
        if odd:
            q, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, v))
            wide = torch.zeros(b, n, h, d + 16, device=dev, dtype=dt)
            wide[..., :d] = do
            do = wide[..., :d]
        tau = d ** -0.5
        o_r, m_r, l_r = R.forward(q, k, v, tau, causal, softcap=softcap, window_size=window)
        row = [f"served={HB.serves(q, k, v, do)}"]
        for fix, fold in (("none", False), ("gproj", False), ("gproj", True), ("gproj_uniform", False)):
            g = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, dk_fold=fold, softcap=softcap, window_size=window)
            with mock.patch.dict(os.environ, {"GPROJ_HOPPER_BWD": "0"}):
                g_t = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, dk_fold=fold, softcap=softcap, window_size=window)
            g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, dk_fold=fold, softcap=softcap, window_size=window)
            same = "n/a"  # the persistent dK/dV kernel serves only none's pass (none, gproj_uniform) without a window
            if fix in ("none", "gproj_uniform") and window == (-1, -1) and HB.serves(q, k, v, do):
                # These shapes have fewer items than the GPU has SMs, so the schedule runs them one block per program
                # (attention_fwd_hopper.paired_items); 4 SMs make it loop (each program several items). Two passes
                # (fix none may take the one pass).
                with mock.patch.object(HF, "_sm_count", lambda device: 4), \
                        mock.patch.dict(os.environ, {"GPROJ_ONEPASS_BWD": "0"}):
                    g_p = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, dk_fold=fold, softcap=softcap,
                                     window_size=window)
                # every dK/dV block its own program
                with mock.patch.dict(os.environ, {"GPROJ_BWD_PERSISTENT": "0", "GPROJ_ONEPASS_BWD": "0"}):
                    g_1 = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, dk_fold=fold, softcap=softcap,
                                     window_size=window)
                same = all(torch.equal(x, y) for x, y in zip(g_p[1:3], g_1[1:3]))
            onepass = ""  # fix none through the one pass: against the two passes (dv bit for bit; dq, dk: fp32 order)
            if fix == "none" and softcap == 0 and window == (-1, -1) and HB.serves(q, k, v, do) and OP.serves(
                    q, k, v, do, causal):
                with mock.patch.dict(os.environ, {"GPROJ_ONEPASS_BWD": "0", "GPROJ_BWD_PERSISTENT": "0"}):
                    g_2 = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix)
                g_again = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix)
                # deterministic=True (flash-attn's flag) keeps the two passes: bit-identical to them and to its rerun
                g_det = [B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, deterministic=True) for _ in range(2)]
                det = all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(g_det[0][:3], g_det[1][:3], g_2[:3]))
                onepass = (f", one pass vs two passes dq {rel(g[0], g_2[0]):.1e} dk {rel(g[1], g_2[1]):.1e} dv "
                           f"bit-identical {torch.equal(g[2], g_2[2])}, dq vs its rerun {rel(g_again[0], g[0]):.1e}, "
                           f"deterministic=True twice = two passes bit for bit: {det}")
            errs = [rel(x, y) for x, y in zip(g[:3], g_r[:3])]
            worst = max(worst, *errs)
            nan = any(torch.isnan(x).any().item() for x in g[:3])
            row.append(f"{fix}{'/fold' if fold else ''}: vs reference " + "/".join(f"{e:.1e}" for e in errs) + " vs tl.dot "
                       + "/".join(f"{rel(x, y):.1e}" for x, y in zip(g[:3], g_t[:3])) + (" NAN" if nan else "")
                       + f", persistent dk,dv (4 programs) as one block per program: {same}" + onepass)
        print(f"hopper_bwd {(b, n, h, hk, d, causal, str(dt)[6:], 'q,v (B,H,N,d), strided do' if odd else '')} softcap={softcap} window={window}",
              "; ".join(row), flush=True)
    for causal in (False, True):
        b, n, h, hk, d = 2, 1024, 8, 2, 128
        q = torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16)
        k = (torch.randn(b, n, hk, d, device=dev) + 2.0).bfloat16()
        v = torch.randn(b, n, hk, d, device=dev, dtype=torch.bfloat16)
        do = torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16)
        o_r, m_r, l_r = R.forward(q, k, v, d ** -0.5, causal, softcap=softcap, window_size=window)
        c2, dqs = [], []
        for env in ("1", "0"):
            with mock.patch.dict(os.environ, {"GPROJ_HOPPER_BWD": env}):
                dq, dk = B.backward(do, q, k, v, o_r, m_r, l_r, d ** -0.5, causal, "gproj", grad_dtype=torch.float32,
                                    softcap=softcap, window_size=window)[:2]
            c2.append((dk.double().sum(1).abs() / dk.double().abs().sum(1)).max().item())
            dqs.append(dq)
        print(f"hopper_bwd fp32 dk causal={causal} softcap={softcap} window={window}: C2 Gluon {c2[0]:.1e}, tl.dot {c2[1]:.1e}; fp32 dq Gluon vs tl.dot "
              f"{rel(dqs[0], dqs[1]):.1e} (dtype {dqs[0].dtype})", flush=True)
    print("hopper_bwd worst rel diff vs reference (grads):", worst, flush=True)


#: hopper_keypad: right key padding, (B, N, H, Hk, d, causal, dtype, seqlens_k).
KEYPAD = [(3, 1024, 8, 2, 128, True, torch.bfloat16, [1024, 700, 1]), (2, 1024, 8, 2, 128, False, torch.bfloat16, [129, 1024]),
          (2, 1000, 4, 4, 64, True, torch.float16, [1000, 77]), (2, 1024, 8, 8, 128, True, "bhsd", [300, 1024]),
          (2, 640, 4, 1, 64, False, torch.bfloat16, [640, 128]), (2, 1000, 4, 2, 128, False, torch.bfloat16, [1000, 77])]


def hopper_keypad_check(dev, softcap=0.0):
    """Right key padding (seqlens_k) through the sm_90 Gluon kernels: o, m, log2l and dq, dk, dv (fix none, gproj,
    gproj with an fp32 dk and its C2) against reference.py and the tl.dot kernels (GPROJ_HOPPER_FWD=0 /
    GPROJ_HOPPER_BWD=0); padded keys' dk = dv = 0 exactly; and the rule of tests/test_masks.py: NaN, +inf or 1e10 in
    the padded keys and values leave every result bit-identical (the Gluon loads of them come from descriptors made
    on the device that end at seqlens_k[b])."""
    import os
    from unittest import mock
    worst = 0.0
    for (b, n, h, hk, d, causal, dt, lens) in KEYPAD:
        heads_major = dt == "bhsd"
        dt = torch.bfloat16 if heads_major else dt
        q, k, v, do = _inputs(dev, b, n, h, hk, d, dt, "kv" if heads_major else "")
        sk = torch.tensor(lens, dtype=torch.int32, device=dev)
        hidden = torch.arange(n, device=dev)[None, :] >= sk[:, None]
        tau = d ** -0.5
        kw = dict(softcap=softcap, seqlens_k=sk)
        t0 = time.time()
        served = (HF.serves(q, k, v), HB.serves(q, k, v, do))
        o, m, l2 = F.forward(q, k, v, tau, causal, **kw)
        with mock.patch.dict(os.environ, {"GPROJ_HOPPER_FWD": "0"}):
            o_t, m_t, l_t = F.forward(q, k, v, tau, causal, **kw)
        o_r, m_r, l_r = R.forward(q, k, v, tau, causal, **kw)
        worst = max(worst, rel(o, o_r))
        row = [f"served fwd/bwd={served} o vs reference {rel(o, o_r):.1e} vs tl.dot {rel(o, o_t):.1e} m vs tl.dot "
               f"{(m - m_t).abs().max().item():.1e} log2l {(l2 - l_t).abs().max().item():.1e}"]
        grads = {}
        for fix, gdt in (("none", None), ("gproj", None), ("gproj", torch.float32)):
            g = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, grad_dtype=gdt, **kw)
            with mock.patch.dict(os.environ, {"GPROJ_HOPPER_BWD": "0"}):
                g_t = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, grad_dtype=gdt, **kw)
            g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, grad_dtype=gdt, **kw)
            errs = [rel(x, y) for x, y in zip(g[:3], g_r[:3])]
            worst = max(worst, *errs)
            pad0 = bool((g[1][hidden] == 0).all() and (g[2][hidden] == 0).all())
            nan = any(torch.isnan(x).any().item() for x in g[:3])
            text = (f"{fix}{'/fp32' if gdt else ''}: vs reference " + "/".join(f"{e:.1e}" for e in errs) + " vs tl.dot "
                    + "/".join(f"{rel(x, y):.1e}" for x, y in zip(g[:3], g_t[:3])) + f" padded dk,dv=0 {pad0}"
                    + (" NAN" if nan else ""))
            if gdt is not None:
                c2 = (g[1].double().sum(1).abs() / g[1].double().abs().sum(1).clamp(min=1e-300)).max().item()
                text += f" C2 {c2:.1e}"
            row.append(text)
            grads[(fix, gdt)] = g[:3]
        same = True
        for poison in (float("nan"), float("inf"), 1e10):
            kp, vp = k.clone(), v.clone()
            kp[hidden], vp[hidden] = poison, -poison
            fp = F.forward(q, kp, vp, tau, causal, **kw)
            same &= all(torch.equal(x, y) for x, y in zip(fp, (o, m, l2)))
            for fix, gdt in grads:
                gp = B.backward(do, q, kp, vp, o_r, m_r, l_r, tau, causal, fix, grad_dtype=gdt, **kw)
                same &= all(torch.equal(x, y) for x, y in zip(gp[:3], grads[(fix, gdt)]))
        torch.cuda.synchronize()
        print(f"hopper_keypad {(b, n, h, hk, d, causal, str(dt)[6:], 'k,v (B,H,N,d) memory' if heads_major else '')} "
              f"lens={lens} softcap={softcap} {time.time() - t0:.1f}s", "; ".join(row), f"poison-proof={same}", flush=True)
    print("hopper_keypad worst rel diff vs reference (o, grads):", worst, flush=True)


#: hopper_dropout: (B, N, H, Hk, d, causal, dtype, p) — d 128 and 64, bf16 and fp16, GQA, N 1024 and a ragged 1000.
HOPPER_DROPOUT = [(2, 1024, 8, 2, 128, False, torch.bfloat16, 0.1), (2, 1024, 8, 2, 128, True, torch.bfloat16, 0.2),
                  (1, 1000, 4, 4, 128, True, torch.float16, 0.1), (2, 1000, 8, 2, 64, False, torch.bfloat16, 0.2),
                  (1, 1024, 4, 1, 64, True, torch.float16, 0.1), (2, 1024, 8, 2, 128, False, torch.bfloat16, 0.6)]


def hopper_dropout_check(dev, seed=2**40 + 12345, offset=7, shapes=None, n_mixed=1000):
    """Attention dropout through the sm_90 Gluon kernels (kernels/attention_fwd_hopper.philox_keep and the backward's
    dQ / dK/dV dropout variants): for each shape of HOPPER_DROPOUT and fix none / gproj,

    * the package op (gproj_attn_func with dropout_p; its Philox (seed, offset) pinned to a 64-bit seed >= 2³² and an
      offset != 0) forward and backward against the float64 reference with the same keep mask (R.forward / R.backward
      with the same dropout arguments): a mask that is not the reference's bit for bit gives o, dv off by ~10%, not
      ~1e-3; the launches of the Gluon forward, dQ and dK/dV passes are counted (they must be 1, 1, 1);
    * the kernels against the tl.dot ones (GPROJ_HOPPER_DROPOUT=0: the same calls without the Gluon kernels): m must be
      bit-identical (the same scores' max), log2l and o, dq, dk, dv to rounding (l sums the same P in another order);
    * packed sequences and right key padding with dropout (``n_mixed`` tokens) against the tl.dot kernels.

    Prints one line per case and a final verdict line ("hopper_dropout PASS" / "FAIL")."""
    import os
    from unittest import mock
    from lightning_gproj import ops
    from lightning_gproj.ops import gproj_attn_func

    counts = {"fwd": 0, "dq": 0, "dkdv": 0}

    def counted(name, fn):
        def run(*a, **kw):
            counts[name] += 1
            return fn(*a, **kw)
        return run

    ok = True
    worst = 0.0
    rng = torch.tensor([seed - 2**64 if seed >= 2**63 else seed, offset], dtype=torch.int64)
    with mock.patch.object(HF, "forward", counted("fwd", HF.forward)), \
            mock.patch.object(HB, "dq_pass", counted("dq", HB.dq_pass)), \
            mock.patch.object(HB, "dkdv", counted("dkdv", HB.dkdv)), \
            mock.patch.object(ops, "_draw_rng", lambda p: rng.clone() if p else None):
        for (b, n, h, hk, d, causal, dt, p) in shapes or HOPPER_DROPOUT:
            q, k, v, do = _inputs(dev, b, n, h, hk, d, dt)
            tau = d ** -0.5
            drop = dict(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
            o_r, m_r, l_r = R.forward(q, k, v, tau, causal, **drop)
            # the kernels against the tl.dot ones: m bit for bit, log2l and o to rounding
            o_g, m_g, l_g = F.forward(q, k, v, tau, causal, **drop)
            with mock.patch.dict(os.environ, {"GPROJ_HOPPER_DROPOUT": "0"}):
                o_t, m_t, l_t = F.forward(q, k, v, tau, causal, **drop)
            m_same = torch.equal(m_g, m_t)
            fin = torch.isfinite(l_t)
            stats = (f"vs tl.dot: m bit-identical={m_same} (max |Δm| {(m_g - m_t).abs().max().item():.1e}), log2l "
                     f"bit-identical={torch.equal(l_g, l_t)} (max |Δ| {(l_g - l_t)[fin].abs().max().item():.1e}), o "
                     f"{rel(o_g, o_t):.1e}; vs reference o {rel(o_g, o_r):.1e}")
            ok &= m_same and rel(o_g, o_r) < 1e-2
            print(f"hopper_dropout fwd {(b, n, h, hk, d, causal, str(dt)[6:], p)} served={HF.serves(q, k, v)}: {stats}",
                  flush=True)
            for fix in ("none", "gproj"):
                before = dict(counts)
                qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
                o = gproj_attn_func(qg, kg, vg, causal=causal, fix=fix, dropout_p=p)
                g = torch.autograd.grad(o, (qg, kg, vg), do)
                launched = {key: counts[key] - before[key] for key in counts}
                g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False, **drop)
                errs = [rel(o, o_r)] + [rel(x, y) for x, y in zip(g, g_r[:3])]
                # the backward kernels alone, fed the reference's o, m, log2l, against the tl.dot ones
                g_b = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False, **drop)
                with mock.patch.dict(os.environ, {"GPROJ_HOPPER_DROPOUT": "0"}):
                    g_t = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False, **drop)
                nan = any(torch.isnan(x).any().item() for x in g)
                gluon = launched == {"fwd": 1, "dq": 1, "dkdv": 1}
                ok &= gluon and not nan and max(errs) < 1e-2
                worst = max(worst, *errs)
                print(f"hopper_dropout {fix} {(b, n, h, hk, d, causal, str(dt)[6:], p)} seed={seed} offset={offset}: "
                      f"Gluon launches {launched} ({'Gluon path' if gluon else 'NOT the Gluon path'}); op vs reference "
                      f"o/dq/dk/dv " + "/".join(f"{e:.1e}" for e in errs) + "; backward kernels vs tl.dot dq/dk/dv "
                      + "/".join(f"{rel(x, y):.1e}" for x, y in zip(g_b[:3], g_t[:3])) + (" NAN" if nan else ""),
                      flush=True)
        # packed sequences (one cu_seqlens, ragged) and right key padding, with dropout: Gluon vs tl.dot
        for what in ("packed", "keypad"):
            q, k, v, do = _inputs(dev, 1 if what == "packed" else 2, n_mixed, 8, 2, 128, torch.bfloat16)
            drop = dict(dropout_p=0.1, dropout_seed=seed, dropout_offset=offset)
            if what == "packed":
                cu = torch.tensor([0, n_mixed // 10, n_mixed * 357 // 1000, n_mixed], dtype=torch.int32, device=dev)
                q, k, v, do = (x[0] for x in (q, k, v, do))
                longest = int(cu.diff().max())
                kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
            else:
                kw = dict(seqlens_k=torch.tensor([n_mixed, n_mixed * 613 // 1000], dtype=torch.int32, device=dev))
            res = {}
            for env in ("1", "0"):
                before = dict(counts)
                with mock.patch.dict(os.environ, {"GPROJ_HOPPER_DROPOUT": env}):
                    o_, m_, l_ = F.forward(q, k, v, 128 ** -0.5, True, **kw, **drop)
                    g_ = B.backward(do, q, k, v, o_, m_, l_, 128 ** -0.5, True, "gproj", False, **kw, **drop)
                res[env] = (o_, m_, l_, g_[:3], {key: counts[key] - before[key] for key in counts})
            (o1, m1, l1, g1, c1), (o0, m0, l0, g0, c0) = res["1"], res["0"]
            m_same = torch.equal(m1, m0)
            fin = torch.isfinite(l0)
            ok &= m_same and c1 == {"fwd": 1, "dq": 1, "dkdv": 1} and rel(o1, o0) < 1e-2
            print(f"hopper_dropout {what} causal gproj: Gluon launches {c1} (tl.dot run: {c0}); vs tl.dot m "
                  f"bit-identical={m_same}, log2l max |Δ| {(l1 - l0)[fin].abs().max().item():.1e}, o {rel(o1, o0):.1e}, "
                  f"dq/dk/dv " + "/".join(f"{rel(x, y):.1e}" for x, y in zip(g1, g0)), flush=True)
    print(f"hopper_dropout worst rel diff vs reference (o, grads): {worst:.1e}", flush=True)
    print("hopper_dropout " + ("PASS" if ok else "FAIL"), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick-speed", action="store_true")
    ap.add_argument("--skip-cases", action="store_true", help="skip the Triton-vs-reference cases")
    ap.add_argument("--ds-formats", default="bf16", help="ds_format values to check (FP8 ones with none/gproj only)")
    ap.add_argument("--hopper-softcap", type=float, default=0.0, metavar="C",
                    help="run the hopper and hopper_bwd groups with logit softcap C")
    ap.add_argument("--hopper-window", default="-1,-1", metavar="LEFT,RIGHT",
                    help="run the hopper and hopper_bwd groups with this sliding window (flash-attn's window_size)")
    ap.add_argument("--cases", default="base,features,varlen,hopper",
                    help="which Triton-vs-reference groups to run: base (8 shapes, every fix), features (windows, "
                         "softcap), dropout (attention dropout, the reference drawing the kernels' mask), varlen "
                         "(packed sequences), hopper (the sm_90 Gluon forward), hopper_bwd (the sm_90 Gluon backward passes), "
                         "hopper_varlen (packed sequences through the Gluon kernels), hopper_ragged (the hopper and "
                         "hopper_bwd checks at seqlens that are not a multiple of 128), hopper_keypad (right key "
                         "padding through the Gluon kernels, with --hopper-softcap), hopper_dropout (attention dropout "
                         "through the Gluon kernels: the op against the reference's mask and the tl.dot kernels)")
    args = ap.parse_args()
    groups = set(args.cases.split(","))
    if not groups <= {"base", "features", "dropout", "varlen", "hopper", "hopper_bwd", "hopper_varlen", "hopper_ragged",
                      "hopper_keypad", "hopper_dropout"}:
        ap.error(f"--cases takes base, features, dropout, varlen, hopper, hopper_bwd, hopper_varlen, hopper_ragged, "
                 f"hopper_keypad, hopper_dropout; got "
                 f"{args.cases!r}")
    if args.skip_cases:
        groups = set()
    import triton
    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
    torch.manual_seed(0)
    dev = "cuda"
    worst = 0.0
    cases = [
        (2, 300, 300, 4, 2, 64, False, torch.bfloat16), (2, 300, 300, 4, 2, 64, True, torch.bfloat16),
        (1, 257, 513, 4, 1, 128, True, torch.bfloat16), (1, 513, 257, 4, 4, 128, True, torch.bfloat16),
        (1, 200, 200, 2, 2, 32, True, torch.float16), (1, 200, 333, 2, 2, 96, False, torch.bfloat16),
        (1, 130, 130, 2, 1, 256, True, torch.bfloat16), (2, 1024, 1024, 8, 2, 128, True, torch.bfloat16),
    ]
    for (b, nq, nk, h, hk, d, causal, dt) in (cases if "base" in groups else []):
        q = torch.randn(b, nq, h, d, device=dev, dtype=dt)
        k = (torch.randn(b, nk, hk, d, device=dev) + 2.0).to(dt)
        v = torch.randn(b, nk, hk, d, device=dev, dtype=dt)
        do = torch.randn(b, nq, h, d, device=dev, dtype=dt)
        # a strided (non-contiguous) q: a slice of a wider tensor
        qw = torch.randn(b, nq, h, d + 16, device=dev, dtype=dt)[..., :d]
        qw.copy_(q)
        tau = d ** -0.5
        t0 = time.time()
        o, m, l2 = F.forward(qw, k, v, tau, causal)
        o_r, m_r, l_r = R.forward(q, k, v, tau, causal)
        fin = torch.isfinite(l_r)
        row = [rel(o, o_r), (m - m_r).abs().max().item(), (l2 - l_r)[fin].abs().max().item() if fin.any() else 0.0]
        variants = [(fix, fold, "bf16") for fix, fold in
                    [("none", False), ("gproj", False), ("gproj", True), ("gproj_uniform", False)]]
        variants += [(fix, False, fmt) for fmt in args.ds_formats.split(",") if fmt != "bf16" for fix in ("none", "gproj")]
        for fix, fold, fmt in variants:
            g = B.backward(do, qw, k, v, o_r, m_r, l_r, tau, causal, fix, True, dk_fold=fold, ds_format=fmt)
            g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, dk_fold=fold, ds_format=fmt)
            errs = [rel(x, y) for x, y in zip(g[:3], g_r[:3])] + [rel(g[3]["r"], g_r[3]["r"])]
            nan = any(torch.isnan(x).any().item() for x in g[:3])
            worst = max(worst, max(errs[:3]))
            row.append(f"{fix}{'/fold' if fold else ''}{'' if fmt == 'bf16' else '/' + fmt}:" + ",".join(f"{e:.1e}" for e in errs) + (" NAN" if nan else ""))
        torch.cuda.synchronize()
        print((b, nq, nk, h, hk, d, causal, str(dt)[6:]), f"{time.time()-t0:.1f}s", " ".join(
            x if isinstance(x, str) else f"{x:.1e}" for x in row), flush=True)
    # Sliding windows and softcap (issue 16): Triton vs reference, every fix; windows also shorter than a
    # tile and wider than the sequence; softcap alone and with a causal window.
    feats = [dict(causal=True, window_size=(255, 0)), dict(causal=False, window_size=(100, 37)),
             dict(causal=False, window_size=(-1, 3)), dict(causal=True, window_size=(5000, 0)),
             dict(causal=False, softcap=30.0), dict(causal=True, window_size=(511, 0), softcap=50.0)]
    # Attention dropout: a 64-bit seed, an offset, with a window and softcap (the GPU's Philox must give the
    # reference's mask bit for bit, or o and dv are off by far more than rounding).
    dropout_feats = [dict(causal=False, dropout_p=0.1, dropout_seed=2**40 + 7, dropout_offset=3),
                     dict(causal=True, window_size=(255, 0), softcap=30.0, dropout_p=0.2, dropout_seed=99)]
    for feat in (feats if "features" in groups else []) + (dropout_feats if "dropout" in groups else []):
        causal = feat.pop("causal")
        for (b, nq, nk, h, hk, d) in [(2, 1000, 1000, 4, 2, 128), (1, 700, 1200, 4, 1, 64)]:
            q = torch.randn(b, nq, h, d, device=dev, dtype=torch.bfloat16)
            k = (torch.randn(b, nk, hk, d, device=dev) + 2.0).bfloat16()
            v = torch.randn(b, nk, hk, d, device=dev, dtype=torch.bfloat16)
            do = torch.randn(b, nq, h, d, device=dev, dtype=torch.bfloat16)
            tau = d ** -0.5
            o, m, l2 = F.forward(q, k, v, tau, causal, **feat)
            o_r, m_r, l_r = R.forward(q, k, v, tau, causal, **feat)
            row = [f"o:{rel(o, o_r):.1e}"]
            for fix in R.FIXES:
                g = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, **feat)
                g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, **feat)
                errs = [rel(x, y) for x, y in zip(g[:3], g_r[:3])]
                worst = max(worst, max(errs))
                nan = any(torch.isnan(x).any().item() for x in g[:3])
                row.append(f"{fix}:" + ",".join(f"{e:.1e}" for e in errs) + (" NAN" if nan else ""))
            print((b, nq, nk, h, hk, d, causal), feat, " ".join(row), flush=True)
        for cval in (133120.0, 1000.0) if "dropout_p" not in feat else ():
            x = torch.full((1, 1000, 2, 128), cval, device=dev, dtype=torch.bfloat16)
            o, _, _ = F.forward(x, x, x, 128 ** -0.5, causal, **feat)
            print(f"constant {cval} {feat}: nan={torch.isnan(o).any().item()} exact={(o.float() == cval).all().item()}")
    print("worst grad rel diff vs reference:", worst)
    if "varlen" in groups:
        varlen_check(dev)
    window = tuple(int(x) for x in args.hopper_window.split(","))
    if "hopper" in groups:
        hopper_check(dev, args.hopper_softcap, window)
    if "hopper_bwd" in groups:
        hopper_bwd_check(dev, args.hopper_softcap, window)
    if "hopper_varlen" in groups:
        hopper_varlen_check(dev, args.hopper_softcap, window)
    if "hopper_ragged" in groups:
        hopper_check(dev, args.hopper_softcap, window, RAGGED_FWD)
        hopper_bwd_check(dev, args.hopper_softcap, window, RAGGED_BWD)
    if "hopper_keypad" in groups:
        hopper_keypad_check(dev, args.hopper_softcap)
    if "hopper_dropout" in groups:
        hopper_dropout_check(dev)
    for cval in (133120.0, 1000.0):
        for causal in (False, True):
            x = torch.full((1, 1000, 2, 128), cval, device=dev, dtype=torch.bfloat16)
            o, m, l2 = F.forward(x, x, x, 128 ** -0.5, causal)
            print(f"constant {cval} causal={causal}: nan={torch.isnan(o).any().item()} exact={(o.float() == cval).all().item()}")
    # The op under autocast with an fp32 k (a key bias added in fp32): the Triton backward returns the
    # fp32 accumulators, so Σ_j dK_j = 0 (C2) holds to fp32 rounding with fix="gproj".
    from lightning_gproj import gproj_attn_func
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
            c2[fix + "@bf16"] = (dk.bfloat16().double().sum(1).norm() / dk.double().norm()).item()
        # Triton vs reference.py on the same bf16 inputs, fp32 gradients (same rounding points: ~1e-4)
        qb, kb, vb = q.detach().bfloat16(), k.detach().bfloat16(), v.detach()
        o_r, m_r, l_r = R.forward(qb, kb, vb, 128 ** -0.5, causal)
        g = B.backward(do, qb, kb, vb, o_r, m_r, l_r, 128 ** -0.5, causal, "gproj", False, grad_dtype=torch.float32)
        g_r = R.backward(do, qb, kb, vb, o_r, m_r, l_r, 128 ** -0.5, causal, "gproj", False, grad_dtype=torch.float32)
        print(f"autocast fp32 k, causal={causal}: grads {dq.dtype}/{dk.dtype}/{dv.dtype}; C2 "
              + " ".join(f"{n}={x:.1e}" for n, x in c2.items())
              + "; gproj Triton vs reference (fp32 grads) dq/dk/dv "
              + "/".join(f"{rel(a, b_):.1e}" for a, b_ in zip(g[:3], g_r[:3])), flush=True)
    if args.quick_speed:
        from triton.testing import do_bench
        import torch.nn.functional as Fn
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for (b, h, n, d, causal) in [(4, 16, 2048, 128, False), (1, 16, 8192, 128, True), (2, 16, 4096, 64, False)]:
            q, k, v, do = (torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16, requires_grad=False) for _ in range(4))
            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0) * 3.5
            res = {}
            for name, fold, fix in [("none", False, "none"), ("gproj", False, "gproj"), ("gproj_fold", True, "gproj")]:
                def run():
                    o, m, l2 = F.forward(q, k, v, d ** -0.5, causal)
                    B.backward(do, q, k, v, o, m, l2, d ** -0.5, causal, fix, False, dk_fold=fold)
                run()
                res[name] = flops / do_bench(run, warmup=50, rep=200, return_mode="median") * 1e-9
            for name, be in [("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
                qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                dot = do.transpose(1, 2)
                def run():
                    with sdpa_kernel(be):
                        out = Fn.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    torch.autograd.grad(out, (qt, kt, vt), dot)
                try:
                    run()
                    res[name] = flops / do_bench(run, warmup=50, rep=200, return_mode="median") * 1e-9
                except Exception as exc:
                    res[name] = f"err {exc.__class__.__name__}"
            print((b, h, n, d, causal), {k_: (round(v_) if isinstance(v_, float) else v_) for k_, v_ in res.items()}, flush=True)


if __name__ == "__main__":
    main()
