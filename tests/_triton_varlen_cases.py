"""Runs the Triton kernels' packed-sequence (varlen) variant under the CPU interpreter and prints
measured agreement as JSON (see tests/_triton_interp_cases.py for why this is a subprocess).

Executed by tests/test_triton_varlen.py with TRITON_INTERPRET=1. Output: one JSON object on the last
stdout line. Every number is measured here; the test module holds the thresholds.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from lightning_gproj.kernels import attention_bwd as B  # noqa: E402
from lightning_gproj.kernels import attention_fwd as F  # noqa: E402
from lightning_gproj.kernels import reference as R  # noqa: E402

from _fp64 import packed_attention_fp64  # noqa: E402  (tests/ is this script's directory)

def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖_F / ‖b‖_F in float64 (0 when both are 0)."""
    a, b = a.double(), b.double()
    n = b.norm().item()
    d = (a - b).norm().item()
    return d / n if n > 0 else d


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def inputs(lens_q, lens_k, h, hk, d, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=gen).bfloat16()
    k = (torch.randn(sum(lens_k), hk, d, generator=gen) + 4.0).bfloat16()  # ‖k̄‖ = 4√d: a visible leak
    v = torch.randn(sum(lens_k), hk, d, generator=gen).bfloat16()
    do = torch.randn(sum(lens_q), h, d, generator=gen).bfloat16()
    vl = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    return q, k, v, do, vl


def c2_per_sequence(dk: torch.Tensor, cu_k: torch.Tensor) -> float:
    """max over sequences with ≥ 2 keys and kv heads of ‖Σ_{j in b} dK_j‖ / ‖dK_b‖_F (fp32 dk)."""
    dk = dk.double()
    out = 0.0
    for a, e in zip(cu_k[:-1].tolist(), cu_k[1:].tolist()):
        if e - a > 1 and dk[a:e].norm() > 0:
            out = max(out, (dk[a:e].sum(dim=0).norm(dim=-1) / dk[a:e].norm(dim=(0, 2))).max().item())
    return out


def run_case(lens_q, lens_k, h, hk, d, causal, seed, fixes):
    """Forward and the backward for ``fixes`` against kernels/reference.py and float64."""
    q, k, v, do, vl = inputs(lens_q, lens_k, h, hk, d, seed)
    tau = d**-0.5
    o, m, l2 = F.forward(q, k, v, tau, causal, **vl)
    o_r, m_r, l_r = R.forward(q, k, v, tau, causal, **vl)
    o64, dq64, dk64, dv64 = packed_attention_fp64(q, k, v, do, tau, causal, vl["cu_seqlens_q"], vl["cu_seqlens_k"])
    fin = torch.isfinite(l_r)
    out = {"lens_q": lens_q, "lens_k": lens_k, "heads": [h, hk, d], "causal": causal, "fwd": {
        "shapes_ok": o.shape == q.shape and m.shape == m_r.shape == (h, q.shape[0]),
        "o_rel_vs_ref": rel(o, o_r), "o_rel_vs_f64": rel(o, o64), "ref_o_rel_vs_f64": rel(o_r, o64),
        "m_max_abs_diff": (m - m_r).abs().max().item(),
        "log2l_max_abs_diff": (l2 - l_r)[fin].abs().max().item(),
        "inf_pattern_equal": bool(torch.equal(torch.isinf(l2), torch.isinf(l_r))),
        "nan": bool(torch.isnan(o).any().item()),
    }, "bwd": {}}
    # Rows and keys of sequences where nobody attends: exact zeros expected.
    cq, ck = vl["cu_seqlens_q"].tolist(), vl["cu_seqlens_k"].tolist()
    idle_q = [i for b in range(len(lens_q)) if lens_k[b] == 0 for i in range(cq[b], cq[b + 1])]
    idle_k = [j for b in range(len(lens_q)) if lens_q[b] == 0 for j in range(ck[b], ck[b + 1])]
    out["idle"] = [len(idle_q), len(idle_k)]
    out["fwd"]["idle_rows_zero"] = bool((o[idle_q] == 0).all().item())
    for fix in fixes:
        g = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, **vl)
        g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, **vl)
        res = {"nan": any(bool(torch.isnan(x).any().item()) for x in g[:3])}
        for nm, x, y, z in zip(("dq", "dk", "dv"), g[:3], g_r[:3], (dq64, dk64, dv64)):
            res[f"{nm}_rel_vs_ref"] = rel(x, y)
            res[f"{nm}_rel_vs_f64"] = rel(x, z)
            res[f"ref_{nm}_rel_vs_f64"] = rel(y, z)
            res[f"{nm}_shape_ok"] = x.shape == y.shape and x.dtype == y.dtype
        for key in ("r", "abs_dS", "leak"):
            res[f"{key}_rel_vs_ref"] = rel(g[3][key], g_r[3][key])
        res["idle_zero"] = bool((g[0][idle_q] == 0).all() and (g[1][idle_k] == 0).all() and (g[2][idle_k] == 0).all())
        g32 = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False, grad_dtype=torch.float32, **vl)
        res["c2_per_sequence_fp32"] = c2_per_sequence(g32[1], vl["cu_seqlens_k"])
        out["bwd"][fix] = res
    return out


def run_window_case(lens_q, lens_k, h, hk, causal, window, softcap, seed):
    """Packed sequences with a sliding window and / or softcap (each sequence in its own bottom-right
    aligned coordinates): Triton and the reference against float64 over all packed tokens,
    every fix; C2 per sequence of the fp32 dk; rows with no visible key."""
    q, k, v, do, vl = inputs(lens_q, lens_k, h, hk, 32, seed)
    tau = 32**-0.5
    kw = dict(window_size=window, softcap=softcap, **vl)
    o, m, l2 = F.forward(q, k, v, tau, causal, **kw)
    o_r, m_r, l_r = R.forward(q, k, v, tau, causal, **kw)
    o64, dq64, dk64, dv64 = packed_attention_fp64(q, k, v, do, tau, causal, vl["cu_seqlens_q"], vl["cu_seqlens_k"],
                                                  window_size=window, softcap=softcap)
    empty = torch.isinf(l_r).transpose(0, 1)  # (total_q, h): rows with no visible key
    out = {"case": [lens_q, lens_k, h, hk, causal, list(window), softcap], "o_rel_vs_ref": rel(o, o_r),
           "o_rel_vs_f64": rel(o, o64), "ref_o_rel_vs_f64": rel(o_r, o64), "n_empty": int(empty.sum()),
           "inf_pattern_equal": bool(torch.equal(torch.isinf(l2), torch.isinf(l_r))),
           "c2_f64": c2_per_sequence(dk64, vl["cu_seqlens_k"]), "bwd": {}}
    for fix in R.FIXES:
        g = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, **kw)
        g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, **kw)
        res = {"nan": any(bool(torch.isnan(x).any()) for x in g[:3] + g_r[:3])}
        for nm, x, y, z in zip(("dq", "dk", "dv"), g[:3], g_r[:3], (dq64, dk64, dv64)):
            res[f"{nm}_rel_vs_ref"] = rel(x, y)
            res[f"{nm}_rel_vs_f64"] = rel(x, z)
            res[f"ref_{nm}_rel_vs_f64"] = rel(y, z)
        res["empty_rows_zero"] = bool((g[0][empty] == 0).all() and (g_r[0][empty] == 0).all())
        g32 = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False, grad_dtype=torch.float32, **kw)
        res["c2_per_sequence_fp32"] = c2_per_sequence(g32[1], vl["cu_seqlens_k"])
        out["bwd"][fix] = res
    return out


def independence(seed):
    """One sequence's keys and values set to NaN / 1e10: every other sequence's o, dq, dk, dv must be
    bit-identical (fix="gproj", causal)."""
    lens_q, lens_k = [9, 18, 1, 6], [9, 21, 2, 6]
    q, k, v, do, vl = inputs(lens_q, lens_k, 2, 1, 32, seed)
    tau = 32**-0.5
    k0, k1 = vl["cu_seqlens_k"][1].item(), vl["cu_seqlens_k"][2].item()
    q0, q1 = vl["cu_seqlens_q"][1].item(), vl["cu_seqlens_q"][2].item()
    rows = torch.ones(q.shape[0], dtype=torch.bool)
    rows[q0:q1] = False
    keys = torch.ones(k.shape[0], dtype=torch.bool)
    keys[k0:k1] = False
    out = {}
    fwd_clean = F.forward(q, k, v, tau, True, **vl)
    for poison in (float("nan"), 1e10):
        kp, vp = k.clone(), v.clone()
        kp[k0:k1], vp[k0:k1] = poison, -poison
        fwd = F.forward(q, kp, vp, tau, True, **vl)
        same = bool(torch.equal(fwd[0][rows], fwd_clean[0][rows]))
        gc = B.backward(do, q, k, v, *fwd_clean, tau, True, "gproj", **vl)
        gd = B.backward(do, q, kp, vp, *fwd, tau, True, "gproj", **vl)
        out[f"{poison:g}"] = same and bool(
            torch.equal(gc[0][rows], gd[0][rows]) and torch.equal(gc[1][keys], gd[1][keys])
            and torch.equal(gc[2][keys], gd[2][keys]))
    return out


def main() -> None:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    res = {"cases": [
        # Causal, GQA 2:1: an empty query sequence with keys, a keyless query sequence, a length-1 pair,
        # Nq > Nk (rows with no key), Nq < Nk, lengths crossing the interpreter's 16-row blocks.
        run_case([5, 0, 1, 3, 20, 9], [7, 3, 1, 0, 14, 17], 2, 1, 32, True, 1, R.FIXES),
        # Not causal, no GQA, a key sequence spanning three blocks.
        run_case([1, 21, 0, 7], [2, 36, 5, 7], 2, 2, 32, False, 2, ("none", "gproj")),
    ]}
    res["window_cases"] = [
        # Mistral-style causal window: sequences with Nq > Nk (rows with no key), Nq < Nk (keys before
        # the first row's window: C2 over the keys some query sees), an empty one, one spanning blocks.
        run_window_case([5, 0, 20, 9, 1], [7, 3, 14, 17, 1], 2, 1, True, (4, 0), 0.0, 11),
        # Two-sided window with softcap, and softcap alone (no GQA).
        run_window_case([1, 21, 7], [2, 36, 7], 2, 2, False, (3, 2), 2.0, 12),
        run_window_case([6, 18], [9, 18], 2, 2, True, (-1, -1), 1.5, 13),
    ]
    res["independence"] = independence(3)
    sys.stdout.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
