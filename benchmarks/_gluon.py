"""Shared pieces of the Gluon probes (benchmarks/gluon_fwd_probe.py, gluon_dkdv_probe.py)."""

from __future__ import annotations

import argparse

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

# Triton 3.6 names the TMA copies async_copy_global_to_shared / async_copy_shared_to_global; later
# versions async_load / async_store (the old names raise there).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def ring_load_pair(a_desc, b_desc, a_smem, b_smem, ready, empty, i, row, col, NUM_STAGES: gl.constexpr):
    """Fill slot i % NUM_STAGES of a ring that two consumers share: wait until both released it (a fresh
    barrier passes the first round), then TMA-load an a tile and a b tile at (row, col) into it."""
    s = i % NUM_STAGES
    mbarrier.wait(empty.index(s), ((i // NUM_STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [row, col], ready.index(s), a_smem.index(s))
    tma_load(b_desc, [row, col], ready.index(s), b_smem.index(s))


def tensordesc(rows: int, head_dim: int, layout) -> str:
    """The signature string of a bf16 [rows, head_dim] tensor-descriptor argument with that shared layout."""
    return f"tensordesc<bf16[{rows}, {head_dim}],{layout!r}>"


def compile_sm90(kernel, signature: dict):
    """Compile a Gluon kernel for sm_90 without a GPU (Triton's AOT path), 4 warps in its default partition."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    return triton.compile(GluonASTSource(kernel, signature, {}), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})


def probe_main(doc: str, default_shapes: str, compile_only, run_shape, argv=None) -> int:
    """A probe's command line: ``--compile-only`` compiles for head dims 64 and 128 (no GPU) and prints each
    one's shared memory; otherwise ``run_shape(b, h, n, d, causal)`` for each of ``--shapes``
    ("B,H,N,d,causal;...")."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 (no GPU needed) and report")
    ap.add_argument("--shapes", default=default_shapes)
    args = ap.parse_args(argv)
    if args.compile_only:
        for d in (64, 128):
            ck = compile_only(d)
            print(f"d {d}: compiled for sm_90, shared memory {ck.metadata.shared} B", flush=True)
        return 0
    for spec in args.shapes.split(";"):
        b, h, n, d, causal = (int(x) for x in spec.split(","))
        run_shape(b, h, n, d, bool(causal))
    return 0
