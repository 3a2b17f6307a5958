"""The Gluon forward's causal block order, A/B (issue 12; benchmarks/NOTES.md, run 18). H200 only.

kernels/attention_fwd_hopper.py runs a causal grid's query blocks of each (batch·head) heaviest first. This
times it against the same kernel in launch order (a copy of the module with that one line removed, written
to a temporary file) and cuDNN, forward only, bf16, interleaved rounds; and counts how many forward calls of
one autocast Llama-style attention call (fp32 q, k as (B, H, N, d) views of (B, N, H, d) memory; bf16 v
in (B, H, N, d) memory, as benchmarks/train_step.py's Llama hands it over)
reach the Gluon kernel.

Usage: python benchmarks/hopper_fwd_ab.py [--rounds 2]
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

REVERSE = "            pid_m = gl.num_programs(0) - 1 - pid_m\n"


def in_order_module():
    src = inspect.getsource(H)
    assert src.count(REVERSE) == 1, "the reversal line moved; update this script"
    path = tempfile.NamedTemporaryFile("w", suffix="_hopper_inorder.py", delete=False).name
    with open(path, "w") as f:
        f.write(src.replace(REVERSE, "            pass\n"))
    spec = importlib.util.spec_from_file_location("hopper_inorder", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    inorder = in_order_module()
    for b, h, n, d, causal in [(4, 16, 2048, 128, True), (4, 16, 4096, 128, True), (1, 16, 8192, 128, True),
                               (2, 16, 4096, 64, True), (4, 16, 2048, 128, False)]:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        o1 = H.forward(q, k, v, d ** -0.5, causal)
        o2 = inorder.forward(q, k, v, d ** -0.5, causal)
        same = all(torch.equal(x, y) for x, y in zip(o1, o2))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        rows = []
        for _ in range(args.rounds):
            t_rev = do_bench(lambda: H.forward(q, k, v, d ** -0.5, causal))
            t_in = do_bench(lambda: inorder.forward(q, k, v, d ** -0.5, causal))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                t_c = do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
            rows.append(" / ".join(f"{flops / t * 1e-9:.0f}" for t in (t_rev, t_in, t_c)))
        print(f"{b}x{h}x{n}x{d} causal={causal}: fwd TFLOP/s heaviest-first / launch order / cuDNN: "
              + ", ".join(rows) + f"; outputs bit-identical: {same}", flush=True)
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
    print(f"autocast Llama-style call (fp32 q, k; bf16 v in (B, H, N, d) memory): Gluon forward calls {len(calls)}", flush=True)


if __name__ == "__main__":
    main()
