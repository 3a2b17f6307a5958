"""Runs the Triton kernels under Triton's CPU interpreter and prints measured agreement as JSON.

Executed by tests/test_triton_kernels.py in a fresh subprocess with TRITON_INTERPRET=1: ``triton.jit``
chooses between compiling and interpreting when a kernel module is imported, so the interpreter must
be on before the first import of triton in the process — a subprocess guarantees that whatever the
rest of the pytest session imported. Not a test module itself (leading underscore, no test_ prefix).

Output: one JSON object on the last stdout line, {"cases": [...], "constants": [...], "supports": {...}}.
Every number is measured here; the test module holds the thresholds.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lightning_gproj.kernels import attention_bwd as B  # noqa: E402
from lightning_gproj.kernels import attention_fwd as F  # noqa: E402
from lightning_gproj.kernels import reference as R  # noqa: E402
from lightning_gproj.kernels._triton_utils import INTERPRET, mma  # noqa: E402

from _fp64 import attention_fp64  # noqa: E402  (tests/ is this script's directory)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖_F / ‖b‖_F in float64 (0 when both are 0)."""
    a, b = a.double(), b.double()
    n = b.norm().item()
    d = (a - b).norm().item()
    return d / n if n > 0 else d


def ulps(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest |a − b| measured in units of the last place of ``dtype`` at |b| (elementwise max)."""
    a, b = a.double(), b.double()
    eps = torch.finfo(dtype).eps  # ulp at 1.0
    tiny = torch.finfo(dtype).tiny
    ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp(min=tiny)))) * eps
    return ((a - b).abs() / ulp).max().item()


def run_fp8_case(b, nq, nk, h, hk, d, causal, seed):
    """ds_format e4m3 / e5m2 (dS rounded to FP8 significands): Triton vs reference, both vs float64."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, n, hh, d, generator=gen) for n, hh in ((nq, h), (nk, hk), (nk, hk), (nq, h)))
    k = k + 4.0
    q, k, v, do = (x.bfloat16() for x in (q, k, v, do))
    tau = d ** -0.5
    o_r, m_r, l_r = R.forward(q, k, v, tau, causal)
    _, dq64, dk64, dv64, _ = attention_fp64(q, k, v, do, tau, causal)
    out = {"shape": [b, nq, nk, h, hk, d], "causal": causal, "bwd": {}}
    for fix, ds_format in [(fix, fmt) for fmt in ("e4m3", "e5m2") for fix in ("none", "gproj")]:
        g = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, ds_format=ds_format)
        g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, ds_format=ds_format)
        res = {"nan": any(bool(torch.isnan(x).any().item()) for x in g[:3])}
        for nm, x, y, z in zip(("dq", "dk", "dv"), g[:3], g_r[:3], (dq64, dk64, dv64)):
            res[f"{nm}_rel_vs_ref"] = rel(x, y)
            res[f"{nm}_rel_vs_f64"] = rel(x, z)
            res[f"ref_{nm}_rel_vs_f64"] = rel(y, z)
        res["r_rel_vs_ref"] = rel(g[3]["r"], g_r[3]["r"])
        g32 = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False, grad_dtype=torch.float32,
                         ds_format=ds_format)
        dk32 = g32[1].double()
        res["c2_residual_fp32"] = (dk32.sum(dim=1).norm() / dk32.norm()).item()
        out["bwd"][f"{fix}_{ds_format}"] = res
    return out


def run_case(b, nq, nk, h, hk, d, causal, dtype, key_shift, strided, seed, seqlens=None, fixes=None):
    """Forward and backward variants (``fixes``: names of the variants, None = all four) against
    kernels/reference.py and float64."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q = rnd(b, nq, h, d).to(dtype)
    k = (rnd(b, nk, hk, d) + key_shift).to(dtype)
    v = rnd(b, nk, hk, d).to(dtype)
    do = rnd(b, nq, h, d).to(dtype)
    if strided:
        # Non-contiguous views (a slice of a wider buffer, and a head-major buffer seen as seq-major):
        # the kernels take the strides as they are.
        qw = torch.zeros(b, nq, h, d + 8, dtype=dtype)
        qw[..., :d] = q
        q = qw[..., :d]
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
        assert not q.is_contiguous() and not k.is_contiguous()
    tau = d ** -0.5
    sk = None if seqlens is None else torch.tensor(seqlens, dtype=torch.int32)
    out = {"shape": [b, nq, nk, h, hk, d], "causal": causal, "dtype": str(dtype), "strided": strided,
           "key_shift": key_shift, "seqlens_k": seqlens}

    o, m, l2 = F.forward(q, k, v, tau, causal, seqlens_k=sk)
    o_r, m_r, l_r = R.forward(q, k, v, tau, causal, seqlens_k=sk)
    fin = torch.isfinite(l_r)
    out["fwd"] = {
        "o_rel_vs_ref": rel(o, o_r),
        "o_max_ulps_vs_ref": ulps(o, o_r, dtype),
        "m_max_abs_diff": (m - m_r).abs().max().item(),
        "log2l_max_abs_diff": (l2 - l_r)[fin].abs().max().item() if fin.any() else 0.0,
        "inf_pattern_equal": bool(torch.equal(torch.isinf(l2), torch.isinf(l_r))),
        "nan": bool(torch.isnan(o).any().item()),
    }
    key_mask = None if sk is None else torch.arange(nk)[None, :] < sk[:, None]  # True = key visible
    o64, dq64, dk64, dv64, _ = attention_fp64(q, k, v, do, tau, causal, key_mask)
    out["fwd"]["o_rel_vs_f64"] = rel(o, o64)
    out["fwd"]["ref_o_rel_vs_f64"] = rel(o_r, o64)

    # The backward is fed the reference's forward state, so that any difference is the backward's own.
    out["bwd"] = {}
    runs = [(fix, fold) for fix, fold in (("none", False), ("gproj", False), ("gproj", True), ("gproj_uniform", False))
            if fixes is None or fix + ("_fold" if fold else "") in fixes]
    for fix, fold in runs:
        name = fix + ("_fold" if fold else "")
        g = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, dk_fold=fold, seqlens_k=sk)
        g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, dk_fold=fold, seqlens_k=sk)
        res = {"nan": any(bool(torch.isnan(x).any().item()) for x in g[:3])}
        for nm, x, y, z in zip(("dq", "dk", "dv"), g[:3], g_r[:3], (dq64, dk64, dv64)):
            res[f"{nm}_rel_vs_ref"] = rel(x, y)
            res[f"{nm}_rel_vs_f64"] = rel(x, z)
            res[f"ref_{nm}_rel_vs_f64"] = rel(y, z)
            res[f"{nm}_dtype_ok"] = x.dtype == y.dtype and x.shape == y.shape
        for key in ("r", "abs_dS", "leak"):
            res[f"{key}_rel_vs_ref"] = rel(g[3][key], g_r[3][key])
        # C2 on the fp32 accumulators: Σ_j dK_j / ‖dK‖_F (0 in exact arithmetic, DESIGN.md §2).
        g32 = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False, dk_fold=fold,
                         grad_dtype=torch.float32, seqlens_k=sk)
        dk32 = g32[1].double()
        res["c2_residual_fp32"] = (dk32.sum(dim=1).norm() / dk32.norm()).item()
        if name == "gproj":  # a (dq, dk, dv) dtype triple, as the op asks under autocast for fp32 q, k, bf16 v
            gm = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False, grad_dtype=(torch.float32, torch.float32, None),
                            seqlens_k=sk)
            res["grad_dtype_triple_matches"] = bool(
                torch.equal(gm[0], g32[0]) and torch.equal(gm[1], g32[1]) and torch.equal(gm[2], g[2]))
        if sk is not None:  # gradients of padded keys: exactly 0 (dk, dv), in both dtypes
            pad = torch.arange(nk)[None, :] >= sk[:, None]
            res["padded_keys_zero"] = bool(all((x[pad] == 0).all().item() for x in (g[1], g[2], g32[1], g32[2])))
            res["ref_padded_keys_zero"] = bool(all((x[pad] == 0).all().item() for x in g_r[1:3]))
        out["bwd"][name] = res
    return out


@triton.jit
def _mma_kernel(A, B_, ACC, OUT, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(A + rm[:, None] * K + rk[None, :])
    b = tl.load(B_ + rk[:, None] * N + rn[None, :])
    acc = tl.load(ACC + rm[:, None] * N + rn[None, :])
    tl.store(OUT + rm[:, None] * N + rn[None, :], mma(a, b, acc, INTERPRET))


def mma_is_order_free(dtype: torch.dtype, seed: int) -> bool:
    """Whether the interpreter's tile GEMM equals acc + (a @ b rounded once to fp32), the product taken
    in float64 by torch: bit for bit, so independent of the BLAS kernel's summation order."""
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(16, 64, generator=gen) * 8).to(dtype)
    b = torch.randn(64, 32, generator=gen).to(dtype)
    acc = torch.randn(16, 32, generator=gen)
    out = torch.empty_like(acc)
    _mma_kernel[(1,)](a, b, acc, out, 16, 64, 32)
    return bool(torch.equal(out, acc + (a.double() @ b.double()).float()))


def poisoned_keys(seed: int) -> dict:
    """Values behind the key padding never reach a result: the same call with NaN, +inf and 1e10 in
    the hidden keys and values must give bit-identical o, m, log2l, dq, dk, dv (hidden dk = dv = 0)
    in the Triton kernels and in the reference, every fix."""
    gen = torch.Generator().manual_seed(seed)
    b, n, h, hk, d = 2, 24, 2, 1, 32
    q, k, v, do = (torch.randn(b, n, hh, d, generator=gen).to(torch.bfloat16) for hh in (h, hk, hk, h))
    sk = torch.tensor([13, 24], dtype=torch.int32)
    hidden = torch.arange(n)[None, :] >= sk[:, None]
    out = {}
    for poison in (float("nan"), float("inf"), 1e10):
        kp, vp = k.clone(), v.clone()
        kp[hidden], vp[hidden] = poison, -poison
        for name, fwd, bwd in (("triton", F.forward, B.backward), ("reference", R.forward, R.backward)):
            for causal in (False, True):
                clean, dirty = fwd(q, k, v, d**-0.5, causal, seqlens_k=sk), fwd(q, kp, vp, d**-0.5, causal, seqlens_k=sk)
                same = all(torch.equal(x, y) for x, y in zip(clean, dirty))
                zero = True
                for fix in ("none", "gproj", "gproj_uniform"):
                    for gdt in (None, torch.float32):
                        gc = bwd(do, q, k, v, *clean, d**-0.5, causal, fix, grad_dtype=gdt, seqlens_k=sk)
                        gd = bwd(do, q, kp, vp, *dirty, d**-0.5, causal, fix, grad_dtype=gdt, seqlens_k=sk)
                        same &= all(torch.equal(x, y) for x, y in zip(gc[:3], gd[:3]))
                        zero &= bool((gd[1][hidden] == 0).all() and (gd[2][hidden] == 0).all())
                out[f"{name} {poison:g} causal={causal}"] = {"same": same, "hidden_zero": zero}
    return out


def run_window_case(nq, nk, h, hk, causal, window, softcap, seed, dtype=torch.bfloat16, key_shift=4.0, tau=None):
    """Sliding window / softcap: Triton and the reference vs float64,
    every fix; C2 of the fp32 dk; rows with no visible key. ``tau``: the softmax scale (default d^-1/2)."""
    gen = torch.Generator().manual_seed(seed)
    d = 32
    q, k, v, do = (torch.randn(1, n, hh, d, generator=gen) for n, hh in ((nq, h), (nk, hk), (nk, hk), (nq, h)))
    k = k + key_shift
    q, k, v, do = (x.to(dtype) for x in (q, k, v, do))
    tau = d ** -0.5 if tau is None else tau
    kw = dict(window_size=window, softcap=softcap)
    o, m, l2 = F.forward(q, k, v, tau, causal, **kw)
    o_r, m_r, l_r = R.forward(q, k, v, tau, causal, **kw)
    o64, dq64, dk64, dv64, _ = attention_fp64(q, k, v, do, tau, causal, window_size=window, softcap=softcap)
    empty = torch.isinf(l_r)  # (1, h, nq): rows with no visible key
    out = {"case": [nq, nk, h, hk, causal, list(window), softcap], "o_rel_vs_ref": rel(o, o_r),
           "o_rel_vs_f64": rel(o, o64), "ref_o_rel_vs_f64": rel(o_r, o64), "n_empty": int(empty.sum()),
           "inf_pattern_equal": bool(torch.equal(torch.isinf(l2), empty)),
           "c2_f64": (dk64.sum(dim=1).norm() / dk64.norm()).item(), "bwd": {}}
    for fix in R.FIXES:
        g = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, **kw)
        g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, **kw)
        res = {"nan": any(bool(torch.isnan(x).any()) for x in g[:3] + g_r[:3])}
        for nm, x, y, z in zip(("dq", "dk", "dv"), g[:3], g_r[:3], (dq64, dk64, dv64)):
            res[f"{nm}_rel_vs_ref"] = rel(x, y)
            res[f"{nm}_rel_vs_f64"] = rel(x, z)
            res[f"ref_{nm}_rel_vs_f64"] = rel(y, z)
        rows = empty[0].transpose(0, 1)  # (nq, h)
        res["empty_rows_zero"] = bool((g[0][0][rows] == 0).all() and (g_r[0][0][rows] == 0).all())
        g32 = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False, grad_dtype=torch.float32, **kw)
        dk32 = g32[1].double()
        res["c2_residual_fp32"] = (dk32.sum(dim=1).norm() / dk32.norm()).item()
        out["bwd"][fix] = res
    return out


def main() -> None:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    cases = [
        # (b, nq, nk, h, hk, d, causal, dtype, key_shift, strided, seed)
        (1, 40, 40, 2, 2, 32, False, torch.bfloat16, 4.0, False, 1),
        (2, 37, 53, 2, 1, 64, True, torch.bfloat16, 4.0, False, 2),  # GQA 2:1, Nq < Nk
        (1, 53, 37, 2, 2, 32, True, torch.bfloat16, 4.0, False, 3),  # Nq > Nk: rows with no key
        (1, 130, 130, 2, 1, 32, True, torch.bfloat16, 4.0, False, 4),  # several blocks + ragged tail
        (1, 45, 45, 2, 2, 32, False, torch.float16, 4.0, True, 5),  # fp16, strided q, k
    ]
    res = {"cases": [run_case(*c) for c in cases]}
    # Key padding (seqlens_k): lengths that end inside a 16-key block, on a block edge, and a batch
    # row with one valid key; causal with Nq == Nk (the usual causal + padding mask) and Nq < Nk.
    padded = [
        # (b, nq, nk, h, hk, d, causal, dtype, key_shift, strided, seed, seqlens, fixes)
        (2, 24, 24, 2, 1, 32, False, torch.bfloat16, 4.0, False, 6, [13, 24], R.FIXES),
        (2, 29, 29, 1, 1, 32, True, torch.bfloat16, 4.0, False, 7, [16, 1], None),  # all four fixes
        (1, 21, 40, 2, 2, 32, True, torch.float16, 4.0, True, 8, [30], R.FIXES),
    ]
    res["padded_cases"] = [run_case(*c) for c in padded]
    # (b, nq, nk, h, hk, d, causal, seed)
    res["fp8_cases"] = [run_fp8_case(1, 40, 40, 2, 2, 32, False, 9),
                        run_fp8_case(1, 37, 53, 2, 1, 32, True, 10)]
    consts = []
    for cval in (133120.0, 1000.0):
        for causal in (False, True):
            x = torch.full((1, 40, 2, 32), cval, dtype=torch.bfloat16)
            o, m, l2 = F.forward(x, x, x, 32 ** -0.5, causal)
            consts.append({"value": cval, "causal": causal, "nan": bool(torch.isnan(o).any().item()),
                           "exact": bool((o.float() == cval).all().item())})
    res["constants"] = consts
    # (nq, nk, h, hk, causal, window_size, softcap, seed): left only + causal with Nq < Nk and GQA,
    # both sides, right only, a window wider than Nk, Nq > Nk with rows that see no key, softcap alone
    # and with a causal window.
    res["window_cases"] = [run_window_case(*c) for c in [
        (37, 53, 2, 1, True, (7, -1), 0.0, 11),
        (40, 40, 2, 2, False, (5, 3), 0.0, 12),
        (40, 40, 2, 2, False, (-1, 4), 0.0, 13),
        (53, 37, 2, 2, False, (2, 0), 0.0, 14),
        (40, 30, 2, 2, False, (100, 100), 0.0, 15),
        (40, 40, 2, 2, False, (-1, -1), 5.0, 16),
        (37, 53, 2, 1, True, (9, -1), 3.0, 17),
    ]]
    # fp16 with a softcap that saturates tanh: X = dZ∘g falls below fp16's normal range. τ = 1 (|τ s| ~ 6 against
    # cap 1), and with keys shifted by 4 (|τ s| ~ 23: whole rows saturated, their direction W̃ = rnd(P̃∘g) all 0).
    res["fp16_softcap_cases"] = [run_window_case(32, 32, 2, 2, causal, (-1, -1), 1.0, 18 + causal, torch.float16,
                                                 key_shift=shift, tau=1.0)
                                 for causal in (False, True) for shift in (0.0, 4.0)]
    for cval in (133120.0, 1000.0):
        x = torch.full((1, 40, 2, 32), cval, dtype=torch.bfloat16)
        for kw in (dict(window_size=(3, 2)), dict(softcap=30.0), dict(window_size=(5, 0), softcap=10.0)):
            o, _, _ = F.forward(x, x, x, 32 ** -0.5, False, **kw)
            res["constants"].append({"value": cval, "causal": False, "nan": bool(torch.isnan(o).any().item()),
                                     "exact": bool((o.float() == cval).all().item()), "kw": str(kw)})

    res["mma_order_free"] = {str(dt): mma_is_order_free(dt, 9) for dt in (torch.bfloat16, torch.float16)}
    res["poisoned_keys"] = poisoned_keys(10)
    z = torch.zeros(1, 8, 2, 32)
    res["supports"] = {
        "bf16_cpu_interp": B.supports(z.bfloat16(), z.bfloat16(), z.bfloat16()),
        "fp32": B.supports(z, z, z),
        "bad_heads": B.supports(torch.zeros(1, 8, 3, 32).bfloat16(), z.bfloat16(), z.bfloat16()),
        "head_dim_300": B.supports(*(torch.zeros(1, 8, 2, 300).bfloat16() for _ in range(3))),
        # batch·nheads past CUDA's 65535 grid rows (expanded: no memory), and the same as packed sequences
        "grid_rows_max": B.supports(*(torch.zeros(1, 8, 3, 32).bfloat16().expand(21845, 8, 3, 32) for _ in range(3))),
        "grid_rows_over": B.supports(*(torch.zeros(1, 8, 2, 32).bfloat16().expand(32768, 8, 2, 32) for _ in range(3))),
        "grid_rows_packed": B.supports(*(torch.zeros(1, 8, 2, 32).bfloat16() for _ in range(3)), batch=32768),
    }
    zb = z.bfloat16()
    zargs = (zb, zb, zb, zb, zb, torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), 1.0, False)
    try:
        B.backward(*zargs, "bogus")
        res["bad_fix_raises"] = False
    except ValueError:
        res["bad_fix_raises"] = True
    sys.stdout.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
