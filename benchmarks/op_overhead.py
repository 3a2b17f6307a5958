"""Where one attention call of a bf16-mixed Llama step spends its GPU time (issue 12).

Under ``torch.autocast(bf16)`` a Hugging Face Llama hands attention fp32 q and k (RoPE multiplies the
bf16 projections by fp32 cos / sin) and a bf16 v, in the (batch, nheads, seqlen, headdim) layout (a
view of (batch, seqlen, nheads, headdim) memory). This
script times one forward + backward of that call — ``gproj_attn_func(..., layout="bhsd")`` with fix
gproj / none, and ``F.scaled_dot_product_attention`` on cuDNN — and lists the GPU kernels of one call
from torch.profiler, so the time outside the attention kernels (casts, the fp32 C2 projection, copies)
can be read off.

Usage: python benchmarks/op_overhead.py --out DIR [--shape B,H,N,d] [--smoke]
Writes DIR/op_overhead.json and DIR/op_overhead.md. Default shape 4,16,4096,128 causal (the 8-layer
Llama of benchmarks/train_step.py). ``--smoke``: CPU, tiny shape, reference path; checks the script only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from lightning_gproj import gproj_attn_func


def make_call(arm: str, q, k, v, do):
    if arm == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def call():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(do)
    else:
        def call():
            o = gproj_attn_func(q, k, v, causal=True, fix=arm, layout="bhsd")
            o.backward(do)
    return call


def profile_table(call, cuda: bool, rows: int = 25) -> list[dict]:
    """Kernels of one call, by total device time (µs)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        call()
        if cuda:
            torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        t = e.self_device_time_total if cuda else e.self_cpu_time_total
        if t > 0 and (not cuda or e.device_type == torch.autograd.DeviceType.CUDA):
            out.append({"name": e.key[:90], "us": t, "calls": e.count})
    return sorted(out, key=lambda r: -r["us"])[:rows]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="4,16,4096,128")
    ap.add_argument("--arms", default="cudnn,gproj,none")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    cuda = not args.smoke
    dev = "cuda" if cuda else "cpu"
    b, h, n, d = (2, 2, 32, 16) if args.smoke else tuple(int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    # As a bf16-mixed Llama hands them over: q, k fp32 (after RoPE), v and dO bf16, (B, H, N, d) views of
    # (B, N, H, d) memory (the heads split off the projections' last dim; Llama's attention output goes
    # through .transpose(1, 2).contiguous(), so dO arrives in that layout too).
    def bhsd(dtype=torch.float32, grad=True):
        x = torch.randn(b, n, h, d, device=dev, dtype=dtype).transpose(1, 2)
        return x.requires_grad_() if grad else x
    q, k, v = bhsd(), bhsd(), bhsd(torch.bfloat16)
    do = bhsd(torch.bfloat16, grad=False)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shape": [b, h, n, d], "causal": True,
           "torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu", "arms": {}}
    for arm in args.arms.split(","):
        if arm == "cudnn" and not cuda:
            continue
        call = make_call(arm, q, k, v, do)

        def step():
            with torch.autocast(dev, dtype=torch.bfloat16):
                call()
            q.grad = k.grad = v.grad = None
        step()
        if cuda:
            from triton.testing import do_bench
            ms = do_bench(step, warmup=50, rep=300)
        else:
            t0 = time.perf_counter()
            step()
            ms = (time.perf_counter() - t0) * 1e3
        res["arms"][arm] = {"fwd_bwd_ms": ms, "kernels": profile_table(step, cuda)}
        print(f"{arm}: {ms:.3f} ms", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "op_overhead.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# One attention call under autocast (q, k fp32, v bf16), {b}×{h}×{n}×{d} causal, {res['device']}, "
             f"{res['date']}", ""]
    for arm, r in res["arms"].items():
        lines += [f"## {arm}: fwd+bwd {r['fwd_bwd_ms']:.3f} ms (do_bench median)", "", "| kernel | µs | calls |",
                  "|---|---|---|"]
        lines += [f"| `{x['name']}` | {x['us']:.0f} | {x['calls']} |" for x in r["kernels"]]
        lines.append("")
    with open(os.path.join(args.out, "op_overhead.md"), "w") as f:
        f.write("\n".join(lines))
    return res


if __name__ == "__main__":
    main()
    sys.exit(0)
