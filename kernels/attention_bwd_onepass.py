"""A one-pass backward for fix "none" on Hopper (sm_90), written in Gluon (issue 12, lever 1).

:func:`lightning_gproj.kernels.attention_bwd.backward` runs fix "none" on dense inputs in two passes
(kernels/attention_bwd_hopper.py: a dQ pass over key tiles, a dK/dV pass over query tiles): 7 tile GEMMs per (64 query
rows, 64 keys). This kernel does FlashAttention-3's one pass, 5 GEMMs: one program per (128 keys, batch · kv head), a
1-warp loader (the dK/dV pass's own, kernels/attention_bwd_hopper._dkdv_partitions) streams (Q, dO) tiles of 64 query
rows with their m, log2l, D rows; two 4-warp consumers own 64 keys each and compute per tile, as the dK/dV pass,
Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, P̃ᵀ, dV += P̃ᵀ dO, dS̃ᵀ = bf16(Pᵀ∘(dPᵀ − D)), dK += dS̃ᵀ Q — and also store dS̃ᵀ to shared
memory. They meet at an mbarrier, and consumer h computes columns [h·d/2, (h + 1)·d/2) of the tile's dQ partial over
all 128 keys (dS̃ · K[:, cols], two wgmmas from shared memory) and adds it into an fp32 buffer by one TMA reduce-add of
a contiguous chunk of 64 · d/2 floats (16 KB at d 128; FlashAttention-3's dQaccum layout: the partial is staged in the
wgmma accumulator's own thread order, :func:`bulk_bases`, and added as a [d/8, 256] box; chunk ((b·seqlen + row) / 64
· nheads + h) · 2 + half). Before it, a small kernel computes D = rowsum(dO∘O) and zeroes the buffer; after it, another un-permutes the
chunks into dq = τ dQ, rounded once. Causal calls at head dim 64 split the tile's dQ partial by keys instead
(:func:`keysplit`): each consumer computes dS̃ · K over its own 64 keys and all d columns and adds it into the chunk pair
by one reduce-add, with no barrier between the consumers.

The rounding points are the two passes' (kernels/reference.py, fix "none"): P̃ and dS̃ rounded to the input dtype, every
sum in fp32. dv equals the loop-less dK/dV pass's bit for bit (the same tile code and order); dk and dq differ from the
two passes' in the order of fp32 sums only (D = rowsum(dO∘O) comes from another kernel, dq's partials are added in
another order: 1e-6–3e-4 relative on an H200, benchmarks/NOTES.md run 43) — and, since the reduce-adds land in the order
the programs reach them, dq is not bit-reproducible from call to call (as FlashAttention-3's and cuDNN's default
backwards are not): calls under ``torch.use_deterministic_algorithms(True)`` or with ``deterministic=True`` keep the two
passes.

Served (:func:`serves`): what the Gluon passes serve (kernels/attention_bwd_hopper.serves) at head dim 128 or 64 and a
seqlen that is a multiple of 128, dense (no packed sequences, key padding, window, softcap or dropout), without statistics;
full attention at any such seqlen, causal without GQA from :data:`CAUSAL_MIN_SEQLEN` keys on (8192 at head dim 128, 2048
at 64; :func:`pays`). Measured on an H200 (benchmarks/NOTES.md, runs 43 and 44, benchmarks/onepass_ab.py): the backward
7–25% faster than the two passes on full attention (d 128: 4×16×2048, 1×16×4096, 1×16×8192, 1×8×16384, GQA 8:1; d 64:
4×16×2048, 2×16×4096, GQA 8:1), −7…+5% on causal rows of 8192 keys and +10–11% on 16384 at head dim 128; slower on
shorter causal rows there (−2…−5% at 2048 and 4096: the diagonal tiles stall one consumer at the dQ barrier) and on
causal rows with GQA (−6…−14% at 2048–8192 keys, +0.4% at 16384: the stall comes once per query head of the group). At
head dim 64 causal calls split the dQ partials by keys (:func:`keysplit`: no barrier): +3% at 2048 keys, +8% at 4096
(+12% with two staging buffers), −1% with GQA 8:1. ``GPROJ_ONEPASS_BWD=0`` keeps every call on the two passes.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from lightning_gproj.kernels import attention_bwd_hopper as HB
from lightning_gproj.kernels.attention_fwd_hopper import GLUON_ERROR, _require_gluon, launch, pointer_type

__all__ = ["serves", "pays", "keysplit", "backward", "compile_sm90", "bulk_bases", "CAUSAL_MIN_SEQLEN", "HEAD_DIMS"]

#: The head dims the kernel is written for (the two consumers' dQ column halves of 64 or 32; split by keys, 64 columns).
HEAD_DIMS = (128, 64)
#: Causal calls without GQA take the one pass from this seqlen on, per head dim (benchmarks/NOTES.md: d 128, run 43: 2048
#: and 4096 lost 2–5%, 8192 −7…+5%, 16384 +10–11%, with GQA 8:1 or 2:1 8192 lost 6–12%; d 64 split by keys, run 44:
#: 2048 +3%, 4096 +8%, GQA 8:1 at 4096 −1%).
CAUSAL_MIN_SEQLEN = {128: 8192, 64: 2048}


def bulk_bases(head_dim: int) -> tuple:
    """Offset bits, low to high, of a staged [64 rows, head_dim / 2 columns] fp32 dQ partial in its chunk (32 · head_dim
    floats), as (row bit, column bit) pairs: the wgmma accumulator's (NVMMA v3, 4 warps, n = head_dim / 2;
    gl.to_linear_layout) register bits c0 and r3, its lane bits c1, c2, r0, r1, r2, its warp bits r4, r5, then its
    remaining register bits c3, c4[, c5]. Thread-major: each thread's registers land at 16-byte vectors and a warp's
    stores fill 512 contiguous bytes (no bank conflicts). Raises ValueError for a head_dim not in HEAD_DIMS."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim!r}")
    cols = ((0, 8), (0, 16), (0, 32))[:(head_dim // 2).bit_length() - 4]
    return ((0, 1), (8, 0), (0, 2), (0, 4), (1, 0), (2, 0), (4, 0), (16, 0), (32, 0)) + cols


if GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )

    from lightning_gproj.kernels.attention_fwd_hopper import aot_compile_sm90, tensordesc_type

    if hasattr(tma, "async_atomic_add"):  # Triton 3.9
        tma_reduce_add = tma.async_atomic_add
    else:  # Triton 3.6: the builder has the op, the language does not
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin

        @builtin
        def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)

    # shared_memory_descriptor.reinterpret (3.9) / ._reinterpret (3.6); gl.barrier (3.9) / gl.thread_barrier (3.6):
    # bar.sync of the partition's warps
    _reinterpret = (getattr(gl.shared_memory_descriptor, "reinterpret", None)
                    or gl.shared_memory_descriptor._reinterpret)
    _cta_sync = getattr(gl, "barrier", None) or gl.thread_barrier

    _HALF_N = gl.constexpr(HB.TILE_ROWS)  # keys per consumer
    _BLOCK_M = gl.constexpr(HB.TILE_ROWS)  # query rows per tile
    _STAGE_64 = gl.constexpr(gl.SharedLinearLayout([list(b) for b in bulk_bases(128)]))  # [64, 64] partials
    _STAGE_32 = gl.constexpr(gl.SharedLinearLayout([list(b) for b in bulk_bases(64)]))  # [64, 32] partials

    @gluon.jit
    def _tile(k, v, q, do, dk, dv, keys, key0, rows, start_m, c, m_s, l_s, d_s, ds_out, CAUSAL: gl.constexpr):
        """kernels/attention_bwd_hopper._dkdv_tile without its features (dense, fix none), with dS̃ᵀ also stored to
        ``ds_out`` (shared [64 keys, 64 rows]) and the dV and dK GEMMs left in flight (the dQ GEMMs are issued before
        the wait). Returns (dk, dv)."""
        HEAD: gl.constexpr = k.shape[1]
        dtype: gl.constexpr = k.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        sT, dpT, m, l2 = HB.scores_t(k, v, q, do, m_s, l_s, rows)
        pT = gl.exp2((sT - m[None, :]) * c - l2[None, :])  # the forward's FMA-safe exponent
        if CAUSAL:
            if start_m < key0 + _HALF_N:
                pT = gl.where(keys[:, None] <= rows[None, :], pT, 0.0)
        p16 = gl.convert_layout(pT.to(dtype), a_layout)  # rounding point: P̃
        dv = warpgroup_mma(p16, do, dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT,))
        di = d_s.load(rows.type.layout)
        ds16 = (pT * (dpT - di[None, :])).to(dtype)  # rounding point: dS̃
        dk = warpgroup_mma(gl.convert_layout(ds16, a_layout), q, dk, is_async=True)
        ds_out.store(ds16)
        return dk, dv

    @gluon.jit
    def _dq_gemm(ds_smem, kd0, kd1, ds_bar, st, ph):
        """Once both consumers' dS̃ᵀ of the tile are in ds_smem slots 2·st, 2·st + 1 (ds_bar[st] completes phase ph):
        this consumer's columns of the tile's dQ partial dS̃ · K (kd0, kd1: its columns of the two key halves), issued
        (returned in flight)."""
        DQ_N: gl.constexpr = kd0.shape[1]
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_N, 16])
        fence_async_shared()
        _cta_sync()
        mbarrier.arrive(ds_bar.index(st), count=1)
        mbarrier.wait(ds_bar.index(st), ph)
        zero = gl.zeros([_BLOCK_M, DQ_N], gl.float32, layout=dq_layout)
        dq = warpgroup_mma(ds_smem.index(2 * st).permute((1, 0)), kd0, zero, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_smem.index(2 * st + 1).permute((1, 0)), kd1, dq, is_async=True)
        return dq

    @gluon.jit
    def _dq_gemm_own(ds_out, k):
        """Key split (:func:`keysplit`): this consumer's dQ partial over its own 64 keys, dS̃ · K (ds_out: its dS̃ᵀ as
        :func:`_tile` stored it; k: its [64 keys, d] of K), issued once its warps' stores are visible to the tensor
        cores (returned in flight). No barrier with the other consumer."""
        HEAD: gl.constexpr = k.shape[1]
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HEAD, 16])
        fence_async_shared()
        _cta_sync()
        zero = gl.zeros([_BLOCK_M, HEAD], gl.float32, layout=dq_layout)
        return warpgroup_mma(ds_out.permute((1, 0)), k, zero, use_acc=False, is_async=True)

    @gluon.jit
    def _dq_add_turn(dq, stage0, stage1, dqc_desc, chunk, turn):
        """:func:`_dq_add` staged in stage0 and stage1 by turns (``turn`` counts this consumer's reduces): turn i's
        reduce waits only for the one of turn i − 2 to have read its buffer. Split by keys (run 44: +3.5% on
        2×16×4096×64 causal; split by columns two buffers measured 1–2% slower on full attention and are not used)."""
        if turn % 2 == 0:
            _dq_add(dq, stage0, dqc_desc, chunk, 1)
        else:
            _dq_add(dq, stage1, dqc_desc, chunk, 1)

    @gluon.jit
    def _dq_add(dq, stage, dqc_desc, chunk, PENDING: gl.constexpr):
        """Add this consumer's [64, d/2] dQ partial into chunk ``chunk`` of the fp32 buffer (viewed as [chunks · d/8,
        256]) by one TMA reduce-add of a [d/8, 256] box without swizzle, staged in ``stage`` (layout bulk_bases(d))
        once the reduce before the last PENDING ones has read it (0: one staging buffer, 1: two, used in turn). Split by
        keys (d 64): a [64, d] partial into the chunk pair
        ``chunk`` (chunks 2·chunk, 2·chunk + 1: a [d/4, 256] box; layout bulk_bases(2·d), whose top column bit picks
        the chunk)."""
        BOX: gl.constexpr = dqc_desc.block_type.shape[0]
        tma.store_wait(pendings=PENDING)
        stage.store(dq)
        fence_async_shared()
        tma_reduce_add(dqc_desc, [chunk * BOX, 0], _reinterpret(stage, gl.float32, [BOX, 256], dqc_desc.layout))

    def _consumer_for(half: int, causal: bool, split: bool):
        """Consumer ``half`` (its 64 keys of the block) with the causal mask compiled in or out, the dQ partials split
        by keys or by columns (:func:`keysplit`) (closure constants survive gl.warp_specialize, constexpr arguments do
        not)."""
        HALF, CAUSAL, KEYSPLIT = gl.constexpr(half), gl.constexpr(causal), gl.constexpr(split)

        @gluon.jit
        def consumer(q_smem, do_smem, k_smem, v_smem, m_smem, l_smem, d_smem, ds_smem, kv_bar, ready, empty, ds_bar,
                     dqc_desc, DK, DV, start_n, out_row, out_col, out_stride, chunk_row0, H, GROUP, lo, hi, c, tau, h0):
            HEAD: gl.constexpr = k_smem.shape[2]
            DQ_N: gl.constexpr = HEAD // 2
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, 64, 16])
            acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                 instr_shape=[16, HEAD, 16])
            if KEYSPLIT:  # [64, 64] partials, both column halves (chunks 2·pair, 2·pair + 1: bulk_bases(64) + c5), in turn
                stage = gl.allocate_shared_memory(gl.float32, [_BLOCK_M, HEAD], _STAGE_64)
                stage1 = gl.allocate_shared_memory(gl.float32, [_BLOCK_M, HEAD], _STAGE_64)
            elif DQ_N == 64:
                stage = gl.allocate_shared_memory(gl.float32, [_BLOCK_M, DQ_N], _STAGE_64)
            else:
                stage = gl.allocate_shared_memory(gl.float32, [_BLOCK_M, DQ_N], _STAGE_32)
            key0 = start_n + HALF * _HALF_N
            keys = key0 + gl.arange(0, _HALF_N, layout=gl.SliceLayout(1, s_layout))
            dk = gl.zeros([_HALF_N, HEAD], gl.float32, layout=acc_layout)
            dv = gl.zeros([_HALF_N, HEAD], gl.float32, layout=acc_layout)
            k = k_smem.index(HALF)
            v = v_smem.index(HALF)
            kd0 = k_smem.index(0).slice(HALF * DQ_N, DQ_N, dim=1)
            kd1 = k_smem.index(1).slice(HALF * DQ_N, DQ_N, dim=1)
            mbarrier.wait(kv_bar.index(0), 0)
            first_m = lo
            if CAUSAL:
                first_m = key0
            i = 0  # ring position
            j = 0  # split by keys: reduces issued, the staging buffers' turn (consumer 1 issues none for a tile it skips)
            for g in range(GROUP):
                chunk_h = (h0 + g) * 2 + HALF  # chunk = (row block · H + head) · 2 + half; split by keys, pair h0 + g
                if CAUSAL:
                    if HALF == 1:  # the group's first tile (rows start_n … key0 − 1) sees none of these keys: dS̃ᵀ = 0
                        st = i % 2
                        mbarrier.wait(ready.index(st), (i // 2) & 1)
                        if KEYSPLIT:  # nothing to add
                            mbarrier.arrive(empty.index(st), count=1)
                        else:  # consumer 0's dQ columns still need these keys' (zero) dS̃ᵀ
                            ds_smem.index(2 * st + 1).store(gl.zeros([_HALF_N, _BLOCK_M], k_smem.dtype, layout=s_layout))
                            dq = _dq_gemm(ds_smem, kd0, kd1, ds_bar, st, (i // 2) & 1)
                            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
                            mbarrier.arrive(empty.index(st), count=1)
                            _dq_add(dq, stage, dqc_desc, ((chunk_row0 + start_n) // _BLOCK_M) * 2 * H + chunk_h, 0)
                        i += 1
                for start_m in range(first_m, hi, _BLOCK_M):
                    st = i % 2
                    rows = start_m + gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(0, s_layout))
                    mbarrier.wait(ready.index(st), (i // 2) & 1)
                    dk, dv = _tile(k, v, q_smem.index(st), do_smem.index(st), dk, dv, keys, key0, rows, start_m, c,
                                   m_smem.index(st), l_smem.index(st), d_smem.index(st), ds_smem.index(2 * st + HALF),
                                   CAUSAL)
                    if KEYSPLIT:
                        dq = _dq_gemm_own(ds_smem.index(2 * st + HALF), k)
                    else:
                        dq = _dq_gemm(ds_smem, kd0, kd1, ds_bar, st, (i // 2) & 1)
                    dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
                    mbarrier.arrive(empty.index(st), count=1)
                    row_block = (chunk_row0 + start_m) // _BLOCK_M
                    if KEYSPLIT:
                        _dq_add_turn(dq, stage, stage1, dqc_desc, row_block * H + h0 + g, j)
                        j += 1
                    else:
                        _dq_add(dq, stage, dqc_desc, row_block * 2 * H + chunk_h, 0)
                    i += 1
            dk = dk * tau
            out_rows = (out_row + HALF * _HALF_N
                        + gl.arange(0, _HALF_N, layout=gl.SliceLayout(1, acc_layout))).to(gl.int64)
            cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, acc_layout))
            offs = out_rows[:, None] * out_stride + out_col + cols[None, :]
            gl.store(DK + offs, dk.to(DK.dtype.element_ty))
            gl.store(DV + offs, dv.to(DV.dtype.element_ty))
            tma.store_wait(pendings=0)

        return consumer

    @functools.lru_cache(maxsize=None)
    def _kernel_for(causal: bool, split: bool):
        """The one-pass kernel, the causal mask compiled in or out, the dQ partials split by keys (:func:`keysplit`)
        or by columns."""
        consumer0, consumer1 = _consumer_for(0, causal, split), _consumer_for(1, causal, split)
        loader = HB._dkdv_partitions(False, causal, False, False, False)[1]  # the dK/dV pass's loop-less loader
        CAUSAL, SPLIT = gl.constexpr(causal), gl.constexpr(split)

        @gluon.jit
        def _hopper_onepass_kernel(q_desc, do_desc, k_desc, v_desc, dqc_desc, DK, DV, M, LOG2L, DELTA, c, tau, H,
                                   GROUP, N_CTX, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh,
                                   v_ch):
            # Tile (row, col) of a tensor's 2-D TMA view for batch b, head h, position n: (b·rb + h·rh + n, h·ch)
            # (kernels/attention_fwd_hopper._tma_view). dk, dv: (batch, seqlen, nheads_k, headdim) contiguous.
            HEAD: gl.constexpr = q_desc.block_type.shape[1]
            _, _, b, hk, h0, start_n = HB.program_block(H, GROUP)
            HK = H // GROUP
            lo = 0
            if CAUSAL:
                lo = start_n  # earlier query rows see none of these keys
            # The dK/dV pass's (Q, dO) ring with its m, log2l, D rows and one K/V buffer (one block per program: the
            # loader's one wait on kv_empty passes, a fresh barrier); no −ρ∘Q ring.
            q_smem, do_smem, _, k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty = \
                HB._dkdv_smem(q_desc, do_desc, q_desc, k_desc, v_desc, False, 1)
            # dS̃ᵀ of both consumers for both ring slots: slot 2·st + half
            ds_smem = gl.allocate_shared_memory(q_desc.dtype, [4, _HALF_N, _BLOCK_M],
                                                gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                                     rank=2))
            if SPLIT:
                ds_bar = kv_bar  # not used: split by keys, the consumers do not meet
            else:
                ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
                for s in gl.static_range(2):
                    mbarrier.init(ds_bar.index(s), count=2)  # both consumers' dS̃ᵀ stored
            out_row = b * N_CTX + start_n
            args = (q_smem, do_smem, k_smem, v_smem, m_smem, l_smem, d_smem, ds_smem, kv_bar, ready, empty, ds_bar,
                    dqc_desc, DK, DV, start_n, out_row, hk * HEAD, HK * HEAD, b * N_CTX, H, GROUP, lo, N_CTX, c, tau, h0)
            loader_args = (q_desc, do_desc, q_desc, k_desc, v_desc, M, LOG2L, DELTA, q_smem, do_smem, q_smem, k_smem,
                           v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty,
                           b * k_rb + hk * k_rh + start_n, hk * k_ch, b * v_rb + hk * v_rh + start_n, hk * v_ch,
                           b * q_rb, q_rh, q_ch, b * do_rb, do_rh, do_ch, b * q_rb, q_rh, q_ch, h0, GROUP, lo, N_CTX,
                           (b * H + h0).to(gl.int64) * N_CTX, N_CTX, N_CTX)
            gl.warp_specialize([(consumer0, args), (consumer1, args), (loader, loader_args)], [4, 1], [240, 24])

        return _hopper_onepass_kernel

    def _chunk_layout():
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@triton.jit
def _delta_kernel(O, DO, D, ACC, N, H, o_sb, o_sn, o_sh, do_sb, do_sn, do_sh, HEAD: tl.constexpr):
    """D[b, h, n] = Σ_d O[b, n, h, d]·dO[b, n, h, d] in fp32 (O, dO: strides (sb, sn, sh, 1); D (batch, nheads, seqlen)
    contiguous), and the fp32 dQ buffer's two chunks of these 64 rows and head zeroed (the one pass adds into them; no
    fill kernel of its own). Grid (seqlen / 64, batch · nheads)."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = (tl.program_id(0) * 64 + tl.arange(0, 64)).to(tl.int64)
    cols = tl.arange(0, HEAD)[None, :]
    o = tl.load(O + b.to(tl.int64) * o_sb + h.to(tl.int64) * o_sh + rows[:, None] * o_sn + cols).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * do_sb + h.to(tl.int64) * do_sh + rows[:, None] * do_sn + cols).to(tl.float32)
    tl.store(D + bh.to(tl.int64) * N + rows, tl.sum(o * do, axis=1))
    rb = b.to(tl.int64) * (N // 64) + tl.program_id(0)  # the row block (batch · seqlen) / 64: chunks (rb·H + h)·2 + 0, 1
    pair = (rb * H + h) * (64 * HEAD)
    tl.store(ACC + pair + tl.arange(0, 64)[:, None] * HEAD + cols, tl.zeros([64, HEAD], tl.float32))


@triton.jit
def _unperm_kernel(ACC, DQ, tau, H, HEAD: tl.constexpr):
    """dq[rows 64·rb …, head h] = τ · its two chunks of the fp32 buffer (column halves), each [64, HEAD/2] partial at
    the offsets of bulk_bases(HEAD) (spelled out below, bit i of the offset from the i-th base; c5's term is 0 at HEAD
    64); dq (batch · seqlen, nheads, HEAD) contiguous. Grid (batch · seqlen / 64, nheads)."""
    rb = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.arange(0, 64)[:, None]
    d = tl.arange(0, HEAD)[None, :]
    c = d % (HEAD // 2)
    off = ((c & 1) | ((r >> 3) & 1) << 1 | ((c >> 1) & 1) << 2 | ((c >> 2) & 1) << 3 | (r & 1) << 4
           | ((r >> 1) & 1) << 5 | ((r >> 2) & 1) << 6 | ((r >> 4) & 1) << 7 | ((r >> 5) & 1) << 8
           | ((c >> 3) & 1) << 9 | ((c >> 4) & 1) << 10 | ((c >> 5) & 1) << 11)
    chunk = (rb.to(tl.int64) * H + h) * 2 + d // (HEAD // 2)
    x = tl.load(ACC + chunk * (32 * HEAD) + off)
    tl.store(DQ + ((rb.to(tl.int64) * 64 + r) * H + h) * HEAD + d, (x * tau).to(DQ.dtype.element_ty))


def enabled() -> bool:
    """GPROJ_ONEPASS_BWD=0 keeps fix "none" on the two passes (A/B timing, escape hatch)."""
    return os.environ.get("GPROJ_ONEPASS_BWD", "1") != "0"


def keysplit(head_dim: int, causal: bool) -> bool:
    """Whether :func:`backward` splits the tile's dQ partial by keys (each consumer adds dS̃ · K over its own 64 keys,
    all d columns, with no barrier between the consumers: twice the reduce-adds' bytes) rather than by columns (both
    consumers' dS̃ meet in shared memory, each adds d/2 columns over all 128 keys): causal at head dim 64, where the
    barrier stalled a consumer on every diagonal tile. Measured on an H200 (benchmarks/NOTES.md, run 44,
    benchmarks/onepass_ab.py): split by keys, the backward +7–10% on causal rows (2×16×4096×64, 4×16×2048×64), −2…+1% on
    full ones."""
    return head_dim == 64 and causal


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool,
           deterministic: bool = False) -> bool:
    """Whether :func:`backward` serves these inputs, given that the Gluon passes serve them
    (kernels/attention_bwd_hopper.serves) and the call is fix "none" without statistics on dense inputs (no packed
    sequences, key padding, window, softcap or dropout: the caller checks those): GPROJ_ONEPASS_BWD not 0, neither
    ``deterministic`` (the call's) nor PyTorch's deterministic algorithms on (dq's fp32 reduce-adds land in any order),
    a head dim in HEAD_DIMS, a seqlen that is a multiple of 128, and where the one pass was measured faster
    (:func:`pays`). Never raises."""
    return (enabled() and GLUON_ERROR is None and not (deterministic or torch.are_deterministic_algorithms_enabled())
            and q.shape[3] in HEAD_DIMS and q.shape[1] % HB.BLOCK_N == 0 and pays(q, k, causal))


def pays(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """Where the one pass ran faster than the two passes on an H200 (benchmarks/NOTES.md, runs 43 and 44; at 8192 causal
    keys and head dim 128 in three of four readings, −7…+5%): full attention, or causal without GQA from
    :data:`CAUSAL_MIN_SEQLEN` keys on (head dim 128 or 64). (benchmarks/onepass_ab.py lifts this rule to time the one
    pass everywhere.)"""
    if not causal:
        return True
    min_seqlen = CAUSAL_MIN_SEQLEN.get(q.shape[3])
    return min_seqlen is not None and k.shape[2] == q.shape[2] and q.shape[1] >= min_seqlen


def backward(q, k, v, do, o, m, log2l, delta, dq, c: float, softmax_scale: float, causal: bool, dk_dtype: torch.dtype,
             dv_dtype: torch.dtype, descriptors: dict | None = None):
    """Fix "none"'s backward in one pass; call only where :func:`serves` is True, with do and o as
    kernels/attention_bwd_hopper.tma_ready returns them (o shaped like q, in its dtype).

    Args:
        q, k, v, do, o: as :func:`lightning_gproj.kernels.attention_bwd.backward` takes them (batch, seqlen, nheads[_k],
            headdim 128 or 64), bf16 or fp16, in a memory order the Gluon passes serve.
        m, log2l: (batch, nheads, seqlen) fp32 from the forward. delta: same shape, written: D = rowsum(dO∘O).
        dq: (batch, seqlen, nheads, headdim) contiguous in q's dtype or fp32, written: τ Σ_j dS̃_ij k_j, accumulated
            in fp32 and rounded once.
        c: τ·log2e. softmax_scale: τ. causal: the causal mask.
        dk_dtype, dv_dtype: q's dtype or torch.float32.
        descriptors: None, or a dict of TMA descriptors to reuse (kernels/attention_bwd_hopper._descriptors).

    Returns:
        dk, dv: (batch, seqlen, nheads_k, headdim) contiguous in dk_dtype / dv_dtype (GQA: summed over each kv head's query
        heads).
    """
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, n, h, d = q.shape
    hk = k.shape[2]
    acc = torch.empty((b * n * h * d // 256, 256), device=q.device, dtype=torch.float32)  # the chunks, zeroed by:
    _delta_kernel[(n // 64, b * h)](o, do, delta, acc, n, h, o.stride(0), o.stride(1), o.stride(2), do.stride(0),
                                    do.stride(1), do.stride(2), HEAD=d)
    dk = torch.empty((b, n, hk, d), device=q.device, dtype=dk_dtype)
    dv = torch.empty((b, n, hk, d), device=q.device, dtype=dv_dtype)
    descs, where = HB._descriptors(q, do, k, v, shared=descriptors)
    split = keysplit(d, causal)
    dqc_desc = TensorDescriptor(acc, list(acc.shape), [256, 1], [d // (4 if split else 8), 256], _chunk_layout())
    launch(_kernel_for(bool(causal), split), (n // HB.BLOCK_N, b * hk), q.device, False, *descs, dqc_desc, dk, dv, m,
           log2l, delta, float(c), float(softmax_scale), h, h // hk, n, *where)
    _unperm_kernel[(b * n // 64, h)](acc, dq, float(softmax_scale), h, HEAD=d)
    return dk, dv


def compile_sm90(causal: bool, dtype: torch.dtype = torch.bfloat16, grad_dtype: torch.dtype | None = None,
                 ones: tuple[str, ...] = (), head_dim: int = HEAD_DIMS[0], split: bool | None = None):
    """Compile the one-pass kernel for sm_90 without a GPU (kernels/attention_fwd_hopper.aot_compile_sm90), as CI does;
    dk, dv in ``grad_dtype`` (default ``dtype``); ``ones`` names integer arguments compiled as the constant 1
    (``GROUP`` without GQA); ``split``: dQ partials split by keys (None: as :func:`backward` runs it, :func:`keysplit`).
    Returns the compiled kernel. Raises RuntimeError if Gluon is not importable, ValueError for ``split`` at a head dim
    other than 64."""
    split = keysplit(head_dim, causal) if split is None else split
    if split and head_dim != 64:
        raise ValueError(f"split: the dQ partials split by keys at head dim 64 only, got head_dim={head_dim}")
    _require_gluon()
    t = tensordesc_type(dtype, HB.TILE_ROWS, head_dim, HB._layout(head_dim, dtype))
    g = pointer_type(grad_dtype or dtype)
    sig = {"q_desc": t, "do_desc": t, "k_desc": t, "v_desc": t,
           "dqc_desc": f"tensordesc<fp32[{head_dim // (4 if split else 8)}, 256],{_chunk_layout()!r}>", "DK": g,
           "DV": g, "M": "*fp32", "LOG2L": "*fp32", "DELTA": "*fp32", "c": "fp32", "tau": "fp32", "H": "i32",
           "GROUP": "i32", "N_CTX": "i32",
           **{f"{x}_{w}": "i32" for x in ("q", "do", "k", "v") for w in ("rb", "rh", "ch")}}
    return aot_compile_sm90(_kernel_for(bool(causal), bool(split)), sig, {arg: 1 for arg in ones})
