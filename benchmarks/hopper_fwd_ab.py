"""Variants of the Gluon forward, A/B against the package's (issue 12; benchmarks/NOTES.md, runs 18–19). H200 only.

Each variant is a copy of kernels/attention_fwd_hopper.py with source edits (written to a temporary file and
imported as its own module), timed against the package's kernel and cuDNN, forward only, bf16, interleaved
rounds, its outputs compared with the package's (bit-identical expected where the edit changes only the
schedule). A variant that does not compile for a shape (e.g. more pipeline stages than shared memory holds at
d 128) is reported and skipped. Also counts how many forward calls of one autocast Llama-style attention call
reach the Gluon kernel (fp32 q, k as (B, H, N, d) views of (B, N, H, d) memory; bf16 v in (B, H, N, d)
memory, as benchmarks/train_step.py's Llama hands it over).

Variants (``--variants``, comma-separated; default all):
- ``stages3``: a 3-slot K/V ring instead of 2 (fits d 64 only);
- ``loader_regs40``: 40 registers for the loader partition instead of 24 (the consumers keep 232).
Run 19 measured both, and a launch-order variant since replaced by the persistent schedule (run 33), within
the rounds' spread. FA3's intra-warp-group pipelining (the next block's S issued
before the current softmax) measured 20–30% slower there and was removed from this script (commit 0db54c1 has it).

Usage: python benchmarks/hopper_fwd_ab.py [--variants a,b] [--rounds 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import tempfile

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from lightning_gproj import gproj_attn_func
from lightning_gproj.kernels import attention_fwd_hopper as H

#: name: the (text in kernels/attention_fwd_hopper.py, its replacement) edits
VARIANTS = {
    "stages3": [("    _NUM_STAGES = gl.constexpr(2)\n", "    _NUM_STAGES = gl.constexpr(3)\n")],
    "loader_regs40": [("        ], [4, 1], [232, 24])\n", "        ], [4, 1], [232, 40])\n")],
}
SHAPES = [(4, 16, 2048, 128, True), (4, 16, 4096, 128, True), (1, 16, 8192, 128, True), (2, 16, 4096, 64, True),
          (2, 16, 4096, 64, False), (4, 16, 2048, 128, False)]


def variant_module(name: str):
    """kernels/attention_fwd_hopper.py with the variant's edits, imported from a temporary file."""
    src = inspect.getsource(H)
    for old, new in VARIANTS[name]:
        if src.count(old) != 1:
            raise RuntimeError(f"variant {name}: an edit's text is not in kernels/attention_fwd_hopper.py once; "
                               "update VARIANTS")
        src = src.replace(old, new)
    with tempfile.NamedTemporaryFile("w", suffix=f"_hopper_{name}.py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"hopper_{name}", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    mods = {n: variant_module(n) for n in names}
    for b, h, n, d, causal in SHAPES:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        ref = H.forward(q, k, v, d ** -0.5, causal)
        runners, notes = {"package": H.forward}, []
        for name, mod in mods.items():
            try:
                out = mod.forward(q, k, v, d ** -0.5, causal)
                notes.append(f"{name} bit-identical: {all(torch.equal(x, y) for x, y in zip(out, ref))}")
                runners[name] = mod.forward
            except Exception as exc:  # e.g. out of shared memory: report, keep going
                notes.append(f"{name} failed: {exc.__class__.__name__}: {str(exc)[:120]}")
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        rows = []
        for _ in range(args.rounds):
            tflops = {name: flops / do_bench(lambda f=f: f(q, k, v, d ** -0.5, causal)) * 1e-9
                      for name, f in runners.items()}
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                tflops["cudnn"] = flops / do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)) * 1e-9
            rows.append(" / ".join(f"{name} {t:.0f}" for name, t in tflops.items()))
        print(f"{b}x{h}x{n}x{d} causal={causal}: fwd TFLOP/s " + "; ".join(rows) + "; " + "; ".join(notes), flush=True)
    # Which path the op's forward takes for a bf16-mixed Llama call.
    calls = []
    real = H.forward
    H.forward = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    b, h, n, d = 4, 16, 4096, 128
    q, k = (torch.randn(b, n, h, d, device="cuda").transpose(1, 2).requires_grad_() for _ in range(2))
    v = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # as train_step's Llama
    with torch.autocast("cuda", dtype=torch.bfloat16):
        o = gproj_attn_func(q, k, v, causal=True, fix="gproj", layout="bhsd")
    o.float().sum().backward()
    H.forward = real
    print(f"autocast Llama-style call (fp32 q, k; bf16 v in (B, H, N, d) memory): Gluon forward calls {len(calls)}",
          flush=True)


if __name__ == "__main__":
    main()
