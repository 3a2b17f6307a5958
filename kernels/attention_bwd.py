"""Triton attention backward with the GProj corrections, implementing the kernel contract of
docs/architecture.md:

    backward(do, q, k, v, o, m, log2l, softmax_scale, causal, fix, want_stats) -> (dq, dk, dv, extras)

Two launches, rounding at the points of kernels/reference.py (DESIGN.md §3, §4, §4.1):

1. dQ pass, one program per (query block, batch·head), looping over key blocks. First
   D_i = Σ_d do_id·o_id in fp32 from the *stored* 16-bit o and do of its query rows (written out,
   B·H·Nq fp32, for pass 2); then
   P = exp2((s − m)·τ·log2e − log2l) (the forward's FMA-safe exponent, same fp32 s and m), dP = dO·Vᵀ,
   dS = P∘(dP − D) in fp32, dS̃ = dS rounded to the input dtype (the rounding point that breaks the
   zero-sum law C1), dQ += dS̃·K, r_i += Σ_j dS̃_ij (fp32, from the very rounded values the GEMM
   consumed), and — for fix="gproj" or want_stats — PK += P̃·K with P̃ the rounded P.
   Also Σ_j P̃_ij, giving ρ_i = r_i / Σ_j P̃_ij (so that the corrected row Σ_j (dS̃_ij − ρ_i P̃_ij)
   is exactly 0, as in kernels/reference.py). fix="gproj": dQ = τ (dQ − ρ∘PK). r is written out
   (B·H·Nq fp32) for pass 2, and in the "gemm" schedule below −ρ∘Q rounded to the input dtype
   (B·Nq·H·d, like q).
2. dK/dV pass, one program per (key block, batch·kv-head), looping over the query heads of its GQA
   group and over query blocks: dV += P̃ᵀ·dO, dK += dS̃ᵀ·Q. For fix="gproj" the P-weighted dK term
   −P̃ᵀ(ρ∘Q) is either
   * "gemm" (default): its own GEMM, P̃ᵀ·bf16(−ρ∘Q), as in kernels/reference.py (rounding the
     operand changes the *correction* by a relative 2^-9 only; an fp32 dk ends with the C2
     projection anyway), with the operand formed once per query row by pass 1, or
   * "fold": folded into dS before its rounding, dS' = P∘(dP − (D + r)) — zero extra GEMMs
     (``dk_fold=True``; DESIGN.md §4.1 table: slightly less accurate dK).
   The choice of default is recorded in benchmarks/NOTES.md with the measurements behind it.

On an sm_90 GPU, for the inputs of kernels/attention_bwd_hopper.py (head dim 64 / 128, seqlen_q = seqlen_k; windows,
softcap, dropout (unless GPROJ_HOPPER_DROPOUT=0), key padding without a window and packed sequences with one cu_seqlens
for queries and keys served), both passes
run as that module's warp-specialized Gluon kernels, with the
same rounding points: the dQ pass for fix "none" and "gproj" without want_stats, the dK/dV pass for "none",
"gproj" with the "gemm" schedule and the PyTorch "gproj_uniform" (not the in-kernel uniform one of windows and
softcap). Fix "none" on dense inputs at head dim 128 and 64 (a seqlen that is a multiple of 128; no window, softcap,
dropout, key padding or packing, no statistics; full attention, or causal without GQA from 8192 keys at d 128 and 2048 at d 64) instead runs
kernels/attention_bwd_onepass.py: one pass, dq added into an fp32 buffer by reduce-adds (not bit-reproducible; not
under torch.use_deterministic_algorithms or with ``deterministic=True``).

fix="gproj_uniform" (the orthogonal projection) runs both passes without corrections, with fp32 dq/dk
outputs, and applies the rank-one corrections in PyTorch (O(N·d): prefix means / suffix sums when
causal), then rounds once.

Key padding (``seqlens_k``, right padding, a constexpr variant HAS_SEQLENS so the unpadded kernels
are unchanged): the dQ pass stops at the batch row's key length (the straddling block masked); the
dK/dV pass skips key blocks wholly past it and zeroes the rows of padded keys before storing.

Attention dropout (``dropout_p`` > 0, a constexpr variant DROPOUT; without it the kernels are the code
above): both passes regenerate the forward's Philox keep mask M per tile (kernels/_triton_utils.dropout_keep,
the counters of kernels/reference.dropout_keep_mask; the dK/dV pass builds the [queries, keys] tile and
transposes it), dP' = M ∘ dP/(1 − p̂) replaces dP (p̂ the drop probability of the 8-bit keep test,
kernels/reference.dropout_scale), dV += (P̃ ∘ M)ᵀ·dO is scaled by 1/(1 − p̂) before its store, and
everything else — D, dS = P ∘ (dP' − D) with the undropped P, r, the GProj direction P̃ — is unchanged:
dS's rows still sum to zero (kernels/reference.py).

Extra memory: D and r (B·H·Nq fp32 each; the one pass: D and dq's fp32 buffer, B·Nq·H·d); with want_stats also abs_dS (B·H·Nq) and the leak
(B·H·Nq·d fp32). Never N×N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_gproj.kernels import attention_bwd_hopper, attention_bwd_onepass, attention_fwd_hopper
from lightning_gproj.kernels._triton_utils import (
    INTERPRET, autotune_enabled, batch_strides, check_seqlens, check_varlen, dropout_args, dropout_groups,
    dropout_keep, exponent_factor, in_window, interpreting, load_pair, load_rows, mma, on_input_device, padded_head_dim, rcp_ftz,
    round_ds, seq_bounds, supports, softcap_f32, softcap_factor, to16, tune_lengths, visible, window_args, window_key_blocks, window_query_blocks,
)
from lightning_gproj.kernels.reference import FIXES, check_ds_format, grad_dtypes, project_key_sum_, sequences

__all__ = ["backward", "supports", "FIXES", "DEFAULT_DK_FOLD"]


#: Default schedule of the P-weighted dK term (False: its own GEMM; True: folded into dS before its
#: rounding). Chosen by the measurements in benchmarks/NOTES.md (fidelity bar of DESIGN.md §6 first).
DEFAULT_DK_FOLD = False

_DK_NONE, _DK_FOLD, _DK_GEMM = 0, 1, 2


def _entry(c) -> tuple[int, int, int, int]:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


def _candidates(by_head_dim: dict, interp_entry: tuple[int, int]) -> list:
    """Every (BLOCK_M, BLOCK_N, num_warps, num_stages) that ``by_head_dim`` names for some head-dim
    class, as triton.Configs (the interpreter: one small config)."""
    if interpreting():
        bm, bn = interp_entry
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=1)]
    entries = dict.fromkeys(e for es in by_head_dim.values() for e in es)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in entries]


def _pruner(by_head_dim: dict):
    """Early-config prune: the candidates of the smallest head-dim class (keys: largest padded head dim)
    that holds HEAD_DIM, in order; GPROJ_TRITON_AUTOTUNE=0 keeps the first."""
    def prune(configs, named_args, **kwargs):
        d = named_args["HEAD_DIM"] if "HEAD_DIM" in named_args else kwargs["HEAD_DIM"]
        keep = next(es for d_max, es in sorted(by_head_dim.items()) if d <= d_max)
        out = [c for e in keep for c in configs if _entry(c) == e] or configs[:1]
        return out if autotune_enabled() else out[:1]
    return prune


# Autotune candidates per head-dim class, (BLOCK_M, BLOCK_N, num_warps, num_stages), best-first for
# fix="gproj". Three each: every candidate is a separate compile of every constexpr variant. d <= 128:
# chosen by the per-config sweeps of benchmarks/config_sweep.py on the H200 (benchmarks/NOTES.md, run 14);
# d = 256: small tiles and 8 warps keep the two fp32 [tile, 256] accumulators in registers (register
# arithmetic; what was checked at d = 256 is in benchmarks/NOTES.md).
# dQ pass: query block BLOCK_M stays resident, key blocks BLOCK_N stream.
_DQ_BY_HEAD_DIM = {
    64: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)],
    128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2)],
    256: [(64, 32, 8, 2)],
}
# dK/dV pass: key block BLOCK_N stays resident, query blocks BLOCK_M stream.
_DKDV_BY_HEAD_DIM = {
    64: [(64, 64, 4, 3), (32, 128, 4, 4), (64, 128, 8, 3)],
    128: [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3)],
    256: [(32, 32, 8, 2)],
}


@triton.jit
def _dq_inner(
    dq, pk, r, a, ps, q, do, m, l2, Di, K, V, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dk, offs_dv,
    lo, hi, c, N_K, CAUSAL_OFF, WL, WR, sc, cap, drop_rows, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr, NEED_R: tl.constexpr, NEED_PK: tl.constexpr, STATS: tl.constexpr,
    DS_BITS: tl.constexpr, INTERP: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    UNIFORM: tl.constexpr, DROPOUT: tl.constexpr, ROWSUM_N: tl.constexpr,
):
    BLOCK_M: tl.constexpr = q.shape[0]
    # r and Σ_j P̃_ij are [BLOCK_M, ROWSUM_N] tiles whose column 0 holds the sum (the others stay 0): without
    # softcap they are summed on the tensor cores, as the 16-bit tile times e0 = (1, 0, …, 0) per key,
    # which takes the per-score convert-and-add off the ALUs (benchmarks/NOTES.md, run 16); softcap's r
    # divides each score by g first, so it sums on the ALUs into a one-column tile.
    col0 = tl.arange(0, ROWSUM_N)[None, :] == 0
    e0 = to16(tl.where(col0, 1.0, tl.zeros([BLOCK_N, ROWSUM_N], tl.float32)), K.dtype.element_ty, INTERP)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k, v = load_pair(K, V, cols, stride_kn, stride_vn, offs_d, offs_dk, offs_dv, N_K, HEAD_DIM, MASKED, EVEN_D)
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERP)
        if SOFTCAP:
            s, g = softcap_f32(s, sc, cap, INTERP)  # the forward's capped logits, bit for bit; g = 1 − tanh²
        # The forward's exponent: (s − m) exact 0 at the row max, then scale, then normalize.
        p = tl.math.exp2((s - m[:, None]) * c - l2[:, None])
        if MASKED:
            valid = visible(offs_m, cols, N_K, CAUSAL_OFF, CAUSAL)
            if WINDOW:
                valid = valid & in_window(offs_m, cols, CAUSAL_OFF, WL, WR)
            p = tl.where(valid, p, 0.0)
        dp = mma(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERP)
        if DROPOUT:
            # dP' = M ∘ dP / (1 − p̂); dS = P ∘ (dP' − D) with the undropped P still sums to zero per row.
            keep = dropout_keep(drop_rows, start_n, bh, seed_lo, seed_hi, drop_off, drop_thr, BLOCK_N)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - Di[:, None])
        if SOFTCAP:
            # The operand is X = dZ∘g, g = 1 − t² (kernels/reference.py); its invariant is Σ_j X_ij/g_ij = 0.
            ds16 = round_ds(ds * g, k.dtype, DS_BITS, INTERP)
            live = g >= 1.1754943508222875e-38  # 1/g finite (fp32 tiny)
            inv_g = tl.where(live, rcp_ftz(g, INTERP), 0.0)
            # r takes X̃ / g only where X̃ is a normal number of the operand dtype (fp16 2⁻¹⁴; bf16: fp32's), else the
            # unrounded dZ (kernels/reference.py: fp16's subnormal X̃ where tanh saturates, divided by a tiny g).
            TINY16: tl.constexpr = 6.103515625e-05 if k.dtype == tl.float16 else 1.1754943508222875e-38
            x16 = ds16.to(tl.float32)
            dz = tl.where(live & (tl.abs(x16) >= TINY16), x16 * inv_g, ds)
        else:
            # Rounding point (DESIGN.md §3): dS becomes a 16-bit GEMM operand; r must come from these values.
            ds16 = round_ds(ds, k.dtype, DS_BITS, INTERP)
            dz = ds16.to(tl.float32)
        dq = mma(ds16, k, dq, INTERP)
        if NEED_R:
            if SOFTCAP:
                r += tl.where(col0, tl.sum(dz, 1)[:, None], 0.0)
            else:
                r = mma(ds16, e0, r, INTERP)
        if STATS:
            a += tl.sum(tl.abs(dz), 1)
        if NEED_PK:
            p16 = to16(p, k.dtype, INTERP)
            if UNIFORM:  # the uniform projection's direction: 1 on the keys the row sees
                p16 = tl.full([BLOCK_M, BLOCK_N], 1.0, k.dtype)
                if MASKED:
                    p16 = tl.where(valid, p16, 0.0).to(k.dtype)
            if SOFTCAP:
                pw = to16(p16.to(tl.float32) * g, k.dtype, INTERP)
                p16 = tl.where(pw >= TINY16, pw, 0.0).to(k.dtype)  # entries below the normal range: out of it, as X̃
                ps += tl.where(col0, tl.sum(p16.to(tl.float32) * inv_g, 1)[:, None], 0.0)
            else:
                # Σ_j P̃_ij of the rounded P: ρ_i = r_i / Σ_j P̃_ij makes Σ_j (dS̃_ij − ρ_i P̃_ij) = 0.
                ps = mma(p16, e0, ps, INTERP)
            pk = mma(p16, k, pk, INTERP)
    return dq, pk, r, a, ps


@triton.autotune(configs=_candidates(_DQ_BY_HEAD_DIM, (16, 16)),
                 key=["TUNE_NQ", "TUNE_NK", "HEAD_DIM", "CAUSAL", "GROUP", "GPROJ", "NEED_R", "STATS", "HAS_SEQLENS",
                      "DS_BITS", "WINDOW", "SOFTCAP", "UNIFORM", "IS_VARLEN", "DROPOUT", "STORE_QR"],
                 prune_configs_by={"early_config_prune": _pruner(_DQ_BY_HEAD_DIM)})
@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "drop_off", "drop_thr", "TUNE_NQ", "TUNE_NK"])
def _dq_kernel(
    Q, K, V, DO, O, M, LOG2L, DELTA, DQ, R, QR, ABS, LEAK, SEQLENS, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_don, stride_doh, stride_dod,
    stride_ob, stride_on, stride_oh, stride_od,
    stride_dqb, stride_dqn, stride_dqh, stride_dqd,
    stride_qrb, stride_qrn, stride_qrh, stride_qrd,
    c, tau, H, N_Q, N_K, WL, WR, sc, cap, seed_lo, seed_hi, drop_off, drop_thr, drop_scale, TUNE_NQ, TUNE_NK,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    GPROJ: tl.constexpr, NEED_R: tl.constexpr, STATS: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    DS_BITS: tl.constexpr, IS_VARLEN: tl.constexpr, INTERP: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, UNIFORM: tl.constexpr, DROPOUT: tl.constexpr, STORE_QR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    NEED_PK: tl.constexpr = GPROJ or STATS
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # Dropout counters, as in attention_fwd._fwd_kernel.
    drop_rows = offs_m.to(tl.int64) * dropout_groups(N_K)
    bh = pid_bh
    if IS_VARLEN:
        # Packed sequences, as in attention_fwd._fwd_kernel: batch strides are 0, N_Q and N_K arrive as
        # total_q, total_k (row statistics are (H, total_q)) and become this sequence's lengths.
        q_start, k_start, n_q, n_k = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, b)
        row0 = h.to(tl.int64) * N_Q + q_start
        drop_rows = (q_start + offs_m).to(tl.int64) * dropout_groups(N_K)
        bh = h
        N_Q = n_q
        N_K = n_k
        if start_m >= N_Q:
            return
        Q += q_start.to(tl.int64) * stride_qn
        DO += q_start.to(tl.int64) * stride_don
        O += q_start.to(tl.int64) * stride_on
        DQ += q_start.to(tl.int64) * stride_dqn
        QR += q_start.to(tl.int64) * stride_qrn
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
    else:
        row0 = pid_bh.to(tl.int64) * N_Q
    CAUSAL_OFF = N_K - N_Q  # the causal alignment always uses the full seqlen_k
    b64 = b.to(tl.int64)
    # Keys [0, K_LEN) are valid in this batch row (right padding); K_LEN = N_K without seqlens_k.
    if HAS_SEQLENS:
        K_LEN = tl.load(SEQLENS + b).to(tl.int32)
    else:
        K_LEN = N_K

    row_mask = offs_m < N_Q
    tile_mask = row_mask[:, None]
    if not EVEN_D:
        tile_mask = tile_mask & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b64 * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=tile_mask, other=0.0)
    do = tl.load(DO + b64 * stride_dob + h * stride_doh + offs_m[:, None] * stride_don
                 + offs_d[None, :] * stride_dod, mask=tile_mask, other=0.0)
    rows = row0 + offs_m
    m = tl.load(M + rows, mask=row_mask, other=0.0)
    # Rows past N_Q get log2l = +inf, hence P = 0 (their gradients are never stored).
    l2 = tl.load(LOG2L + rows, mask=row_mask, other=float("inf"))
    # D_i = Σ_d do_id·o_id in fp32 from the stored 16-bit o and do (products of 16-bit values are exact
    # in fp32), reduced before the key loop so that the o tile is dead there. Stored for the dK/dV pass;
    # this launch never reads DELTA, so a repeated launch (autotuning) rewrites the same values.
    o = tl.load(O + b64 * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
                mask=tile_mask, other=0.0)
    Di = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + rows, Di, mask=row_mask)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pk = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # 16: the narrowest tile the tensor-core dot takes; softcap sums on the ALUs, into its one column.
    ROWSUM_N: tl.constexpr = 1 if SOFTCAP else 16
    r = tl.zeros([BLOCK_M, ROWSUM_N], tl.float32)
    a = tl.zeros([BLOCK_M], tl.float32)
    ps = tl.zeros([BLOCK_M, ROWSUM_N], tl.float32)

    Kb = K + b64 * stride_kb + hk * stride_kh
    Vb = V + b64 * stride_vb + hk * stride_vh
    offs_dk = offs_d * stride_kd
    offs_dv = offs_d * stride_vd
    # Key blocks past K_LEN are skipped; the one straddling K_LEN runs masked. A window visits only the
    # key blocks its rows see (kernels/_triton_utils.window_key_blocks), masking the edge ranges.
    lo_full = 0
    if WINDOW:
        lo, lo_full, hi_full, hi = window_key_blocks(start_m, K_LEN, CAUSAL_OFF, WL, WR, BLOCK_M, BLOCK_N)
        dq, pk, r, a, ps = _dq_inner(
            dq, pk, r, a, ps, q, do, m, l2, Di, Kb, Vb, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dk, offs_dv,
            lo, lo_full, c, K_LEN, CAUSAL_OFF, WL, WR, sc, cap, drop_rows, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale,
            BLOCK_N, True, CAUSAL, HEAD_DIM, EVEN_D, NEED_R, NEED_PK, STATS, DS_BITS, INTERP, WINDOW, SOFTCAP, UNIFORM,
            DROPOUT, ROWSUM_N,
        )
    elif CAUSAL:
        hi = tl.minimum(K_LEN, tl.maximum(start_m + BLOCK_M + CAUSAL_OFF, 0))
        full = tl.maximum(start_m + CAUSAL_OFF + 1, 0)
        hi_full = tl.minimum(tl.minimum((full // BLOCK_N) * BLOCK_N, (K_LEN // BLOCK_N) * BLOCK_N), hi)
    else:
        hi = K_LEN
        hi_full = (K_LEN // BLOCK_N) * BLOCK_N
    dq, pk, r, a, ps = _dq_inner(
        dq, pk, r, a, ps, q, do, m, l2, Di, Kb, Vb, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dk, offs_dv,
        lo_full, hi_full, c, K_LEN, CAUSAL_OFF, WL, WR, sc, cap, drop_rows, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale,
        BLOCK_N, False, CAUSAL, HEAD_DIM, EVEN_D, NEED_R, NEED_PK, STATS, DS_BITS, INTERP, WINDOW, SOFTCAP, UNIFORM,
        DROPOUT, ROWSUM_N,
    )
    dq, pk, r, a, ps = _dq_inner(
        dq, pk, r, a, ps, q, do, m, l2, Di, Kb, Vb, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dk, offs_dv,
        hi_full, hi, c, K_LEN, CAUSAL_OFF, WL, WR, sc, cap, drop_rows, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale,
        BLOCK_N, True, CAUSAL, HEAD_DIM, EVEN_D, NEED_R, NEED_PK, STATS, DS_BITS, INTERP, WINDOW, SOFTCAP, UNIFORM,
        DROPOUT, ROWSUM_N,
    )
    r = tl.sum(r, 1)  # column 0: adding the zero columns is exact
    if NEED_PK:
        # ρ_i = r_i / Σ_j P̃_ij (kernels/reference.py); rows with no visible key have r = 0 and get ρ = 0.
        ps_row = tl.sum(ps, 1)
        rho = tl.where(ps_row > 0, r / tl.maximum(ps_row, 1.1754943508222875e-38), 0.0)  # 0: no direction
    if GPROJ:
        # P-weighted projection (DESIGN.md §4): dQ_i = τ (Σ_j dS̃_ij k_j − ρ_i (P̃K)_i), all fp32.
        dq = dq - rho[:, None] * pk
    dq = dq * tau
    tl.store(DQ + b64 * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :] * stride_dqd,
             to16(dq, DQ.dtype.element_ty, INTERP), mask=tile_mask)
    if NEED_R:
        tl.store(R + rows, r, mask=row_mask)
    if STORE_QR:
        # −ρ∘Q rounded to the input dtype: the B operand of the dK/dV pass's dK term, P̃ᵀ(−ρ∘Q).
        tl.store(QR + b64 * stride_qrb + h * stride_qrh + offs_m[:, None] * stride_qrn + offs_d[None, :] * stride_qrd,
                 to16(q.to(tl.float32) * (-rho)[:, None], QR.dtype.element_ty, INTERP), mask=tile_mask)
    if STATS:
        tl.store(ABS + rows, a, mask=row_mask)
        leak = (tau * rho)[:, None] * pk
        tl.store(LEAK + rows[:, None] * HEAD_DIM + offs_d[None, :], leak, mask=tile_mask)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, Qh, DOh, Mh, L2h, DELh, Rh, QRh, stride_qn, stride_don, stride_qrn, offs_m, cols, offs_d, offs_dq,
    offs_ddo, offs_dqr,
    lo, hi, c, N_Q, CAUSAL_OFF, WL, WR, sc, cap, start_n, drow0, DG, bh, seed_lo, seed_hi, drop_off, drop_thr,
    drop_scale,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr, DK_MODE: tl.constexpr, DS_BITS: tl.constexpr, INTERP: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, UNIFORM: tl.constexpr, DROPOUT: tl.constexpr,
):
    BLOCK_N: tl.constexpr = k.shape[0]
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q, do = load_pair(Qh, DOh, rows, stride_qn, stride_don, offs_d, offs_dq, offs_ddo, N_Q, HEAD_DIM, MASKED, EVEN_D)
        if MASKED:
            rmask = rows < N_Q
            m = tl.load(Mh + rows, mask=rmask, other=0.0)
            l2 = tl.load(L2h + rows, mask=rmask, other=float("inf"))  # P = 0 on rows past N_Q
            Di = tl.load(DELh + rows, mask=rmask, other=0.0)
            if DK_MODE == 1:
                r = tl.load(Rh + rows, mask=rmask, other=0.0)
        else:
            m = tl.load(Mh + rows)
            l2 = tl.load(L2h + rows)
            Di = tl.load(DELh + rows)
            if DK_MODE == 1:
                r = tl.load(Rh + rows)
        sT = mma(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), INTERP)
        if SOFTCAP:
            sT, gT = softcap_f32(sT, sc, cap, INTERP)
        pT = tl.math.exp2((sT - m[None, :]) * c - l2[None, :])
        if MASKED:
            if CAUSAL:
                pT = tl.where(cols[:, None] <= rows[None, :] + CAUSAL_OFF, pT, 0.0)
            if WINDOW:
                winT = tl.trans(in_window(rows, cols, CAUSAL_OFF, WL, WR))
                pT = tl.where(winT, pT, 0.0)
        p16 = to16(pT, k.dtype, INTERP)  # rounding point: P̃, the operand of P̃ᵀ·dO (and of the dK term)
        # dV before dPᵀ, the order of the kernels before dropout was added: with dPᵀ first the backward
        # without dropout ran slower; with this order it is as fast as before (benchmarks/NOTES.md, runs 13-14).
        # Softcap keeps dPᵀ first: with dV first its tanh derivative stays live across both GEMMs, and the
        # compiled kernel spills about twice as much (benchmarks/NOTES.md, run 17).
        if SOFTCAP:
            dpT = mma(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), INTERP)
        if DROPOUT:
            # The forward's mask, transposed: dV += (P̃ ∘ M)ᵀ dO (scaled by 1/(1 − p̂) at the store),
            # dP' = M ∘ dP / (1 − p̂); the dK term's direction stays the undropped P̃.
            keepT = tl.trans(dropout_keep((drow0 + rows).to(tl.int64) * DG, start_n, bh, seed_lo, seed_hi, drop_off,
                                          drop_thr, BLOCK_N))
            dv = mma(tl.where(keepT, p16, 0.0).to(k.dtype), do, dv, INTERP)
        else:
            dv = mma(p16, do, dv, INTERP)
        if not SOFTCAP:
            dpT = mma(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), INTERP)
        if DROPOUT:
            dpT = tl.where(keepT, dpT * drop_scale, 0.0)
        if DK_MODE == 1:
            # Fold: dS' = P∘(dP − (D + r)) rounded once; its row sums vanish up to that rounding.
            Di = Di + r
        dsT = pT * (dpT - Di[None, :])
        if SOFTCAP:
            dsT = dsT * gT  # the operand X = dZ∘g (kernels/reference.py)
        dk = mma(round_ds(dsT, k.dtype, DS_BITS, INTERP), q, dk, INTERP)
        if DK_MODE == 2:
            # Own GEMM: P̃ᵀ(−ρ∘Q), its B operand −ρ∘Q rounded once per query row by the dQ pass (QR), so
            # that the loop adds no per-score work for it (benchmarks/NOTES.md, run 16). UNIFORM: 1 on
            # visible keys instead of P̃; SOFTCAP: the direction is bf16(P̃∘g), as in the dQ pass.
            w16 = p16
            if UNIFORM:
                w = tl.full([BLOCK_N, BLOCK_M], 1.0, tl.float32)
                if MASKED:
                    if CAUSAL:
                        w = tl.where(cols[:, None] <= rows[None, :] + CAUSAL_OFF, w, 0.0)
                    if WINDOW:
                        w = tl.where(winT, w, 0.0)
                w16 = w.to(k.dtype)  # exact: 0 and 1
            if SOFTCAP:
                w16 = to16(w16.to(tl.float32) * gT, k.dtype, INTERP)
            qr = load_rows(QRh, rows, stride_qrn, offs_d, offs_dqr, N_Q, HEAD_DIM, MASKED, EVEN_D)
            dk = mma(w16, qr, dk, INTERP)
    return dk, dv


@triton.autotune(configs=_candidates(_DKDV_BY_HEAD_DIM, (16, 16)),
                 key=["TUNE_NQ", "TUNE_NK", "HEAD_DIM", "CAUSAL", "GROUP", "DK_MODE", "HAS_SEQLENS", "DS_BITS",
                      "WINDOW", "SOFTCAP", "UNIFORM", "IS_VARLEN", "DROPOUT"],
                 prune_configs_by={"early_config_prune": _pruner(_DKDV_BY_HEAD_DIM)})
@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "drop_off", "drop_thr", "TUNE_NQ", "TUNE_NK"])
def _dkdv_kernel(
    Q, K, V, DO, M, LOG2L, DELTA, R, QR, DK, DV, KS, SEQLENS, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_don, stride_doh, stride_dod,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    stride_qrb, stride_qrn, stride_qrh, stride_qrd,
    stride_ks, c, tau, H, HK, N_Q, N_K, WL, WR, sc, cap, seed_lo, seed_hi, drop_off, drop_thr, drop_scale, TUNE_NQ,
    TUNE_NK,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DK_MODE: tl.constexpr, HAS_SEQLENS: tl.constexpr, DS_BITS: tl.constexpr, IS_VARLEN: tl.constexpr,
    INTERP: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, UNIFORM: tl.constexpr,
    DROPOUT: tl.constexpr, KEY_SUMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HK
    hk = pid_bh % HK
    b64 = b.to(tl.int64)
    start_n = pid_n * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    # KEY_SUMS: slot pid_n of KS (per batch row · kv head) gets Σ over this block's keys of the dk it
    # stores (fp32), so that the C2 projection of an fp32 dk needs no pass over dk to sum it. Every
    # program writes its slot (zeros where it has no keys), so slots left by another config's launch
    # (autotuning) never count.
    KS += pid_bh.to(tl.int64) * stride_ks + pid_n * HEAD_DIM
    # Dropout counters, as in attention_fwd._fwd_kernel: query row drow0 + i has group counters
    # (drow0 + i)·DG + g, DG = ⌈N_K / 16⌉ (packed: of total_k, rows packed, keys within the sequence).
    DG = dropout_groups(N_K)
    drow0 = 0
    if IS_VARLEN:
        # Packed sequences, as in _dq_kernel; key blocks past the sequence's keys exit at once.
        q_start, k_start, n_q, n_k = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, b)
        drow0 = q_start
        ROWS = N_Q
        N_Q = n_q
        N_K = n_k
        if start_n >= N_K:
            if KEY_SUMS:
                tl.store(KS + offs_d, tl.zeros([BLOCK_D], tl.float32), mask=offs_d < HEAD_DIM)
            return
        Q += q_start.to(tl.int64) * stride_qn
        DO += q_start.to(tl.int64) * stride_don
        QR += q_start.to(tl.int64) * stride_qrn
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
        DK += k_start.to(tl.int64) * stride_dkn
        DV += k_start.to(tl.int64) * stride_dvn
    CAUSAL_OFF = N_K - N_Q

    kv_mask = cols[:, None] < N_K
    if not EVEN_D:
        kv_mask = kv_mask & (offs_d[None, :] < HEAD_DIM)
    # Key padding: column j of this block only feeds dK_j and dV_j (P comes from the stored m, log2l;
    # D and r from the dQ pass), so masked keys (j >= K_LEN) need no score mask here: their rows of
    # dk and dv are zeroed before the store, their k/v are not loaded, and a block wholly past K_LEN
    # skips the query loops (q_end = 0).
    if HAS_SEQLENS:
        K_LEN = tl.load(SEQLENS + b).to(tl.int32)
        key_ok = cols < K_LEN
        load_mask = kv_mask & key_ok[:, None]
        q_end = tl.where(start_n < K_LEN, N_Q, 0)
    else:
        load_mask = kv_mask
        q_end = N_Q
    k = tl.load(K + b64 * stride_kb + hk * stride_kh + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=load_mask, other=0.0)
    v = tl.load(V + b64 * stride_vb + hk * stride_vh + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=load_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # Query blocks: [lo, lo_full) cross the causal diagonal (masked), [lo_full, nq_full) see the whole
    # key block (unmasked), [max(lo_full, nq_full), N_Q) is the ragged tail (masked).
    # A window: only the query blocks [lo, q_hi) whose windows touch this key block, unmasked on
    # [lo_full, nq_full) (kernels/_triton_utils.window_query_blocks).
    nq_full = (N_Q // BLOCK_M) * BLOCK_M
    if WINDOW:
        lo, lo_full, nq_full, q_hi = window_query_blocks(start_n, N_Q, CAUSAL_OFF, WL, WR, BLOCK_M, BLOCK_N)
        q_end = tl.minimum(q_end, q_hi)
    elif CAUSAL:
        first = tl.maximum(start_n - CAUSAL_OFF, 0)
        lo = (first // BLOCK_M) * BLOCK_M
        last = tl.maximum(start_n + BLOCK_N - 1 - CAUSAL_OFF, 0)
        lo_full = tl.maximum(((last + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, lo)
    else:
        lo = 0
        lo_full = 0
    offs_dq = offs_d * stride_qd
    offs_ddo = offs_d * stride_dod
    offs_dqr = offs_d * stride_qrd
    for g in range(GROUP):
        h = hk * GROUP + g
        Qh = Q + b64 * stride_qb + h * stride_qh
        DOh = DO + b64 * stride_dob + h * stride_doh
        QRh = QR + b64 * stride_qrb + h * stride_qrh
        if IS_VARLEN:
            row0 = h.to(tl.int64) * ROWS + q_start
            bh = h
        else:
            row0 = (b64 * H + h) * N_Q
            bh = b64 * H + h
        dk, dv = _dkdv_inner(
            dk, dv, k, v, Qh, DOh, M + row0, LOG2L + row0, DELTA + row0, R + row0, QRh, stride_qn, stride_don,
            stride_qrn, offs_m, cols, offs_d, offs_dq, offs_ddo, offs_dqr, lo, tl.minimum(lo_full, q_end), c, N_Q, CAUSAL_OFF, WL, WR, sc, cap,
            start_n, drow0, DG, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale,
            BLOCK_M, True, CAUSAL, HEAD_DIM, EVEN_D, DK_MODE, DS_BITS, INTERP, WINDOW, SOFTCAP, UNIFORM, DROPOUT,
        )
        dk, dv = _dkdv_inner(
            dk, dv, k, v, Qh, DOh, M + row0, LOG2L + row0, DELTA + row0, R + row0, QRh, stride_qn, stride_don,
            stride_qrn, offs_m, cols, offs_d, offs_dq, offs_ddo, offs_dqr, lo_full, tl.minimum(nq_full, q_end), c, N_Q, CAUSAL_OFF, WL, WR, sc, cap,
            start_n, drow0, DG, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale,
            BLOCK_M, False, CAUSAL, HEAD_DIM, EVEN_D, DK_MODE, DS_BITS, INTERP, WINDOW, SOFTCAP, UNIFORM, DROPOUT,
        )
        dk, dv = _dkdv_inner(
            dk, dv, k, v, Qh, DOh, M + row0, LOG2L + row0, DELTA + row0, R + row0, QRh, stride_qn, stride_don,
            stride_qrn, offs_m, cols, offs_d, offs_dq, offs_ddo, offs_dqr, tl.maximum(lo_full, nq_full), q_end, c, N_Q, CAUSAL_OFF, WL, WR, sc, cap,
            start_n, drow0, DG, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale,
            BLOCK_M, True, CAUSAL, HEAD_DIM, EVEN_D, DK_MODE, DS_BITS, INTERP, WINDOW, SOFTCAP, UNIFORM, DROPOUT,
        )
    dk = dk * tau
    if DROPOUT:
        dv = dv * drop_scale
    if HAS_SEQLENS:
        dk = tl.where(key_ok[:, None], dk, 0.0)
        dv = tl.where(key_ok[:, None], dv, 0.0)
    tl.store(DK + b64 * stride_dkb + hk * stride_dkh + cols[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             to16(dk, DK.dtype.element_ty, INTERP), mask=kv_mask)
    if KEY_SUMS:  # dk is fp32 here: the sum is over the values just stored
        tl.store(KS + offs_d, tl.sum(tl.where(cols[:, None] < N_K, dk, 0.0), axis=0), mask=offs_d < HEAD_DIM)
    tl.store(DV + b64 * stride_dvb + hk * stride_dvh + cols[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             to16(dv, DV.dtype.element_ty, INTERP), mask=kv_mask)


#: The smallest key block of any dK/dV config: the number of key-sum slots is counted in it.
_MIN_BLOCK_N = min(cfg.kwargs["BLOCK_N"] for cfg in _dkdv_kernel.configs)


def _cumsum_seq(x):
    """Cumulative sum over dim 1 of a (B, N, H, d) tensor, scanned along the innermost dimension.

    PyTorch's CUDA scan over an outer dimension runs one sequential loop per inner element (B·H·d of
    them, each N steps long); the innermost-dimension scan is parallel within each row, which matters
    for the causal gproj_uniform backward (measurements: benchmarks/NOTES.md).
    """
    return x.permute(0, 2, 3, 1).contiguous().cumsum(dim=-1).permute(0, 3, 1, 2)


def _apply_uniform_corrections(dq, dk, q, k, r, tau, causal, seqlens_k=None):
    """Orthogonal-projection corrections (DESIGN.md §4 "uniform"), in place on fp32 dq, dk; O(N·d).

    dq_i −= τ r_i k̄_i with k̄_i the mean of the keys row i sees; dk_j −= τ Σ_{i sees j} (r_i/n_i) q_i,
    summed over the query heads of each kv head. Row i of batch row b sees the key prefix j < n_bi,
    n_bi = min(i + Nk − Nq + 1, L_b) (causal, clamped at 0) or L_b, with L_b = seqlens_k[b] (Nk when
    ``seqlens_k`` is None): k̄_bi is a gathered prefix mean, and the dk correction of a valid key j a
    suffix sum over rows i >= j − (Nk − Nq) (all rows when not causal); masked keys get none.

    dq: (B, Nq, H, d) fp32; dk: (B, Nk, Hk, d) fp32; q, k: the 16-bit inputs; r: (B, H, Nq) fp32;
    seqlens_k: None or (B,) int.
    """
    b, nq, h, d = q.shape
    nk, hk = k.shape[1], k.shape[2]
    g = h // hk
    dev = q.device
    rt = r.transpose(1, 2).reshape(b, nq, hk, g)  # (B, Nq, Hk, G)
    dq5 = dq.view(b, nq, hk, g, d)
    q5 = q.view(b, nq, hk, g, d) if q.is_contiguous() else q.reshape(b, nq, hk, g, d)
    if seqlens_k is None:
        lens = torch.full((b,), nk, device=dev, dtype=torch.int64)
    else:
        lens = seqlens_k.to(device=dev, dtype=torch.int64)
    off = nk - nq
    if causal:
        n = torch.minimum(torch.arange(nq, device=dev)[None, :] + off + 1, lens[:, None]).clamp(min=0)
    else:
        n = lens[:, None].expand(b, nq)
    n_f = n.to(torch.float32).clamp(min=1.0)[:, :, None, None]  # rows with n = 0 have r = 0
    prefix = _cumsum_seq(k.float())  # (B, Nk, Hk, d)
    idx = (n - 1).clamp(min=0)[:, :, None, None].expand(b, nq, hk, d)
    kbar = torch.gather(prefix, 1, idx) / n_f  # (B, Nq, Hk, d)
    coef = torch.where((n > 0)[:, :, None, None], rt / n_f, torch.zeros_like(rt))
    dq5.sub_(tau * (rt * (n > 0)[:, :, None, None])[..., None] * kbar[:, :, :, None, :])
    w = torch.einsum("bnkg,bnkgd->bnkd", coef, q5.float())  # (B, Nq, Hk, d)
    if causal:
        csum = _cumsum_seq(w)
        suffix = torch.cat([csum[:, -1:] - csum + w, torch.zeros_like(w[:, :1])], dim=1)  # row nq: empty
        first = (torch.arange(nk, device=dev) - off).clamp(min=0, max=nq)
        corr = suffix.index_select(1, first)  # (B, Nk, Hk, d)
    else:
        corr = w.sum(dim=1, keepdim=True)
    key_ok = torch.arange(nk, device=dev)[None, :] < lens[:, None]  # (B, Nk)
    dk.sub_(tau * corr * key_ok[:, :, None, None])


@on_input_device
def backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    m: torch.Tensor,
    log2l: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    fix: str = "gproj",
    want_stats: bool = False,
    dk_fold: bool | None = None,
    grad_dtype: torch.dtype | tuple | None = None,
    seqlens_k: torch.Tensor | None = None,
    ds_format: str = "bf16",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
    deterministic: bool = False,
):
    """Attention backward with FA3-class rounding points and the GProj corrections.

    Args:
        do: (batch, seqlen_q, nheads, headdim), q's dtype, any strides.
        q, k, v, o: as passed to / returned by :func:`lightning_gproj.kernels.attention_fwd.forward`.
        m, log2l: (batch, nheads, seqlen_q) fp32 from the forward (contiguous).
        softmax_scale: τ. causal: bottom-right aligned mask.
        fix: "none" | "gproj" (P-weighted) | "gproj_uniform" (DESIGN.md §4).
        want_stats: also return extras "r", "abs_dS" (batch, nheads, seqlen_q) fp32 and "leak"
            (batch, nheads, seqlen_q, headdim) fp32 = τ ρ_i (P̃K)_i, ρ_i = r_i / Σ_j P̃_ij.
        dk_fold: fix="gproj" only: True folds the dK term into dS before its rounding, False runs it
            as its own GEMM; None takes :data:`DEFAULT_DK_FOLD`.
        grad_dtype: None (the input dtype, as stored by a kernel) or torch.float32 (the fp32
            accumulators, where the conservation laws hold to fp32 rounding; with either projection an
            fp32 dk ends with :func:`~lightning_gproj.kernels.reference.project_key_sum_`, as in the
            reference, its Σ_j dK_j summed by the dK/dV kernel), for all three gradients or as a
            (dq, dk, dv) triple of those.
        seqlens_k: None, or the (batch,) int32/int64 key lengths the forward ran with (right
            padding, values in [1, seqlen_k], not checked). Masked keys get dk = dv = 0 exactly.
        ds_format: "bf16" (dS rounded to the input dtype), "e4m3" or "e5m2" (first to 4 / 3 significant
            bits, no range limit): as in :func:`lightning_gproj.kernels.reference.backward`.
        window_size, softcap: as the forward ran with (kernels/reference.py: with softcap the projection
            acts in the capped domain and an fp32 dk gets no C2 projection; with either, fix="gproj_uniform"
            runs in the kernels with the visible-key mask as its direction instead of the O(N·d) PyTorch
            corrections). Query/key block pairs outside the window are skipped.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: packed sequences, the values the
            forward ran with (:func:`lightning_gproj.kernels.attention_fwd.forward`): do, q, o
            (total_q, nheads, headdim), k, v (total_k, nheads_k, headdim), m, log2l (nheads, total_q).
            Query-block programs run over cdiv(max_seqlen_q, BLOCK_M), key-block programs over
            cdiv(max_seqlen_k, BLOCK_N), per sequence; blocks past a sequence's end exit at once.
            r is per query row, and the fp32 dk projection and
            gproj_uniform's dK correction act per sequence (Σ over each sequence's keys). A window
            and softcap apply within each sequence (bottom-right aligned per sequence).
        dropout_p, dropout_seed, dropout_offset: as the forward ran with: both passes regenerate its
            keep mask M (constexpr DROPOUT), dV = ((P̃ ∘ M)/(1 − p̂))ᵀ dO, dP' = M ∘ dP/(1 − p̂) (p̂: p
            rounded by the 8-bit keep test, kernels/reference.dropout_scale),
            dS = P ∘ (dP' − D) with the undropped P, whose rows still sum to zero
            (kernels/reference.py); r and the GProj direction P̃ are unchanged.
        deterministic: True keeps fix "none" on the two passes, whose gradients are bit-reproducible, instead of the
            one pass (kernels/attention_bwd_onepass.py: dq's fp32 partials are added in any order), as
            ``torch.use_deterministic_algorithms(True)`` does (flash-attn's ``deterministic``).

    Returns:
        (dq, dk, dv, extras): dq like q, dk/dv like k/v (GQA: summed over each kv head's query heads),
        all contiguous; extras is {} unless want_stats (packed: r, abs_dS (nheads, total_q), leak
        (nheads, total_q, headdim)).

    Raises:
        ValueError: unknown ``fix`` or ``ds_format``, an input the
            kernels cannot serve (:func:`supports`), a ``seqlens_k`` that is not a (batch,) integer
            tensor on q's device, or malformed packed-sequence arguments
            (:func:`~lightning_gproj.kernels._triton_utils.check_varlen`).
    """
    if fix not in FIXES:
        raise ValueError(f"fix must be one of {FIXES}, got {fix!r}")
    ds_bits = check_ds_format(ds_format)
    varlen = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, seqlens_k)
    if varlen:  # packed: (1, total, ...) views; the kernels see batch stride 0 and one batch row per sequence
        do, q, k, v, o = (x.unsqueeze(0) for x in (do, q, k, v, o))
        m, log2l = m.unsqueeze(0), log2l.unsqueeze(0)
    reason = supports(q, k, v, batch=varlen[0].numel() - 1 if varlen else None)
    if reason is not None:
        raise ValueError(f"Triton attention backward cannot serve this input: {reason}")
    seqlens_k = check_seqlens(seqlens_k, q)
    if dk_fold is None:
        dk_fold = DEFAULT_DK_FOLD
    b, nq, h, d = q.shape
    dev = q.device
    gdq, gdk, gdv = grad_dtypes(grad_dtype, q.dtype)
    if not {gdq, gdk, gdv} <= {q.dtype, torch.float32}:
        raise ValueError(f"grad_dtype must be None, the input dtype, torch.float32 or a (dq, dk, dv) triple of "
                         f"those, got {grad_dtype}")

    delta = torch.empty((b, h, nq), dtype=torch.float32, device=dev)  # D, written by the dQ pass (or the one pass)
    nk = k.shape[1]
    win = window_args(bool(causal), window_size, float(softcap), nq, nk)
    # Windows and softcap: the uniform projection runs in the kernels (its direction is not constant
    # along a row, or its rows are bands), so no PyTorch corrections afterwards.
    torch_uniform = fix == "gproj_uniform" and not (win["WINDOW"] or win["SOFTCAP"])
    # Uniform corrections are applied in fp32 before the single final rounding.
    out32 = (torch_uniform or gdq == torch.float32, torch_uniform or gdk == torch.float32)
    # The C2 projection of an fp32 dk (below) takes Σ_j dK_j from the dK/dV kernel, unless the PyTorch
    # uniform corrections change dk after it.
    c2 = fix != "none" and gdk == torch.float32 and not win["SOFTCAP"]
    dq, dk, dv, r, abs_ds, leak, key_sums = _two_pass(
        do, q, k, v, o, m.contiguous(), log2l.contiguous(), delta, float(softmax_scale), win["CAUSAL"], fix,
        bool(want_stats), dk_fold, out32, gdv, seqlens_k, ds_bits, varlen, win,
        dict(dropout_args(dropout_p, dropout_seed, dropout_offset), p=dropout_p, seed=dropout_seed, offset=dropout_offset),
        want_key_sums=c2 and not torch_uniform, deterministic=deterministic,
    )
    if torch_uniform:
        if varlen:  # each sequence on its own: its rows see only its keys
            for q0, q1, k0, k1 in sequences(varlen[0], varlen[1]):
                if q1 > q0 and k1 > k0:
                    _apply_uniform_corrections(dq[:, q0:q1], dk[:, k0:k1], q[:, q0:q1], k[:, k0:k1], r[:, :, q0:q1],
                                               float(softmax_scale), bool(causal))
        else:
            _apply_uniform_corrections(dq, dk, q, k, r, float(softmax_scale), bool(causal), seqlens_k)
    if c2:
        # C2 to fp32 rounding, as kernels/reference.py: it holds with a window (over the keys some query
        # sees), not with softcap; packed: per sequence, with each sequence's own alignment.
        left = tuple(window_size)[0]
        if varlen:
            cu_q, cu_k = varlen[0].long(), varlen[1].long()
            starts = (cu_k.diff() - cu_q.diff() - left).clamp(min=0) if left >= 0 else 0
            project_key_sum_(dk[0], key_start=starts, cu_seqlens_k=cu_k, key_sums=key_sums)
        else:
            project_key_sum_(dk, seqlens_k, key_start=max(0, nk - nq - left) if left >= 0 else 0, key_sums=key_sums)
    dq, dk = dq.to(gdq), dk.to(gdk)

    extras = {}
    if want_stats:
        extras = {"r": r, "abs_dS": abs_ds, "leak": leak}
    if varlen:
        dq, dk, dv = dq[0], dk[0], dv[0]
        extras = {name: x[0] for name, x in extras.items()}
    return dq, dk, dv, extras


def _two_pass(do, q, k, v, o, m, log2l, delta, tau, causal, fix, want_stats, dk_fold, out32, gdv, seqlens_k, ds_bits,
              varlen, win, drop, want_key_sums, deterministic):
    """dQ pass then dK/dV pass (module docstring), or for fix "none" on plain dense inputs the one pass
    (kernels/attention_bwd_onepass.py). Returns dq, dk (each fp32 where its flag in the pair
    ``out32`` is set, else the input dtype), dv (``gdv``), r, abs_dS, leak, key_sums (r None unless
    needed; abs_dS, leak None unless want_stats; key_sums, Σ_j dK_j of the fp32 dk as (batch, nheads_k,
    headdim) fp64, per sequence when packed, None unless ``want_key_sums``). ``varlen``: None, or (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k) with the tensors as packed (1, total, ...) views. ``win``:
    the window / softcap arguments of :func:`~lightning_gproj.kernels._triton_utils.window_args`; ``drop``:
    those of :func:`~lightning_gproj.kernels._triton_utils.dropout_args` and the call's own p, seed, offset (which the
    Gluon passes take). ``deterministic``: never the one pass."""
    b, nq, h, d = q.shape
    nk, hk = k.shape[1], k.shape[2]
    dev = q.device
    bd = padded_head_dim(d)
    has_seqlens = seqlens_k is not None
    seqlens_arg = seqlens_k if has_seqlens else m
    uniform = fix == "gproj_uniform" and (win["WINDOW"] or win["SOFTCAP"])
    gproj = fix == "gproj" or uniform  # the in-kernel projection, P̃ or the visible-key mask as direction
    softcap = win["cap"] if win["SOFTCAP"] else 0.0
    c = exponent_factor(tau, softcap)
    sc = softcap_factor(tau, win["cap"])
    wargs = (win["WL"], win["WR"], sc, win["cap"])
    wargs += (drop["seed_lo"], drop["seed_hi"], drop["drop_off"], drop["drop_thr"], drop["drop_scale"], *tune_lengths(nq, nk, varlen))
    wconst = dict(WINDOW=win["WINDOW"], SOFTCAP=win["SOFTCAP"], UNIFORM=uniform, DROPOUT=drop["DROPOUT"])
    # Packed: one batch row per sequence, over the longest one (N_Q, N_K stay total_q, total_k).
    packed = varlen is not None
    nb, grid_q, grid_k = (varlen[0].numel() - 1, varlen[2], varlen[3]) if packed else (b, nq, nk)
    cu_args = varlen[:2] if packed else (m, m)
    need_r = fix != "none" or want_stats
    dq = torch.empty((b, nq, h, d), dtype=torch.float32 if out32[0] else q.dtype, device=dev)
    r = torch.empty((b, h, nq), dtype=torch.float32, device=dev) if need_r else delta
    dk_mode = (_DK_FOLD if dk_fold and not uniform else _DK_GEMM) if gproj else _DK_NONE
    # −ρ∘Q in the input dtype (the dK term's B operand, written by the dQ pass); a dummy when unused.
    qr = torch.empty((b, nq, h, d), dtype=q.dtype, device=dev) if dk_mode == _DK_GEMM else q
    abs_ds = torch.empty((b, h, nq), dtype=torch.float32, device=dev) if want_stats else delta
    leak = torch.empty((b, h, nq, d), dtype=torch.float32, device=dev) if want_stats else delta

    # sm_90: the warp-specialized Gluon passes (kernels/attention_bwd_hopper.py, same rounding points), windows,
    # softcap and packed sequences (one cu_seqlens for queries and keys, no key sums) included: the dQ one for fix
    # "none" and "gproj" without statistics, the dK/dV one for "none", "gproj" with its own-GEMM dK term and the PyTorch
    # gproj_uniform (not the in-kernel uniform one).
    hopper = ds_bits == 0 and not (uniform or (has_seqlens and win["WINDOW"])
                                   or (drop["DROPOUT"] and not attention_fwd_hopper.dropout_enabled()))
    if packed:
        hopper = hopper and attention_bwd_hopper.serves_varlen(q, k, v, do, varlen, key_sums=want_key_sums)
    else:
        hopper = hopper and attention_bwd_hopper.serves(q, k, v, do, key_sums=want_key_sums)
    # Both Gluon passes: the sequences when packed, and one dict for their TMA descriptors (q, do, k, v built once).
    gluon_args = dict(cu_seqlens=varlen[0], max_seqlen=varlen[2]) if packed else {}
    gluon_args["descriptors"] = {}
    # Dropout: the Gluon passes regenerate the forward's keep mask (kernels/attention_fwd_hopper.philox_keep); its
    # arguments go in only with dropout (without it the kernels are compiled without its code).
    drop_kw = (dict(dropout_p=drop["p"], dropout_seed=drop["seed"], dropout_offset=drop["offset"])
               if drop["DROPOUT"] else {})
    window = (win["WL"], win["WR"]) if win["WINDOW"] else None
    do_tma = attention_bwd_hopper.tma_ready(do) if hopper else None
    if do_tma is None:
        hopper = False
    else:
        do = do_tma
    # The Gluon dQ pass (fix "none" or "gproj", no statistics) reads o by TMA as q's dtype: an o of another dtype
    # or shape keeps the tl.dot pass.
    o_tma = (attention_bwd_hopper.tma_ready(o) if hopper and not want_stats and need_r == gproj
             and o.dtype == q.dtype and o.shape == q.shape else None)
    dk_dtype = torch.float32 if out32[1] else k.dtype
    # Fix "none" on dense inputs: dq, dk, dv in one pass (kernels/attention_bwd_onepass.py) where it is faster.
    if (o_tma is not None and fix == "none" and not (packed or has_seqlens or win["WINDOW"] or win["SOFTCAP"]
                                                     or drop["DROPOUT"])
            and attention_bwd_onepass.serves(q, k, v, do, causal, deterministic)):
        dk, dv = attention_bwd_onepass.backward(q, k, v, do, o_tma, m, log2l, delta, dq, c, tau, causal, dk_dtype, gdv,
                                                descriptors=gluon_args["descriptors"])
        return dq, dk, dv, None, None, None, None
    if o_tma is not None:
        attention_bwd_hopper.dq_pass(q, k, v, do, o_tma, m, log2l, delta, dq, c, tau, causal,
                                     r if gproj else None, qr if dk_mode == _DK_GEMM else None, softcap, window,
                                     seqlens_k=seqlens_k, **gluon_args, **drop_kw)
    else:
        _dq_kernel[lambda meta: (triton.cdiv(grid_q, meta["BLOCK_M"]), nb * h)](
            q, k, v, do, o, m, log2l, delta, dq, r, qr, abs_ds, leak, seqlens_arg, *cu_args,
            *batch_strides(q, packed), *batch_strides(k, packed), *batch_strides(v, packed), *batch_strides(do, packed),
            *batch_strides(o, packed), *batch_strides(dq, packed), *batch_strides(qr, packed),
            c, tau, h, nq, nk, *wargs,
            GROUP=h // hk, HEAD_DIM=d, BLOCK_D=bd, CAUSAL=causal,
            GPROJ=gproj, NEED_R=need_r, STATS=want_stats, HAS_SEQLENS=has_seqlens, DS_BITS=ds_bits,
            IS_VARLEN=packed, INTERP=INTERPRET, STORE_QR=dk_mode == _DK_GEMM, **wconst,
        )

    if hopper and dk_mode != _DK_FOLD:
        dk, dv, key_sums = attention_bwd_hopper.dkdv(
            q, k, v, do, m, log2l, delta, qr if dk_mode == _DK_GEMM else None, c, tau, causal, dk_dtype, gdv,
            want_key_sums, softcap, window, seqlens_k=seqlens_k, **gluon_args, **drop_kw)
    else:
        dk = torch.empty((b, nk, hk, d), dtype=dk_dtype, device=dev)
        dv = torch.empty((b, nk, hk, d), dtype=gdv, device=dev)
        # Per-block key sums of dk: one slot per key block of the smallest BLOCK_N any config uses.
        slots = triton.cdiv(grid_k, _MIN_BLOCK_N) if want_key_sums else 1
        ks = torch.empty((nb, hk, slots, d), dtype=torch.float32, device=dev) if want_key_sums else delta
        _dkdv_kernel[lambda meta: (triton.cdiv(grid_k, meta["BLOCK_N"]), nb * hk)](
            q, k, v, do, m, log2l, delta, r, qr, dk, dv, ks, seqlens_arg, *cu_args,
            *batch_strides(q, packed), *batch_strides(k, packed), *batch_strides(v, packed), *batch_strides(do, packed),
            *batch_strides(dk, packed), *batch_strides(dv, packed), *batch_strides(qr, packed),
            slots * d, c, tau, h, hk, nq, nk, *wargs,
            GROUP=h // hk, HEAD_DIM=d, BLOCK_D=bd, CAUSAL=causal, DK_MODE=dk_mode, HAS_SEQLENS=has_seqlens,
            DS_BITS=ds_bits, IS_VARLEN=packed, INTERP=INTERPRET, KEY_SUMS=want_key_sums, **wconst,
        )
        key_sums = None
        if want_key_sums:  # the slots the launch's config wrote, summed in fp64
            used = triton.cdiv(grid_k, _dkdv_kernel.best_config.kwargs["BLOCK_N"])
            key_sums = ks[:, :, :used].sum(dim=2, dtype=torch.float64)
    return (dq, dk, dv, (r if need_r else None), (abs_ds if want_stats else None), (leak if want_stats else None),
            key_sums)
