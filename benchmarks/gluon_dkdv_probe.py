"""A warp-specialized Hopper dK/dV pass in Gluon (issue 12) — a probe, not package code.

Status: run once on the H200 (benchmarks/NOTES.md, run 18): correct (dk, dv within 1.1e-5 of the package) and
5–22% slower than the package's tl.dot dK/dV kernel, with register spills at d 128. Since then (not timed) δ is
loaded where dS needs it and each consumer gets 240 registers: spill stores in the SASS 50 → 22 at d 128 compiled
with Triton 3.6, the H200's (58 → 27 with 3.9; none at d 64). Same partition pattern as kernels/attention_fwd_hopper.py.

What it computes: the package's dK/dV pass for ``fix="none"`` (kernels/attention_bwd.py, pass 3), i.e.
per key block Sᵀ = K Qᵀ, Pᵀ = exp2((Sᵀ − m)·τ·log2e − log2l) from the forward's row statistics, dV += P̃ᵀ dO,
dPᵀ = V dOᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − D), dK += dS̃ᵀ Q (P̃, dS̃ rounded to bf16 as the GEMM operands), dk = τ dK.
Layout: one program per (128 keys, batch·head); a 1-warp loader streams (Q, dO) tiles of 64 query rows by
TMA into a 2-slot ring; two 4-warp consumers (the default partition and one worker) own 64 keys each, with
their K, V rows and dK, dV accumulators resident, share every (Q, dO) slot, and run the four GEMMs on
wgmma (P̃ᵀ and dS̃ᵀ as register A operands). The GProj dK term (P̃ᵀ·QR, one more GEMM) is left out.

Limits: bf16, contiguous (batch, seqlen, nheads, headdim), Nq = Nk = N a multiple of 128, head dim 64 or
128, nheads_k = nheads, optional causal mask.

Usage: python benchmarks/gluon_dkdv_probe.py [--compile-only] [--shapes B,H,N,d,causal;...]
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# The package's forward kernel holds the TMA copy names of this Triton, the two-consumer ring and the AOT compile.
from lightning_gproj.kernels.attention_fwd_hopper import (
    aot_compile_sm90, ring_barriers, ring_load_pair, tensordesc_type, tma_load, tma_store,
)


LOG2E = 1.4426950408889634
# Module constants: the partitions of gl.warp_specialize receive their arguments as IR values.
BLOCK_N = gl.constexpr(128)  # keys per program: two consumers of 64
HALF_N = gl.constexpr(64)
BLOCK_M = gl.constexpr(64)  # query rows per streamed (Q, dO) tile
NUM_STAGES = gl.constexpr(2)


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty, kv_row, q_row0,
            col, lo, N_CTX):
    # The program's K and V rows, once: two halves of 64 keys.
    mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    for half in gl.static_range(2):
        tma_load(k_desc, [kv_row + half * HALF_N, col], kv_bar, k_smem.index(half))
        tma_load(v_desc, [kv_row + half * HALF_N, col], kv_bar, v_smem.index(half))
    i = 0
    for start_m in range(lo, N_CTX, BLOCK_M):
        ring_load_pair(q_desc, do_desc, q_smem, do_smem, ready, empty, i, q_row0 + start_m, col, q_row0 + start_m, col,
                       NUM_STAGES)
        i += 1


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty, dk_desc, dv_desc, M, LOG2L, DELTA,
              half: gl.constexpr, kv_row, start_n, col, lo, N_CTX, c, tau, causal):
    HEAD_DIM: gl.constexpr = dk_desc.block_type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # along the query rows of a [keys, queries] tile
    key_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    keys = start_n + half * HALF_N + gl.arange(0, HALF_N, layout=key_s)
    dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, layout=acc_layout)
    zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)
    k = k_smem.index(half)
    v = v_smem.index(half)
    mbarrier.wait(kv_bar, 0)
    i = 0
    for start_m in range(lo, N_CTX, BLOCK_M):
        st = i % NUM_STAGES
        rows = start_m + gl.arange(0, BLOCK_M, layout=col_s)
        m = gl.load(M + rows)
        l2 = gl.load(LOG2L + rows)
        mbarrier.wait(ready.index(st), (i // NUM_STAGES) & 1)
        q = q_smem.index(st)
        do = do_smem.index(st)
        sT = warpgroup_mma(k, q.permute((1, 0)), zero, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v, do.permute((1, 0)), zero, use_acc=False, is_async=True)
        sT = warpgroup_mma_wait(num_outstanding=1, deps=(sT,))
        # The forward's exponent: (s − m) exact 0 at the row max, then scale, then normalize.
        pT = gl.exp2((sT - m[None, :]) * c - l2[None, :])
        if causal != 0:
            pT = gl.where(keys[:, None] <= rows[None, :], pT, 0.0)
        p16 = pT.to(gl.bfloat16)  # rounding point: P̃, the A operand of dV += P̃ᵀ dO
        dv = warpgroup_mma(gl.convert_layout(p16, a_layout), do, dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT,))
        di = gl.load(DELTA + rows)  # loaded here, not with m and l2: shorter-lived, fewer spills
        ds16 = (pT * (dpT - di[None, :])).to(gl.bfloat16)  # rounding point: dS̃
        dk = warpgroup_mma(gl.convert_layout(ds16, a_layout), q, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(empty.index(st), count=1)
        i += 1
    out = gl.allocate_shared_memory(gl.bfloat16, [HALF_N, HEAD_DIM], dk_desc.layout)
    out.store((dk * tau).to(gl.bfloat16))
    fence_async_shared()
    tma_store(dk_desc, [kv_row + half * HALF_N, col], out)
    tma.store_wait(pendings=0)
    out.store(dv.to(gl.bfloat16))
    fence_async_shared()
    tma_store(dv_desc, [kv_row + half * HALF_N, col], out)
    tma.store_wait(pendings=0)


@gluon.jit
def _consumer_default(q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty, dk_desc, dv_desc, M, LOG2L, DELTA, kv_row,
                      start_n, col, lo, N_CTX, c, tau, causal):
    _consumer(q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty, dk_desc, dv_desc, M, LOG2L, DELTA, 0, kv_row,
              start_n, col, lo, N_CTX, c, tau, causal)


@gluon.jit
def _consumer_worker(q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty, dk_desc, dv_desc, M, LOG2L, DELTA, kv_row,
                     start_n, col, lo, N_CTX, c, tau, causal):
    _consumer(q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty, dk_desc, dv_desc, M, LOG2L, DELTA, 1, kv_row,
              start_n, col, lo, N_CTX, c, tau, causal)


@gluon.jit
def _dkdv_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, M, LOG2L, DELTA, c, tau, H, N_CTX, causal):
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    start_n = pid_n * BLOCK_N
    kv_row = b * N_CTX + start_n  # rows of the (batch·seqlen, nheads·headdim) views
    q_row0 = b * N_CTX
    col = h * HEAD_DIM
    lo = 0
    if causal != 0:
        lo = (start_n // BLOCK_M) * BLOCK_M  # earlier query rows see none of these keys
    stats = pid_bh.to(gl.int64) * N_CTX

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HALF_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HALF_N, HEAD_DIM], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    ready, empty = ring_barriers(NUM_STAGES)

    args = (q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty, dk_desc, dv_desc, M + stats, LOG2L + stats,
            DELTA + stats, kv_row, start_n, col, lo, N_CTX, c, tau, causal)
    gl.warp_specialize([
        (_consumer_default, args),
        (_consumer_worker, args),
        (_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty, kv_row,
                   q_row0, col, lo, N_CTX)),
    ], [4, 1], [240, 24])  # 240 each consumer: the register file's even split beside a 24-register loader


def _layout(rows, head_dim):
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16)


def dkdv(q, k, v, do, m, log2l, delta, causal: bool):
    """dk, dv of the package's fix="none" dK/dV pass. q, k, v, do: (batch, seqlen, nheads, headdim) bf16
    contiguous on a Hopper GPU, seqlen % 128 == 0; m, log2l, delta: (batch, nheads, seqlen) fp32."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, n, h, d = q.shape
    assert n % BLOCK_N.value == 0 and d in (64, 128) and q.dtype == torch.bfloat16
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    bm, hn = BLOCK_M.value, HALF_N.value

    def desc(x, rows):
        x2 = x.view(b * n, h * d)
        return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [rows, d], _layout(rows, d))

    _dkdv_kernel[(n // BLOCK_N.value, b * h)](
        desc(q, bm), desc(do, bm), desc(k, hn), desc(v, hn), desc(dk, hn), desc(dv, hn), m, log2l, delta,
        d ** -0.5 * LOG2E, d ** -0.5, h, n, int(causal), num_warps=4,
    )
    return dk, dv


def compile_only(head_dim: int):
    """Compile the kernel for sm_90 without a GPU: checks the Gluon code and the layouts."""
    bm, hn = BLOCK_M.value, HALF_N.value
    tq = tensordesc_type(torch.bfloat16, bm, head_dim, _layout(bm, head_dim))
    tk = tensordesc_type(torch.bfloat16, hn, head_dim, _layout(hn, head_dim))
    sig = {"q_desc": tq, "do_desc": tq, "k_desc": tk, "v_desc": tk, "dk_desc": tk, "dv_desc": tk,
           "M": "*fp32", "LOG2L": "*fp32", "DELTA": "*fp32", "c": "fp32", "tau": "fp32", "H": "i32", "N_CTX": "i32",
           "causal": "i32"}
    return aot_compile_sm90(_dkdv_kernel, sig)


def run_shape(b, h, n, d, causal):
    """Check dk, dv against the package's fix="none" backward; time against its _dkdv_kernel."""
    from torch.profiler import ProfilerActivity, profile
    from triton.testing import do_bench
    from lightning_gproj.kernels import attention_bwd, attention_fwd

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    tau = d ** -0.5
    o, m, log2l = attention_fwd.forward(q, k, v, tau, causal)
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()  # D_i = Σ_d dO_id O_id
    dk, dv = dkdv(q, k, v, do, m, log2l, delta, causal)
    _, dk_p, dv_p, _ = attention_bwd.backward(do, q, k, v, o, m, log2l, tau, causal, "none")
    err = max(((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in ((dk, dk_p), (dv, dv_p)))
    flops = 4 * 2 * b * h * n * n * d * (0.5 if causal else 1.0)  # S, dP, dV, dK
    t_g = do_bench(lambda: dkdv(q, k, v, do, m, log2l, delta, causal))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        attention_bwd.backward(do, q, k, v, o, m, log2l, tau, causal, "none")
        torch.cuda.synchronize()
    t_p = sum(e.self_device_time_total for e in prof.key_averages() if e.key == "_dkdv_kernel") * 1e-3
    print(f"{b}x{h}x{n}x{d} causal={causal}: dk/dv rel diff vs the package {err:.1e}; dK/dV pass TFLOP/s "
          f"gluon {flops / t_g * 1e-9:.0f}, package {flops / t_p * 1e-9:.0f} (one profiled call)", flush=True)


def main(argv=None) -> int:
    """``--compile-only`` compiles for head dims 64 and 128 (no GPU) and prints each one's shared memory;
    otherwise :func:`run_shape` for each of ``--shapes`` ("B,H,N,d,causal;...")."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 (no GPU needed) and report")
    ap.add_argument("--shapes", default="4,16,2048,128,0;4,16,2048,128,1;1,16,8192,128,1;2,16,4096,64,1")
    args = ap.parse_args(argv)
    if args.compile_only:
        for d in (64, 128):
            print(f"d {d}: compiled for sm_90, shared memory {compile_only(d).metadata.shared} B", flush=True)
        return 0
    for spec in args.shapes.split(";"):
        b, h, n, d, causal = (int(x) for x in spec.split(","))
        run_shape(b, h, n, d, bool(causal))
    return 0


if __name__ == "__main__":
    sys.exit(main())
