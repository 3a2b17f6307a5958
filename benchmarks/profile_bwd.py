"""One forward + backward per method for Nsight Compute (issue 12: where the backward's time goes).

    ncu --clock-control none --kernel-name regex:"hopper|bprop|dgrad" --section SpeedOfLight \
        --section WarpStateStats python3 benchmarks/profile_bwd.py [--shape B,H,N,d] [--causal] [--methods gproj,none,cudnn]
        [--dropout P] [--softcap C]

``--dropout P`` / ``--softcap C``: our methods with attention dropout P / logit softcap C (issue 16: where each
feature's time goes); cuDNN without.

Each method runs twice (the first call compiles); profile the second with ncu's --launch-skip, or read both.
"""
import argparse

import torch
import torch.nn.functional as F

from lightning_gproj.ops import gproj_attn_func


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1,16,8192,128", help="B,H,N,d (default 1,16,8192,128)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--methods", default="none,cudnn", help="comma list of gproj, none, cudnn")
    ap.add_argument("--dropout", type=float, default=0.0, help="attention dropout of our methods (default 0)")
    ap.add_argument("--softcap", type=float, default=0.0, help="logit softcap of our methods (default 0: off)")
    args = ap.parse_args()
    b, h, n, d = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    for method in args.methods.split(","):
        for _ in range(2):
            if method == "cudnn":
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=args.causal)
                o.transpose(1, 2).backward(do)
            else:
                gproj_attn_func(q, k, v, causal=args.causal, fix=method, dropout_p=args.dropout,
                                softcap=args.softcap).backward(do)
            torch.cuda.synchronize()
        print(method, "done", flush=True)


if __name__ == "__main__":
    main()
