"""Attention speed (DESIGN.md §7, issue 12): forward, backward and forward+backward TFLOP/s and peak memory.

Shapes (B×H×N×d), each without and with the causal mask: 4×16×2048×128, 1×16×8192×128, 2×16×4096×64,
1×8×16384×128; bf16, inputs from torch.randn. FLOPs: forward 4·B·H·N²·d (× ½ causal), backward
2.5 × forward. Time: triton.testing.do_bench, median (warm-up first; the first call of each shape
autotunes / compiles); ``--timer kernels``: the GPU time of the call's kernels instead, every method alike (do_bench
launches each call from Python after an L2 flush, so a short call whose host time exceeds the flush's GPU time reads
slower than its kernels run: :func:`kernel_time`), with each kernel's median printed and kept in the records
(``kernels_ms``: where a method's time goes, e.g. the backward's dQ and dK/dV passes). Peak memory: torch.cuda.max_memory_allocated over one forward+backward, minus
the memory held before it (inputs), in MiB.

Methods (benchmarks/_methods.py): gproj, gproj_fold, none, gproj_uniform (our kernels), cudnn (SDPA),
sdpa_flash (SDPA FlashAttention-2), fa4 (flash-attn-4 CuTe, when importable).

Usage: python benchmarks/attention.py --out DIR [--json [PATH]] [--smoke] [--methods a,b] [--shapes i,j]
Writes DIR/attention.json (environment, date, records), DIR/attention.md and (matplotlib permitting)
DIR/attention.png, rewritten after every shape; with ``--json`` also PATH (default
benchmarks/results/speed_latest.json): the list of records
{shape: [B, H, N, d], causal, method, fwd_tflops, bwd_tflops, fwdbwd_tflops, peak_mib} (plus the
times in ms, with ``--timer kernels`` ``kernels_ms`` — per mode, each kernel's median ms per call; medians taken
kernel by kernel, so they need not sum to the mode's median — and ``error`` where a method failed, its numbers then
null).

``--dropout P``: also each method with attention dropout P; on an H200 the Gluon kernels serve ours (their
dropout variants; ``GPROJ_HOPPER_DROPOUT=0`` times the tl.dot kernels instead, A/B), cudnn and sdpa_flash take SDPA's
``dropout_p`` (their own mask: what dropout costs the anchors). ``--softcap C`` / ``--window W``: also each method with
that softcap / window; of the anchors fa4 takes both (its softcap tanh is ``tanh.approx.f32``), sdpa_mask the window.

``--smoke``: CPU, Triton's interpreter (TRITON_INTERPRET=1), two tiny shapes (causal and not), our
kernels only. The timings are the interpreter's and mean nothing; it exists so that a CPU test can
check that the script runs and what it writes.

``--varlen [LENGTHS]``: packed sequences instead (issue 16): the comma-separated sequence lengths
(default 4096,3072,2560,2048,1536,1280,1024,768: 8 sequences, 16384 tokens), ``--varlen-heads H,d``
(default 16,128), bf16, without and with the causal mask, fix none and gproj. "packed": the kernels with cu_seqlens (total, H, d); "padded": the same sequences right-padded
to the longest as one (8, max, H, d) batch with seqlens_k (padded query rows computed and thrown away; equal lengths:
one dense batch without seqlens_k).
Both are timed on the kernels (attention_fwd.forward, attention_bwd.backward; no op-level device sync)
and rated in useful TFLOP/s (Σ_b 4·H·L_b²·d, × ½ causal; backward 2.5×). Writes DIR/attention_varlen.json
and prints a table; with ``--smoke`` tiny lengths on the interpreter (gproj only).
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
SMOKE_METHODS = ["gproj", "none"]
#: (B, H, N, d): DESIGN.md §7 and issue 12; each runs without and with the causal mask.
BASE_SHAPES = [(4, 16, 2048, 128), (1, 16, 8192, 128), (2, 16, 4096, 64), (1, 8, 16384, 128)]
SHAPES = [(*s, causal) for s in BASE_SHAPES for causal in (False, True)]
SMOKE_SHAPES = [(1, 1, 24, 16, False), (1, 1, 24, 16, True)]
#: The keys of one record of the --json output (issue 12).
RECORD_KEYS = ("shape", "causal", "method", "fwd_tflops", "bwd_tflops", "fwdbwd_tflops", "peak_mib")
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "speed_latest.json")
#: DESIGN.md §7 anchors measured earlier on an H200 (fwd+bwd TFLOP/s, FA4 / cuDNN / SDPA-flash).
DESIGN_ANCHORS = {
    (4, 16, 2048, 128, False): (560, 500, 283), (1, 16, 8192, 128, False): (616, 546, 315),
    (1, 16, 8192, 128, True): (559, 483, 274), (2, 16, 4096, 64, False): (495, 429, 275),
    (1, 8, 16384, 128, True): (614, 524, 305),
}
MODES = (("fwd", "fwd"), ("bwd", "bwd"), ("fwdbwd", "fwd_bwd"))  # (record key, attn_flops mode)


#: How the GPU runs are timed (``--timer``): "do_bench" (triton.testing.do_bench: each call launched from Python
#: after an L2 flush, so a call whose host time exceeds the flush's GPU time is timed partly on the host) or
#: "kernels" (:func:`kernel_time`: the summed GPU time of each call's kernels, L2 flushed before each call).
TIMER = "do_bench"
#: Bytes the L2 flush writes before each timed call (as triton.testing.do_bench; the H200's L2 holds 50 MB).
FLUSH_BYTES = 256 * 2**20


def _flush_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _l2_flush(X, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(X + offs, tl.zeros([BLOCK], tl.int32))

    return _l2_flush


def kernel_time(fn, calls=30, warmup=5, kernels=None):
    """Median over ``calls`` calls of fn's GPU time in ms: the durations of the kernels, memsets and copies the
    call runs, summed (CUDA activity of torch.profiler, i.e. CUPTI), so host time between launches is not counted.
    Before each call a kernel of our own (its name ``_l2_flush``, which also splits the calls apart) writes
    FLUSH_BYTES, as do_bench's flush does. Works for every method, cuDNN included (CUDA graphs do not: the SDPA
    anchors failed under capture, benchmarks/NOTES.md run 20). ``kernels``: None, or a dict that receives each
    kernel's (event name's) median time per call in ms (:func:`split_calls`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    block = 4096
    kernel = _flush_kernel()
    for _ in range(warmup):
        kernel[(flush.numel() // block,)](flush, BLOCK=block)
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            kernel[(flush.numel() // block,)](flush, BLOCK=block)
            fn()
        torch.cuda.synchronize()
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name = []
    per_call = split_calls(events, by_name)
    if len(per_call) != calls or min(per_call) <= 0:
        raise RuntimeError(f"kernel_time: {len(per_call)} of {calls} calls seen with kernels by the profiler")
    if kernels is not None:
        kernels.update(kernel_medians(by_name))
    return sorted(per_call)[calls // 2]


def kernel_medians(by_name):
    """Each kernel's median time per call (ms) from :func:`split_calls`' per-call dicts, a call that did not run it
    counting 0 (the upper median for an even number of calls, as :func:`kernel_time`'s); taken kernel by kernel, so
    the medians need not sum to the calls' median."""
    names = dict.fromkeys(n for call in by_name for n in call)
    return {n: sorted(call.get(n, 0.0) for call in by_name)[len(by_name) // 2] for n in names}


def split_calls(events, by_name=None):
    """Per-call GPU time in ms from device events (name, start µs, end µs), in any order: each ``_l2_flush`` kernel
    starts a call, whose time is the summed durations of the events after it up to the next flush (events before the
    first flush are dropped). ``by_name``: None, or a list that receives one dict per call, event name → its summed
    durations in that call (ms)."""
    per_call = []
    for name, start, end in sorted(events, key=lambda e: e[1]):
        if "_l2_flush" in name:
            per_call.append(0.0)
            if by_name is not None:
                by_name.append({})
        elif per_call:
            per_call[-1] += (end - start) / 1e3
            if by_name is not None:
                by_name[-1][name] = by_name[-1].get(name, 0.0) + (end - start) / 1e3
    return per_call


def bench(fn, smoke, kernels=None):
    """fn's time in ms (``kernels``: with the kernel timer, filled with each kernel's median, :func:`kernel_time`)."""
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench
    if TIMER == "kernels":
        return kernel_time(fn, kernels=kernels)
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure(shape, name, smoke, window=0, softcap=0.0, dropout=0.0):
    """One record: shape (B, H, N, d, causal) timed with method ``name``; ``window`` > 0: a sliding window
    of that many keys back (window_size=(window, 0) causal, (window, window) not), ``softcap`` > 0: logit
    capping, ``dropout`` > 0: attention dropout with that probability (ours: a fixed seed; cudnn, sdpa_flash: SDPA's
    ``dropout_p``); an anchor that cannot express a feature (_methods.unsupported) gets an ``error`` row. TFLOP/s count
    the dense (or causal) FLOPs either way, so a window shows as the speed-up its skipped blocks give."""
    b, h, n, d, causal = shape
    feat = {}
    if window:
        feat["window_size"] = (window, 0 if causal else window)
    if softcap:
        feat["softcap"] = softcap
    if dropout:
        feat["dropout_p"] = dropout
        if name in M.OURS:
            feat.update(dropout_seed=0x1234_5678_9ABC, dropout_offset=0)
    dev = "cpu" if smoke else "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(b, n, h, d, generator=g, device=dev).bfloat16() for _ in range(4))
    tag = _tag(window, softcap, dropout, "+")
    row = {"shape": [b, h, n, d], "causal": causal, "method": name + tag, "peak_mib": None, "window": window,
           "softcap": softcap, "dropout": dropout, "timer": TIMER}
    for key, _ in MODES:
        row[f"{key}_tflops"] = row[f"{key}_ms"] = None
    try:
        meth = M.make(name, q, k, v, do, causal, timing=True, **feat)
        meth.fwd_bwd()  # compile / autotune
        if not smoke:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            meth.fwd_bwd()
            torch.cuda.synchronize()
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        kernels = {key: {} for key, _ in MODES}  # the kernel timer's per-kernel medians (ms)
        times = {"fwdbwd": bench(meth.fwd_bwd, smoke, kernels["fwdbwd"]), "fwd": bench(meth.fwd, smoke, kernels["fwd"])}
        if name in M.OURS:
            meth.fwd()
        else:
            meth.fwd_graph()
        times["bwd"] = bench(meth.bwd, smoke, kernels["bwd"])
        if TIMER == "kernels" and not smoke:
            row["kernels_ms"] = kernels
        for key, mode in MODES:
            row[f"{key}_ms"] = times[key]
            row[f"{key}_tflops"] = M.attn_flops(b, h, n, n, d, causal, mode) / (times[key] * 1e-3) / 1e12
    except Exception as exc:
        row["error"] = f"{exc.__class__.__name__}: {str(exc)[:300]}"
    return row


def _tag(window, softcap, dropout, sep):
    """'+window1024+softcap30+dropout0.1' (sep '+') or ' window=1024 ...' (sep ' '): the features of a row."""
    eq = "" if sep == "+" else "="
    return "".join(f"{sep}{name}{eq}{value:g}" for name, value in
                   (("window", window), ("softcap", softcap), ("dropout", dropout)) if value)


def _key(r):
    return (*r["shape"], r["causal"])


def _label(s):
    return f"{s[0]}×{s[1]}×{s[2]}×{s[3]} {'causal' if s[4] else 'full'}"


def markdown(res):
    rows = res["rows"]
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    # --window / --softcap rows: their own columns, named after the method and the feature
    methods += list(dict.fromkeys(r["method"] for r in rows if r["method"] not in methods))
    shapes = list(dict.fromkeys(_key(r) for r in rows))

    def get(shape, m, key):
        r = next((x for x in rows if _key(x) == shape and x["method"] == m), None)
        if r is None:
            return None
        return "err" if "error" in r else r.get(key)

    def fmt(x, nd=0):
        return "—" if x is None else (x if isinstance(x, str) else f"{x:.{nd}f}")

    def ratio(a, b):
        return fmt(a / b, 2) if isinstance(a, float) and isinstance(b, float) else "—"

    timer = {"do_bench": "triton.testing.do_bench medians (each call launched after an L2 flush)",
             "kernels": "medians of each call's summed kernel time (torch.profiler's CUDA activity; L2 flushed "
                        "before each call; no host launch time)"}[res.get("timer", "do_bench")]
    out = [f"# Attention speed (DESIGN.md §7)\n\n{res['env']}\n\nDate {res['date']}. TFLOP/s from "
           f"{timer}; bf16; FLOPs 4·B·H·N²·d (½ causal), bwd 2.5×.\n"]
    for key, title in (("fwdbwd", "fwd+bwd"), ("fwd", "fwd"), ("bwd", "bwd")):
        out += [f"### {title} TFLOP/s", "", "| B×H×N×d causal | " + " | ".join(methods) + " |",
                "|---|" + "---|" * len(methods)]
        for s in shapes:
            out.append(f"| {_label(s)} | " + " | ".join(fmt(get(s, m, f"{key}_tflops")) for m in methods) + " |")
        out.append("")
    # Issue 12's goals: fwd+bwd ≥ 0.70× cuDNN (gproj), ≥ 0.90× (none), forward ≥ 0.90×.
    ours = [m for m in methods if m in M.OURS]
    out += ["### Against cuDNN (issue 12 goals: gproj fwd+bwd ≥ 0.70×, none ≥ 0.90×, fwd ≥ 0.90×)", "",
            "| shape | " + " | ".join(f"{m} fwd+bwd" for m in ours) + " | gproj fwd |",
            "|---|" + "---|" * (len(ours) + 1)]
    for s in shapes:
        c = get(s, "cudnn", "fwdbwd_tflops")
        cells = [ratio(get(s, m, "fwdbwd_tflops"), c) for m in ours]
        cells.append(ratio(get(s, "gproj", "fwd_tflops"), get(s, "cudnn", "fwd_tflops")))
        out.append(f"| {_label(s)} | " + " | ".join(cells) + " |")
    pairs = [(a, b) for a, b in (("gproj", "none"), ("gproj_fold", "none")) if a in methods and b in methods]
    if pairs:
        out += ["", "### fwd+bwd time, one method over another", "",
                "| shape | " + " | ".join(f"{a} / {b}" for a, b in pairs) + " |", "|---|" + "---|" * len(pairs)]
        for s in shapes:
            cells = []
            for a, b in pairs:
                ta, tb = get(s, a, "fwdbwd_ms"), get(s, b, "fwdbwd_ms")
                cells.append(f"{100 * (ta / tb - 1):+.1f}%" if isinstance(ta, float) and isinstance(tb, float) else "—")
            out.append(f"| {_label(s)} | " + " | ".join(cells) + " |")
    out += ["", "### Peak memory of one fwd+bwd above the inputs (MiB)", "",
            "| shape | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for s in shapes:
        out.append(f"| {_label(s)} | " + " | ".join(fmt(get(s, m, "peak_mib")) for m in methods) + " |")
    out += ["", "DESIGN.md §7 anchors (fwd+bwd, earlier H200 session): FA4 / cuDNN / SDPA-flash = "
            + "; ".join(f"{_label(k)}: {v[0]}/{v[1]}/{v[2]}" for k, v in DESIGN_ANCHORS.items()), ""]
    errs = [r for r in rows if "error" in r]
    if errs:
        out += ["### Errors", ""] + [f"- {r['method']} {_label(_key(r))}: {r['error']}" for r in errs]
    return "\n".join(out) + "\n"


def chart(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    rows = [r for r in res["rows"] if r.get("fwdbwd_tflops") is not None]
    shapes = list(dict.fromkeys(_key(r) for r in rows))
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    if not shapes or not methods:
        return False
    fig, ax = plt.subplots(figsize=(13, 4.5))
    w = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ys = [next((r["fwdbwd_tflops"] for r in rows if _key(r) == s and r["method"] == m), 0) for s in shapes]
        ax.bar([j + i * w for j in range(len(shapes))], ys, w, label=m)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(shapes))])
    ax.set_xticklabels([f"{s[0]}×{s[1]}×{s[2]}×{s[3]}{' c' if s[4] else ''}" for s in shapes], fontsize=8)
    ax.set_ylabel("fwd+bwd TFLOP/s (bf16)")
    ax.set_title(f"Attention fwd+bwd, {res['env'].get('device', 'cpu')}, {res['date']}")
    ax.legend(ncol=5, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def records(rows):
    """The --json records: RECORD_KEYS, the times, ``kernels_ms`` (--timer kernels: per mode, each kernel's median ms
    per call) and ``error`` where there is one."""
    keep = RECORD_KEYS + ("fwd_ms", "bwd_ms", "fwdbwd_ms", "window", "softcap", "dropout", "timer", "kernels_ms",
                          "error")
    return [{k: r[k] for k in keep if k in r} for r in rows]


VARLEN_LENGTHS = "4096,3072,2560,2048,1536,1280,1024,768"
SMOKE_VARLEN_LENGTHS = "9,0,20,1"


def varlen(lengths, heads, head_dim, smoke, out):
    """Packed vs padded timings of the same sequences (module docstring, ``--varlen``)."""
    from lightning_gproj.kernels import attention_bwd as B
    from lightning_gproj.kernels import attention_fwd as F

    dev = "cpu" if smoke else "cuda"
    lens = [int(x) for x in lengths.split(",")]
    g = torch.Generator(device=dev).manual_seed(0)
    total, longest, batch = sum(lens), max(lens), len(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    packed = [torch.randn(total, heads, head_dim, generator=g, device=dev).bfloat16() for _ in range(4)]
    padded = [torch.zeros(batch, longest, heads, head_dim, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    for x, y in zip(packed, padded):
        for b, n in enumerate(lens):
            y[b, :n] = x[cu[b]:cu[b] + n]
    seqlens = torch.tensor([max(n, 1) for n in lens], dtype=torch.int32, device=dev)  # seqlens_k must be >= 1
    vl = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    tau = head_dim**-0.5
    fixes = ["gproj"] if smoke else ["none", "gproj"]
    rows = []
    for causal in (False, True):
        flops = sum(4 * heads * n * n * head_dim * (0.5 if causal else 1.0) for n in lens)
        # Equal lengths: the padded batch needs no key lengths, so it runs the dense kernels (on sm_90 the Gluon ones).
        pad = {} if len(set(lens)) == 1 else dict(seqlens_k=seqlens)
        for layout, (q, k, v, do), extra in (("packed", packed, vl), ("padded", padded, pad)):
            for fix in fixes:
                row = {"lengths": lens, "heads": heads, "head_dim": head_dim, "causal": causal, "layout": layout,
                       "fix": fix}
                try:
                    fwd = F.forward(q, k, v, tau, causal, **extra)
                    times = {
                        "fwd": bench(lambda: F.forward(q, k, v, tau, causal, **extra), smoke),
                        "bwd": bench(lambda: B.backward(do, q, k, v, *fwd, tau, causal, fix, **extra),
                                     smoke),
                    }
                    times["fwdbwd"] = times["fwd"] + times["bwd"]
                    for key, mult in (("fwd", 1.0), ("bwd", 2.5), ("fwdbwd", 3.5)):
                        row[f"{key}_ms"] = times[key]
                        row[f"{key}_tflops"] = mult * flops / (times[key] * 1e-3) / 1e12
                except Exception as exc:
                    row["error"] = f"{exc.__class__.__name__}: {str(exc)[:300]}"
                rows.append(row)
                print(f"{layout} causal={causal} {fix}: " + (row["error"] if "error" in row else
                      f"fwd {row['fwd_ms']:.2f} ms, bwd {row['bwd_ms']:.2f} ms, useful fwd+bwd "
                      f"{row['fwdbwd_tflops']:.0f} TFLOP/s"), flush=True)
    res = {"env": M.env_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "smoke": smoke,
           "timer": TIMER, "rows": rows}
    with open(os.path.join(out, "attention_varlen.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = ["| causal | fix | packed fwd+bwd ms | padded fwd+bwd ms | packed / padded |", "|---|---|---|---|---|"]
    for r in rows:
        if r["layout"] == "packed":
            p = next(x for x in rows if x["layout"] == "padded" and all(x[k] == r[k] for k in ("causal", "fix")))
            if "error" not in r and "error" not in p:
                lines.append(f"| {r['causal']} | {r['fix']} | {r['fwdbwd_ms']:.2f} | {p['fwdbwd_ms']:.2f} | "
                             f"{r['fwdbwd_ms'] / p['fwdbwd_ms']:.2f} |")
    print("\n".join(lines))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--json", nargs="?", const=DEFAULT_JSON, default=None, metavar="PATH",
                    help=f"also write the records as a JSON list (default path {DEFAULT_JSON})")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, two tiny shapes, our kernels only")
    ap.add_argument("--methods", default=None, help="comma-separated (default: all available)")
    ap.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES (or SMOKE_SHAPES)")
    ap.add_argument("--window", type=int, default=0,
                    help="also time each method with a sliding window of this many keys back (ours, fa4, sdpa_mask)")
    ap.add_argument("--softcap", type=float, default=0.0, help="also time each method with this logit softcap")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="also time each method with attention dropout of this probability (ours, cudnn, sdpa_flash)")
    ap.add_argument("--varlen", nargs="?", const="", default=None, metavar="LENGTHS",
                    help=f"time packed sequences vs padded (default lengths {VARLEN_LENGTHS})")
    ap.add_argument("--varlen-heads", default="16,128", help="H,d of --varlen (default 16,128)")
    ap.add_argument("--timer", choices=("do_bench", "kernels"), default="do_bench",
                    help="do_bench (default) or kernels: each call's summed kernel time from torch.profiler (TIMER)")
    args = ap.parse_args(argv)
    global TIMER
    TIMER = args.timer
    os.makedirs(args.out, exist_ok=True)
    if args.varlen is not None:
        heads, head_dim = (int(x) for x in args.varlen_heads.split(","))
        lengths = args.varlen or (SMOKE_VARLEN_LENGTHS if args.smoke else VARLEN_LENGTHS)
        varlen(lengths, heads, head_dim, args.smoke, args.out)
        return
    requested = args.methods.split(",") if args.methods else (SMOKE_METHODS if args.smoke else METHODS)
    unknown = [m for m in requested if m not in METHODS and m not in M.OURS]
    if unknown:
        ap.error(f"unknown methods {unknown}; known: {METHODS} and {sorted(M.OURS)}")
    methods = [m for m in requested if M.available(m)]
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    res = {"env": M.env_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "smoke": args.smoke,
           "timer": args.timer, "rows": []}
    for s in shapes:
        for m in methods:
            t0 = time.time()
            feats = [(0, 0.0, 0.0)] + ([(args.window, 0.0, 0.0)] if args.window else []) + (
                [(0, args.softcap, 0.0)] if args.softcap else []) + ([(0, 0.0, args.dropout)] if args.dropout else [])
            for window, softcap, dropout in feats:
                r = measure(s, m, args.smoke, window, softcap, dropout)
                res["rows"].append(r)
                tag = _tag(window, softcap, dropout, " ")
                print(f"[{time.time() - t0:.1f}s] {_label(s)} {m}{tag}: " + (r["error"] if "error" in r else
                      f"fwd {r['fwd_tflops']:.0f} bwd {r['bwd_tflops']:.0f} fwd+bwd {r['fwdbwd_tflops']:.0f} TFLOP/s"),
                      flush=True)
                for key, parts in r.get("kernels_ms", {}).items():  # --timer kernels: where each mode's time goes
                    print(f"    {key} kernels: " + ", ".join(f"{n[:60]} {1e3 * t:.0f} µs" for n, t in
                                                          sorted(parts.items(), key=lambda x: -x[1])), flush=True)
            if not args.smoke:
                torch.cuda.empty_cache()
        with open(os.path.join(args.out, "attention.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, "attention.md"), "w") as f:
            f.write(markdown(res))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(records(res["rows"]), f, indent=1)
    chart(res, os.path.join(args.out, "attention.png"))
    print(markdown(res))


if __name__ == "__main__":
    main()
