"""A one-pass Gluon backward for fix "none" with FA3's dQ split (issue 12, lever 1): does it beat the two passes?

Run 28's one-pass Gluon kernel (deleted) had each 64-key consumer reduce a full 64 × headdim fp32 dQ partial per query
tile and ran 12–20% slower than the two passes (benchmarks/NOTES.md, run 28). This probe splits dQ as FlashAttention-3
does: the two consumers of a dK/dV program (64 keys each) write their dS̃ᵀ tiles to shared memory, meet at an mbarrier,
and consumer h computes columns [h·d/2, (h+1)·d/2) of the tile's dQ partial over all 128 keys (dS̃ · K[:, cols], two
64-key wgmmas from shared memory) and adds it into an fp32 buffer by one TMA reduce-add: half run 28's reduction traffic,
5 tile GEMMs per (64 query rows, 64 keys) instead of the two passes' 7. D = rowsum(dO∘O) comes from a small kernel
first, dq = τ·dQ from another after.

Probe, not package code: dense (batch, seqlen, nheads, headdim) contiguous bf16, head dim 128, seqlen a multiple
of 128, GQA, causal or not, fix "none" only. Checked against the package's two passes (kernels/attention_bwd_hopper
dq_pass + dkdv) before timing; times (attention.py's kernel timer: summed kernel durations, L2 flushed) the two
passes, the one pass (all its kernels) and cuDNN's backward. ``--variants`` adds variants of the kernel (see
:func:`_partition`): two staging buffers, dQ by red.global.add from registers, each partial as one contiguous chunk
(bulk, bulk2: FlashAttention-3's dQaccum layout, :func:`_dq_bulk`), and timing-only ones that leave out the
reduce-add, the wait before the staging tile is rewritten, half the reduce, or the whole dQ step.
Measured in benchmarks/NOTES.md: run 40 (results/run40/) at parity with the two passes at best; run 42 (results/run42/)
with the contiguous chunk +5–22% over them on full attention.

    python3 benchmarks/onepass_gluon.py --json out.json [--shapes "4,16,2048,128;..."] [--variants bulk,noreduce]

Needs an sm_90 GPU; ``--compile`` only compiles for sm_90 on any machine (Triton's ahead-of-time path).
"""
from __future__ import annotations

import argparse
import functools
import json
import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from lightning_gproj.kernels import attention_bwd_hopper as HB
from lightning_gproj.kernels import attention_fwd_hopper as HF
from lightning_gproj.kernels.attention_fwd_hopper import ring_barriers

if hasattr(tma, "async_atomic_add"):  # Triton 3.9
    tma_reduce_add = tma.async_atomic_add
else:  # Triton 3.6: the builder has the op, the language does not
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

_reinterpret = getattr(gl.shared_memory_descriptor, "reinterpret", None) or gl.shared_memory_descriptor._reinterpret  # 3.9 / 3.6
cta_sync = getattr(gl, "barrier", None) or gl.thread_barrier  # 3.9 / 3.6: bar.sync of the partition's warps

_HALF_N = gl.constexpr(64)
_BLOCK_M = gl.constexpr(64)


@gluon.jit
def _tile(k, v, q, do, dk, dv, keys, key0, rows, start_m, c, m_s, l_s, d_s, ds_out, CAUSAL: gl.constexpr):
    """The dK/dV pass's tile (kernels/attention_bwd_hopper._dkdv_tile, fix none, dense) with dS̃ᵀ also stored to
    ds_out (shared [64 keys, 64 rows]); the dV and dK GEMMs left in flight. Returns (dk, dv)."""
    HEAD_DIM: gl.constexpr = k.shape[1]
    dtype: gl.constexpr = k.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    zero = gl.zeros([_HALF_N, _BLOCK_M], gl.float32, layout=s_layout)
    sT = warpgroup_mma(k, q.permute((1, 0)), zero, use_acc=False, is_async=True)
    dpT = warpgroup_mma(v, do.permute((1, 0)), zero, use_acc=False, is_async=True)
    sT = warpgroup_mma_wait(num_outstanding=1, deps=(sT,))
    m = m_s.load(rows.type.layout)
    l2 = l_s.load(rows.type.layout)
    pT = gl.exp2((sT - m[None, :]) * c - l2[None, :])
    if CAUSAL:
        if start_m < key0 + _HALF_N:
            pT = gl.where(keys[:, None] <= rows[None, :], pT, 0.0)
    p16 = gl.convert_layout(pT.to(dtype), a_layout)
    dv = warpgroup_mma(p16, do, dv, is_async=True)
    dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT,))
    di = d_s.load(rows.type.layout)
    ds16 = (pT * (dpT - di[None, :])).to(dtype)
    dk = warpgroup_mma(gl.convert_layout(ds16, a_layout), q, dk, is_async=True)
    ds_out.store(ds16)
    return dk, dv


@gluon.jit
def _dq_share(ds_smem, kd0, kd1, ds_bar, st, ph):
    """Both consumers' dS̃ᵀ of the tile are in ds_smem slots 2·st, 2·st + 1 once ds_bar[st] completes its phase ph:
    this consumer's columns of dQ = dS̃ · K (kd0, kd1: its columns of the two key halves), issued (returned in
    flight)."""
    DQ_N: gl.constexpr = kd0.shape[1]
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_N, 16])
    fence_async_shared()
    cta_sync()
    mbarrier.arrive(ds_bar.index(st), count=1)
    mbarrier.wait(ds_bar.index(st), ph)
    zero = gl.zeros([_BLOCK_M, DQ_N], gl.float32, layout=dq_layout)
    dq = warpgroup_mma(ds_smem.index(2 * st).permute((1, 0)), kd0, zero, use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_smem.index(2 * st + 1).permute((1, 0)), kd1, dq, is_async=True)
    return dq


@gluon.jit
def _dq_out(dq, dq_smem, dq_desc, dq_row, dq_col, buf, WAIT: gl.constexpr = True, BOTH: gl.constexpr = True,
            PENDING: gl.constexpr = 0):
    """Add this consumer's [64, d/2] dQ partial into the fp32 buffer: two [64, 32] TMA reduce-adds (a 128-byte swizzled
    box is at most 128 bytes wide: 32 fp32) from staging slots 2·buf, 2·buf + 1, the tile split in registers (each
    thread holds columns of both halves). PENDING: reduce groups of earlier tiles left in flight (2 with two buffers)."""
    HALF_N: gl.constexpr = dq_smem.shape[2]
    part_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, HALF_N, 16])
    lo, hi = dq.reshape([dq.shape[0], 2, HALF_N]).permute((0, 2, 1)).split()
    if WAIT:
        tma.store_wait(pendings=PENDING)  # the partials last staged in this buffer have left it
    dq_smem.index(2 * buf).store(gl.convert_layout(lo, part_layout))
    dq_smem.index(2 * buf + 1).store(gl.convert_layout(hi, part_layout))
    fence_async_shared()
    tma_reduce_add(dq_desc, [dq_row, dq_col], dq_smem.index(2 * buf))
    if BOTH:
        tma_reduce_add(dq_desc, [dq_row, dq_col + HALF_N], dq_smem.index(2 * buf + 1))


#: The [64, 64] fp32 staging tile of "bulk": thread-major, so that each thread's accumulator registers land at 16-byte
#: vectors and a warp's stores fill 512 contiguous bytes (no bank conflicts). Offset bits from low to high: the wgmma
#: accumulator's (NVMMA v3, 4 warps, n 64) register bits c0 and r3, its lane bits c1, c2, r0, r1, r2, its warp bits r4,
#: r5, then its remaining register bits c3, c4, c5 (r, c: row and column bits; gl.to_linear_layout of that layout).
_BULK_BASES = [[0, 1], [8, 0], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0], [16, 0], [32, 0], [0, 8], [0, 16], [0, 32]]
#: The variants that add each dQ partial as one contiguous chunk (:func:`_dq_bulk`): one staging buffer, two.
BULK_VARIANTS = ("bulk", "bulk2")
_BULK_STAGE = gl.constexpr(gl.SharedLinearLayout(_BULK_BASES))  # of each [64, 64] buffer of a [NBUF, 64, 64] allocation


@functools.lru_cache(maxsize=None)
def bulk_table(device):
    """[64 · 64] int32: where row r, column c (index 64 r + c) of a staged dQ half-tile sits in its 4096-float chunk."""
    r, c = torch.arange(64).repeat_interleave(64), torch.arange(64).repeat(64)
    off = torch.zeros(4096, dtype=torch.int32)
    for i, (br, bc) in enumerate(_BULK_BASES):
        off |= (((r & br) if br else (c & bc)) != 0).int() << i
    assert sorted(off.tolist()) == list(range(4096))
    return off.to(device)


@gluon.jit
def _dq_bulk(dq, dq_smem, dqc_desc, chunk, buf, PENDING: gl.constexpr):
    """Add this consumer's [64, 64] dQ partial as one contiguous 16 KB chunk (chunk index ``chunk`` of the fp32 buffer
    viewed as [chunks · 16, 256]) by one TMA reduce-add of a [16, 256] box without swizzle, staged through the
    thread-major layout _BULK_STAGE (FlashAttention-3's dQaccum layout: the postprocess un-permutes)."""
    tma.store_wait(pendings=PENDING)
    stage = dq_smem.index(buf)
    stage.store(dq)
    fence_async_shared()
    tma_reduce_add(dqc_desc, [chunk * 16, 0], _reinterpret(stage, gl.float32, [16, 256], dqc_desc.layout))


@gluon.jit
def _dq_red(dq, DQA, dq_row, dq_col, stride, PACK: gl.constexpr):
    """Add this consumer's [64, d/2] dQ partial into the fp32 buffer DQA (rows dq_row …, columns dq_col …, row stride
    ``stride``) from registers by red.global.add (PACK 2: .v2.f32 on the two consecutive columns a thread holds; 1:
    scalar): no shared memory, no TMA."""
    layout: gl.constexpr = dq.type.layout
    rows = dq_row + gl.arange(0, dq.shape[0], layout=gl.SliceLayout(1, layout))
    cols = dq_col + gl.arange(0, dq.shape[1], layout=gl.SliceLayout(0, layout))
    # as integers: Triton 3.6's inline asm does not take a pointer tensor next to a float one
    ptrs = (DQA + (rows.to(gl.int64)[:, None] * stride + cols[None, :])).to(gl.int64, bitcast=True)
    if PACK == 2:
        gl.inline_asm_elementwise("red.global.add.v2.f32 [$2], {$4, $5}; mov.u32 $0, 0; mov.u32 $1, 0;",
                                  "=r,=r,l,l,f,f", [ptrs, dq], dtype=gl.int32, is_pure=False, pack=2)
    else:
        gl.inline_asm_elementwise("red.global.add.f32 [$1], $2; mov.u32 $0, 0;", "=r,l,f", [ptrs, dq], dtype=gl.int32,
                                  is_pure=False, pack=1)


def _partition(half: int, causal: bool, variant: str = "full"):
    """variant "full"; for timing only (wrong dq): "noreduce" (the partials are not added into the buffer), "nodq" (no
    barrier, no dQ GEMM, no reduce: the dK/dV pass with the dS̃ᵀ stores); "dbuf": two staging buffers, a tile's
    reduces left in flight until the tile after next (correct); "red2" / "red1": red.global.add from registers
    (:func:`_dq_red`, correct); "nowait" (dq_smem rewritten without waiting
    for the previous reduce to read it), "onehalf" (only the first [64, 32] half reduced)."""
    HALF, CAUSAL = gl.constexpr(half), gl.constexpr(causal)
    REDUCE, DQ = gl.constexpr(variant not in ("noreduce", "nodq")), gl.constexpr(variant != "nodq")
    WAIT, BOTH = gl.constexpr(variant != "nowait"), gl.constexpr(variant != "onehalf")
    NBUF = gl.constexpr(2 if variant in ("dbuf", "bulk2") else 1)  # dq staging buffers
    BULK = gl.constexpr(variant in BULK_VARIANTS)  # one contiguous 16 KB reduce a tile (_dq_bulk)
    RED = gl.constexpr({"red2": 2, "red1": 1}.get(variant, 0))  # dQ by red.global.add from registers
    PENDING = gl.constexpr({"dbuf": 2, "bulk2": 1}.get(variant, 0))

    @gluon.jit
    def _dq_add(dq, dq_smem, dq_desc, DQA, dq_row, dq_col, stride, buf):
        """The variant's way of adding this consumer's dQ partial (rows dq_row …, columns dq_col …) into the buffer
        (noreduce: only staged, so that the GEMM stays)."""
        if BULK:
            HEAD_DIM: gl.constexpr = 2 * dq.shape[1]
            chunk = ((dq_row // 64) * (stride // HEAD_DIM) + dq_col // HEAD_DIM) * 2 + HALF
            _dq_bulk(dq, dq_smem, dq_desc, chunk, buf, PENDING)
        elif RED != 0:
            _dq_red(dq, DQA, dq_row, dq_col, stride, RED)
        elif REDUCE:
            _dq_out(dq, dq_smem, dq_desc, dq_row, dq_col, buf, WAIT, BOTH, PENDING)
        else:
            dq_smem.index(0).store(dq.reshape([dq.shape[0], 2, dq.shape[1] // 2]).permute((0, 2, 1)).split()[0])

    @gluon.jit
    def consumer(q_smem, do_smem, k_smem, v_smem, m_smem, l_smem, d_smem, ds_smem, kv_bar, ready, empty, ds_bar,
                 dq_desc, DQA, DK, DV, start_n, out_row, out_col, out_stride, dq_row0, GROUP, lo, hi, c, tau, h0):
        HEAD_DIM: gl.constexpr = k_smem.shape[2]
        DQ_N: gl.constexpr = HEAD_DIM // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 64, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        if BULK:
            dq_smem = gl.allocate_shared_memory(gl.float32, [NBUF, _BLOCK_M, DQ_N], _BULK_STAGE)
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [2 * NBUF, _BLOCK_M, DQ_N // 2], dq_desc.layout)
        key0 = start_n + HALF * _HALF_N
        keys = key0 + gl.arange(0, _HALF_N, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([_HALF_N, HEAD_DIM], gl.float32, layout=acc_layout)
        dv = gl.zeros([_HALF_N, HEAD_DIM], gl.float32, layout=acc_layout)
        k = k_smem.index(HALF)
        v = v_smem.index(HALF)
        kd0 = k_smem.index(0).slice(HALF * DQ_N, DQ_N, dim=1)
        kd1 = k_smem.index(1).slice(HALF * DQ_N, DQ_N, dim=1)
        mbarrier.wait(kv_bar.index(0), 0)
        first_m = lo
        if CAUSAL:
            first_m = key0
        i = 0
        for g in range(GROUP):
            dq_col = (h0 + g) * HEAD_DIM + HALF * DQ_N
            if CAUSAL:
                if HALF == 1:  # the group's first tile (rows start_n … key0 − 1) sees none of these keys: dS̃ᵀ = 0
                    st = i % 2
                    mbarrier.wait(ready.index(st), (i // 2) & 1)
                    if DQ:
                        ds_smem.index(2 * st + 1).store(gl.zeros([_HALF_N, _BLOCK_M], k_smem.dtype, layout=s_layout))
                        dq = _dq_share(ds_smem, kd0, kd1, ds_bar, st, (i // 2) & 1)
                        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
                        mbarrier.arrive(empty.index(st), count=1)
                        _dq_add(dq, dq_smem, dq_desc, DQA, dq_row0 + start_n, dq_col, out_stride * GROUP, i % NBUF)
                    else:
                        mbarrier.arrive(empty.index(st), count=1)
                    i += 1
            for start_m in range(first_m, hi, _BLOCK_M):
                st = i % 2
                rows = start_m + gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(0, s_layout))
                mbarrier.wait(ready.index(st), (i // 2) & 1)
                dk, dv = _tile(k, v, q_smem.index(st), do_smem.index(st), dk, dv, keys, key0, rows, start_m, c,
                               m_smem.index(st), l_smem.index(st), d_smem.index(st), ds_smem.index(2 * st + HALF),
                               CAUSAL)
                if DQ:
                    dq = _dq_share(ds_smem, kd0, kd1, ds_bar, st, (i // 2) & 1)
                    dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
                    mbarrier.arrive(empty.index(st), count=1)
                    _dq_add(dq, dq_smem, dq_desc, DQA, dq_row0 + start_m, dq_col, out_stride * GROUP, i % NBUF)
                else:
                    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
                    mbarrier.arrive(empty.index(st), count=1)
                i += 1
        dk = dk * tau
        out_rows = (out_row + HALF * _HALF_N + gl.arange(0, _HALF_N, layout=gl.SliceLayout(1, acc_layout))).to(gl.int64)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        offs = out_rows[:, None] * out_stride + out_col + cols[None, :]
        gl.store(DK + offs, dk.to(DK.dtype.element_ty))
        gl.store(DV + offs, dv.to(DV.dtype.element_ty))
        tma.store_wait(pendings=0)

    return consumer


@functools.lru_cache(maxsize=None)
def kernel_for(causal: bool, variant: str = "full"):
    consumer0, consumer1 = _partition(0, causal, variant), _partition(1, causal, variant)
    loader = HB._dkdv_partitions(False, causal, False, False, False)[1]  # the dK/dV pass's loop-less loader, fix none
    CAUSAL = gl.constexpr(causal)

    @gluon.jit
    def onepass_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, DQA, DK, DV, M, LOG2L, DELTA, c, tau, H, GROUP, N_CTX,
                       q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch):
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        dtype: gl.constexpr = q_desc.dtype
        pid_n = gl.program_id(0)
        pid_bh = gl.program_id(1)
        HK = H // GROUP
        b = pid_bh // HK
        hk = pid_bh % HK
        h0 = hk * GROUP
        start_n = pid_n * 128
        out_row = b * N_CTX + start_n
        lo = 0
        if CAUSAL:
            lo = start_n
        stats0 = (b * H + h0).to(gl.int64) * N_CTX
        q_smem = gl.allocate_shared_memory(dtype, [2, _BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, _BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, _HALF_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, _HALF_N, HEAD_DIM], v_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [4, _HALF_N, _BLOCK_M],
                                            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
        stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        m_smem = gl.allocate_shared_memory(gl.float32, [2, _BLOCK_M], stat_layout)
        l_smem = gl.allocate_shared_memory(gl.float32, [2, _BLOCK_M], stat_layout)
        d_smem = gl.allocate_shared_memory(gl.float32, [2, _BLOCK_M], stat_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        # one block per program: the loader's one wait on kv_empty passes (a fresh barrier)
        kv_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar.index(0), count=1)
        mbarrier.init(kv_empty.index(0), count=2)
        ready, empty = ring_barriers(2)
        ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(ds_bar.index(s), count=2)
        args = (q_smem, do_smem, k_smem, v_smem, m_smem, l_smem, d_smem, ds_smem, kv_bar, ready, empty, ds_bar, dq_desc,
                DQA, DK, DV, start_n, out_row, hk * HEAD_DIM, HK * HEAD_DIM, b * N_CTX, GROUP, lo, N_CTX, c, tau, h0)
        loader_args = (q_desc, do_desc, q_desc, k_desc, v_desc, M, LOG2L, DELTA, q_smem, do_smem, q_smem,
                       k_smem, v_smem, m_smem, l_smem, d_smem, kv_bar, kv_empty, ready, empty, b * k_rb + hk * k_rh + start_n,
                       hk * k_ch, b * v_rb + hk * v_rh + start_n, hk * v_ch, b * q_rb, q_rh, q_ch,
                       b * do_rb, do_rh, do_ch, b * q_rb, q_rh, q_ch, h0, GROUP, lo, N_CTX, stats0, N_CTX, N_CTX)
        gl.warp_specialize([(consumer0, args), (consumer1, args), (loader, loader_args)], [4, 1], [240, 24])

    return onepass_kernel


@triton.jit
def _delta_kernel(O, DO, D, N, H, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """D[b, h, n] = Σ_d O[b, n, h, d]·dO[b, n, h, d] in fp32 ((batch, seqlen, nheads, headdim) contiguous)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    offs = ((b * N + rows).to(tl.int64) * H + h)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(O + offs).to(tl.float32)
    do = tl.load(DO + offs).to(tl.float32)
    tl.store(D + bh.to(tl.int64) * N + rows, tl.sum(o * do, axis=1))


@triton.jit
def _scale_kernel(X, Y, tau, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, (tl.load(X + offs) * tau).to(Y.dtype.element_ty))


@triton.jit
def _unperm_kernel(ACC, TABLE, DQ, tau, H, HEAD_DIM: tl.constexpr):
    """dq[row block rb, head h] = τ · the two staged chunks of "bulk" (bulk_table's positions), (batch·seqlen, nheads,
    headdim) out."""
    rb = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.arange(0, 64)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    chunk = (rb.to(tl.int64) * H + h) * 2 + d // 64
    x = tl.load(ACC + chunk * 4096 + tl.load(TABLE + r * 64 + d % 64))
    tl.store(DQ + ((rb.to(tl.int64) * 64 + r) * H + h) * HEAD_DIM + d, (x * tau).to(DQ.dtype.element_ty))


def _dq_layout(variant: str = "full"):
    if variant in BULK_VARIANTS:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return gl.NVMMASharedLayout.get_default_for([64, 32], gl.float32)


def _dq_block(variant: str, d: int):
    return [16, 256] if variant in BULK_VARIANTS else [64, d // 4]


def backward(q, k, v, do, o, m, log2l, softmax_scale: float, causal: bool, variant: str = "full"):
    """dq, dk, dv of fix "none" in one pass (q, k, v, do, o (batch, seqlen, nheads[_k], 128) contiguous; m, log2l from
    kernels/attention_fwd_hopper.forward)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, n, h, d = q.shape
    hk = k.shape[2]
    delta = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    _delta_kernel[(n // 64, b * h)](o, do, delta, n, h, HEAD_DIM=d, BLOCK=64)
    acc = torch.zeros((b, n, h, d), device=q.device, dtype=torch.float32)
    dk = torch.empty((b, n, hk, d), device=q.device, dtype=q.dtype)
    dv = torch.empty_like(dk)
    descs, where = HB._descriptors(q, do, k, v)
    if variant in BULK_VARIANTS:
        dq_desc = TensorDescriptor(acc, [acc.numel() // 256, 256], [256, 1], _dq_block(variant, d), _dq_layout(variant))
    else:
        dq_desc = TensorDescriptor(acc, [b * n, h * d], [h * d, 1], _dq_block(variant, d), _dq_layout(variant))
    c = softmax_scale * 1.4426950408889634
    HF.launch(kernel_for(bool(causal), variant), (n // 128, b * hk), q.device, False, *descs, dq_desc, acc, dk, dv, m, log2l, delta,
              float(c), float(softmax_scale), h, h // hk, n, *where)
    dq = torch.empty_like(q)
    if variant in BULK_VARIANTS:
        _unperm_kernel[(b * n // 64, h)](acc, bulk_table(q.device), dq, float(softmax_scale), h, HEAD_DIM=d)
    else:
        _scale_kernel[(acc.numel() // 1024,)](acc, dq, float(softmax_scale), BLOCK=1024)
    return dq, dk, dv


def two_pass(q, k, v, do, o, m, log2l, softmax_scale: float, causal: bool):
    b, n, h, d = q.shape
    delta = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    dq = torch.empty_like(q)
    c = softmax_scale * 1.4426950408889634
    shared = {}
    HB.dq_pass(q, k, v, do, o, m, log2l, delta, dq, c, softmax_scale, causal, descriptors=shared)
    dk, dv, _ = HB.dkdv(q, k, v, do, m, log2l, delta, None, c, softmax_scale, causal, q.dtype, q.dtype, False,
                        descriptors=shared)
    return dq, dk, dv


def compile_sm90(causal: bool, dtype=torch.bfloat16, variant: str = "full"):
    """Compile the one-pass kernel for sm_90 without a GPU (HF.aot_compile_sm90)."""
    t = HF.tensordesc_type(dtype, 64, 128, HB._layout(128, dtype))
    dq_t = f"tensordesc<fp32{_dq_block(variant, 128)},{_dq_layout(variant)!r}>"
    sig = {"q_desc": t, "do_desc": t, "k_desc": t, "v_desc": t, "dq_desc": dq_t, "DQA": "*fp32", "DK": HF.pointer_type(dtype),
           "DV": HF.pointer_type(dtype), "M": "*fp32", "LOG2L": "*fp32", "DELTA": "*fp32", "c": "fp32", "tau": "fp32",
           "H": "i32", "GROUP": "i32", "N_CTX": "i32",
           **{f"{x}_{w}": "i32" for x in ("q", "do", "k", "v") for w in ("rb", "rh", "ch")}}
    return HF.aot_compile_sm90(kernel_for(bool(causal), variant), sig)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4,16,2048,128;1,16,8192,128;1,8,16384,128;4,16,2048,128,8")
    ap.add_argument("--json", default=None)
    ap.add_argument("--causal", choices=("both", "0", "1"), default="both")
    ap.add_argument("--variants", default="", help="also time these variants, comma-separated: correct ones (checked "
                    "against the two passes) dbuf, red2, red1, bulk, bulk2; timing-only ones (wrong dq) noreduce, "
                    "nodq, nowait, onehalf")
    ap.add_argument("--compile", action="store_true", help="only compile both variants for sm_90 (no GPU needed)")
    args = ap.parse_args(argv)
    if args.compile:
        for causal in (False, True):
            for var in ("full", "noreduce", "nodq"):
                k = compile_sm90(causal, variant=var)
                print(f"causal={causal} {var}: shared {k.metadata.shared} B")
        return
    import sys, os
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from attention import kernel_time

    torch.manual_seed(0)
    rows = []
    for spec in args.shapes.split(";"):
        dims = [int(x) for x in spec.split(",")]
        b, n, h, d = dims[0], dims[2], dims[1], dims[3]
        hk = h // dims[4] if len(dims) > 4 else h
        for causal in {"both": (False, True), "0": (False,), "1": (True,)}[args.causal]:
            q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16)
            do = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
            tau = 1 / math.sqrt(d)
            o, m, l2 = HF.forward(q, k, v, tau, causal)
            ref = two_pass(q, k, v, do, o, m, l2, tau, causal)
            got = backward(q, k, v, do, o, m, l2, tau, causal)
            torch.cuda.synchronize()
            errs = {name: _rel(x, y) for name, x, y in zip(("dq", "dk", "dv"), got, ref)}
            flops = 4 * 2 * b * h * n * n * d * 0.5 * (0.5 if causal else 1.0) * 2.5  # bwd = 2.5× fwd
            t2 = kernel_time(lambda: two_pass(q, k, v, do, o, m, l2, tau, causal))
            t1 = kernel_time(lambda: backward(q, k, v, do, o, m, l2, tau, causal))
            extra = {}
            for var in filter(None, args.variants.split(",")):
                extra[var] = flops / kernel_time(lambda: backward(q, k, v, do, o, m, l2, tau, causal, var)) / 1e9
                if var in ("dbuf", "red2", "red1", *BULK_VARIANTS):  # correct variants: checked too
                    got_v = backward(q, k, v, do, o, m, l2, tau, causal, var)
                    errs[f"dq_{var}"] = _rel(got_v[0], ref[0])
            qg, kg, vg = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
            from torch.nn.attention import SDPBackend, sdpa_kernel
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                                           enable_gqa=hk != h)
                    dot = do.transpose(1, 2)
                    tc = kernel_time(lambda: torch.autograd.grad(out, (qg, kg, vg), dot, retain_graph=True))
            except Exception as exc:  # cuDNN without GQA support in this torch
                print(f"cudnn: {exc.__class__.__name__}: {str(exc)[:200]}")
                tc = float("inf")
            row = {"shape": [b, h, n, d], "hk": hk, "causal": causal, "err_vs_two_pass": errs,
                   "two_pass_ms": t2, "one_pass_ms": t1, "cudnn_bwd_ms": tc,
                   "two_pass_tflops": flops / t2 / 1e9, "one_pass_tflops": flops / t1 / 1e9,
                   "cudnn_tflops": flops / tc / 1e9, **{f"{x}_tflops": y for x, y in extra.items()}}
            rows.append(row)
            print(f"{b}x{h}x{n}x{d} hk={hk} causal={causal}: err " + " ".join(f"{x} {y:.1e}" for x, y in errs.items())
                  + f" | bwd TFLOP/s two-pass {row['two_pass_tflops']:.0f} one-pass "
                  f"{row['one_pass_tflops']:.0f} cudnn {row['cudnn_tflops']:.0f} "
                  + " ".join(f"{x} {y:.0f}" for x, y in extra.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
