"""Runs the Triton kernels' attention-dropout variant (DROPOUT) under Triton's CPU interpreter and prints
measured agreement as JSON (executed by tests/test_dropout.py in a fresh subprocess with
TRITON_INTERPRET=1, for the reason given in tests/_triton_interp_cases.py).

Measured: Triton's Philox (``tl.philox``, and the kernels' ``dropout_keep``) against the PyTorch
Philox of kernels/reference.py bit for bit; the keep mask each kernel pass (forward, dQ pass, dK/dV
pass) applies, read off its outputs, against ``reference.dropout_keep_mask`` element for element;
forward and backward of the kernels against the reference (same rounding points, same mask) and
against a float64 autograd attention with the keep mask of ``reference.dropout_keep_mask`` applied
explicitly; the same float64 attention with another seed's mask (the control: a backward that used
another mask than its forward's would sit there).
Every number is measured here; tests/test_dropout.py holds the thresholds.
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
from lightning_gproj.kernels._triton_utils import dropout_args, dropout_groups, dropout_keep  # noqa: E402

from _attention_models import packed_keep_mask  # noqa: E402
from _fp64 import attention_fp64, packed_attention_fp64  # noqa: E402

SEEDS = (0, 1, 0xDEADBEEF, 2**32 + 7, 2**63 + 99, 2**64 - 1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    n = b.norm().item()
    return (a - b).norm().item() / n if n > 0 else (a - b).norm().item()


@triton.jit
def _philox_kernel(OUT, C, seed_lo, seed_hi, N: tl.constexpr, ROUNDS: tl.constexpr):
    o = tl.arange(0, N)
    c0 = tl.load(C + o).to(tl.uint32)
    c1 = tl.load(C + N + o).to(tl.uint32)
    c2 = tl.load(C + 2 * N + o).to(tl.uint32)
    c3 = tl.load(C + 3 * N + o).to(tl.uint32)
    seed = (seed_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | seed_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    x0, x1, x2, x3 = tl.philox(seed, c0, c1, c2, c3, n_rounds=ROUNDS)
    tl.store(OUT + o, x0.to(tl.int64) & 0xFFFFFFFF)
    tl.store(OUT + N + o, x1.to(tl.int64) & 0xFFFFFFFF)
    tl.store(OUT + 2 * N + o, x2.to(tl.int64) & 0xFFFFFFFF)
    tl.store(OUT + 3 * N + o, x3.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def _keep_kernel(OUT, OUT_T, row0, n_k, start_n, bh, seed_lo, seed_hi, drop_off, drop_thr, M: tl.constexpr,
                 N: tl.constexpr):
    """dropout_keep's [M, N] tile of rows row0 + [0, M), keys start_n + [0, N), and its transpose (the
    dK/dV pass's orientation), stored as int8."""
    i = tl.arange(0, M)
    j = tl.arange(0, N)
    keep = dropout_keep((row0 + i).to(tl.int64) * dropout_groups(n_k), start_n, bh, seed_lo, seed_hi, drop_off,
                        drop_thr, N)
    tl.store(OUT + i[:, None] * N + j[None, :], keep.to(tl.int8))
    tl.store(OUT_T + j[:, None] * M + i[None, :], tl.trans(keep).to(tl.int8))


def philox_bits() -> dict:
    """tl.philox's four outputs (reference.PHILOX_ROUNDS rounds) vs reference.philox4x32 on 64 counters
    (uint32 extremes included) per seed; the kernels' dropout_keep (and its transpose) vs
    reference.dropout_keep_mask on 16×64 tiles: keys 2^28 − 64 .. 2^28 − 1 of rows 120..135 with
    n_k = 2^28 + 3 (not a multiple of 8; the group counter i·G + g crosses 2^32, so c3 is used), and
    keys 0..63 of rows 0..15 with n_k = 53 (the last group partial, past-the-end keys included)."""
    gen = torch.Generator().manual_seed(0)
    n = 64
    counters = torch.randint(0, 2**32, (4, n), generator=gen, dtype=torch.int64)
    counters[:, :4] = torch.tensor([0, 1, 2**31, 2**32 - 1])[:, None]
    out = {"philox_equal": [], "keep_equal": [], "keep_t_equal": [], "keep_frac": []}
    for seed in SEEDS:
        args = dropout_args(0.3, seed, 0)
        res = torch.zeros(4 * n, dtype=torch.int64)
        _philox_kernel[(1,)](res, counters.flatten().contiguous(), args["seed_lo"], args["seed_hi"], n, R.PHILOX_ROUNDS)
        ref = torch.stack(R.philox4x32(seed, *counters, rounds=R.PHILOX_ROUNDS)).flatten()
        out["philox_equal"].append(bool(torch.equal(res, ref)))
        tiles = ((0.3, 5, 3, 120, 2**28 + 3, 2**28 - 64), (0.9, 2**32 - 1, 0, 0, 53, 0))
        for p, offset, bh, row0, n_k, start_n in tiles:
            a = dropout_args(p, seed, offset)
            keep = torch.zeros(16, 64, dtype=torch.int8)
            keep_t = torch.zeros(64, 16, dtype=torch.int8)
            _keep_kernel[(1,)](keep, keep_t, row0, n_k, start_n, bh, a["seed_lo"], a["seed_hi"], a["drop_off"],
                               a["drop_thr"], 16, 64)
            ref_keep = R.dropout_keep_mask(seed, offset, p, 1, bh + 1, n_k, (row0, row0 + 16),
                                           (start_n, start_n + 64))[0, bh]
            out["keep_equal"].append(bool(torch.equal(keep.bool(), ref_keep)))
            out["keep_t_equal"].append(bool(torch.equal(keep_t.bool(), ref_keep.T)))
            out["keep_frac"].append(keep.float().mean().item())
    return out


def _mask_inputs(nq: int, nk: int, h: int, hk: int, d: int, seqs):
    """Inputs whose results spell out the keep mask of each kernel pass (needs nk_s <= d, nq_s < d): q = 0,
    so every visible P is 1/n_s (n_s the sequence's keys, no causal mask); for the forward v_fwd_j = e_j
    (o_ij = M_ij (1/n_s) / (1 − p)); for the backward k_j = e_j, v_j = e_{d−1}, dO_i = 4^g e_i + e_{d−1}
    (g: the head's place in its GQA group), so dP_ij = 1, dS_ij = P_ij (M_ij / (1 − p) − D_i) and with
    τ = 1 dQ_ij = dS̃_ij (the dQ pass), and dV_ji = Σ_g 4^g P̃_ij M_ij / (1 − p) (the dK/dV pass, one
    base-4 digit per query head). ``seqs``: [(batch row, q0, q1, k0, k1)] of the tokens."""
    q = torch.zeros(nq, h, d)
    k, v, v_fwd = torch.zeros(nk, hk, d), torch.zeros(nk, hk, d), torch.zeros(nk, hk, d)
    do = torch.zeros(nq, h, d)
    for _, q0, q1, k0, k1 in seqs:
        jl = torch.arange(k1 - k0)
        v_fwd[k0 + jl, :, jl] = 1.0
        k[k0 + jl, :, jl] = 1.0
        v[k0:k1, :, d - 1] = 1.0
        il = torch.arange(q1 - q0)
        for hh in range(h):
            do[q0 + il, hh, il] = 4.0 ** (hh % (h // hk))
        do[q0:q1, :, d - 1] = 1.0
    return tuple(x.bfloat16() for x in (q, k, v, v_fwd, do))


def _spelled_masks(o_fwd, dq, dv, D, n, group):
    """The masks the forward (o_fwd), dQ pass (dq) and dK/dV pass (dv) applied to one sequence with n keys,
    each (nheads, nq_s, n) bool, and the largest distance of a decoded value from an integer (a sanity
    check of the decoding); p = 0.5 (scale 2, exact). o_fwd, dq: (nq_s, nheads, d); dv: (n, nheads_k, d);
    D: (nq_s, nheads) float64."""
    fwd = (o_fwd[:, :, :n] != 0).permute(1, 0, 2)
    vq = (dq[:, :, :n].double() * n + D[:, :, None]) / 2  # M_ij
    nq_s = dq.shape[0]
    vv = dv[:, :, :nq_s].double() * n / 2  # Σ_g 4^g M_ij, (n, nheads_k, nq_s)
    digits = vv.round().long()
    h = dq.shape[1]
    bwd_kv = torch.stack([(digits[:, hh // group] >> (2 * (hh % group))) & 1 for hh in range(h)])  # (h, n, nq_s)
    off = max((vq - vq.round()).abs().max().item(), (vv - vv.round()).abs().max().item())
    return fwd, vq.round().bool().permute(1, 0, 2), bwd_kv.bool().transpose(1, 2), off


def kernel_masks(seqs_q, seqs_k, h, hk, d, seed, packed) -> dict:
    """The keep mask each kernel pass applies (forward, dQ pass, dK/dV pass), read off their outputs on
    :func:`_mask_inputs`, against reference.dropout_keep_mask, element for element. ``packed``: the
    sequences are packed (varlen); else each is a batch row of one dense call (all of one length)."""
    p, offset, group = 0.5, 3, h // hk
    cq = [0] + torch.tensor(seqs_q).cumsum(0).tolist()
    ck = [0] + torch.tensor(seqs_k).cumsum(0).tolist()
    seqs = [(bi, cq[bi], cq[bi + 1], ck[bi], ck[bi + 1]) for bi in range(len(seqs_q))]
    q, k, v, v_fwd, do = _mask_inputs(cq[-1], ck[-1], h, hk, d, seqs)
    drop = dict(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    if packed:
        pk = dict(cu_seqlens_q=torch.tensor(cq, dtype=torch.int32), cu_seqlens_k=torch.tensor(ck, dtype=torch.int32),
                  max_seqlen_q=max(seqs_q), max_seqlen_k=max(seqs_k))
        args = (q, k, v, v_fwd, do)
    else:
        pk = {}
        args = tuple(x.view(len(seqs), -1, *x.shape[1:]) for x in (q, k, v, v_fwd, do))
    q, k, v, v_fwd, do = args
    o_fwd = F.forward(q, k, v_fwd, 1.0, False, **pk, **drop)[0]
    o_r, m_r, l_r = R.forward(q, k, v, 1.0, False, **pk, **drop)
    dq, _, dv, _ = B.backward(do, q, k, v, o_r, m_r, l_r, 1.0, False, "none", False, grad_dtype=torch.float32,
                              **pk, **drop)
    D = (do.double() * o_r.double()).sum(-1)
    flat = (lambda x: x) if packed else (lambda x: x.flatten(0, 1))
    o_fwd, dq, dv, D = (flat(x) for x in (o_fwd, dq, dv, D))
    out = {"case": [seqs_q, seqs_k, h, hk, d, seed, packed], "fwd": [], "dq": [], "dkdv": [], "decode_off": 0.0,
           "kept_frac": []}
    for bi, q0, q1, k0, k1 in seqs:
        if q1 == q0 or k1 == k0:
            continue  # no query sees a key: no mask to read
        if packed:
            ref = R.dropout_keep_mask(seed, offset, p, 1, h, ck[-1], (q0, q1), (0, k1 - k0))[0]
        else:
            ref = R.dropout_keep_mask(seed, offset, p, len(seqs), h, seqs_k[0], (0, seqs_q[0]), (0, seqs_k[0]))[bi]
        fwd, bq, bkv, off = _spelled_masks(o_fwd[q0:q1], dq[q0:q1], dv[k0:k1], D[q0:q1], k1 - k0, group)
        out["fwd"].append(bool(torch.equal(fwd, ref)))
        out["dq"].append(bool(torch.equal(bq, ref)))
        out["dkdv"].append(bool(torch.equal(bkv, ref)))
        out["decode_off"] = max(out["decode_off"], off)
        out["kept_frac"].append(ref.float().mean().item())
    return out


def _inputs(shape_q, shape_k, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=gen)
    k = torch.randn(*shape_k, generator=gen) + 4.0  # a mean key: the leak GProj removes is visible
    v = torch.randn(*shape_k, generator=gen)
    do = torch.randn(*shape_q, generator=gen)
    return tuple(x.bfloat16() for x in (q, k, v, do))


def dense_case(b, nq, nk, h, hk, d, causal, p, seed, window=(-1, -1), softcap=0.0, seqlens=None):
    """Forward and backward (fix none / gproj) of the kernels with dropout vs the reference and float64."""
    q, k, v, do = _inputs((b, nq, h, d), (b, nk, hk, d), seed % 1000)
    tau = d ** -0.5
    sk = None if seqlens is None else torch.tensor(seqlens, dtype=torch.int32)
    drop = dict(dropout_p=p, dropout_seed=seed, dropout_offset=3)
    kw = dict(seqlens_k=sk, window_size=window, softcap=softcap)
    o, m, l2 = F.forward(q, k, v, tau, causal, **kw, **drop)
    o2, _, _ = F.forward(q, k, v, tau, causal, **kw, **drop)
    o_other, _, _ = F.forward(q, k, v, tau, causal, **kw, **dict(drop, dropout_seed=seed + 1))
    o_r, m_r, l_r = R.forward(q, k, v, tau, causal, **kw, **drop)
    keep = R.dropout_keep_mask(seed, 3, p, b, h, nk, (0, nq), (0, nk))
    other = R.dropout_keep_mask(seed + 1, 3, p, b, h, nk, (0, nq), (0, nk))
    key_mask = None if sk is None else torch.arange(nk)[None, :] < sk[:, None]
    f64 = dict(key_mask=key_mask, window_size=window, softcap=softcap, dropout_p=p)
    o64, dq64, dk64, dv64, _ = attention_fp64(q, k, v, do, tau, causal, keep=keep, **f64)
    _, dqx, dkx, dvx, _ = attention_fp64(q, k, v, do, tau, causal, keep=other, **f64)
    out = {"case": [b, nq, nk, h, hk, d, causal, p, seed, list(window), softcap, seqlens],
           "o_rel_vs_ref": rel(o, o_r), "o_rel_vs_f64": rel(o, o64), "ref_o_rel_vs_f64": rel(o_r, o64),
           "same_seed_equal": bool(torch.equal(o, o2)), "other_seed_rel": rel(o_other, o),
           "m_equal_undropped": rel(m, R.forward(q, k, v, tau, causal, **kw)[1]), "bwd": {}}
    for fix in ("none", "gproj"):
        g = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, **kw, **drop)
        g2 = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, **kw, **drop)
        g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, True, **kw, **drop)
        res = {"nan": any(bool(torch.isnan(x).any()) for x in g[:3]),
               "repeat_equal": all(torch.equal(x, y) for x, y in zip(g[:3], g2[:3]))}
        for nm, x, y, z, zx in zip(("dq", "dk", "dv"), g[:3], g_r[:3], (dq64, dk64, dv64), (dqx, dkx, dvx)):
            res[f"{nm}_rel_vs_ref"] = rel(x, y)
            res[f"{nm}_rel_vs_f64"] = rel(x, z)
            res[f"ref_{nm}_rel_vs_f64"] = rel(y, z)
            res[f"{nm}_rel_vs_other_mask"] = rel(x, zx)
        res["r_rel_vs_ref"] = rel(g[3]["r"], g_r[3]["r"])
        if softcap == 0:  # C2 holds with dropout (Σ_j dS_ij = 0 for the undropped P); not with softcap
            dk32 = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False, grad_dtype=torch.float32,
                              **kw, **drop)[1].double()
            res["c2_residual_fp32"] = (dk32.sum(dim=1).norm() / dk32.norm()).item()
        out["bwd"][fix] = res
    return out


def varlen_case(lens_q, lens_k, h, hk, d, causal, p, seed):
    """Packed sequences (one batch row; the mask over packed query rows and each sequence's own keys),
    Triton vs reference and float64."""
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q, k, v, do = (x[0] for x in _inputs((1, tq, h, d), (1, tk, hk, d), seed % 1000))
    tau = d ** -0.5
    pk = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
              dropout_p=p, dropout_seed=seed, dropout_offset=0)
    o, m, l2 = F.forward(q, k, v, tau, causal, **pk)
    o_r, m_r, l_r = R.forward(q, k, v, tau, causal, **pk)
    keep = packed_keep_mask(seed, 0, p, h, cu_q, cu_k)
    o64, dq64, dk64, dv64 = packed_attention_fp64(q, k, v, do, tau, causal, cu_q, cu_k, keep=keep, dropout_p=p)
    out = {"case": [lens_q, lens_k, h, hk, d, causal, p, seed], "o_rel_vs_ref": rel(o, o_r),
           "o_rel_vs_f64": rel(o, o64), "ref_o_rel_vs_f64": rel(o_r, o64), "bwd": {}}
    for fix in ("none", "gproj"):
        g = B.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False, **pk)
        g_r = R.backward(do, q, k, v, o_r, m_r, l_r, tau, causal, fix, False, **pk)
        res = {"nan": any(bool(torch.isnan(x).any()) for x in g[:3])}
        for nm, x, y, z in zip(("dq", "dk", "dv"), g[:3], g_r[:3], (dq64, dk64, dv64)):
            res[f"{nm}_rel_vs_ref"] = rel(x, y)
            res[f"{nm}_rel_vs_f64"] = rel(x, z)
            res[f"ref_{nm}_rel_vs_f64"] = rel(y, z)
        out["bwd"][fix] = res
    return out


def main() -> None:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    res = {"philox": philox_bits()}
    res["masks"] = [
        kernel_masks([37, 37], [53, 53], 2, 1, 64, 2**40 + 12, packed=False),  # GQA 2:1, nk = 53 not a multiple of 8
        kernel_masks([5, 0, 19, 9], [7, 3, 19, 12], 2, 1, 32, 14, packed=True),  # sequences start at keys 0, 7, 10, 29
    ]
    # (b, nq, nk, h, hk, d, causal, p, seed, window, softcap, seqlens)
    res["dense"] = [
        dense_case(2, 40, 40, 2, 2, 32, False, 0.2, 11, seqlens=[40, 23]),
        dense_case(1, 37, 53, 2, 1, 32, True, 0.1, 2**40 + 12),  # GQA 2:1, Nq < Nk, a seed >= 2^32
        dense_case(1, 40, 40, 2, 2, 32, True, 0.3, 13, window=(9, 0), softcap=5.0),
    ]
    res["varlen"] = [varlen_case([5, 0, 19, 9], [7, 3, 19, 12], 2, 1, 32, True, 0.25, 14)]
    sys.stdout.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
