"""A warp-specialized Hopper attention forward in Gluon (issue 12, lever 4) — a probe, not package code.

Status: written and compiled for sm_90 on a CPU machine (``--compile-only``, Triton 3.6); **never run on a
GPU yet** (benchmarks/NOTES.md, run 17). Its first device run checks it against a float32 reference
and times it against cuDNN and the package's forward.

Layout (FA3's forward, in Gluon's explicit partitions): one program per (128 query rows, batch·head);
a 1-warp loader partition streams K and V tiles by TMA into a ring of NUM_STAGES shared-memory slots
(mbarriers ``ready`` / ``empty``); two 4-warp consumer partitions (the default partition and one worker)
each own 64 of the 128 query rows, share every K/V slot (``empty`` counts both arrivals), and run
S = Q Kᵀ, the online softmax and O += P V with asynchronous wgmma. The warp scheduler overlaps one
consumer's softmax with the other's GEMMs. The exponent is the package's FMA-safe one,
P = exp2((s − m)·τ·log2e) with m the row max of the raw scores s (DESIGN.md §5), so a row of equal
logits gives P = 1 exactly. Outputs as kernels/attention_fwd.forward: o (batch, seqlen, nheads, headdim)
and the row statistics m, log2l (batch, nheads, seqlen_q) fp32.

Limits of the probe: bf16, contiguous (batch, seqlen, nheads, headdim) inputs, Nq = Nk = N a multiple of
128, head dim 64 or 128, nheads_k = nheads, optional causal mask; nothing else.

Usage: python benchmarks/gluon_fwd_probe.py [--compile-only] [--shapes B,H,N,d[,causal];...]
"""

from __future__ import annotations

import os
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gluon import compile_sm90, probe_main, ring_load_pair, tensordesc, tma_load, tma_store  # noqa: E402


LOG2E = 1.4426950408889634
# Tile sizes are module constants: the partitions of gl.warp_specialize receive their arguments as IR
# values, so constexpr arguments would not stay constexpr there.
BLOCK_M = gl.constexpr(128)  # query rows per program: two consumers of 64
HALF_M = gl.constexpr(64)
BLOCK_N = gl.constexpr(128)  # keys per K/V tile
NUM_STAGES = gl.constexpr(2)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row, kv_row, col, hi):
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma_load(q_desc, [q_row, col], q_bar, q_smem.index(0))
    tma_load(q_desc, [q_row + q_desc.block_type.shape[0], col], q_bar, q_smem.index(1))
    i = 0
    for start_n in range(0, hi, BLOCK_N):
        ring_load_pair(k_desc, v_desc, k_smem, v_smem, ready, empty, i, kv_row + start_n, col, NUM_STAGES)
        i += 1


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, ready, empty, o_desc, M, LOG2L, half: gl.constexpr, q_row, row0, col, hi,
              c, causal):
    HEAD_DIM: gl.constexpr = o_desc.block_type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    offs_m = row0 + half * HALF_M + gl.arange(0, HALF_M, layout=row_s)  # query positions in the sequence
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([HALF_M], gl.float32, layout=row_s)
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    q = q_smem.index(half)
    mbarrier.wait(q_bar, 0)
    i = 0
    for start_n in range(0, hi, BLOCK_N):
        st = i % NUM_STAGES
        mbarrier.wait(ready.index(st), (i // NUM_STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if causal != 0:
            if start_n + BLOCK_N > row0 + half * HALF_M:  # a tile on or past the diagonal
                offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s = gl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        # FMA-safe: (s − m) is exact 0 at the row max, so that entry's weight is exactly 1.
        alpha = gl.exp2((m_i - m_new) * c)
        p = gl.exp2((s - m_new[:, None]) * c)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc = warpgroup_mma(p16, v_smem.index(st), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(st), count=1)
        m_i = m_new
        i += 1
    o = acc / gl.convert_layout(l_i, row_o)[:, None]
    o_smem = gl.allocate_shared_memory(gl.bfloat16, [HALF_M, HEAD_DIM], o_desc.layout)
    o_smem.store(o.to(gl.bfloat16))
    fence_async_shared()
    tma_store(o_desc, [q_row + half * HALF_M, col], o_smem)
    gl.store(M + offs_m, m_i)
    gl.store(LOG2L + offs_m, gl.log2(l_i))
    tma.store_wait(pendings=0)


@gluon.jit
def _consumer_worker(q_smem, k_smem, v_smem, q_bar, ready, empty, o_desc, M, LOG2L, q_row, row0, col, hi, c, causal):
    _consumer(q_smem, k_smem, v_smem, q_bar, ready, empty, o_desc, M, LOG2L, 1, q_row, row0, col, hi, c, causal)


@gluon.jit
def _consumer_default(q_smem, k_smem, v_smem, q_bar, ready, empty, o_desc, M, LOG2L, q_row, row0, col, hi, c, causal):
    _consumer(q_smem, k_smem, v_smem, q_bar, ready, empty, o_desc, M, LOG2L, 0, q_row, row0, col, hi, c, causal)


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, o_desc, M, LOG2L, c, H, N_CTX, causal):
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    row0 = pid_m * BLOCK_M
    q_row = b * N_CTX + row0  # row of the (batch·seqlen, nheads·headdim) view
    kv_row = b * N_CTX
    col = h * HEAD_DIM
    hi = N_CTX
    if causal != 0:
        hi = gl.minimum(N_CTX, row0 + BLOCK_M)
    stats = M + pid_bh.to(gl.int64) * N_CTX
    stats2 = LOG2L + pid_bh.to(gl.int64) * N_CTX

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HALF_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumers release a slot

    consumer_args = (q_smem, k_smem, v_smem, q_bar, ready, empty, o_desc, stats, stats2, q_row, row0, col, hi, c, causal)
    gl.warp_specialize([
        (_consumer_default, consumer_args),
        (_consumer_worker, consumer_args),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row, kv_row, col, hi)),
    ], [4, 1], [232, 24])


def _layouts(head_dim):
    qo = gl.NVMMASharedLayout.get_default_for([HALF_M.value, head_dim], gl.bfloat16)
    kv = gl.NVMMASharedLayout.get_default_for([BLOCK_N.value, head_dim], gl.bfloat16)
    return qo, kv


def forward(q, k, v, causal: bool):
    """q, k, v: (batch, seqlen, nheads, headdim) bf16 contiguous on a Hopper GPU, seqlen % 128 == 0."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, n, h, d = q.shape
    assert n % BLOCK_M.value == 0 and d in (64, 128) and q.dtype == torch.bfloat16 and k.shape == q.shape == v.shape
    o = torch.empty_like(q)
    m = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    log2l = torch.empty_like(m)
    qo, kv = _layouts(d)

    def desc(x, block, layout):
        x2 = x.view(b * n, h * d)
        return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), block, layout)

    hm, bn = HALF_M.value, BLOCK_N.value
    _fwd_kernel[(n // BLOCK_M.value, b * h)](
        desc(q, [hm, d], qo), desc(k, [bn, d], kv), desc(v, [bn, d], kv), desc(o, [hm, d], qo),
        m, log2l, d ** -0.5 * LOG2E, h, n, int(causal), num_warps=4,
    )
    return o, m, log2l


def compile_only(head_dim: int):
    """Compile the kernel for sm_90 without a GPU: checks the Gluon code and the layouts."""
    qo, kv = _layouts(head_dim)
    hm, bn = HALF_M.value, BLOCK_N.value
    sig = {"q_desc": tensordesc(hm, head_dim, qo), "k_desc": tensordesc(bn, head_dim, kv),
           "v_desc": tensordesc(bn, head_dim, kv), "o_desc": tensordesc(hm, head_dim, qo),
           "M": "*fp32", "LOG2L": "*fp32", "c": "fp32", "H": "i32", "N_CTX": "i32", "causal": "i32"}
    return compile_sm90(_fwd_kernel, sig)


def run_shape(b, h, n, d, causal):
    """Check against a float32 reference and the package's forward; time against the package and cuDNN."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    from lightning_gproj.kernels import attention_fwd

    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o, m, log2l = forward(q, k, v, causal)
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)), is_causal=causal)
    err = ((o.float() - ref.transpose(1, 2)).norm() / ref.norm()).item()
    o_p, m_p, l_p = attention_fwd.forward(q, k, v, d ** -0.5, causal)
    stats_err = max((m - m_p).abs().max().item(), (log2l - l_p).abs().max().item())
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    t_g = do_bench(lambda: forward(q, k, v, causal))
    t_p = do_bench(lambda: attention_fwd.forward(q, k, v, d ** -0.5, causal))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        t_c = do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    print(f"{b}x{h}x{n}x{d} causal={causal}: o rel err vs fp32 {err:.1e}, m/log2l vs package {stats_err:.1e}; "
          f"TFLOP/s gluon {flops / t_g * 1e-9:.0f}, package {flops / t_p * 1e-9:.0f}, cuDNN {flops / t_c * 1e-9:.0f}",
          flush=True)


if __name__ == "__main__":
    sys.exit(probe_main(__doc__, "4,16,2048,128,0;4,16,2048,128,1;1,16,8192,128,0;1,16,8192,128,1;2,16,4096,64,0;"
                        "2,16,4096,64,1", compile_only, run_shape))
