"""Fidelity sweep of DESIGN.md §6 (synthetic inputs) against a float64 reference.

Inputs: keys = μ + N(0, 1) with ‖μ‖ ∈ {0, 50, 200, 1000} (μ a random direction per head), q ~ N(0, σ²),
σ ∈ {1, 3}, v and dO ~ N(0, 1); causal and not; B=1, H=4, N=2048, d=128, bf16. Plus d=64, GQA 8:1
(H=8, Hk=1), N=1000. Reference: float64 softmax attention and autograd on the same bf16 inputs.

Metrics per (setting, method), for o, dq, dk, dv:
  * ``frob``: per-head relative Frobenius error ‖x − x_ref‖_F / ‖x_ref‖_F, median over heads (primary);
  * ``rowmed``: median over rows of ‖x_i − x_ref,i‖ / ‖x_ref,i‖ (rows whose reference is exactly 0 skipped);
  * ``c2``: ‖Σ_j dK_j‖ / ‖dK‖_F of the returned (bf16) dK, median over kv heads (C2, DESIGN.md §2);
  * ``c1_pre`` (ours only): max_i |r_i| / Σ_j |dS̃_ij|, the zero-sum violation of the rounded dS that
    the projections remove (after a projection the row sums are 0 by construction, up to fp32).
Also the FMA checks of DESIGN.md §5: q = k = v = 133120 and 1000 (bf16) through every forward.

Methods: ours (gproj, gproj_fold, none, gproj_uniform; gproj/none with ds_format e4m3 / e5m2 as
``*_e4m3``, ``*_e5m2``), cudnn, sdpa_flash, fa4 (when importable). ``--mus`` picks the ‖μ‖ values.

Sliding windows and softcap (issue 16): ``--window LEFT,RIGHT`` (flash-attn's ``window_size``: query i sees
key j iff i + Nk − Nq − LEFT <= j <= i + Nk − Nq + RIGHT, −1 unbounded, causal sets RIGHT = 0) and
``--softcap C`` (logits C·tanh(τ q·k / C)) go to our kernels and, written out in float64, to the
reference. Anchors that cannot express them are skipped with a note (``sdpa_mask``, SDPA with the
window as a boolean mask, joins the default methods when a window is given). A window with RIGHT = 0 is
causal already, so only the causal settings run. Under softcap C2 does not hold in exact arithmetic:
the ``c2_ref`` column is the float64 gradient's own Σ_j dK_j / ‖dK‖_F, the floor to compare ``c2`` with.

Usage: python benchmarks/fidelity.py --out DIR [--smoke] [--quick] [--methods a,b] [--mus 0,200,1000]
                                     [--window LEFT,RIGHT] [--softcap C]
Writes DIR/fidelity.json and DIR/fidelity.md (rewritten after every setting, so a cut-off run keeps
what it measured); both name the window and softcap.
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

METHODS = ["gproj", "gproj_fold", "none", "gproj_uniform", "gproj_e4m3", "none_e4m3", "gproj_e5m2", "none_e5m2",
           "cudnn", "sdpa_flash", "sdpa_mask", "fa4"]


def make_inputs(b, n, h, hk, d, mu, sigma, seed, dev):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = (sigma * torch.randn(b, n, h, d, generator=g, device=dev)).bfloat16()
    direction = torch.randn(1, 1, hk, d, generator=g, device=dev)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    k = (mu * direction + torch.randn(b, n, hk, d, generator=g, device=dev)).bfloat16()
    v = torch.randn(b, n, hk, d, generator=g, device=dev).bfloat16()
    do = torch.randn(b, n, h, d, generator=g, device=dev).bfloat16()
    return q, k, v, do


def feature_label(window_size, softcap, dropout=0.0):
    """'window (256, 0), softcap 30, dropout 0.1', or '' without any."""
    parts = ([f"window ({window_size[0]}, {window_size[1]})"] if tuple(window_size) != (-1, -1) else []) + (
        [f"softcap {softcap:g}"] if softcap else []) + ([f"dropout {dropout:g}"] if dropout else [])
    return ", ".join(parts)


def parse_window(text):
    """'LEFT,RIGHT' -> (left, right), ints >= −1; argparse type."""
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window takes LEFT,RIGHT (two integers >= -1), got {text!r}") from None
    if left < -1 or right < -1:
        raise argparse.ArgumentTypeError(f"--window values must be >= -1 (-1 = unbounded), got {text!r}")
    return left, right


def measure_setting(setting, methods, dev):
    b, n, h, hk, d = setting["b"], setting["n"], setting["h"], setting["hk"], setting["d"]
    q, k, v, do = make_inputs(b, n, h, hk, d, setting["mu"], setting["sigma"], setting["seed"], dev)
    tau = d ** -0.5
    feat = {"window_size": tuple(setting["window_size"]), "softcap": setting["softcap"]}
    if setting.get("dropout"):  # the same mask for our kernels and the float64 reference
        feat.update(dropout_p=setting["dropout"], dropout_seed=1000 + setting["seed"], dropout_offset=0)
    o64, dq64, dk64, dv64 = M.f64_reference(q, k, v, do, tau, setting["causal"], **feat)
    c2_ref = M.c2_pairs(dk64).median().item()  # 0 up to float64 rounding, except under softcap
    rows = []
    for name in methods:
        row = {**setting, "method": name, "c2_ref": c2_ref}
        try:
            meth = M.make(name, q, k, v, do, setting["causal"], **feat,
                          **({"want_stats": True} if name in M.OURS else {}))
            o, dq, dk, dv, extras = meth.run()
            for nm, x, ref in (("o", o, o64), ("dq", dq, dq64), ("dk", dk, dk64), ("dv", dv, dv64)):
                row[f"{nm}_frob"] = M.frob_pairs(x, ref).median().item()
                rowerr = M.row_errors(x, ref)
                row[f"{nm}_rowmed"] = rowerr.median().item() if rowerr.numel() else float("nan")
            row["c2"] = M.c2_pairs(dk).median().item()
            row["nan"] = any(bool(torch.isnan(x).any().item()) for x in (o, dq, dk, dv))
            if extras:
                a = extras["abs_dS"]
                keep = a > 0
                ratio = extras["r"].abs()[keep] / a[keep]
                row["c1_pre"] = ratio.max().item() if keep.any() else 0.0
                row["c1_pre_median"] = ratio.median().item() if keep.any() else 0.0
        except Exception as exc:  # an anchor that cannot serve a shape is reported, not fatal
            row["error"] = f"{exc.__class__.__name__}: {str(exc)[:200]}"
        rows.append(row)
    return rows


def constant_checks(methods, dev, n, d, causals=(False, True), **feat):
    out = []
    for cval in (133120.0, 1000.0):
        for causal in causals:
            x = torch.full((1, n, 2, d), cval, device=dev, dtype=torch.bfloat16)
            for name in methods:
                rec = {"value": cval, "causal": causal, "method": name}
                try:
                    if name in M.OURS:
                        o = M.make(name, x, x, x, x, causal, **feat).fwd()[0]
                    else:
                        o = M.make(name, x, x, x, x, causal, **feat).fwd()
                    rec["nan"] = bool(torch.isnan(o).any().item())
                    rec["exact"] = bool((o.float() == cval).all().item())
                    rec["max_abs_err"] = (o.float() - cval).abs().nan_to_num(float("inf")).max().item()
                except Exception as exc:
                    rec["error"] = f"{exc.__class__.__name__}: {str(exc)[:200]}"
                out.append(rec)
    return out


def _fmt(x, pct=True):
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    return f"{100 * x:.3g}%" if pct else f"{x:.2e}"


def markdown(res):
    rows = res["rows"]
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    settings = []
    for r in rows:
        key = (r["group"], r["mu"], r["sigma"], r["causal"])
        if key not in settings:
            settings.append(key)

    def table(metric, title, pct=True, ref=None):
        """One row per setting, one column per method; ``ref``: a last column with the reference's value."""
        lines = [f"### {title}", "", "| setting | " + " | ".join(methods) + (" | float64 reference" if ref else "")
                 + " |", "|---|" + "---|" * (len(methods) + bool(ref))]
        for key in settings:
            cells = []
            for mth in methods:
                r = next((x for x in rows if (x["group"], x["mu"], x["sigma"], x["causal"]) == key
                          and x["method"] == mth), None)
                if r is None:
                    cells.append("—")
                elif "error" in r:
                    cells.append("err")
                else:
                    cells.append(_fmt(r.get(metric), pct))
            if ref:
                r = next((x for x in rows if (x["group"], x["mu"], x["sigma"], x["causal"]) == key), {})
                cells.append(_fmt(r.get(ref), pct))
            g, mu, sig, causal = key
            lines.append(f"| {g} ‖μ‖={mu:g} σ={sig:g} {'causal' if causal else 'full'} | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    env = res["env"]
    feature = feature_label(res.get("window_size", (-1, -1)), res.get("softcap", 0.0), res.get("dropout", 0.0))
    parts = [f"# Fidelity sweep (DESIGN.md §6){', ' + feature if feature else ''}\n\n{env}\n\nDate {res['date']}. "
             "Reference: float64 on the same bf16 inputs" + (f", with the same {feature}" if feature else "")
             + ". Percent = relative error.\n"]
    parts += [f"Skipped: {reason}.\n" for reason in res.get("skipped", {}).values()]
    parts.append(table("dq_rowmed", "dq, row-median relative error (paper metric)"))
    parts.append(table("dq_frob", "dq, per-head Frobenius (median over heads)"))
    parts.append(table("dk_frob", "dk, per-head Frobenius"))
    parts.append(table("dv_frob", "dv, per-head Frobenius"))
    parts.append(table("o_frob", "o, per-head Frobenius"))
    parts.append(table("dk_rowmed", "dk, row-median"))
    parts.append(table("c2", "C2 residual ‖Σ_j dK_j‖ / ‖dK‖_F (bf16 dK; the reference's own is not 0 under "
                       "softcap)", pct=False, ref="c2_ref"))
    parts.append(table("c1_pre", "C1 before projection: max_i |r_i| / Σ_j |dS̃_ij| (ours; causal row 0 sees one "
                       "key, where dS is pure rounding, so the max is ~1 there)", pct=False))
    parts.append(table("c1_pre_median", "C1 before projection, median over rows (ours)", pct=False))
    errs = [r for r in rows if "error" in r]
    if errs:
        parts.append("### Errors\n\n" + "\n".join(f"- {r['method']} {r['group']} ‖μ‖={r['mu']} causal={r['causal']}: "
                                                  f"{r['error']}" for r in errs) + "\n")
    if res.get("constants"):
        lines = ["### Constant inputs (DESIGN.md §5)", "", "| value | causal | method | NaN | exact | max abs err |",
                 "|---|---|---|---|---|---|"]
        for c in res["constants"]:
            if "error" in c:
                lines.append(f"| {c['value']:g} | {c['causal']} | {c['method']} | err | {c['error'][:60]} | |")
            else:
                lines.append(f"| {c['value']:g} | {c['causal']} | {c['method']} | {c['nan']} | {c['exact']} | "
                             f"{c['max_abs_err']:.3g} |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, our kernels only")
    ap.add_argument("--quick", action="store_true", help="σ=1 only and a shorter GQA sweep")
    ap.add_argument("--methods", default=None, help=f"comma-separated, of {','.join(METHODS)} (default: all "
                    "available; sdpa_mask only with --window)")
    ap.add_argument("--mus", default=None, help="comma-separated ‖μ‖ values (default 0,50,200,1000)")
    ap.add_argument("--window", type=parse_window, default=(-1, -1), metavar="LEFT,RIGHT",
                    help="flash-attn sliding window for every setting, e.g. 256,0 (write --window=-1,8 when "
                         "LEFT is -1)")
    ap.add_argument("--softcap", type=float, default=0.0, metavar="C", help="logit softcap C > 0 for every setting")
    ap.add_argument("--dropout", type=float, default=0.0, metavar="P",
                    help="attention dropout 0 <= P < 1 for every setting (our methods only; the float64 reference "
                         "uses the kernels' mask)")
    args = ap.parse_args()
    if args.softcap < 0:
        ap.error(f"--softcap must be >= 0 (0 = off), got {args.softcap}")
    if not 0.0 <= args.dropout < 1.0:
        ap.error(f"--dropout must be in [0, 1), got {args.dropout}")
    os.makedirs(args.out, exist_ok=True)
    dev = "cpu" if args.smoke else "cuda"
    feat = {"window_size": args.window, "softcap": args.softcap}
    requested = args.methods.split(",") if args.methods else [m for m in METHODS if m != "sdpa_mask" or
                                                                args.window != (-1, -1)]
    unknown = [m for m in requested if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; known: {METHODS}")
    skipped = {m: M.unsupported(m, **feat, dropout_p=args.dropout) for m in requested
               if M.available(m) and M.unsupported(m, **feat, dropout_p=args.dropout)}
    for reason in skipped.values():
        print(f"skipped {reason}", flush=True)
    methods = [m for m in requested if M.available(m) and m not in skipped]
    if args.smoke:
        main_cfg = dict(b=1, n=40, h=2, hk=2, d=32)
        gqa_cfg = dict(b=1, n=37, h=2, hk=1, d=32)
        mus, sigmas, gqa_mus = (0.0, 200.0), (1.0,), (50.0,)
    else:
        main_cfg = dict(b=1, n=2048, h=4, hk=4, d=128)
        gqa_cfg = dict(b=1, n=1000, h=8, hk=1, d=64)
        mus, sigmas = (0.0, 50.0, 200.0, 1000.0), ((1.0,) if args.quick else (1.0, 3.0))
        gqa_mus = (0.0, 1000.0) if args.quick else (0.0, 50.0, 200.0, 1000.0)
    if args.mus:
        mus = gqa_mus = tuple(float(x) for x in args.mus.split(","))
    # a window with right = 0 is causal already (causal only sets right = 0): run the causal settings only
    causals = (True,) if args.window[1] == 0 else (False, True)
    settings = []
    seed = 0
    for causal in (False, True):
        for sigma in sigmas:
            for mu in mus:
                seed += 1
                settings.append({"group": "d128", **main_cfg, "mu": mu, "sigma": sigma, "causal": causal, "seed": seed})
    for causal in (False, True):
        for mu in gqa_mus:
            seed += 1
            settings.append({"group": "gqa8:1-d64-N1000" if not args.smoke else "gqa", **gqa_cfg, "mu": mu,
                             "sigma": 1.0, "causal": causal, "seed": seed})
    settings = [{**st, "window_size": list(args.window), "softcap": args.softcap, "dropout": args.dropout} for st in settings
                if st["causal"] in causals]
    res = {"env": M.env_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": [],
           "methods": methods, "window_size": list(args.window), "softcap": args.softcap, "dropout": args.dropout,
           "feature": feature_label(args.window, args.softcap, args.dropout) or "none", "skipped": skipped}

    def dump():
        with open(os.path.join(args.out, "fidelity.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, "fidelity.md"), "w") as f:
            f.write(markdown(res))

    res["constants"] = constant_checks(methods, dev, 40 if args.smoke else 1024, 32 if args.smoke else 128, causals,
                                       **feat)
    dump()
    for st in settings:
        t0 = time.time()
        res["rows"].extend(measure_setting(st, methods, dev))
        dump()
        last = [r for r in res["rows"][-len(methods):]]
        print(f"[{time.time() - t0:.1f}s] {st['group']} mu={st['mu']} sigma={st['sigma']} causal={st['causal']}: "
              + " ".join(f"{r['method']}:dq_rm={_fmt(r.get('dq_rowmed'))}/dq_f={_fmt(r.get('dq_frob'))}"
                         f"/dk_f={_fmt(r.get('dk_frob'))}" if "error" not in r else f"{r['method']}:ERR"
                         for r in last), flush=True)
    print(markdown(res))


if __name__ == "__main__":
    main()
