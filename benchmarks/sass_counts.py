"""SASS instruction counts of the Gluon kernels compiled for sm_90 on a machine without a GPU (benchmarks/NOTES.md).

Compiles the forward (kernels/attention_fwd_hopper.py) and the backward's dQ and dK/dV passes
(kernels/attention_bwd_hopper.py) through their ``compile_sm90`` / ``compile_dq_sm90`` helpers (Triton's
ahead-of-time path, as the CPU tests do), disassembles each cubin with the cuobjdump that ships with Triton and
prints, per variant, how often each SASS opcode occurs (with any suffix, e.g. STL.64): special-function ops (MUFU.EX2, MUFU.RCP), FMAs,
spill stores and loads (STL, LDL), global loads (LDG). Counts are static (instructions in the binary, not
executed ones); compare variants or commits, e.g. before and after a change to the softcap's tanh:

    python benchmarks/sass_counts.py --softcap                     # bf16, d 128, gproj and none, full and causal
    python benchmarks/sass_counts.py --kernels dkdv --head-dim 64 --ops STL,LDL
    python benchmarks/sass_counts.py --dropout --ops STL,LDL       # the attention-dropout variants

Raises SystemExit if Gluon is missing, RuntimeError if cuobjdump is (attention_fwd_hopper.sass).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402

from lightning_gproj.kernels import attention_bwd_hopper as HB  # noqa: E402
from lightning_gproj.kernels import attention_fwd_hopper as HF  # noqa: E402

DEFAULT_OPS = "MUFU.EX2,MUFU.RCP,FFMA,STL,LDL,LDG"


def compile_variant(which: str, head_dim: int, gproj: bool, causal: bool, softcap: bool, dtype: torch.dtype,
                    dropout: bool = False):
    """One kernel: the forward (gproj does not apply), the dQ pass or the dK/dV pass."""
    if which == "fwd":
        return HF.compile_sm90(head_dim, dtype, ("causal",) if causal else (), softcap=softcap, dropout=dropout)
    compile_ = HB.compile_dq_sm90 if which == "dq" else HB.compile_sm90
    return compile_(dtype, gproj, causal, None, (), softcap, head_dim=head_dim, dropout=dropout)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default="fwd,dq,dkdv", help="comma list of fwd, dq, dkdv")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--softcap", action="store_true", help="the softcap variants")
    ap.add_argument("--dropout", action="store_true", help="the attention-dropout variants")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--ops", default=DEFAULT_OPS, help="comma list of SASS opcodes to count")
    args = ap.parse_args(argv)
    if HF.GLUON_ERROR is not None:
        raise SystemExit(f"Gluon is not importable: {HF.GLUON_ERROR}")
    ops = args.ops.split(",")
    dtype = getattr(torch, args.dtype)
    print(f"triton {triton.__version__}, d {args.head_dim}, {args.dtype}, softcap {args.softcap}, dropout {args.dropout}")
    print("| kernel | gproj | causal | " + " | ".join(ops) + " |")
    print("|---|---|---|" + "---|" * len(ops))
    for which in args.kernels.split(","):
        for gproj in ((True,) if which == "fwd" else (True, False)):
            for causal in (False, True):
                text = HF.sass(compile_variant(which, args.head_dim, gproj, causal, args.softcap, dtype, args.dropout))
                counts = [str(len(re.findall(r"(?<![\w.])" + re.escape(op) + r"(?![\w])", text))) for op in ops]
                print(f"| {which} | {'—' if which == 'fwd' else gproj} | {causal} | " + " | ".join(counts) + " |",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
