"""Shared pieces of the Gluon dK/dV probe (benchmarks/gluon_dkdv_probe.py)."""

from __future__ import annotations

import argparse

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


# The package's forward kernel (kernels/attention_fwd_hopper.py) holds the TMA copy aliases (Triton 3.6 and
# later name them differently) and the ring loader both use.
from lightning_gproj.kernels.attention_fwd_hopper import ring_load_pair, tma_load, tma_store  # noqa: E402,F401


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
