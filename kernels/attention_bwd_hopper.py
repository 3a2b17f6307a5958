"""Warp-specialized backward passes for Hopper (sm_90), written in Gluon (issue 12, levers 1 and 3).

The two launches of :func:`lightning_gproj.kernels.attention_bwd.backward` for dense inputs, with that module's
rounding points (kernels/reference.py):

* :func:`dq_pass` (fix "none" and "gproj", no statistics): one program per (128 query rows, batch·head); a
  1-warp loader loads the rows' q, dO and o once and streams K/V tiles of 64 keys by TMA through a 2-slot ring;
  two 4-warp consumers own 64 rows each: D = rowsum(dO∘O) (stored for pass 2), then per tile S = Q Kᵀ,
  dP = dO Vᵀ (issued together), P = exp2((S − m)·τ·log2e − log2l) (the forward's FMA-safe exponent),
  dS̃ = P∘(dP − D) rounded, dQ += dS̃ K; gproj also PK += P̃K and r_i = Σ_j dS̃_ij, Σ_j P̃_ij as GEMMs with an
  e0 = (1, 0, …, 0) tile (ROWSUM_N columns, the tl.dot kernel's trick: no per-score ALU work), then
  ρ = r / Σ_j P̃, dQ −= ρ∘PK and −ρ∘Q rounded for pass 2; dq = τ dQ. (Summing r and Σ_j P̃ on the ALUs instead
  spilled as much and ran 0–4% slower than the tl.dot pass: benchmarks/NOTES.md, run 19; with e0, run 20.)
* :func:`dkdv` (fix "none", "gproj" with its dK term as its own GEMM, and the PyTorch "gproj_uniform"): one
  program per (128 keys, batch·kv head); the loader loads its K, V rows once and streams (Q, dO[, −ρ∘Q])
  tiles of 64 query rows over the query heads of the GQA group; two consumers own 64 keys each:
  Sᵀ = K Qᵀ, Pᵀ, dV += P̃ᵀ dO, dPᵀ = V dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D), dK += dS̃ᵀ Q, gproj: dK += P̃ᵀ(−ρ∘Q); dk = τ dK.
  Without GProj's dK term (fix "none", and "gproj_uniform", which runs none's passes) on dense inputs without a
  window, key padding or dropout (:func:`dkdv_schedule`) persistent: one program per SM loops over pairs of key
  blocks (causal: heaviest with lightest) with two K/V buffers; dk, dv bit-identical to a block per program.

All accumulation in fp32, P̃ and dS̃ as register A operands of asynchronous wgmma; only the order of fp32
additions differs from the tl.dot kernels. Causal grids: query blocks heaviest first; only tiles that reach
past the diagonal are masked, and a consumer skips the 64-tile its keys or rows never see (its GEMMs are not
run; the slot is released).

Served (:func:`serves`): the inputs of the Gluon forward (kernels/attention_fwd_hopper.accepts: bf16 / fp16,
(batch, seqlen, nheads, headdim) or (batch, nheads, seqlen, headdim) memory per tensor, seqlen_q = seqlen_k (not a
multiple of 128: the edge variant, as packing's), GQA) at head dim 128 and 64 (at 64 the Gluon dK/dV pass was not faster than the tl.dot one before the row
statistics were staged by the loader warp: benchmarks/NOTES.md, runs 19 and 30), dS rounded to the input dtype, logit softcap (X̃ = bf16(dZ∘g) as the dS operand,
kernels/reference.py), sliding windows (each program visits only the tiles its rows' or keys' windows touch, a
consumer releases a tile none of its rows or keys sees unread, edge tiles masked), packed sequences with one
cu_seqlens for queries and keys (:func:`serves_varlen`; rows past a sequence's end get their statistics masked (P = 0), keys
past it are masked in the dQ pass and not stored by the dK/dV pass; no key sums), right key padding without a window
(``seqlens_k``: the dQ pass reads K/V through TMA descriptors made on the device that end at the batch row's last key
and masks past it; the dK/dV pass masks P there, zeroes the padded keys' dk rows and stores dk = dv = 0 for a block of
padding without running its partitions), attention dropout (both passes regenerate the forward's keep mask M with its
Philox calls, kernels/attention_fwd_hopper.philox_keep / philox_keep_t, and use it as the tl.dot kernels do: dP' = M ∘
dP / (1 − p̂), dV += (P̃ ∘ M)ᵀ dO scaled by 1/(1 − p̂) at the store; D, dS's P and GProj's direction undropped; at head
dim 128 the dK/dV pass and GProj's dQ pass take each score tile in two halves of 32, as with softcap); do and
o in any strides (copied when not in a served order). Gradients in 16-bit or fp32;
with an fp32 dk the per-64-key sums Σ_j dk_j of the stored values, for the C2 projection
(kernels/reference.project_key_sum_). ``GPROJ_HOPPER_BWD=0`` keeps every call on the tl.dot kernels.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from lightning_gproj.kernels.attention_fwd_hopper import (
    DROPOUT_SCALARS, DROPOUT_SIGNATURE, GLUON_ERROR, dropout_kernel_args, _gl_dtype, _layouts, _require_gluon, _tma_view, accepts as _fwd_accepts, feature_args, launch, on_sm90,
    pointer_type, packed_ok, paired_items, persistent, tma_descriptor,
)

if GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    from lightning_gproj.kernels.attention_fwd_hopper import (
        aot_compile_sm90, block_keys, keep_bits, keep_bits_t, keep_layout, keep_layout_t, key_end, keys_descriptor, philox_keep, philox_keep_t, rcp_approx, ring_barriers, ring_load_pair, sequence_span, softcap_and_grad, tensordesc_type, tma_load,
        window_crosses,
        window_mask, window_sees, window_tiles,
    )

__all__ = ["dq_pass", "dkdv", "serves", "serves_varlen", "accepts", "tma_ready", "compile_sm90", "compile_dq_sm90", "BLOCK_N",
           "HEAD_DIMS", "KEYS_PER_SUM"]

#: Keys per dK/dV program (two consumers of 64); rows of every TMA tile; keys per key-sum slot.
BLOCK_N = 128
TILE_ROWS = 64
KEYS_PER_SUM = TILE_ROWS  # one slot per dK/dV consumer
HEAD_DIMS = (128, 64)
#: Columns of the e0 tile whose GEMM with P̃ or dS̃ sums a row (wgmma's N).
ROWSUM_N = 8

if GLUON_ERROR is None:
    # Module constants: the partitions of gl.warp_specialize receive their arguments as IR values.
    _BLOCK_N = gl.constexpr(BLOCK_N)
    _HALF_N = gl.constexpr(TILE_ROWS)
    _BLOCK_M = gl.constexpr(TILE_ROWS)
    _SUB_M = gl.constexpr(TILE_ROWS // 2)  # query rows of a softcap half tile
    # The dropout keep masks' layouts over [keys, queries] (kernels/attention_fwd_hopper.keep_layout_t), 64 and 32 rows.
    _KEEP_T64 = gl.constexpr(keep_layout_t(64))
    _KEEP_T32 = gl.constexpr(keep_layout_t(32))
    _NUM_STAGES = gl.constexpr(2)
    _PAIR = gl.constexpr(2)  # key blocks per item of the persistent dK/dV kernel (dkdv_block)

    @gluon.jit
    def _loader(q_desc, do_desc, qr_desc, k_desc, v_desc, M, LOG2L, DELTA, q_smem, do_smem, qr_smem, k_smem, v_smem,
                m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty, j, i, k_row, k_col, v_row, v_col, q_b, q_rh, q_ch,
                do_b, do_rh, do_ch, qr_b, qr_rh, qr_ch, h0, GROUP, lo, hi, stats0, N_CTX, seqlen, GPROJ: gl.constexpr):
        """The loads of the program's j-th key block (its K/V buffer j % KV_BUFS, KV_BUFS = k_smem.shape[0] // 2, once
        both consumers released that buffer's previous block), then its (Q, dO[, −ρ∘Q]) tiles from ring position i on.
        Returns the ring position after them."""
        # The block's K and V rows, once, as two halves of 64 keys (one per consumer).
        KV_BUFS: gl.constexpr = k_smem.shape[0] // 2
        kb = j % KV_BUFS
        mbarrier.wait(kv_empty.index(kb), ((j // KV_BUFS) & 1) ^ 1)
        mbarrier.expect(kv_bar.index(kb), 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
        for half in gl.static_range(2):
            tma_load(k_desc, [k_row + half * _HALF_N, k_col], kv_bar.index(kb), k_smem.index(2 * kb + half))
            tma_load(v_desc, [v_row + half * _HALF_N, v_col], kv_bar.index(kb), v_smem.index(2 * kb + half))
        tile_rows = gl.arange(0, _BLOCK_M, layout=gl.BlockedLayout([2], [32], [1], [0]))  # over the loader's warp
        for g in range(GROUP):
            h = h0 + g
            for start_m in range(lo, hi, _BLOCK_M):
                s = i % _NUM_STAGES
                mbarrier.wait(empty.index(s), ((i // _NUM_STAGES) & 1) ^ 1)  # both consumers released the slot
                # The rows' m, log2l and D ((batch, nheads, seqlen) fp32; none past the sequence's end: the consumers
                # mask those rows) by cp.async, 4 bytes each: a TMA box has to start on a 16-byte boundary, a row of
                # a seqlen that is not a multiple of 4 or of a packed sequence need not (such boxes faulted, run 29).
                # Tied to the slot's barrier before its expect, so that the phase completes only once they landed.
                rows = start_m + tile_rows
                at = stats0 + g * N_CTX + rows
                inside = rows < seqlen
                cp_async_load(m_smem.index(s), M + at, mask=inside)
                cp_async_load(l_smem.index(s), LOG2L + at, mask=inside)
                cp_async_load(d_smem.index(s), DELTA + at, mask=inside)
                async_copy.mbarrier_arrive(ready.index(s))
                qdo_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
                if GPROJ:
                    mbarrier.expect(ready.index(s), qdo_bytes + qr_desc.block_type.nbytes)
                else:
                    mbarrier.expect(ready.index(s), qdo_bytes)
                tma_load(q_desc, [q_b + h * q_rh + start_m, h * q_ch], ready.index(s), q_smem.index(s))
                tma_load(do_desc, [do_b + h * do_rh + start_m, h * do_ch], ready.index(s), do_smem.index(s))
                if GPROJ:
                    tma_load(qr_desc, [qr_b + h * qr_rh + start_m, h * qr_ch], ready.index(s), qr_smem.index(s))
                i += 1
        return i

    @gluon.jit
    def row_statistics(M, LOG2L, stats, rows, seqlen, EDGES: gl.constexpr):
        """(m, log2l) of query positions ``rows``; with EDGES the rows from seqlen on (the next sequence's, batch row's
        or head's) read none: m = 0 and log2l = +inf, which gives them P = exp2(… − inf) = 0."""
        if EDGES:
            return (gl.load(M + stats + rows, mask=rows < seqlen, other=0.0),
                    gl.load(LOG2L + stats + rows, mask=rows < seqlen, other=float("inf")))
        else:
            return gl.load(M + stats + rows), gl.load(LOG2L + stats + rows)

    @gluon.jit
    def zero_keys(DK, DV, KS, out_row, out_col, out_stride, nkeys, key_sums, HEAD_DIM: gl.constexpr):
        """dk = dv = 0 for a dK/dV program's keys (rows out_row … of dk, dv, the first min(nkeys, BLOCK_N) of them:
        the others are the next batch row's) and, with key_sums, its two key-sum slots 0."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        offs = (out_row + rows).to(gl.int64)[:, None] * out_stride + out_col + cols[None, :]
        inside = (rows < nkeys)[:, None]
        gl.store(DK + offs, gl.zeros([_BLOCK_N, HEAD_DIM], DK.dtype.element_ty, layout), mask=inside)
        gl.store(DV + offs, gl.zeros([_BLOCK_N, HEAD_DIM], DV.dtype.element_ty, layout), mask=inside)
        if key_sums != 0:
            sums_layout: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
            slots = gl.arange(0, 2 * HEAD_DIM, layout=sums_layout)
            gl.store(KS + slots, gl.zeros([2 * HEAD_DIM], gl.float32, sums_layout))

    @gluon.jit
    def scores_t(k, v, q, do, m_s, l_s, rows):
        """The start of a dK/dV tile (64 keys k, v; query rows q, do in shared memory): Sᵀ = K Qᵀ and dPᵀ = V dOᵀ issued
        together, Sᵀ waited for and dPᵀ left in flight, then the rows' m and log2l (m_s, l_s) read in the layout of
        ``rows``. Returns (sT, dpT, m, l2). Shared by :func:`_dkdv_tile` and the one pass
        (kernels/attention_bwd_onepass.py)."""
        ROWS: gl.constexpr = q.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, ROWS, 16])
        zero = gl.zeros([_HALF_N, ROWS], gl.float32, layout=s_layout)
        sT = warpgroup_mma(k, q.permute((1, 0)), zero, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v, do.permute((1, 0)), zero, use_acc=False, is_async=True)
        sT = warpgroup_mma_wait(num_outstanding=1, deps=(sT,))
        # m, log2l read here, not before the GEMMs: live across them they spilled (Triton 3.6). From the tile's
        # shared-memory slot, where the loader put them with Q and dO (from global memory, each tile's loads stalled
        # the consumer and spilled: benchmarks/NOTES.md, run 28).
        m = m_s.load(rows.type.layout)
        l2 = l_s.load(rows.type.layout)
        return sT, dpT, m, l2

    @gluon.jit
    def _dkdv_tile(k, v, q, do, qr, dk, dv, keys, key0, rows, start_m, c, sc, cap, wl, wr, seqlen, kend, m_s, l_s, d_s,
                   drow, DG, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale,
                   GPROJ: gl.constexpr, CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr,
                   EDGES: gl.constexpr, KEYPAD: gl.constexpr, DROPOUT: gl.constexpr):
        """One (Q, dO[, −ρ∘Q]) tile (shared [rows, headdim]; query positions ``rows``, the first start_m; m_s, l_s, d_s:
        their m, log2l and D, shared [rows]) of the dK/dV pass for 64 keys: Sᵀ, dPᵀ, P̃ᵀ, dS̃ᵀ and the asynchronous dV, dK [, GProj's dK term] GEMMs, waited for;
        returns (dk, dv). KEYPAD: keys from ``kend`` on get P = 0 (their dv rows are exactly 0; their dk rows, whose dPᵀ
        read the padded values, are zeroed by the caller). DROPOUT: the forward's keep mask Mᵀ of these keys and rows
        (dropout counter row drow + (row − start_m), kernels/attention_fwd_hopper.philox_keep_t), as the tl.dot dK/dV
        kernel: dV += (P̃ ∘ M)ᵀ dO (scaled by 1/(1 − p̂) at the store), dP' = M ∘ dP / (1 − p̂) (drop_scale); dS and
        GProj's direction keep the undropped P̃."""
        HEAD_DIM: gl.constexpr = k.shape[1]
        ROWS: gl.constexpr = q.shape[0]
        dtype: gl.constexpr = k.dtype
        # The dropout mask's layout for ROWS query rows (64, or 32 in the half tiles): keep_layout_t(ROWS)
        KH: gl.constexpr = ROWS // 32
        if ROWS == 64:
            KEEP_T: gl.constexpr = _KEEP_T64
        else:
            KEEP_T: gl.constexpr = _KEEP_T32
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, ROWS, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        sT, dpT, m, l2 = scores_t(k, v, q, do, m_s, l_s, rows)
        if EDGES:  # rows from seqlen on (the next sequence's, batch row's or head's) read none: P = exp2(… − inf) = 0
            m = gl.where(rows < seqlen, m, 0.0)
            l2 = gl.where(rows < seqlen, l2, float("inf"))
        if SOFTCAP:  # the capped logits z = cap·tanh(τ s/cap), bit for bit the forward's; g = 1 − tanh²
            sT, gT = softcap_and_grad(sT, sc, cap)
        # The forward's exponent: (s − m) is exactly 0 at the row max, then scale, then normalize.
        pT = gl.exp2((sT - m[None, :]) * c - l2[None, :])
        if CAUSAL:
            if start_m < key0 + _HALF_N:  # the tile reaches into these keys: mask keys past the row
                pT = gl.where(keys[:, None] <= rows[None, :], pT, 0.0)
        if WINDOW:  # masked where the tile crosses an edge of some row's window row − wl <= key <= row + wr
            if window_crosses(start_m, ROWS, key0, _HALF_N, wl, wr):
                pT = gl.where(window_mask(rows[None, :], keys[:, None], wl, wr), pT, 0.0)
        if KEYPAD:
            if key0 + _HALF_N > kend:
                pT = gl.where(keys[:, None] < kend, pT, 0.0)
        if DROPOUT:  # the Philox rounds here, after Sᵀ's wait (fewer spills than before the GEMMs are issued: Triton
            # 3.6, d 128, 47 / 60 spill stores full / causal for fix none, 87 / 116 gproj, against 59 / 58 and 87 / 130);
            # the mask's bits taken where they are used
            words = philox_keep_t(drow, DG, key0, bh, seed_lo, seed_hi, drop_off, drop_thr, KH, KEEP_T)
        pr = pT.to(dtype)  # rounding point: P̃
        p16 = gl.convert_layout(pr, a_layout)
        if DROPOUT:  # dV += (P̃ ∘ M)ᵀ dO; the mask in the scores' own placement (keep_layout_t)
            keepT = gl.convert_layout(keep_bits_t(words, KH, KEEP_T), s_layout)
            dv = warpgroup_mma(gl.convert_layout(gl.where(keepT, pr, 0.0).to(dtype), a_layout), do, dv, is_async=True)
        else:
            dv = warpgroup_mma(p16, do, dv, is_async=True)
        if GPROJ:
            # GProj's dK term P̃ᵀ(−ρ∘Q), its B operand rounded once per query row by the dQ pass; with
            # softcap its direction is bf16(P̃∘g), as in the dQ pass.
            if SOFTCAP:
                p16 = gl.convert_layout((pr.to(gl.float32) * gT).to(dtype), a_layout)
            dk = warpgroup_mma(p16, qr, dk, is_async=True)
        if SOFTCAP:
            # The operand X = dZ∘g = (P∘g)∘(dP − D) (kernels/reference.py): P∘g formed before the wait, so
            # that one tile, not P and g, stays live across it.
            pT = pT * gT
        if GPROJ:
            dpT = warpgroup_mma_wait(num_outstanding=2, deps=(dpT,))
        else:
            dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT,))
        di = d_s.load(rows.type.layout)  # read where dS needs it: shorter-lived, fewer spills
        if EDGES:
            di = gl.where(rows < seqlen, di, 0.0)
        if DROPOUT:  # dP' = M ∘ dP / (1 − p̂); dS = P ∘ (dP' − D) with the undropped P. The bits are taken again from
            # a copy of the words that the compiler cannot merge with the first: the mask itself (a register per
            # score) live across the wait spilled
            words = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [words], dtype=gl.uint32, is_pure=False, pack=1)
            keepT = gl.convert_layout(keep_bits_t(words, KH, KEEP_T), s_layout)
            dpT = gl.where(keepT, dpT * drop_scale, 0.0)
        ds16 = gl.convert_layout((pT * (dpT - di[None, :])).to(dtype), a_layout)  # rounding point: dS̃ (X̃)
        dk = warpgroup_mma(ds16, q, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        return dk, dv

    @gluon.jit
    def _consumer(q_smem, do_smem, qr_smem, k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty, j, i,
                  DK, DV, KS, half, GPROJ: gl.constexpr, CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr,
                  EDGES: gl.constexpr, KEYPAD: gl.constexpr, DROPOUT: gl.constexpr, start_n, out_row, out_col, out_stride,
                  GROUP, lo, hi, seqlen, kend, c, tau, key_sums, sc, cap, wl, wr, drow0, DG, bh0, seed_lo, seed_hi,
                  drop_off, drop_thr, drop_scale):
        """The program's j-th key block (K/V buffer j % KV_BUFS, :func:`_loader`), this consumer's 64 keys, its tiles from
        ring position i on; releases the K/V buffer once its GEMMs are done and stores dk, dv. Returns the ring position
        after the block."""
        HEAD_DIM: gl.constexpr = k_smem.shape[2]
        # The score tiles' layout ([keys, queries]): 64 query rows, with softcap 32 (each tile in two halves).
        # Dropout at d 128 too: at full width its mask words next to the dk, dv accumulators spilled 47–116 stores (Triton
        # 3.6), in halves 0–18, and the backward ran 25–27% faster with GProj (benchmarks/NOTES.md, run 35).
        HALVES: gl.constexpr = SOFTCAP or (DROPOUT and HEAD_DIM > 64)
        if HALVES:
            ROWS: gl.constexpr = _SUB_M
        else:
            ROWS: gl.constexpr = _BLOCK_M
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])

        key0 = start_n + half * _HALF_N
        keys = key0 + gl.arange(0, _HALF_N, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([_HALF_N, HEAD_DIM], gl.float32, layout=acc_layout)
        dv = gl.zeros([_HALF_N, HEAD_DIM], gl.float32, layout=acc_layout)
        KV_BUFS: gl.constexpr = k_smem.shape[0] // 2
        kb = j % KV_BUFS
        k = k_smem.index(2 * kb + half)
        v = v_smem.index(2 * kb + half)
        mbarrier.wait(kv_bar.index(kb), (j // KV_BUFS) & 1)
        first_m = lo
        if CAUSAL:
            first_m = key0  # the rows before these keys see none of them
        for g in range(GROUP):
            if CAUSAL:
                if half == 1:  # the group's first tile (rows start_n … key0 − 1): released unread
                    st = i % _NUM_STAGES
                    mbarrier.wait(ready.index(st), (i // _NUM_STAGES) & 1)
                    mbarrier.arrive(empty.index(st), count=1)
                    i += 1
            for start_m in range(first_m, hi, _BLOCK_M):
                st = i % _NUM_STAGES
                rows = start_m + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))  # query positions
                mbarrier.wait(ready.index(st), (i // _NUM_STAGES) & 1)
                q = q_smem.index(st)
                do = do_smem.index(st)
                qr = qr_smem.index(st)
                m_s = m_smem.index(st)
                l_s = l_smem.index(st)
                d_s = d_smem.index(st)
                visit = True
                if WINDOW:  # a tile none of whose rows sees these keys is released unread
                    visit = window_sees(start_m, _BLOCK_M, key0, _HALF_N, wl, wr)
                if KEYPAD:  # (not with WINDOW) keys that are all padding: every tile released unread, dk = dv = 0
                    visit = key0 < kend
                if visit:
                    drow = drow0 + start_m  # the tile's first query row in the dropout counters (packed: packed row)
                    bh = bh0 + g  # query head h0 + g's c1
                    if HALVES:  # two halves of 32 rows: the tanh's tiles or the dropout mask fit the registers only so
                        for sub in gl.static_range(2):
                            dk, dv = _dkdv_tile(k, v, q.slice(sub * _SUB_M, _SUB_M), do.slice(sub * _SUB_M, _SUB_M),
                                                qr.slice(sub * _SUB_M, _SUB_M), dk, dv, keys, key0, rows + sub * _SUB_M,
                                                start_m + sub * _SUB_M, c, sc, cap, wl, wr, seqlen, kend,
                                                m_s.slice(sub * _SUB_M, _SUB_M), l_s.slice(sub * _SUB_M, _SUB_M),
                                                d_s.slice(sub * _SUB_M, _SUB_M), drow + sub * _SUB_M, DG, bh, seed_lo,
                                                seed_hi, drop_off, drop_thr, drop_scale, GPROJ, CAUSAL, SOFTCAP, WINDOW,
                                                EDGES, KEYPAD, DROPOUT)
                    else:
                        dk, dv = _dkdv_tile(k, v, q, do, qr, dk, dv, keys, key0, rows, start_m, c, sc, cap, wl, wr, seqlen,
                                            kend, m_s, l_s, d_s, drow, DG, bh, seed_lo, seed_hi, drop_off, drop_thr,
                                            drop_scale, GPROJ, CAUSAL, SOFTCAP, WINDOW, EDGES, KEYPAD, DROPOUT)
                mbarrier.arrive(empty.index(st), count=1)
                i += 1
        mbarrier.arrive(kv_empty.index(kb), count=1)  # every GEMM reading K, V was waited for
        if KEYPAD:  # a padded key's dS̃ row took 0·(dP − D) with dP from its padded value: NaN for a NaN there
            if key0 + _HALF_N > kend:
                dk = gl.where((key0 + gl.arange(0, _HALF_N, layout=gl.SliceLayout(1, acc_layout)) < kend)[:, None], dk, 0.0)
        dk = dk * tau
        if DROPOUT:
            dv = dv * drop_scale  # 1/(1 − p̂), as the tl.dot dK/dV kernel before its store
        out_rows = (out_row + half * _HALF_N + gl.arange(0, _HALF_N, layout=gl.SliceLayout(1, acc_layout))).to(gl.int64)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        offs = out_rows[:, None] * out_stride + out_col + cols[None, :]
        if EDGES:  # keys from seqlen on are the next sequence's
            key_ok = (key0 + gl.arange(0, _HALF_N, layout=gl.SliceLayout(1, acc_layout)) < seqlen)[:, None]
            gl.store(DK + offs, dk.to(DK.dtype.element_ty), mask=key_ok)
            gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=key_ok)
        else:
            gl.store(DK + offs, dk.to(DK.dtype.element_ty))
            gl.store(DV + offs, dv.to(DV.dtype.element_ty))
        if key_sums != 0:  # dk is fp32 here: Σ over these 64 keys of the values just stored
            gl.store(KS + half * HEAD_DIM + cols, gl.sum(dk, axis=0))
        return i

    @gluon.jit
    def program_block(H, GROUP):
        """The key block of a loop-less dK/dV program (grid (key blocks, batch rows · kv heads)): (pid_n, pid_bh, b, hk,
        h0, start_n) — its program ids, batch row, kv head, first query head of the GQA group and first key position.
        Also the one pass's (kernels/attention_bwd_onepass.py)."""
        pid_n = gl.program_id(0)
        pid_bh = gl.program_id(1)
        HK = H // GROUP
        b = pid_bh // HK
        hk = pid_bh % HK
        return pid_n, pid_bh, b, hk, hk * GROUP, pid_n * _BLOCK_N

    @gluon.jit
    def dkdv_block(t, M_BLOCKS, H, GROUP, CAUSAL: gl.constexpr):
        """Key block t of the persistent dK/dV kernel's (key block, batch row · kv head) blocks of dense inputs:
        (b, hk, start_n) — the batch row, the kv head and the block's first key position. Blocks run key block fastest,
        so programs that run together share a head's Q and dO in L2. Each head has an even number of block slots
        (M_BLOCKS rounded up; an odd head's last slot is a block past the sequence, start_n >= seqlen, skipped), so that
        items of two slots never span heads, and causal blocks come in pairs heaviest and lightest ((0, M−1), (1, M−2),
        …: M + 1 query tiles per pair, the middle block of an odd M alone), as the forward's
        (kernels/attention_fwd_hopper.tile_span)."""
        slots = M_BLOCKS + M_BLOCKS % 2
        idx = t % slots
        pid_n = idx
        if CAUSAL:
            pid_n = gl.where(idx % 2 == 0, idx // 2, M_BLOCKS - 1 - idx // 2)
        pid_n = gl.where(idx < M_BLOCKS, pid_n, M_BLOCKS)  # the padding slot
        pid_bh = t // slots
        HK = H // GROUP
        return pid_bh // HK, pid_bh % HK, pid_n * _BLOCK_N

    def _dkdv_partitions(gproj: bool, causal: bool, softcap: bool, window: bool, edges: bool, keypad: bool = False,
                         dropout: bool = False, persist: bool = False):
        """The dK/dV kernel's (consumer, loader) partitions with (GPROJ, CAUSAL, SOFTCAP, WINDOW, EDGES, …) compiled in:
        constexpr arguments do not survive gl.warp_specialize, closure constants do; with the mask's, GProj's or the
        softcap's code compiled in where it is not used the consumers spilled ~4× more (Triton 3.6's ptxas). Where
        ``persist``, they loop over the program's key blocks (items p, p + P, … of two blocks, :func:`dkdv_block`),
        the ring's position and the K/V buffers' turns running on across blocks; else they run the block the kernel
        located."""
        GPROJ, CAUSAL = gl.constexpr(gproj), gl.constexpr(causal)
        SOFTCAP, WINDOW, EDGES = gl.constexpr(softcap), gl.constexpr(window), gl.constexpr(edges)
        KEYPAD, DROPOUT = gl.constexpr(keypad), gl.constexpr(dropout)

        if not persist:
            @gluon.jit
            def consumer(q_smem, do_smem, qr_smem, k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty,
                         DK, DV, KS, start_n, out_row, out_col, out_stride, GROUP, lo, hi, seqlen, kend, c, tau, key_sums,
                         sc, cap, wl, wr, drow0, DG, bh0, seed_lo, seed_hi, drop_off, drop_thr, drop_scale, half):
                _consumer(q_smem, do_smem, qr_smem, k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready,
                          empty, 0, gl.to_tensor(0), DK, DV, KS, half, GPROJ, CAUSAL, SOFTCAP, WINDOW, EDGES, KEYPAD, DROPOUT, start_n,
                          out_row, out_col, out_stride, GROUP, lo, hi, seqlen, kend, c, tau, key_sums, sc, cap, wl, wr,
                          drow0, DG, bh0, seed_lo, seed_hi, drop_off, drop_thr, drop_scale)

            @gluon.jit
            def loader(q_desc, do_desc, qr_desc, k_desc, v_desc, M, LOG2L, DELTA, q_smem, do_smem, qr_smem, k_smem,
                       v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty, k_row, k_col, v_row, v_col, q_b,
                       q_rh, q_ch, do_b, do_rh, do_ch, qr_b, qr_rh, qr_ch, h0, GROUP, lo, hi, stats0, N_CTX, seqlen):
                _loader(q_desc, do_desc, qr_desc, k_desc, v_desc, M, LOG2L, DELTA, q_smem, do_smem, qr_smem, k_smem,
                        v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty, 0, gl.to_tensor(0), k_row, k_col, v_row, v_col,
                        q_b, q_rh, q_ch, do_b, do_rh, do_ch, qr_b, qr_rh, qr_ch, h0, GROUP, lo, hi, stats0, N_CTX, seqlen,
                        GPROJ)

            return consumer, loader

        @gluon.jit
        def p_consumer(q_smem, do_smem, qr_smem, k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty,
                       DK, DV, KS, H, GROUP, N_CTX, M_BLOCKS, TILES, c, tau, key_sums, sc, cap, half):
            HEAD_DIM: gl.constexpr = k_smem.shape[2]
            HK = H // GROUP
            i = gl.to_tensor(0)  # ring position
            j = gl.to_tensor(0)  # key blocks done (the K/V buffers' turns)
            for item in range(gl.program_id(0) * _PAIR, TILES, gl.num_programs(0) * _PAIR):
                for t in range(item, item + _PAIR):  # TILES is even
                    b, hk, start_n = dkdv_block(t, M_BLOCKS, H, GROUP, CAUSAL)
                    if start_n < N_CTX:
                        lo = 0
                        if CAUSAL:
                            lo = start_n
                        ks = KS + ((b * HK + hk).to(gl.int64) * (N_CTX // _HALF_N) + start_n // _HALF_N) * HEAD_DIM
                        i = _consumer(q_smem, do_smem, qr_smem, k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty,
                                      ready, empty, j, i, DK, DV, ks, half, GPROJ, CAUSAL, SOFTCAP, WINDOW, EDGES, KEYPAD,
                                      DROPOUT, start_n, b * N_CTX + start_n, hk * HEAD_DIM, HK * HEAD_DIM, GROUP, lo,
                                      N_CTX, N_CTX, N_CTX, c, tau, key_sums, sc, cap,
                                      0, 0, 0, 0, 0, 0, 0, 0, 0, 1.0)  # no window, no dropout
                        j += 1

        @gluon.jit
        def p_loader(q_desc, do_desc, qr_desc, k_desc, v_desc, M, LOG2L, DELTA, q_smem, do_smem, qr_smem, k_smem, v_smem,
                     m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty, H, GROUP, N_CTX, M_BLOCKS, TILES, q_rb,
                     q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch):
            i = gl.to_tensor(0)
            j = gl.to_tensor(0)
            for item in range(gl.program_id(0) * _PAIR, TILES, gl.num_programs(0) * _PAIR):
                for t in range(item, item + _PAIR):  # TILES is even
                    b, hk, start_n = dkdv_block(t, M_BLOCKS, H, GROUP, CAUSAL)
                    if start_n < N_CTX:
                        h0 = hk * GROUP
                        lo = 0
                        if CAUSAL:
                            lo = start_n
                        i = _loader(q_desc, do_desc, qr_desc, k_desc, v_desc, M, LOG2L, DELTA, q_smem, do_smem, qr_smem,
                                    k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty, j, i,
                                    b * k_rb + hk * k_rh + start_n, hk * k_ch, b * v_rb + hk * v_rh + start_n, hk * v_ch,
                                    b * q_rb, q_rh, q_ch, b * do_rb, do_rh, do_ch, 0, 0, 0, h0, GROUP, lo, N_CTX,
                                    (b * H + h0).to(gl.int64) * N_CTX, N_CTX, N_CTX, False)  # no −ρ∘Q: not with gproj
                        j += 1

        return p_consumer, p_loader

    @gluon.jit
    def _dkdv_smem(q_desc, do_desc, qr_desc, k_desc, v_desc, GPROJ: gl.constexpr, KV_BUFS: gl.constexpr):
        """The dK/dV kernel's shared memory and barriers: the (Q, dO[, −ρ∘Q]) ring with each tile's m, log2l, D rows,
        KV_BUFS buffers of the block's K and V (two halves of 64 keys each) and their ``kv_bar`` (loaded) and
        ``kv_empty`` (both consumers done) barriers."""
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [_NUM_STAGES, _BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [_NUM_STAGES, _BLOCK_M, HEAD_DIM], do_desc.layout)
        if GPROJ:
            qr_smem = gl.allocate_shared_memory(dtype, [_NUM_STAGES, _BLOCK_M, HEAD_DIM], qr_desc.layout)
        else:
            qr_smem = q_smem  # not read
        k_smem = gl.allocate_shared_memory(dtype, [2 * KV_BUFS, _HALF_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2 * KV_BUFS, _HALF_N, HEAD_DIM], v_desc.layout)
        stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        m_smem = gl.allocate_shared_memory(gl.float32, [_NUM_STAGES, _BLOCK_M], stat_layout)
        l_smem = gl.allocate_shared_memory(gl.float32, [_NUM_STAGES, _BLOCK_M], stat_layout)
        d_smem = gl.allocate_shared_memory(gl.float32, [_NUM_STAGES, _BLOCK_M], stat_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [KV_BUFS, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [KV_BUFS, 1], mbarrier.MBarrierLayout())
        for kb in gl.static_range(KV_BUFS):
            mbarrier.init(kv_bar.index(kb), count=1)
            mbarrier.init(kv_empty.index(kb), count=2)  # both consumers
        ready, empty = ring_barriers(_NUM_STAGES)
        return q_smem, do_smem, qr_smem, k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty

    @functools.lru_cache(maxsize=None)
    def _dkdv_kernel_for(gproj: bool, causal: bool, softcap: bool, window: bool, varlen: bool = False,
                         edges: bool = False, keypad: bool = False, dropout: bool = False, persist: bool = False):
        """The dK/dV kernel with GProj's dK term (gproj), the causal mask, the softcap, the sliding window, packed
        sequences (varlen), sequence ends inside tiles (edges: a seqlen not a multiple of 128; implied by varlen) and
        right key padding (keypad: batch row b's keys from SEQLENS[b] on masked, their dk = dv = 0; not with window
        or varlen) and attention dropout (the forward's keep mask, :func:`_dkdv_tile`) compiled in or out. persist
        (:func:`dkdv_schedule`: without gproj, where kernels/attention_fwd_hopper.persistent allows it): program p runs
        items p, p + P, … of two key blocks (:func:`dkdv_block`, :func:`_dkdv_partitions`); else one block per program,
        grid (key blocks, batch · kv heads). Raises ValueError for keypad with window or varlen, and for persist where
        it is not allowed."""
        if keypad and (window or varlen):
            raise ValueError("keypad: not with window or varlen")
        if persist and (gproj or not persistent(window, varlen, keypad, dropout)):
            raise ValueError("persist: only without gproj, for dense inputs without a window, key padding or dropout")
        GPROJ, CAUSAL, WINDOW = gl.constexpr(gproj), gl.constexpr(causal), gl.constexpr(window)
        VARLEN, KEYPAD = gl.constexpr(varlen), gl.constexpr(keypad)
        consumer, loader = _dkdv_partitions(gproj, causal, softcap, window, edges or varlen, keypad, dropout, persist)

        # Tile (row, col) of a tensor's 2-D TMA view for batch b, head h, position n: (b·rb + h·rh + n, h·ch)
        # (kernels/attention_fwd_hopper._tma_view). dk, dv: (batch, seqlen, nheads_k, headdim) contiguous.
        # VARLEN: b is the sequence, the tensors are packed (1, total, heads, headdim) views (N_CTX = total), the
        # sequence's rows start at CU[b]; m, log2l, D are (nheads, total); rows and keys past its end are the next
        # sequence's (P = 0 there, not stored). No key sums (key_sums = 0). KEYPAD: keys [0, SEQLENS[b]) of batch
        # row b are valid, the others get dk = dv = 0 (a block of padding only: stored here, no partitions). Dropout
        # (unused without it): kernels/attention_fwd_hopper.dropout_kernel_args; counter rows start + row, c1 = b·H + h.
        # M_BLOCKS, TILES: key blocks per (batch row, kv head) and block slots in all (dkdv_block) of the persistent
        # kernel; the loop-less one takes them too (one signature for both launches) and does not read them.
        if persist:
            @gluon.jit(do_not_specialize=DROPOUT_SCALARS)
            def _hopper_dkdv_kernel(q_desc, do_desc, qr_desc, k_desc, v_desc, DK, DV, KS, M, LOG2L, DELTA, CU, SEQLENS,
                                    c, tau, H, GROUP, N_CTX, key_sums, M_BLOCKS, TILES, q_rb, q_rh, q_ch, do_rb,
                                    do_rh, do_ch, qr_rb, qr_rh, qr_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, sc, cap, wl,
                                    wr, DG, seed_lo, seed_hi, drop_off, drop_thr, drop_scale):
                # Two K/V buffers: a block's K, V load while the previous block's last tiles run.
                q_smem, do_smem, qr_smem, k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty = \
                    _dkdv_smem(q_desc, do_desc, qr_desc, k_desc, v_desc, GPROJ, 2)
                # The two consumers' arguments differ in the last one, their half of the keys (Gluon has no *tuple).
                args0 = (q_smem, do_smem, qr_smem, k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty,
                         DK, DV, KS, H, GROUP, N_CTX, M_BLOCKS, TILES, c, tau, key_sums, sc, cap, 0)
                args1 = (q_smem, do_smem, qr_smem, k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty,
                         DK, DV, KS, H, GROUP, N_CTX, M_BLOCKS, TILES, c, tau, key_sums, sc, cap, 1)
                loader_args = (q_desc, do_desc, qr_desc, k_desc, v_desc, M, LOG2L, DELTA, q_smem, do_smem, qr_smem,
                               k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty, H, GROUP, N_CTX,
                               M_BLOCKS, TILES, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh,
                               v_ch)
                gl.warp_specialize([(consumer, args0), (consumer, args1), (loader, loader_args)], [4, 1], [240, 24])

            return _hopper_dkdv_kernel

        @gluon.jit(do_not_specialize=DROPOUT_SCALARS)
        def _hopper_dkdv_kernel(q_desc, do_desc, qr_desc, k_desc, v_desc, DK, DV, KS, M, LOG2L, DELTA, CU, SEQLENS, c, tau,
                                H, GROUP, N_CTX, key_sums, M_BLOCKS, TILES, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch,
                                qr_rb, qr_rh, qr_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, sc, cap, wl, wr, DG, seed_lo,
                                seed_hi, drop_off, drop_thr, drop_scale):
            HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
            pid_n, pid_bh, b, hk, h0, start_n = program_block(H, GROUP)
            HK = H // GROUP
            b, start, seqlen = sequence_span(CU, b, N_CTX, VARLEN)
            if start_n >= seqlen:  # VARLEN: the grid spans the longest sequence
                return
            out_row = b * N_CTX + start + start_n
            ks = KS + pid_bh.to(gl.int64) * (N_CTX // _HALF_N) * HEAD_DIM + pid_n * 2 * HEAD_DIM
            kend = seqlen
            if KEYPAD:
                kend = key_end(SEQLENS, b, seqlen)
                if start_n >= kend:
                    zero_keys(DK, DV, ks, out_row, hk * HEAD_DIM, HK * HEAD_DIM, seqlen - start_n, key_sums, HEAD_DIM)
                    return
            lo = 0
            hi = seqlen
            if CAUSAL:
                lo = start_n  # earlier query rows see none of these keys (seqlen_q = seqlen_k)
            if WINDOW:  # the query tiles some row of which sees one of these keys: key − wr <= row <= key + wl
                lo, hi = window_tiles(start_n, _BLOCK_N, wr, wl, seqlen, _BLOCK_M)
            stats0 = (b * H + h0).to(gl.int64) * N_CTX + start
            q_smem, do_smem, qr_smem, k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty = \
                _dkdv_smem(q_desc, do_desc, qr_desc, k_desc, v_desc, GPROJ, 1)

            # The two consumers' arguments differ in the last one, their half of the keys (Gluon has no *tuple).
            bh0 = b * H + h0  # the dropout counters' c1 of the group's first query head (b = 0 when packed)
            args0 = (q_smem, do_smem, qr_smem, k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty, DK,
                     DV, ks, start_n, out_row, hk * HEAD_DIM, HK * HEAD_DIM, GROUP, lo, hi, seqlen, kend, c, tau, key_sums,
                     sc, cap, wl, wr, start, DG, bh0, seed_lo, seed_hi, drop_off, drop_thr, drop_scale, 0)
            args1 = (q_smem, do_smem, qr_smem, k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty, DK,
                     DV, ks, start_n, out_row, hk * HEAD_DIM, HK * HEAD_DIM, GROUP, lo, hi, seqlen, kend, c, tau, key_sums,
                     sc, cap, wl, wr, start, DG, bh0, seed_lo, seed_hi, drop_off, drop_thr, drop_scale, 1)
            loader_args = (q_desc, do_desc, qr_desc, k_desc, v_desc, M, LOG2L, DELTA, q_smem, do_smem, qr_smem,
                           k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty,
                           b * k_rb + hk * k_rh + start + start_n, hk * k_ch, b * v_rb + hk * v_rh + start + start_n,
                           hk * v_ch, b * q_rb + start, q_rh, q_ch, b * do_rb + start, do_rh, do_ch, b * qr_rb + start,
                           qr_rh, qr_ch, h0, GROUP, lo, hi, stats0, N_CTX, seqlen)
            # 240 registers for each consumer, 24 for the loader: the register file's even split (run 18's probe:
            # fewer spills than 232 / 248).
            gl.warp_specialize([(consumer, args0), (consumer, args1), (loader, loader_args)], [4, 1], [240, 24])

        return _hopper_dkdv_kernel


if GLUON_ERROR is None:
    # The dQ pass: 128 query rows per program (two consumers of 64), key tiles of 64 through a 2-slot ring.
    _DQ_BLOCK_M = gl.constexpr(128)
    _DQ_HALF_M = gl.constexpr(TILE_ROWS)
    _DQ_BLOCK_N = gl.constexpr(TILE_ROWS)
    _DQ_HALF_N = gl.constexpr(TILE_ROWS // 2)
    _ROWSUM_N = gl.constexpr(ROWSUM_N)
    # The dropout keep masks' layouts (kernels/attention_fwd_hopper.keep_layout) of 64 rows × 64 keys (the dQ pass's
    # score tiles) and × 32 keys (its softcap half tiles).
    _KEEP_64 = gl.constexpr(keep_layout(64))
    _KEEP_32 = gl.constexpr(keep_layout(32))

    def _dq_loader_for(keypad: bool):
        """The dQ pass's loader partition (:func:`_dq_load_tiles`), with KEYPAD compiled in (a closure constant, as
        :func:`_dq_partition`'s): right key padding takes the K/V tiles through descriptors of the batch row's valid
        keys [0, kend) (kernels/attention_fwd_hopper.keys_descriptor; K, V point at k, v, whose 2-D TMA views have
        k_cols, v_cols columns), zero past them; otherwise the host's descriptors (K, V, kend, k_cols, v_cols unused)."""
        KEYPAD = gl.constexpr(keypad)

        @gluon.jit
        def loader(q_desc, do_desc, o_desc, k_desc, v_desc, e0_desc, q_smem, do_smem, o_smem, k_smem, v_smem, e0_smem,
                   q_bar, ready, empty, q_row, q_col, do_row, do_col, o_row, o_col, K, V, kend, k_cols, v_cols, k_row,
                   k_col, v_row, v_col, lo, hi, GPROJ):
            if KEYPAD:
                _dq_load_tiles(q_desc, do_desc, o_desc, keys_descriptor(K, k_row, kend, k_cols, k_desc),
                               keys_descriptor(V, v_row, kend, v_cols, v_desc), e0_desc, q_smem, do_smem, o_smem, k_smem,
                               v_smem, e0_smem, q_bar, ready, empty, q_row, q_col, do_row, do_col, o_row, o_col, 0, k_col,
                               0, v_col, lo, hi, GPROJ)
            else:
                _dq_load_tiles(q_desc, do_desc, o_desc, k_desc, v_desc, e0_desc, q_smem, do_smem, o_smem, k_smem, v_smem,
                               e0_smem, q_bar, ready, empty, q_row, q_col, do_row, do_col, o_row, o_col, k_row, k_col,
                               v_row, v_col, lo, hi, GPROJ)

        return loader

    @gluon.jit
    def _dq_load_tiles(q_desc, do_desc, o_desc, k_desc, v_desc, e0_desc, q_smem, do_smem, o_smem, k_smem, v_smem, e0_smem,
                       q_bar, ready, empty, q_row, q_col, do_row, do_col, o_row, o_col, k_row, k_col, v_row, v_col, lo, hi,
                       GPROJ):
        # The program's q, dO and o rows, once (two halves of 64 rows, one per consumer), with gproj the e0 tile;
        # then the K/V tiles. GPROJ: a value, as in _loader (fix "none" passes an e0 stand-in of a q tile's shape).
        rows_bytes: gl.constexpr = 2 * (q_desc.block_type.nbytes + do_desc.block_type.nbytes + o_desc.block_type.nbytes)
        if GPROJ:
            mbarrier.expect(q_bar, rows_bytes + e0_desc.block_type.nbytes)
        else:
            mbarrier.expect(q_bar, rows_bytes)
        for half in gl.static_range(2):
            tma_load(q_desc, [q_row + half * _DQ_HALF_M, q_col], q_bar, q_smem.index(half))
            tma_load(do_desc, [do_row + half * _DQ_HALF_M, do_col], q_bar, do_smem.index(half))
            tma_load(o_desc, [o_row + half * _DQ_HALF_M, o_col], q_bar, o_smem.index(half))
        if GPROJ:
            tma_load(e0_desc, [0, 0], q_bar, e0_smem)
        i = 0
        for start_n in range(lo, hi, _DQ_BLOCK_N):
            ring_load_pair(k_desc, v_desc, k_smem, v_smem, ready, empty, i, k_row + start_n, k_col, v_row + start_n,
                           v_col, _NUM_STAGES)
            i += 1

    @gluon.jit
    def _dq_tile(q, do, k, v, e0_smem, dq, pk, r, ps, m, l2, di, rows, first, start_n, c, sc, cap, wl, wr, kend,
                 drow, DG, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale,
                 GPROJ: gl.constexpr, CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr,
                 KEYMASK: gl.constexpr, DROPOUT: gl.constexpr):
        """One key tile (k, v: shared [keys, headdim]) of the dQ pass for 64 query rows: S, dP, P̃, dS̃ and the
        asynchronous dQ [, P̃K, row sums] GEMMs, waited for; returns (dq, pk, r, ps). KEYMASK: keys from ``kend`` on
        get P = 0 (the next sequence's, or key padding). DROPOUT: the forward's keep mask M of these rows (dropout
        counter rows drow …, kernels/attention_fwd_hopper.philox_keep) makes dP' = M ∘ dP / (1 − p̂) (drop_scale) of
        dP, as the tl.dot dQ kernel; D, P, the direction P̃ and everything else stay the undropped ones."""
        HEAD_DIM: gl.constexpr = q.shape[1]
        KEYS: gl.constexpr = k.shape[0]
        dtype: gl.constexpr = q.dtype
        # The dropout mask's layout for KEYS keys (64, or 32 in softcap's half tiles): keep_layout(KEYS)
        A: gl.constexpr = KEYS // 32
        if KEYS == 64:
            KEEP: gl.constexpr = _KEEP_64
        else:
            KEEP: gl.constexpr = _KEEP_32
        # The smallest normal number of the operand dtype (fp16 2⁻¹⁴; bf16: fp32's), for softcap's r and direction.
        TINY16: gl.constexpr = 6.103515625e-05 if dtype == gl.float16 else 1.1754943508222875e-38
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, KEYS, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        sum_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, _ROWSUM_N, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        sum_a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=sum_layout, k_width=2)
        zero = gl.zeros([_DQ_HALF_M, KEYS], gl.float32, layout=s_layout)
        if KEYS == _DQ_BLOCK_N:  # the e0 tile's rows are alike: a half tile sums with its first KEYS
            e0 = e0_smem
        else:
            e0 = e0_smem.slice(0, KEYS)
        if DROPOUT:  # the Philox rounds before the GEMMs are issued; the mask's bits taken where dP' is formed
            words = philox_keep(drow, DG, start_n, bh, seed_lo, seed_hi, drop_off, drop_thr, A, KEEP)
        s = warpgroup_mma(q, k.permute((1, 0)), zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, v.permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        if SOFTCAP:  # the capped logits z = cap·tanh(τ s/cap), bit for bit the forward's; g = 1 − tanh²
            s, g = softcap_and_grad(s, sc, cap)
        # The forward's exponent: (s − m) is exactly 0 at the row max, then scale, then normalize.
        p = gl.exp2((s - m[:, None]) * c - l2[:, None])
        if CAUSAL:
            if start_n + KEYS > first + 1:  # a key of the tile lies past one of the rows
                cols = start_n + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
                p = gl.where(cols[None, :] <= rows[:, None], p, 0.0)
        if WINDOW:  # masked where the tile crosses an edge of some row's window row − wl <= key <= row + wr
            if window_crosses(first, _DQ_HALF_M, start_n, KEYS, wl, wr):
                cols = start_n + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
                p = gl.where(window_mask(rows[:, None], cols[None, :], wl, wr), p, 0.0)
        if KEYMASK:
            if start_n + KEYS > kend:
                cols = start_n + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
                p = gl.where(cols[None, :] < kend, p, 0.0)
        if GPROJ:
            p16 = p.to(dtype)  # rounding point: P̃ (GProj's direction)
            if SOFTCAP:
                # The direction bf16(P̃∘g) and Σ_j of it over g (kernels/attention_bwd._dq_inner); 1/g only
                # where it is finite (fp32 tiny), else X̃ ≈ 0 and r takes the unrounded dZ = P∘(dP − D) below.
                # Entries below the operand dtype's normal range are left out of the direction (kernels/reference.py).
                pw = (p16.to(gl.float32) * g).to(dtype)
                pw = gl.where(pw >= TINY16, pw, 0.0).to(dtype)
                pk = warpgroup_mma(gl.convert_layout(pw, a_layout), k, pk, is_async=True)
                inv_g = gl.where(g >= 1.1754943508222875e-38, rcp_approx(g), 0.0)
                ps += gl.sum(pw.to(gl.float32) * inv_g, axis=1)
            else:
                pk = warpgroup_mma(gl.convert_layout(p16, a_layout), k, pk, is_async=True)
                ps = warpgroup_mma(gl.convert_layout(p16, sum_a_layout), e0, ps, is_async=True)
        if SOFTCAP:
            # The operand X = dZ∘g = (P∘g)∘(dP − D) (kernels/reference.py): P∘g formed before the wait, so that
            # one tile, not P and g, stays live across it. gproj keeps P itself where 1/g is not finite (there X̃ is
            # 0 and r takes dZ = P∘(dP − D), as kernels/reference.py and the tl.dot kernel do).
            if GPROJ:
                p = gl.where(inv_g != 0.0, p * g, p)
            else:
                p = p * g
        if GPROJ:
            if SOFTCAP:
                dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp,))
            else:
                dp = warpgroup_mma_wait(num_outstanding=2, deps=(dp,))
        else:
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        if DROPOUT:  # dP' = M ∘ dP / (1 − p̂); dS = P ∘ (dP' − D) with the undropped P still sums to zero per row
            dp = gl.where(gl.convert_layout(keep_bits(words, A, KEEP), s_layout), dp * drop_scale, 0.0)  # the same placement (keep_layout)
        dp = dp - di[:, None]
        ds = p * dp
        x = ds
        if GPROJ:
            if SOFTCAP:  # X̃ = 0 where g underflows (there ds holds dZ, not dZ∘g)
                x = gl.where(inv_g != 0.0, ds, 0.0)
        ds16 = x.to(dtype)  # rounding point: dS̃ (with softcap X̃ = bf16(dZ∘g)), the operand of dQ += dS̃ K
        dq = warpgroup_mma(gl.convert_layout(ds16, a_layout), k, dq, is_async=True)
        if GPROJ:
            if SOFTCAP:
                # r_i = Σ_j dZ̃_ij, dZ̃ = X̃ / g: the zero-sum quantity (docs/architecture.md), where X̃ is a normal
                # number of the operand dtype; elsewhere the unrounded dZ (X / g, or ds itself where 1/g is not
                # finite): fp16's subnormal X̃ where tanh saturates, divided by a tiny g (kernels/reference.py).
                live = inv_g != 0.0
                x16 = ds16.to(gl.float32)
                r += gl.sum(gl.where(live & (gl.abs(x16) >= TINY16), x16, ds) * gl.where(live, inv_g, 1.0), axis=1)
                dq, pk = warpgroup_mma_wait(num_outstanding=0, deps=(dq, pk))
            else:
                r = warpgroup_mma(gl.convert_layout(ds16, sum_a_layout), e0, r, is_async=True)
                dq, pk, r, ps = warpgroup_mma_wait(num_outstanding=0, deps=(dq, pk, r, ps))
        else:
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        return dq, pk, r, ps

    @gluon.jit
    def _dq_consumer(q_smem, do_smem, o_smem, k_smem, v_smem, e0_smem, q_bar, ready, empty, DQ, R, QR, M, LOG2L, DELTA,
                     GPROJ: gl.constexpr, CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr,
                     EDGES: gl.constexpr, KEYMASK: gl.constexpr, DROPOUT: gl.constexpr, row0, stats, out_row, out_col,
                     out_stride, lo, hi, seqlen, kend, c, tau, store_qr, sc, cap, wl, wr, drow0, DG, bh, seed_lo, seed_hi,
                     drop_off, drop_thr, drop_scale, half):
        HEAD_DIM: gl.constexpr = q_smem.shape[2]
        # The score tiles' layout: 64 keys, with softcap 32 (each K/V tile in two halves, see the loop).
        # GProj with dropout at d 128 too: at full width it spilled 108–113 stores (Triton 3.6), in halves 10–18 (run 35).
        HALVES: gl.constexpr = SOFTCAP or (DROPOUT and GPROJ and HEAD_DIM > 64)
        if HALVES:
            KEYS: gl.constexpr = _DQ_HALF_N
        else:
            KEYS: gl.constexpr = _DQ_BLOCK_N
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, KEYS, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        sum_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, _ROWSUM_N, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_a: gl.constexpr = gl.SliceLayout(1, acc_layout)

        first = row0 + half * _DQ_HALF_M  # this consumer's first query row
        drow = drow0 + half * _DQ_HALF_M  # its row in the dropout counters (packed: the packed row)
        if CAUSAL:
            # seqlen_q = seqlen_k: these rows see no key past the last of them. Half 0 skips the block's last
            # tile (only half 1 waits for it and arrives; no later load waits for that slot).
            hi = gl.minimum(hi, first + _DQ_HALF_M)
        rows = first + gl.arange(0, _DQ_HALF_M, layout=row_s)
        rows_a = first + gl.arange(0, _DQ_HALF_M, layout=row_a)
        # With EDGES the rows from seqlen on get P = 0 and no store writes them (row_ok; None: all rows).
        row_ok = None
        if EDGES:
            row_ok = rows_a < seqlen
        m, l2 = row_statistics(M, LOG2L, stats, rows, seqlen, EDGES)
        q = q_smem.index(half)
        do = do_smem.index(half)
        mbarrier.wait(q_bar, 0)
        # D_i = Σ_d dO_id O_id in fp32 from the 16-bit o and dO (exact products), stored for the dK/dV pass.
        di = gl.sum(o_smem.index(half).load(acc_layout).to(gl.float32) * do.load(acc_layout).to(gl.float32), axis=1)
        gl.store(DELTA + stats + rows_a, di, mask=row_ok)
        di = gl.convert_layout(di, row_s)

        dq = gl.zeros([_DQ_HALF_M, HEAD_DIM], gl.float32, layout=acc_layout)
        if GPROJ:
            # PK = Σ_j P̃_ij k_j; r_i = Σ_j dS̃_ij and Σ_j P̃_ij on the tensor cores: the 16-bit tile times
            # e0 = (1, 0, …, 0) per key, column 0 of a [64, ROWSUM_N] accumulator (the tl.dot kernel's trick,
            # benchmarks/NOTES.md run 16), from the very values the GEMMs consume. Softcap divides each score by
            # g first (r = Σ_j X̃_ij / g_ij), so it sums on the ALUs into row vectors, as the tl.dot kernel does.
            pk = gl.zeros([_DQ_HALF_M, HEAD_DIM], gl.float32, layout=acc_layout)
            if SOFTCAP:
                r = gl.zeros([_DQ_HALF_M], gl.float32, layout=row_s)
                ps = gl.zeros([_DQ_HALF_M], gl.float32, layout=row_s)
            else:
                r = gl.zeros([_DQ_HALF_M, _ROWSUM_N], gl.float32, layout=sum_layout)
                ps = gl.zeros([_DQ_HALF_M, _ROWSUM_N], gl.float32, layout=sum_layout)
        else:
            pk, r, ps = dq, dq, dq  # not used
        i = 0
        for start_n in range(lo, hi, _DQ_BLOCK_N):
            st = i % _NUM_STAGES
            mbarrier.wait(ready.index(st), (i // _NUM_STAGES) & 1)
            k = k_smem.index(st)
            v = v_smem.index(st)
            visit = True
            if WINDOW:  # a tile none of these rows sees is released unread
                visit = window_sees(first, _DQ_HALF_M, start_n, _DQ_BLOCK_N, wl, wr)
            if visit:
                if HALVES:  # two halves of 32 keys: the tanh's tiles (g, 1/g, P∘g) or GProj's with the dropout mask fit
                    # the registers only at half width
                    for sub in gl.static_range(2):
                        dq, pk, r, ps = _dq_tile(q, do, k.slice(sub * _DQ_HALF_N, _DQ_HALF_N),
                                                 v.slice(sub * _DQ_HALF_N, _DQ_HALF_N), e0_smem, dq, pk, r, ps, m, l2, di, rows,
                                                 first, start_n + sub * _DQ_HALF_N, c, sc, cap, wl, wr, kend, drow, DG, bh,
                                                 seed_lo, seed_hi, drop_off, drop_thr, drop_scale, GPROJ, CAUSAL,
                                                 SOFTCAP, WINDOW, KEYMASK, DROPOUT)
                else:
                    dq, pk, r, ps = _dq_tile(q, do, k, v, e0_smem, dq, pk, r, ps, m, l2, di, rows, first, start_n, c, sc, cap,
                                             wl, wr, kend, drow, DG, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale,
                                             GPROJ, CAUSAL, SOFTCAP, WINDOW, KEYMASK, DROPOUT)
            mbarrier.arrive(empty.index(st), count=1)
            i += 1
        tile_ok = None
        if EDGES:  # formed again here rather than kept live across the loop
            row_ok = rows_a < seqlen
            tile_ok = row_ok[:, None]
        offs = ((out_row + half * _DQ_HALF_M + gl.arange(0, _DQ_HALF_M, layout=row_a)).to(gl.int64)[:, None] * out_stride
                + out_col + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))[None, :])
        if GPROJ:
            # Column 0 holds the sums, the others 0: adding them is exact. ρ_i = r_i / Σ_j P̃_ij (0 for a row
            # that sees no key); dQ_i = τ (Σ_j dS̃_ij k_j − ρ_i (P̃K)_i).
            if not SOFTCAP:
                r = gl.sum(r, axis=1)
                ps = gl.sum(ps, axis=1)
            r = gl.convert_layout(r, row_a)
            ps = gl.convert_layout(ps, row_a)
            rho = gl.where(ps > 0.0, r / gl.maximum(ps, 1.1754943508222875e-38), 0.0)  # 0: no direction
            dq = dq - rho[:, None] * pk
        gl.store(DQ + offs, (dq * tau).to(DQ.dtype.element_ty), mask=tile_ok)
        if GPROJ:
            gl.store(R + stats + rows_a, r, mask=row_ok)
            if store_qr != 0:  # −ρ∘Q rounded: the B operand of the dK/dV pass's GProj term (after dq's store)
                gl.store(QR + offs, (q.load(acc_layout).to(gl.float32) * (-rho)[:, None]).to(QR.dtype.element_ty),
                         mask=tile_ok)

    def _dq_partition(gproj: bool, causal: bool, softcap: bool, window: bool, edges: bool, keypad: bool = False,
                      dropout: bool = False):
        """A dQ consumer partition with (GPROJ, CAUSAL, SOFTCAP, WINDOW, EDGES, DROPOUT) compiled in, as
        :func:`_dkdv_partitions`; KEYMASK: keys from ``kend`` on masked (a sequence's end inside a tile, which causal
        rows never reach, or key padding)."""
        GPROJ, CAUSAL = gl.constexpr(gproj), gl.constexpr(causal)
        SOFTCAP, WINDOW, EDGES = gl.constexpr(softcap), gl.constexpr(window), gl.constexpr(edges)
        KEYMASK = gl.constexpr((edges and not causal) or keypad)
        DROPOUT = gl.constexpr(dropout)

        @gluon.jit
        def consumer(q_smem, do_smem, o_smem, k_smem, v_smem, e0_smem, q_bar, ready, empty, DQ, R, QR, M, LOG2L, DELTA,
                     row0, stats, out_row, out_col, out_stride, lo, hi, seqlen, kend, c, tau, store_qr, sc, cap, wl, wr,
                     drow0, DG, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale, half):
            _dq_consumer(q_smem, do_smem, o_smem, k_smem, v_smem, e0_smem, q_bar, ready, empty, DQ, R, QR, M, LOG2L,
                         DELTA, GPROJ, CAUSAL, SOFTCAP, WINDOW, EDGES, KEYMASK, DROPOUT, row0, stats, out_row, out_col,
                         out_stride, lo, hi, seqlen, kend, c, tau, store_qr, sc, cap, wl, wr, drow0, DG, bh, seed_lo,
                         seed_hi, drop_off, drop_thr, drop_scale, half)

        return consumer

    @functools.lru_cache(maxsize=None)
    def _dq_kernel_for(gproj: bool, causal: bool, softcap: bool, window: bool, varlen: bool = False,
                       edges: bool = False, keypad: bool = False, dropout: bool = False):
        """The dQ kernel with GProj's projection (gproj), the causal mask, the softcap, the sliding window, packed
        sequences (varlen), sequence ends inside tiles (edges, as :func:`_dkdv_kernel_for`), right key padding
        (keypad, as :func:`_dkdv_kernel_for`) and attention dropout (the forward's keep mask, :func:`_dq_tile`)
        compiled in or out."""
        if keypad and (window or varlen):
            raise ValueError("keypad: not with window or varlen")
        GPROJ, CAUSAL, WINDOW = gl.constexpr(gproj), gl.constexpr(causal), gl.constexpr(window)
        VARLEN, KEYPAD = gl.constexpr(varlen), gl.constexpr(keypad)
        consumer = _dq_partition(gproj, causal, softcap, window, edges or varlen, keypad, dropout)
        loader = _dq_loader_for(keypad)

        @gluon.jit(do_not_specialize=DROPOUT_SCALARS)
        def _hopper_dq_kernel(q_desc, do_desc, o_desc, k_desc, v_desc, e0_desc, DQ, R, QR, M, LOG2L, DELTA, CU, SEQLENS, K,
                              V, c, tau, H, GROUP, N_CTX, store_qr, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, o_rb, o_rh, o_ch,
                              k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, k_cols, v_cols, sc, cap, wl, wr, DG, seed_lo, seed_hi,
                              drop_off, drop_thr, drop_scale):
            # Tiles located as in _hopper_dkdv_kernel; dq and −ρ∘Q: (batch, seqlen, nheads, headdim) contiguous.
            # VARLEN as in _hopper_dkdv_kernel: b is the sequence, its rows start at CU[b]. KEYPAD: keys [0,
            # SEQLENS[b]) of batch row b are valid; its K/V tiles come through descriptors made on the device
            # (kernels/attention_fwd_hopper.keys_descriptor: zeros past them), of K, V with k_cols, v_cols columns.
            # Dropout (unused without it): kernels/attention_fwd_hopper.dropout_kernel_args; the counters' rows are the
            # (packed) rows start + row0 + …, bh = b·H + h (b = 0 when packed: h).
            HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
            dtype: gl.constexpr = q_desc.dtype
            pid_m = gl.program_id(0)
            if CAUSAL:  # heaviest query blocks (the most keys) first
                pid_m = gl.num_programs(0) - 1 - pid_m
            pid_bh = gl.program_id(1)
            b = pid_bh // H
            h = pid_bh % H
            hk = h // GROUP
            row0 = pid_m * _DQ_BLOCK_M
            b, start, seqlen = sequence_span(CU, b, N_CTX, VARLEN)
            if row0 >= seqlen:  # VARLEN: the grid spans the longest sequence
                return
            lo, hi, kend = block_keys(row0, seqlen, CAUSAL, SEQLENS, b, wl, wr, _DQ_BLOCK_M, _DQ_BLOCK_N, WINDOW, KEYPAD)
            stats = (b * H + h).to(gl.int64) * N_CTX + start

            q_smem = gl.allocate_shared_memory(dtype, [2, _DQ_HALF_M, HEAD_DIM], q_desc.layout)
            do_smem = gl.allocate_shared_memory(dtype, [2, _DQ_HALF_M, HEAD_DIM], do_desc.layout)
            o_smem = gl.allocate_shared_memory(dtype, [2, _DQ_HALF_M, HEAD_DIM], o_desc.layout)
            k_smem = gl.allocate_shared_memory(dtype, [_NUM_STAGES, _DQ_BLOCK_N, HEAD_DIM], k_desc.layout)
            v_smem = gl.allocate_shared_memory(dtype, [_NUM_STAGES, _DQ_BLOCK_N, HEAD_DIM], v_desc.layout)
            if GPROJ:
                e0_smem = gl.allocate_shared_memory(dtype, [_DQ_BLOCK_N, _ROWSUM_N], e0_desc.layout)
            else:
                e0_smem = q_smem.index(0)  # not read; shaped like the stand-in e0_desc (q's) for the loader's dead branch
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bar, count=1)
            ready, empty = ring_barriers(_NUM_STAGES)

            out_row = b * N_CTX + start + row0
            bh = b * H + h  # the dropout counters' c1; their rows are the (packed) rows start + row0 + …
            args0 = (q_smem, do_smem, o_smem, k_smem, v_smem, e0_smem, q_bar, ready, empty, DQ, R, QR, M, LOG2L, DELTA, row0,
                     stats, out_row, h * HEAD_DIM, H * HEAD_DIM, lo, hi, seqlen, kend, c, tau, store_qr, sc, cap, wl, wr,
                     start + row0, DG, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale, 0)
            args1 = (q_smem, do_smem, o_smem, k_smem, v_smem, e0_smem, q_bar, ready, empty, DQ, R, QR, M, LOG2L, DELTA, row0,
                     stats, out_row, h * HEAD_DIM, H * HEAD_DIM, lo, hi, seqlen, kend, c, tau, store_qr, sc, cap, wl, wr,
                     start + row0, DG, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale, 1)
            first = start + row0
            k_row = b * k_rb + hk * k_rh + start
            v_row = b * v_rb + hk * v_rh + start
            loader_args = (q_desc, do_desc, o_desc, k_desc, v_desc, e0_desc, q_smem, do_smem, o_smem, k_smem, v_smem,
                           e0_smem, q_bar, ready, empty, b * q_rb + h * q_rh + first, h * q_ch,
                           b * do_rb + h * do_rh + first, h * do_ch, b * o_rb + h * o_rh + first, h * o_ch, K, V, kend,
                           k_cols, v_cols, k_row, hk * k_ch, v_row, hk * v_ch, lo, hi, GPROJ)
            gl.warp_specialize([(consumer, args0), (consumer, args1), (loader, loader_args)], [4, 1], [240, 24])

        return _hopper_dq_kernel


def enabled() -> bool:
    """GPROJ_HOPPER_BWD=0 keeps every call on the ``tl.dot`` kernels (A/B timing, escape hatch)."""
    return os.environ.get("GPROJ_HOPPER_BWD", "1") != "0"


def tma_ready(x: torch.Tensor):
    """do or o (any strides in attention_bwd.backward) as these kernels' TMA reads it: x itself when its memory is
    in a served order (kernels/attention_fwd_hopper._tma_view), else a fresh copy in standard strides (a fresh
    allocation: ``.contiguous()`` would return a tensor that only PyTorch calls contiguous, e.g. batch 1 with an
    odd batch stride, or a misaligned one, unchanged); None if even the copy is not served. Never raises."""
    if _tma_view(x) is not None:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    return x if _tma_view(x) is not None else None


def accepts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> bool:
    """The shape, dtype and layout half of :func:`serves` (any device): the Gluon forward's inputs
    (kernels/attention_fwd_hopper.accepts) at a head dim in HEAD_DIMS (128, 64), do shaped like q in its dtype (any strides: a do
    that is not in a served memory order is copied). Never raises."""
    return (_fwd_accepts(q, k, v) and q.shape[3] in HEAD_DIMS and do.shape == q.shape and do.dtype == q.dtype)


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, key_sums: bool = False) -> bool:
    """Whether :func:`dkdv` serves these (already validated) inputs: an sm_90 GPU (not the interpreter, Gluon
    importable, GPROJ_HOPPER_BWD not 0) and :func:`accepts`; with ``key_sums`` (an fp32 dk's Σ_j dk_j for the C2
    projection) only a seqlen that is a multiple of BLOCK_N (the per-64-key sums would take the rows past the end).
    The caller checks the rest (fix "none" or "gproj" with its own-GEMM dK term, ds_format "bf16", no
    packing (:func:`serves_varlen`), key padding only without a window). Never raises."""
    return enabled() and on_sm90(q) and accepts(q, k, v, do) and not (key_sums and q.shape[1] % BLOCK_N)


def serves_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, varlen,
                  key_sums: bool = False) -> bool:
    """Whether both passes serve packed sequences: GPROJ_HOPPER_BWD not 0, kernels/attention_fwd_hopper.packed_ok (q, k,
    v, do their (1, total, heads, headdim) views, one cu_seqlens tensor for queries and keys), a head dim in HEAD_DIMS, no
    ``key_sums`` (not kept per sequence). The caller checks the rest, as for :func:`serves`. Never raises."""
    return (enabled() and not key_sums and packed_ok(q, k, v, varlen) and q.shape[3] in HEAD_DIMS
            and do.shape == q.shape and do.dtype == q.dtype)


def _layout(head_dim: int, dtype: torch.dtype):
    """The shared layout of every tile here: TILE_ROWS = 64 rows (q, do, o, −ρ∘Q, the halves of k, v and the dQ pass's K/V
    tiles), the forward's q / o tile layout (cached there)."""
    return _layouts(head_dim, dtype)[0]


def _descriptors(*tensors, shared: dict | None = None):
    """TMA descriptors of ``tensors`` in 64-row tiles and their tile locators (rb, rh, ch), in the kernels'
    argument order. ``shared``: a dict that both passes of one backward pass in (keyed by the tensors' ids, so it
    must not outlive them): q, do, k and v are described once for the two (building a descriptor is most of the
    host time of a launch: benchmarks/NOTES.md, runs 30 and 31)."""
    descs, where = [], []
    for x in tensors:
        made = None if shared is None else shared.get(id(x))
        if made is None:
            made = tma_descriptor(x, TILE_ROWS, _layout(x.shape[3], x.dtype))
            if shared is not None:
                shared[id(x)] = made
        descs.append(made[0])
        where += made[1]
    return descs, where


def dkdv(q, k, v, do, m, log2l, delta, qr, c: float, softmax_scale: float, causal: bool, dk_dtype: torch.dtype,
         dv_dtype: torch.dtype, want_key_sums: bool, softcap: float = 0.0, window: tuple[int, int] | None = None,
         cu_seqlens: torch.Tensor | None = None, max_seqlen: int = 0, seqlens_k: torch.Tensor | None = None,
         descriptors: dict | None = None, dropout_p: float = 0.0, dropout_seed: int = 0, dropout_offset: int = 0):
    """The dK/dV pass on Hopper; call only where :func:`serves` is True, after the dQ pass.

    Args:
        q, k, v, do: as :func:`lightning_gproj.kernels.attention_bwd.backward` takes them (:func:`accepts`).
        m, log2l: (batch, nheads, seqlen) fp32 from the forward; delta: D = rowsum(dO∘O), same shape, from
            the dQ pass.
        qr: None (fix="none") or bf16(−ρ∘Q), (batch, seqlen, nheads, headdim) contiguous in q's dtype, from the
            dQ pass (fix="gproj": the dK term P̃ᵀ(−ρ∘Q) runs as its own GEMM).
        c: the exponent's factor τ·log2e (log2e with softcap). softmax_scale: τ. causal: the causal mask.
        dk_dtype, dv_dtype: q's dtype or torch.float32.
        want_key_sums: with an fp32 dk, also Σ_j dk_j over each batch row's keys.
        softcap: 0 (off) or the cap of the logits z = cap·tanh(τ s / cap); the dK operand is then X̃ = bf16(dZ∘g),
            g = 1 − tanh², and GProj's dK direction bf16(P̃∘g) (kernels/reference.py).
        window: None, or (wl, wr) >= 0: row i sees keys i − wl … i + wr only (kernels/_triton_utils.window_args;
            ``causal`` False).
        cu_seqlens, max_seqlen: packed sequences (:func:`serves_varlen`): the tensors are (1, total, heads,
            headdim) views, m, log2l, delta (1, nheads, total), cu_seqlens int32 (nseq + 1,) for queries and keys
            alike; not with ``want_key_sums``.
        seqlens_k: None, or int32 (batch,) contiguous, each in [1, seqlen] (not checked): right key padding as the
            forward ran with it (kernels/attention_fwd_hopper.forward); not with ``window`` or packed sequences.
            Padded keys get dk = dv = 0 exactly, and their values reach no other result.
        descriptors: None, or a dict shared with :func:`dq_pass` of the same backward (its TMA descriptors of q, do, k,
            v are reused; the dict must not outlive the tensors).
        dropout_p, dropout_seed, dropout_offset: attention dropout as the forward ran with it (0: off, the kernel without
            it): dV = ((P̃ ∘ M)/(1 − p̂))ᵀ dO, dP' = M ∘ dP / (1 − p̂) (kernels/attention_bwd.py).

    Returns:
        dk, dv (batch, seqlen, nheads_k, headdim) contiguous in dk_dtype / dv_dtype (GQA: summed over each kv
        head's query heads), and key_sums: (batch, nheads_k, headdim) fp64 summed from per-64-key fp32 sums
        of the stored dk, or None unless ``want_key_sums``.
    """
    b, n, h, d = q.shape
    hk = k.shape[2]
    dk = torch.empty((b, n, hk, d), dtype=dk_dtype, device=q.device)
    dv = torch.empty((b, n, hk, d), dtype=dv_dtype, device=q.device)
    packed = cu_seqlens is not None
    edges = packed or n % BLOCK_N != 0
    if edges and want_key_sums:
        raise ValueError("dkdv: key sums are kept only for a seqlen that is a multiple of 128, not packed")
    slots = n // KEYS_PER_SUM
    ks = torch.empty((b, hk, slots, d), dtype=torch.float32, device=q.device) if want_key_sums else delta
    descs, where = _descriptors(q, do, q if qr is None else qr, k, v, shared=descriptors)  # q: a placeholder, not read
    keypad = seqlens_k is not None
    m_blocks = triton.cdiv(max_seqlen if packed else n, BLOCK_N)
    rows = (cu_seqlens.numel() - 1 if packed else b) * hk
    persist, tiles, grid = dkdv_schedule(m_blocks, rows, window is not None, packed, keypad, dropout_p > 0,
                                         qr is not None, q.device)
    kernel = _dkdv_kernel_for(qr is not None, bool(causal), softcap > 0, window is not None, packed, edges, keypad,
                              dropout_p > 0, persist)
    # No descriptor is made on the device here (the padded keys' dk rows are zeroed instead): no scratch.
    launch(kernel, grid, q.device, False, *descs, dk, dv, ks, m, log2l, delta, cu_seqlens if packed else delta,
           seqlens_k if keypad else delta, float(c), float(softmax_scale), h, h // hk, n, int(bool(want_key_sums)),
           m_blocks, tiles, *where,
           *feature_args(softmax_scale, softcap, window), *dropout_kernel_args(dropout_p, dropout_seed, dropout_offset, n))
    return dk, dv, (ks.sum(dim=2, dtype=torch.float64) if want_key_sums else None)


def dkdv_schedule(m_blocks: int, rows: int, window: bool, packed: bool, keypad: bool, dropout: bool, gproj: bool,
                  device: torch.device) -> tuple[bool, int, tuple[int, ...]]:
    """(persist, TILES, grid) of the dK/dV kernel for ``m_blocks`` key blocks of ``rows`` (batch rows or sequences) ·
    kv heads. Without GProj's dK term (``gproj``) and where kernels/attention_fwd_hopper.persistent allows it (dense, no
    window, key padding or dropout), the persistent kernel where its items fill the device
    (kernels/attention_fwd_hopper.paired_items): TILES block slots (each head's an even number, :func:`dkdv_block`:
    causal blocks paired heaviest with lightest) in items of two, one program per SM; elsewhere, or with
    GPROJ_BWD_PERSISTENT=0 (for A/B timing), one block per program, grid (m_blocks, rows). On an H200 the persistent
    kernel ran fix "none"'s backward 3–6% faster with the causal mask and at head dim 64, as fast on full attention at
    head dim 128; GProj's (one K/V buffer: the −ρ∘Q ring leaves no shared memory for a second) −2.3…+3.5%
    (benchmarks/NOTES.md, run 41)."""
    paired = None
    if os.environ.get("GPROJ_BWD_PERSISTENT", "1") != "0" and not gproj and persistent(window, packed, keypad, dropout):
        paired = paired_items(m_blocks, rows, device)
    if paired is None:
        return False, m_blocks * rows, (m_blocks, rows)
    tiles, programs = paired
    return True, tiles, (programs,)


def compile_sm90(dtype: torch.dtype = torch.bfloat16, gproj: bool = True, causal: bool = False,
                 dk_dtype: torch.dtype | None = None, ones: tuple[str, ...] = (), softcap: bool = False,
                 window: bool = False, varlen: bool = False, edges: bool = False, head_dim: int = HEAD_DIMS[0],
                 keypad: bool = False, dropout: bool = False, persist: bool = False):
    """Compile the kernel for sm_90 without a GPU (Triton's ahead-of-time path), as CI does: head dim ``head_dim``, dk
    in ``dk_dtype`` (default: ``dtype``; torch.float32 for the fp32-dk path), dv in ``dtype``. ``ones`` names
    integer arguments compiled as the constant 1, as Triton specializes them at launch (``key_sums``,
    ``GROUP``). ``persist``: the persistent kernel (:func:`dkdv_schedule`). Returns the compiled kernel. Raises RuntimeError if Gluon is not importable."""
    _require_gluon()
    d = head_dim
    t = tensordesc_type(dtype, TILE_ROWS, d, _layout(d, dtype))
    sig = {"q_desc": t, "do_desc": t, "qr_desc": t, "k_desc": t, "v_desc": t, "DK": pointer_type(dk_dtype or dtype),
           "DV": pointer_type(dtype), "KS": "*fp32", "M": "*fp32", "LOG2L": "*fp32", "DELTA": "*fp32",
           "CU": "*i32" if varlen else "*fp32", "SEQLENS": "*i32" if keypad else "*fp32", "c": "fp32",
           "tau": "fp32", "H": "i32", "GROUP": "i32", "N_CTX": "i32", "key_sums": "i32", "M_BLOCKS": "i32",
           "TILES": "i32",
           **{f"{x}_{w}": "i32" for x in ("q", "do", "qr", "k", "v") for w in ("rb", "rh", "ch")}, "sc": "fp32", "cap": "fp32",
           "wl": "i32", "wr": "i32", **DROPOUT_SIGNATURE}
    return aot_compile_sm90(_dkdv_kernel_for(bool(gproj), bool(causal), bool(softcap), bool(window), bool(varlen),
                                             bool(edges), bool(keypad), bool(dropout), bool(persist)), sig,
                            {arg: 1 for arg in ones})


def _e0(device: torch.device, dtype: torch.dtype):
    """The e0 tile (TILE_ROWS keys × ROWSUM_N, ones in column 0) and its TMA descriptor: cached per device and dtype,
    except while a CUDA graph is being captured (its fill would be recorded, not run, and an eager call before the
    graph's first replay would read the unfilled tile): then a fresh one, filled at each replay."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _e0_tile(device, dtype)
    return _e0_cached(device, dtype)


def _e0_tile(device: torch.device, dtype: torch.dtype):
    e0 = torch.zeros((TILE_ROWS, ROWSUM_N), dtype=dtype, device=device)
    e0[:, 0] = 1
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor(e0, [TILE_ROWS, ROWSUM_N], [ROWSUM_N, 1], [TILE_ROWS, ROWSUM_N], _e0_layout(dtype))


def _e0_layout(dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([TILE_ROWS, ROWSUM_N], _gl_dtype(dtype))


_e0_cached = functools.lru_cache(maxsize=None)(_e0_tile)


def dq_pass(q, k, v, do, o, m, log2l, delta, dq, c: float, softmax_scale: float, causal: bool, r=None, qr=None,
            softcap: float = 0.0, window: tuple[int, int] | None = None, cu_seqlens: torch.Tensor | None = None,
            max_seqlen: int = 0, seqlens_k: torch.Tensor | None = None, descriptors: dict | None = None,
            dropout_p: float = 0.0, dropout_seed: int = 0, dropout_offset: int = 0):
    """The dQ pass on Hopper, fix "none" or "gproj"; call only where :func:`serves` is True, with do and o as
    :func:`tma_ready` returns them (o shaped like q, in its dtype).

    Args:
        q, k, v, do, o: as :func:`lightning_gproj.kernels.attention_bwd.backward` takes them.
        m, log2l: (batch, nheads, seqlen) fp32 from the forward. delta: same shape, written: D = rowsum(dO∘O).
        dq: (batch, seqlen, nheads, headdim) contiguous in q's dtype or fp32, written: τ Σ_j dS̃_ij k_j, with
            fix="gproj" minus τ ρ_i (P̃K)_i (ρ_i = r_i / Σ_j P̃_ij), accumulated in fp32 and rounded once.
        c: τ·log2e (log2e with softcap). softmax_scale: τ. causal: the causal mask.
        r: None (fix="none"), or (batch, nheads, seqlen) fp32, written: r_i = Σ_j dS̃_ij (fix="gproj").
        qr: None, or with r: (batch, seqlen, nheads, headdim) contiguous in q's dtype, written: −ρ∘Q rounded
            (the B operand of :func:`dkdv`'s GProj term).
        softcap: 0 (off) or the cap of the logits z = cap·tanh(τ s / cap): the dQ operand is X̃ = bf16(dZ∘g),
            g = 1 − tanh², r_i = Σ_j X̃_ij / g_ij and GProj's direction bf16(P̃∘g) (kernels/reference.py).
        window: None, or (wl, wr) >= 0, as :func:`dkdv`.
        cu_seqlens, max_seqlen: packed sequences, as :func:`dkdv` (dq, qr (1, total, nheads, headdim), r (1, nheads,
            total)).
        seqlens_k: None, or right key padding as :func:`dkdv` takes it; the K/V tiles are loaded through TMA
            descriptors made on the device that end at seqlens_k[b] (kernels/attention_fwd_hopper.launch).
        descriptors: None, or a dict shared with :func:`dkdv`, as there.
        dropout_p, dropout_seed, dropout_offset: attention dropout as the forward ran with it (0: off, the kernel without
            it): the forward's keep mask M regenerated per tile, dP' = M ∘ dP / (1 − p̂) (kernels/attention_bwd.py).
    """
    b, n, h, d = q.shape
    hk = k.shape[2]
    descs, where = _descriptors(q, do, o, k, v, shared=descriptors)
    gproj = r is not None
    e0 = _e0(q.device, q.dtype) if gproj else descs[0]  # fix="none": a placeholder the kernel never reads
    packed = cu_seqlens is not None
    grid = (triton.cdiv(max_seqlen if packed else n, _DQ_BLOCK_M.value), (cu_seqlens.numel() - 1 if packed else b) * h)
    keypad = seqlens_k is not None
    kernel = _dq_kernel_for(gproj, bool(causal), softcap > 0, window is not None, packed, n % _DQ_BLOCK_M.value != 0, keypad,
                            dropout_p > 0)
    launch(kernel, grid, q.device, keypad, *descs, e0, dq, delta if r is None else r, q if qr is None else qr, m, log2l,
           delta, cu_seqlens if packed else delta, seqlens_k if keypad else delta, k, v, float(c), float(softmax_scale), h,
           h // hk, n, int(qr is not None), *where, descs[3].shape[1], descs[4].shape[1],  # k, v: their views' widths
           *feature_args(softmax_scale, softcap, window), *dropout_kernel_args(dropout_p, dropout_seed, dropout_offset, n))


def compile_dq_sm90(dtype: torch.dtype = torch.bfloat16, gproj: bool = True, causal: bool = False,
                    dq_dtype: torch.dtype | None = None, ones: tuple[str, ...] = (), softcap: bool = False,
                    window: bool = False, varlen: bool = False, edges: bool = False, head_dim: int = HEAD_DIMS[0],
                    keypad: bool = False, dropout: bool = False):
    """Compile the dQ kernel for sm_90 without a GPU, as :func:`compile_sm90` does the dK/dV one (``ones``:
    ``store_qr``, ``GROUP``)."""
    _require_gluon()
    d = head_dim
    t = tensordesc_type(dtype, TILE_ROWS, d, _layout(d, dtype))
    e0 = tensordesc_type(dtype, TILE_ROWS, ROWSUM_N, _e0_layout(dtype)) if gproj else t
    sig = {"q_desc": t, "do_desc": t, "o_desc": t, "k_desc": t, "v_desc": t, "e0_desc": e0,
           "DQ": pointer_type(dq_dtype or dtype), "R": "*fp32", "QR": pointer_type(dtype), "M": "*fp32",
           "LOG2L": "*fp32", "DELTA": "*fp32", "CU": "*i32" if varlen else "*fp32",
           "SEQLENS": "*i32" if keypad else "*fp32", "K": pointer_type(dtype), "V": pointer_type(dtype), "c": "fp32",
           "tau": "fp32", "H": "i32", "GROUP": "i32", "N_CTX": "i32",
           "store_qr": "i32", **{f"{x}_{w}": "i32" for x in ("q", "do", "o", "k", "v") for w in ("rb", "rh", "ch")},
           "k_cols": "i32", "v_cols": "i32", "sc": "fp32", "cap": "fp32", "wl": "i32", "wr": "i32", **DROPOUT_SIGNATURE}
    return aot_compile_sm90(_dq_kernel_for(bool(gproj), bool(causal), bool(softcap), bool(window), bool(varlen),
                                           bool(edges), bool(keypad), bool(dropout)), sig,
                            {arg: 1 for arg in ones})
