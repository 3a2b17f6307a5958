"""Triton attention forward, FMA-safe (DESIGN.md §5), implementing the kernel contract of
docs/architecture.md:

    forward(q, k, v, softmax_scale, causal) -> (o, m, log2l)

Online softmax over key blocks. Scores s = q·k are kept *raw* (unscaled) in fp32, the running max m
is a max of those same fp32 numbers, and the exponent is ``exp2((s − m) · (τ·log2e))``: for the row's
maximum the subtraction is exactly 0, so its weight is exactly 1 whatever the compiler does with the
multiply (a product cannot be contracted with the subtraction that precedes it). The pattern of
Triton's fused-attention tutorial, ``s·c − m·c`` (FMA-contractible across the max), is avoided. With
q = k = v = constant every P element is exactly 1 and o is exactly the constant (133120 in bf16 and
1000 included; DESIGN.md §5 and tests/test_triton_kernels.py).

Rounding points (DESIGN.md §3, the same as kernels/reference.py): s fp32; P fp32, rounded to the input
dtype as the A operand of P·V; l = Σ_j of the fp32 P; O = acc / l stored in the input dtype.

Layout (batch, seqlen, nheads, headdim) with arbitrary strides (no copies); k, v may have fewer heads
(GQA/MQA). Causal masks are bottom-right aligned (query i sees key j iff j ≤ i + Nk − Nq). Optional
per-batch key lengths ``seqlens_k`` (right padding) are a constexpr variant (HAS_SEQLENS): without
them the kernel is the same code as before. So are sliding windows (WINDOW: each query block visits
only the key blocks its rows' windows touch, masking the two edge ranges) and logit softcapping
(SOFTCAP: the capped logits z = cap·tanh(τ s/cap) replace s, and m is their row max, so the row's
maximum still gets exactly exp2(0)), and attention dropout (DROPOUT: the P·V operand is P̃ ∘ M with
the Philox keep mask of kernels/reference.dropout_keep_mask, one Philox call per 16 keys of a row, and o
is scaled by 1/(1 − p̂) at the end, p̂ the drop probability of the 8-bit keep test).

On an sm_90 GPU, dense inputs with seqlen_q = seqlen_k >= 128 (causal, windows, softcap, dropout and key padding
without a window included) and packed sequences that share one cu_seqlens between queries and keys (>= 128 tokens in
all), at head dim 64 / 128, go to the warp-specialized Gluon kernel of kernels/attention_fwd_hopper.py (same contract,
same rounding points, the same dropout keep mask); everything else (key padding with a window, seqlen_q !=
seqlen_k; dropout with GPROJ_HOPPER_DROPOUT=0), and every interpreter run, uses the kernel below.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_gproj.kernels import attention_fwd_hopper
from lightning_gproj.kernels._triton_utils import (
    INTERPRET, autotune_enabled, batch_strides, check_seqlens, check_varlen, dropout_args, dropout_groups,
    dropout_keep, exponent_factor, in_window, interpreting, load_pair, mma, on_input_device, padded_head_dim,
    seq_bounds, supports, softcap_f32, softcap_factor, to16, tune_lengths, visible, window_args, window_key_blocks,
)

__all__ = ["forward", "supports"]


def _fwd_configs():
    if interpreting():
        # One small configuration: the interpreter runs every program serially in NumPy.
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    # Two candidates per head-dim class (see _prune_fwd): compile time dominates a short device lease
    # (each config is a separate compile of every constexpr variant), see benchmarks/NOTES.md.
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 8, 2)]]


def _prune_fwd(configs, named_args, **kwargs):
    d = named_args["HEAD_DIM"] if "HEAD_DIM" in named_args else kwargs["HEAD_DIM"]
    if d > 128:
        keep = [(64, 64, 8, 2)]  # d = 256: small tiles keep the accumulators in registers (benchmarks/NOTES.md)
    elif d > 64:
        keep = [(128, 128, 8, 3), (128, 64, 8, 3)]
    else:
        keep = [(128, 64, 4, 3), (128, 128, 8, 3)]
    out = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in keep]
    out = out or configs[:1]
    return out if autotune_enabled() else out[:1]


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, K, V, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dk, offs_dv, lo, hi, c, N_K,
    CAUSAL_OFF, WL, WR, sc, cap, drop_rows, bh, seed_lo, seed_hi, drop_off, drop_thr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr, INTERP: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    """Online-softmax steps over key blocks [lo, hi). MASKED: apply the causal mask, the window and the
    key-tail mask cols < N_K, where N_K is the batch row's valid key count (seqlen_k, or seqlens_k[b]).
    SOFTCAP: the logits are z = cap·tanh(τ s/cap) (softcap_f32, sc = softcap_factor) and c = log2e. DROPOUT: the P·V operand
    is P̃ ∘ M (M = dropout_keep of the rows' group counters drop_rows = i·G); l and m stay the
    undropped P's."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k, v = load_pair(K, V, cols, stride_kn, stride_vn, offs_d, offs_dk, offs_dv, N_K, HEAD_DIM, MASKED, EVEN_D)
        s = mma(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32), INTERP)  # raw fp32, unscaled
        if SOFTCAP:
            # The capped logits are the fp32 numbers both the max and the exponent use (FMA-safe as below).
            s, _ = softcap_f32(s, sc, cap, INTERP)
        if MASKED:
            valid = visible(offs_m, cols, N_K, CAUSAL_OFF, CAUSAL)
            if WINDOW:
                valid = valid & in_window(offs_m, cols, CAUSAL_OFF, WL, WR)
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; use 0 as its shift (its p are all 0 anyway).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        # FMA-safe: (s − m) is exact 0 at the max; the scale multiplies the difference afterwards.
        p = tl.math.exp2((s - m_use[:, None]) * c)
        alpha = tl.math.exp2((m_i - m_use) * c)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        # Rounding point: P becomes a 16-bit GEMM operand (DESIGN.md §3).
        if DROPOUT:
            keep = dropout_keep(drop_rows, start_n, bh, seed_lo, seed_hi, drop_off, drop_thr, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        acc = mma(to16(p, v.dtype, INTERP), v, acc, INTERP)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_fwd_configs(), key=["TUNE_NQ", "TUNE_NK", "HEAD_DIM", "CAUSAL", "GROUP", "HAS_SEQLENS", "WINDOW",
                                             "SOFTCAP", "IS_VARLEN", "DROPOUT"],
                 prune_configs_by={"early_config_prune": _prune_fwd})
@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "drop_off", "drop_thr", "TUNE_NQ", "TUNE_NK"])
def _fwd_kernel(
    Q, K, V, O, M, LOG2L, SEQLENS, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_on, stride_oh, stride_od,
    c, H, N_Q, N_K, WL, WR, sc, cap, seed_lo, seed_hi, drop_off, drop_thr, drop_scale, TUNE_NQ, TUNE_NK,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, IS_VARLEN: tl.constexpr, INTERP: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    # Dropout counters (kernels/reference.dropout_keep_mask): row i's groups of 16 keys start at i·G,
    # G = ⌈N_K / 16⌉; packed, i is the packed row, G that of total_k and bh = h (keys count from the
    # sequence's first, so key tiles start on a group boundary).
    drop_rows = offs_m.to(tl.int64) * dropout_groups(N_K)
    bh = pid_bh
    if IS_VARLEN:
        # Packed sequences: batch row b is rows [cu_q[b], cu_q[b+1]) of q, o and keys [cu_k[b], cu_k[b+1])
        # of k, v (batch strides are 0); N_Q, N_K arrive as total_q, total_k (m, log2l are (H, total_q))
        # and become this sequence's lengths, so every bound and the causal offset below are per sequence.
        q_start, k_start, n_q, n_k = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, b)
        row0 = h.to(tl.int64) * N_Q + q_start
        drop_rows = (q_start + offs_m).to(tl.int64) * dropout_groups(N_K)
        bh = h
        N_Q = n_q
        N_K = n_k
        if start_m >= N_Q:
            return
        Q += q_start.to(tl.int64) * stride_qn
        O += q_start.to(tl.int64) * stride_on
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
    else:
        row0 = pid_bh.to(tl.int64) * N_Q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    CAUSAL_OFF = N_K - N_Q  # the causal alignment always uses the full seqlen_k
    # Keys [0, K_LEN) are valid in this batch row (right padding); K_LEN = N_K without seqlens_k.
    if HAS_SEQLENS:
        K_LEN = tl.load(SEQLENS + b).to(tl.int32)
    else:
        K_LEN = N_K

    Qb = Q + b.to(tl.int64) * stride_qb + h * stride_qh
    Kb = K + b.to(tl.int64) * stride_kb + hk * stride_kh
    Vb = V + b.to(tl.int64) * stride_vb + hk * stride_vh
    # stride_*d is 1 in practice (Triton specializes an argument equal to 1, so this costs nothing).
    offs_dq = offs_d * stride_qd
    q_mask = offs_m[:, None] < N_Q
    if not EVEN_D:
        q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Qb + offs_m[:, None] * stride_qn + offs_dq[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Key range: [0, hi); blocks fully visible to every row of this q block need no mask. Key blocks
    # past K_LEN (padding) are skipped; the one that straddles K_LEN runs masked. A window visits only
    # the key blocks [lo, hi) some row of this block sees: masked edges [lo, lo_full), [hi_full, hi).
    lo_full = 0
    if WINDOW:
        lo, lo_full, hi_full, hi = window_key_blocks(start_m, K_LEN, CAUSAL_OFF, WL, WR, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, Kb, Vb, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_d * stride_kd,
            offs_d * stride_vd, lo, lo_full, c, K_LEN, CAUSAL_OFF, WL, WR, sc, cap,
            drop_rows, bh, seed_lo, seed_hi, drop_off, drop_thr,
            BLOCK_N, True, CAUSAL, HEAD_DIM, EVEN_D, INTERP, WINDOW, SOFTCAP, DROPOUT,
        )
    elif CAUSAL:
        hi = tl.minimum(K_LEN, tl.maximum(start_m + BLOCK_M + CAUSAL_OFF, 0))
        full = tl.maximum(start_m + CAUSAL_OFF + 1, 0)
        hi_full = tl.minimum((full // BLOCK_N) * BLOCK_N, (K_LEN // BLOCK_N) * BLOCK_N)
        hi_full = tl.minimum(hi_full, hi)
    else:
        hi = K_LEN
        hi_full = (K_LEN // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, Kb, Vb, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_d * stride_kd, offs_d * stride_vd, lo_full, hi_full,
        c,
        K_LEN, CAUSAL_OFF, WL, WR, sc, cap, drop_rows, bh, seed_lo, seed_hi, drop_off, drop_thr,
        BLOCK_N, False, CAUSAL, HEAD_DIM, EVEN_D, INTERP, WINDOW, SOFTCAP, DROPOUT,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, Kb, Vb, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_d * stride_kd, offs_d * stride_vd, hi_full, hi,
        c,
        K_LEN, CAUSAL_OFF, WL, WR, sc, cap, drop_rows, bh, seed_lo, seed_hi, drop_off, drop_thr,
        BLOCK_N, True, CAUSAL, HEAD_DIM, EVEN_D, INTERP, WINDOW, SOFTCAP, DROPOUT,
    )

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DROPOUT:
        o = o * drop_scale  # 1/(1 − p̂) on the fp32 output, after the undropped normalizer l
    # Contract (kernels/reference.py): a row with no visible key has m = 0, log2l = +inf, o = 0.
    m_out = tl.where(empty, 0.0, m_i)
    log2l = tl.where(empty, float("inf"), tl.math.log2(tl.where(empty, 1.0, l_i)))
    Ob = O + b.to(tl.int64) * stride_ob + h * stride_oh
    tl.store(Ob + offs_m[:, None] * stride_on + (offs_d * stride_od)[None, :], to16(o, O.dtype.element_ty, INTERP),
             mask=q_mask)
    row = row0 + offs_m
    tl.store(M + row, m_out, mask=offs_m < N_Q)
    tl.store(LOG2L + row, log2l, mask=offs_m < N_Q)


@on_input_device
def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    seqlens_k: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
):
    """FMA-safe attention forward.

    Args:
        q: (batch, seqlen_q, nheads, headdim) bf16/fp16, any strides.
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype; nheads % nheads_k == 0.
        softmax_scale: τ (float), multiplies q·k inside the softmax.
        causal: bottom-right aligned causal mask.
        seqlens_k: None, or an int32/int64 tensor (batch,) on q's device: key j of batch row b is
            masked iff j >= seqlens_k[b] (right padding; combined with ``causal`` by "and"). Values
            must lie in [1, seqlen_k] (not checked here). Key blocks past seqlens_k[b] are skipped.
        window_size: (left, right), flash-attn's sliding window (−1 unbounded; ``causal`` sets right = 0),
            as in kernels/reference.py. Key blocks outside every row's window are skipped.
        softcap: 0 (off) or cap > 0: logits z = cap·tanh(τ s / cap), softmax(z) with no further scale.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: packed sequences (all four or none;
            not with ``seqlens_k``): q (total_q, nheads, headdim), k, v (total_k, nheads_k, headdim),
            cu_seqlens int32 (batch + 1,) on q's device, max_seqlen ints >= every sequence's length
            (values not checked here; :func:`lightning_gproj.ops.gproj_attn_varlen_func` checks them).
            Sequence b is its own batch row (rows cu_seqlens_q[b]..cu_seqlens_q[b+1], keys likewise;
            causal and window bottom-right aligned within it). The grid is (cdiv(max_seqlen_q,
            BLOCK_M), batch·nheads); query blocks past a sequence's end exit at once.
        dropout_p, dropout_seed, dropout_offset: attention dropout (0: off, the kernel without it), the
            mask of :func:`lightning_gproj.kernels.reference.dropout_keep_mask` (packed: over the packed
            query rows and each sequence's own keys): O = (P ∘ M) V / (1 − p̂), p̂ = p rounded to a
            multiple of 2⁻⁸ (kernels/reference.dropout_scale); m and log2l are the undropped P's.

    Returns:
        o: (batch, seqlen_q, nheads, headdim) (packed: (total_q, nheads, headdim)), q's dtype, contiguous.
        m: (batch, nheads, seqlen_q) fp32 (packed: (nheads, total_q)), row max of the raw scores q·k
        (with softcap: of the capped logits z) (0 for a row with no key).
        log2l: same shape as m, log2 Σ_j exp2((s_ij − m_i)·τ·log2e) (+inf for a row with no key).

    Raises:
        ValueError: the input is not served (see :func:`supports` for the reason), ``seqlens_k`` is
            not a (batch,) integer tensor on q's device, or the packed-sequence arguments are
            malformed (:func:`~lightning_gproj.kernels._triton_utils.check_varlen`).
    """
    varlen = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, seqlens_k)
    q4, k4, v4 = (x.unsqueeze(0) for x in (q, k, v)) if varlen else (q, k, v)
    reason = supports(q4, k4, v4, batch=varlen[0].numel() - 1 if varlen else None)
    if reason is not None:
        raise ValueError(f"Triton attention forward cannot serve this input: {reason}")
    seqlens_k = check_seqlens(seqlens_k, q)
    b, nq, h, d = q4.shape
    nk, hk = k4.shape[1], k4.shape[2]
    # nq, nk are total_q, total_k when packed: window_args only needs an "unbounded" wider than any sequence.
    win = window_args(causal, window_size, softcap, nq, nk)
    drop = dropout_args(dropout_p, dropout_seed, dropout_offset)
    if not (seqlens_k is not None and win["WINDOW"]) and (not drop["DROPOUT"] or attention_fwd_hopper.dropout_enabled()):
        window = (win["WL"], win["WR"]) if win["WINDOW"] else None
        # Dropout: the Gluon kernel draws the same keep mask (kernels/attention_fwd_hopper.philox_keep).
        dkw = (dict(dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset)
               if drop["DROPOUT"] else {})
        if varlen is None and attention_fwd_hopper.serves(q, k, v):
            return attention_fwd_hopper.forward(q, k, v, softmax_scale, win["CAUSAL"], softcap, window,
                                                seqlens_k=seqlens_k, **dkw)
        if varlen is not None and attention_fwd_hopper.serves_varlen(q4, k4, v4, varlen):
            o, m, log2l = attention_fwd_hopper.forward(q4, k4, v4, softmax_scale, win["CAUSAL"], softcap, window,
                                                       varlen[0], varlen[2], **dkw)
            return o[0], m[0], log2l[0]
    o = torch.empty((b, nq, h, d), dtype=q.dtype, device=q.device)
    m = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    log2l = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    c = exponent_factor(softmax_scale, softcap)
    sc = softcap_factor(softmax_scale, win["cap"])
    # Packed: one batch row per sequence, over the longest one (N_Q, N_K stay total_q, total_k).
    packed = varlen is not None
    nb, grid_q = (varlen[0].numel() - 1, varlen[2]) if packed else (b, nq)

    def grid(meta):
        return (triton.cdiv(grid_q, meta["BLOCK_M"]), nb * h)

    _fwd_kernel[grid](
        q4, k4, v4, o, m, log2l, seqlens_k if seqlens_k is not None else m,
        *(varlen[:2] if varlen else (m, m)),
        *batch_strides(q4, packed), *batch_strides(k4, packed), *batch_strides(v4, packed), *batch_strides(o, packed),
        c, h, nq, nk, win["WL"], win["WR"], sc, win["cap"],
        drop["seed_lo"], drop["seed_hi"], drop["drop_off"], drop["drop_thr"], drop["drop_scale"],
        *tune_lengths(nq, nk, varlen), GROUP=h // hk, HEAD_DIM=d, BLOCK_D=padded_head_dim(d), CAUSAL=win["CAUSAL"],
        HAS_SEQLENS=seqlens_k is not None, IS_VARLEN=packed, INTERP=INTERPRET, WINDOW=win["WINDOW"],
        SOFTCAP=win["SOFTCAP"], DROPOUT=drop["DROPOUT"],
    )
    if varlen:
        o, m, log2l = o[0], m[0], log2l[0]
    return o, m, log2l
