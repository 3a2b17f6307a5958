"""Attention speed (DESIGN.md §7): forward, backward and forward+backward TFLOP/s and peak memory.

Shapes (B×H×N×d, causal): 4×16×2048×128 no; 1×16×8192×128 no; 1×16×8192×128 yes; 2×16×4096×64 no;
1×8×16384×128 yes; bf16, inputs from torch.randn. FLOPs: forward 4·B·H·N²·d (× ½ causal), backward
2.5 × forward. Time: triton.testing.do_bench, median (warm-up first; the first call of each shape
autotunes / compiles). Peak memory: torch.cuda.max_memory_allocated over one forward+backward, minus
the memory held before it (inputs), in MiB.

Methods: gproj (default schedule: dK term as its own GEMM), gproj_fold (dK term folded into dS),
none, gproj_uniform, cudnn (SDPA), sdpa_flash (SDPA FlashAttention-2), fa4 (flash-attn-4 CuTe, when
importable).

Usage: python benchmarks/attention.py --out DIR [--smoke] [--methods a,b] [--shapes i,j]
Writes DIR/attention.json, DIR/attention.md and (matplotlib permitting) DIR/attention.png, rewritten
after every shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _methods as M  # noqa: E402

METHODS = ["gproj", "gproj_fold", "none", "gproj_uniform", "cudnn", "sdpa_flash", "fa4"]
SHAPES = [(4, 16, 2048, 128, False), (1, 16, 8192, 128, False), (1, 16, 8192, 128, True),
          (2, 16, 4096, 64, False), (1, 8, 16384, 128, True)]
#: DESIGN.md §7 anchors measured earlier on an H200 (fwd+bwd TFLOP/s), for the table's context.
DESIGN_ANCHORS = {
    (4, 16, 2048, 128, False): (560, 500, 283), (1, 16, 8192, 128, False): (616, 546, 315),
    (1, 16, 8192, 128, True): (559, 483, 274), (2, 16, 4096, 64, False): (495, 429, 275),
    (1, 8, 16384, 128, True): (614, 524, 305),
}


def bench(fn, smoke):
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure(shape, name, smoke):
    b, h, n, d, causal = shape
    dev = "cpu" if smoke else "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(b, n, h, d, generator=g, device=dev).bfloat16() for _ in range(4))
    row = {"shape": list(shape), "method": name}
    try:
        meth = M.make(name, q, k, v, do, causal)
        meth.fwd_bwd()  # compile / autotune
        if not smoke:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            meth.fwd_bwd()
            torch.cuda.synchronize()
            row["peak_mem_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        t_fb = bench(meth.fwd_bwd, smoke)
        t_f = bench(meth.fwd, smoke)
        if name in M.OURS:
            meth.fwd()
            t_b = bench(meth.bwd, smoke)
        else:
            meth.fwd_graph()
            t_b = bench(meth.bwd, smoke)
        for mode, t in (("fwd", t_f), ("bwd", t_b), ("fwd_bwd", t_fb)):
            row[f"{mode}_ms"] = t
            row[f"{mode}_tflops"] = M.attn_flops(b, h, n, n, d, causal, mode) / (t * 1e-3) / 1e12
    except Exception as exc:
        row["error"] = f"{exc.__class__.__name__}: {str(exc)[:300]}"
    return row


def markdown(res):
    rows = res["rows"]
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    shapes = []
    for r in rows:
        if tuple(r["shape"]) not in shapes:
            shapes.append(tuple(r["shape"]))

    def get(shape, m, key):
        r = next((x for x in rows if tuple(x["shape"]) == shape and x["method"] == m), None)
        if r is None:
            return None
        return "err" if "error" in r else r.get(key)

    def fmt(x, nd=0):
        return "—" if x is None else (x if isinstance(x, str) else f"{x:.{nd}f}")

    out = [f"# Attention speed (DESIGN.md §7)\n\n{res['env']}\n\nDate {res['date']}. TFLOP/s from "
           "triton.testing.do_bench medians; bf16; FLOPs 4·B·H·N²·d (½ causal), bwd 2.5×.\n"]
    for mode in ("fwd_bwd", "fwd", "bwd"):
        out += [f"### {mode} TFLOP/s", "", "| B×H×N×d causal | " + " | ".join(methods) + " |",
                "|---|" + "---|" * len(methods)]
        for s in shapes:
            out.append(f"| {s[0]}×{s[1]}×{s[2]}×{s[3]} {'causal' if s[4] else 'full'} | "
                       + " | ".join(fmt(get(s, m, f"{mode}_tflops")) for m in methods) + " |")
        out.append("")
    out += ["### Ratios (fwd+bwd)", "",
            "| shape | gproj/none | gproj overhead vs none | gproj_fold overhead | gproj/sdpa_flash | gproj/fa4 |"
            " gproj/cudnn |", "|---|---|---|---|---|---|---|"]
    for s in shapes:
        gp = get(s, "gproj", "fwd_bwd_tflops")
        cells = []
        for other in ("none",):
            o = get(s, other, "fwd_bwd_tflops")
            cells.append(fmt(gp / o, 3) if isinstance(gp, float) and isinstance(o, float) else "—")
        for m in ("gproj", "gproj_fold"):
            t = get(s, m, "fwd_bwd_ms")
            t0 = get(s, "none", "fwd_bwd_ms")
            cells.append(f"{100 * (t / t0 - 1):+.1f}%" if isinstance(t, float) and isinstance(t0, float) else "—")
        for other in ("sdpa_flash", "fa4", "cudnn"):
            o = get(s, other, "fwd_bwd_tflops")
            cells.append(fmt(gp / o, 3) if isinstance(gp, float) and isinstance(o, float) else "—")
        out.append(f"| {s[0]}×{s[1]}×{s[2]}×{s[3]} {'causal' if s[4] else 'full'} | " + " | ".join(cells) + " |")
    out += ["", "### Peak memory of one fwd+bwd above the inputs (MiB)", "",
            "| shape | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for s in shapes:
        out.append(f"| {s[0]}×{s[1]}×{s[2]}×{s[3]} {'causal' if s[4] else 'full'} | "
                   + " | ".join(fmt(get(s, m, "peak_mem_mib")) for m in methods) + " |")
    out += ["", "DESIGN.md §7 anchors (fwd+bwd, earlier H200 session): FA4 / cuDNN / SDPA-flash = "
            + "; ".join(f"{k[0]}×{k[1]}×{k[2]}×{k[3]}{' causal' if k[4] else ''}: {v[0]}/{v[1]}/{v[2]}"
                        for k, v in DESIGN_ANCHORS.items()), ""]
    errs = [r for r in rows if "error" in r]
    if errs:
        out += ["### Errors", ""] + [f"- {r['method']} {r['shape']}: {r['error']}" for r in errs]
    return "\n".join(out) + "\n"


def chart(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    rows = [r for r in res["rows"] if "error" not in r and "fwd_bwd_tflops" in r]
    shapes = []
    for r in rows:
        if tuple(r["shape"]) not in shapes:
            shapes.append(tuple(r["shape"]))
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    if not shapes or not methods:
        return False
    fig, ax = plt.subplots(figsize=(11, 4.5))
    w = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ys = [next((r["fwd_bwd_tflops"] for r in rows if tuple(r["shape"]) == s and r["method"] == m), 0) for s in shapes]
        ax.bar([j + i * w for j in range(len(shapes))], ys, w, label=m)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(shapes))])
    ax.set_xticklabels([f"{s[0]}×{s[1]}×{s[2]}×{s[3]}{' c' if s[4] else ''}" for s in shapes])
    ax.set_ylabel("fwd+bwd TFLOP/s (bf16)")
    ax.set_title(f"Attention fwd+bwd, {res['env'].get('device', 'cpu')}, {res['date']}")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, one tiny shape, our kernels only")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    methods = [m for m in args.methods.split(",") if M.available(m)]
    shapes = [(1, 2, 48, 32, True)] if args.smoke else SHAPES
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    res = {"env": M.env_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": []}
    for s in shapes:
        for m in methods:
            t0 = time.time()
            r = measure(s, m, args.smoke)
            res["rows"].append(r)
            print(f"[{time.time() - t0:.1f}s] {s} {m}: " + (r["error"] if "error" in r else
                  f"fwd {r['fwd_tflops']:.0f} bwd {r['bwd_tflops']:.0f} fwd+bwd {r['fwd_bwd_tflops']:.0f} TFLOP/s"),
                  flush=True)
            if not args.smoke:
                torch.cuda.empty_cache()
        with open(os.path.join(args.out, "attention.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, "attention.md"), "w") as f:
            f.write(markdown(res))
    chart(res, os.path.join(args.out, "attention.png"))
    print(markdown(res))


if __name__ == "__main__":
    main()
