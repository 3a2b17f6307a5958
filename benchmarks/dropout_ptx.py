"""Where attention dropout's per-score instructions go, without a GPU (issue 16; benchmarks/NOTES.md, run 14).

Compiles a minimal attention-forward loop (q·kᵀ, exp2, mask, P·V; BLOCK 128×64, d 128, 8 warps, 2 stages)
for sm_90 with the local Triton (no GPU needed) in three variants and prints the TTGIR layout conversions
and PTX instruction counts of each:
  none:  no mask (the baseline);
  join:  kernels/_triton_utils.dropout_keep (Philox on a [rows, BLOCK_N/8] tile, 8 bool tiles interleaved
         with tl.join + tl.reshape, then one tl.where);
  split: an experiment: P split into 8 register pieces along a group of keys the wgmma accumulator keeps
         in one thread (32a + 8c + 2t + h), the mask applied per piece, P joined back (a different key
         grouping from the kernels' mask: instruction counts only, not the same random draws).

    python benchmarks/dropout_ptx.py none join split
"""
import argparse
import os
import re
from collections import Counter
os.environ.pop("TRITON_INTERPRET", None)
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lightning_gproj.kernels._triton_utils import dropout_keep, _PHILOX_ROUNDS

@triton.jit
def keep_none(row_base, start_n, bh, seed_lo, seed_hi, drop_off, drop_thr, BLOCK_N: tl.constexpr):
    return tl.full([row_base.shape[0], BLOCK_N], 1, tl.int1)

@triton.jit
def _pieces(x, BLOCK_N: tl.constexpr):
    R: tl.constexpr = x.shape[0]
    A: tl.constexpr = BLOCK_N // 32
    x = tl.reshape(x, [R, A, 2, 2, 4, 2])
    x = tl.permute(x, (0, 1, 4, 2, 3, 5))
    x = tl.reshape(x, [R, A * 4, 2, 2, 2])
    e, o = tl.split(x)
    e0, e1 = tl.split(e)
    o0, o1 = tl.split(o)
    e00, e10 = tl.split(e0)
    e01, e11 = tl.split(e1)
    o00, o10 = tl.split(o0)
    o01, o11 = tl.split(o1)
    return e00, e01, e10, e11, o00, o01, o10, o11

@triton.jit
def _unpieces(e00, e01, e10, e11, o00, o01, o10, o11, BLOCK_N: tl.constexpr):
    R: tl.constexpr = e00.shape[0]
    A: tl.constexpr = BLOCK_N // 32
    x = tl.join(tl.join(tl.join(e00, e10), tl.join(e01, e11)), tl.join(tl.join(o00, o10), tl.join(o01, o11)))
    x = tl.reshape(x, [R, A, 4, 2, 2, 2])
    x = tl.permute(x, (0, 1, 3, 4, 2, 5))
    return tl.reshape(x, [R, BLOCK_N])

@triton.jit
def apply_split(p, row_base, start_n, bh, seed_lo, seed_hi, drop_off, drop_thr, BLOCK_N: tl.constexpr):
    cols = start_n + tl.arange(0, BLOCK_N)
    grp = row_base[:, None] + ((cols // 32) * 4 + (cols % 8) // 2).to(tl.int64)[None, :]
    g, _, _, _, _, _, _, _ = _pieces(grp, BLOCK_N)
    e00, e01, e10, e11, o00, o01, o10, o11 = _pieces(p, BLOCK_N)
    c0 = g.to(tl.uint32); c3 = (g >> 32).to(tl.uint32); zero = c0 * 0
    seed = (seed_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | seed_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    x0, x1, x2, x3 = tl.philox(seed, c0, zero + bh.to(tl.uint32), zero + drop_off.to(tl.uint32, bitcast=True), c3, n_rounds=_PHILOX_ROUNDS)
    thr = drop_thr.to(tl.uint32) << 16
    e00 = tl.where((x0 << 16) >= thr, e00, 0.0); o00 = tl.where(x0 >= thr, o00, 0.0)
    e01 = tl.where((x1 << 16) >= thr, e01, 0.0); o01 = tl.where(x1 >= thr, o01, 0.0)
    e10 = tl.where((x2 << 16) >= thr, e10, 0.0); o10 = tl.where(x2 >= thr, o10, 0.0)
    e11 = tl.where((x3 << 16) >= thr, e11, 0.0); o11 = tl.where(x3 >= thr, o11, 0.0)
    return _unpieces(e00, e01, e10, e11, o00, o01, o10, o11, BLOCK_N)

VARIANTS = {"none": keep_none, "join": dropout_keep, "split": apply_split}

def make(fn):
    @triton.jit
    def k_drop(Q, K, V, O, bh, seed_lo, seed_hi, drop_off, drop_thr, N, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, APPLY: tl.constexpr):
        offs_m = tl.arange(0, BM); offs_n = tl.arange(0, BN); offs_d = tl.arange(0, D)
        q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :])
        acc = tl.zeros([BM, D], tl.float32)
        rows = offs_m.to(tl.int64) * ((N + 7) // 8)
        for start_n in range(0, N, BN):
            k = tl.load(K + (start_n + offs_n)[:, None] * D + offs_d[None, :])
            v = tl.load(V + (start_n + offs_n)[:, None] * D + offs_d[None, :])
            s = tl.dot(q, tl.trans(k))
            p = tl.math.exp2(s)
            if APPLY:
                p = fn(p, rows, start_n, bh, seed_lo, seed_hi, drop_off, drop_thr, BN)
            else:
                keep = fn(rows, start_n, bh, seed_lo, seed_hi, drop_off, drop_thr, BN)
                p = tl.where(keep, p, 0.0)
            acc = tl.dot(p.to(tl.bfloat16), v, acc)
        tl.store(O + offs_m[:, None] * D + offs_d[None, :], acc)
    return k_drop

sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*fp32", "bh": "i32", "seed_lo": "i32", "seed_hi": "i32", "drop_off": "i32", "drop_thr": "i32", "N": "i32", "BM": "constexpr", "BN": "constexpr", "D": "constexpr", "APPLY": "constexpr"}
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("variants", nargs="+", choices=sorted(VARIANTS), help="the variants to compile")
for name in parser.parse_args().variants:
    fn = VARIANTS[name]
    kern = make(fn)
    try:
        src = ASTSource(fn=kern, signature=sig, constexprs={"BM": 128, "BN": 64, "D": 128, "APPLY": name == "split"})
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 2})
    except Exception as e:
        print(name, "ERROR", str(e)[-300:]); continue
    ttgir, ptx = ck.asm["ttgir"], ck.asm["ptx"]
    ops = re.findall(r"^\s+([a-z]+)", ptx, re.M)
    c = Counter(ops)
    print(name, "convert_layout", ttgir.count("convert_layout"), "ptx", len(ops), {k: c[k] for k in ("mul", "xor", "setp", "selp", "and", "or", "shr", "shl", "prmt", "st", "ld", "cvt", "mov", "add")})
