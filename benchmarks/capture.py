"""Capture q, k, v and the incoming dO of the example GPT's attention layers (DESIGN.md §6, "Real activations").

Trains examples/gpt.py's ``GPT`` (Muon on the blocks' 2-D hidden matrices, AdamW on the rest, qkv bias,
no QK-norm) on its default data (the standard library's ``.py`` files) for a short CPU run, once per
setting given with ``--run NAME:muon_lr=..,lr=..``, then runs one batch under bf16 autocast (CPU) and
saves, for every layer in ``--layers``, the bf16 tensors that enter ``F.scaled_dot_product_attention``
and the gradient arriving at its output, in flash layout (batch, seqlen, nheads, headdim):

    OUT/NAME.pt = {"layers": {i: {"q", "k", "v", "do"}}, "meta": {...settings, loss, per-layer stats}}

Training runs in fp32 ("32-true"; bf16 autocast on a CPU costs ~1.7× per step); only the capture batch
runs under bf16 autocast, so q, k, v are the bf16 outputs of the qkv projection, as in a bf16-mixed run.
Stats per layer (on the capture batch): ``max_logit`` = max over visible (i, j) of τ q_i·k_j (fp32 on the
bf16 inputs), ``mean_key_norm`` = ‖k̄‖ (mean key over positions), median and max over (sequence, head);
the same two are logged every ``--log-every`` steps during training (fp32 forward, no autocast).

Defaults: 4 layers, 2 heads, n_embd 128 (head dim 64), block 256, batch 8; layers 0, 1, 3 captured on 4
validation sequences (3.15 MB a run). ``.captures/`` is git-ignored (.git/info/exclude).
Usage (what benchmarks/NOTES.md ran, ~4.5 min on 2 busy CPU cores, one thread):
    python benchmarks/capture.py --out .captures/h --steps 150 --run healthy:muon_lr=0.02,lr=3e-3
    python benchmarks/capture.py --out .captures/m --steps 150 --run moderate:muon_lr=0.2,lr=0.02,weight_decay=0
    python benchmarks/capture.py --out .captures/u60 --steps 60 --run unstable:muon_lr=1.0,lr=0.1,weight_decay=0
    python benchmarks/capture.py --out .captures/u150 --steps 150 \
        --run unstable_150steps:muon_lr=1.0,lr=0.1,weight_decay=0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import gpt as G  # noqa: E402  (examples/gpt.py: the LightningModule and DataModule are reused as is)

import lightning as L  # noqa: E402


@contextlib.contextmanager
def sdpa_tap(on_call):
    """Route torch.nn.functional.scaled_dot_product_attention through ``on_call(idx, q, k, v, kwargs)``.

    gpt.py calls ``F.scaled_dot_product_attention`` with ``F = torch.nn.functional``, so rebinding the
    attribute for the duration of the block sees every layer, in order. ``on_call`` returns the output.
    """
    orig = F.scaled_dot_product_attention
    count = [0]

    def tapped(q, k, v, *args, **kwargs):
        i = count[0]
        count[0] += 1
        return on_call(i, orig, q, k, v, args, kwargs)

    F.scaled_dot_product_attention = tapped
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


@torch.no_grad()
def attn_stats(q, k):
    """q, k: (B, H, T, d) -> dict of max τ q·k over causal pairs and ‖mean key‖, per (sequence, head)."""
    q32, k32 = q.float(), k.float()
    tau = q.shape[-1] ** -0.5
    s = tau * q32 @ k32.transpose(-1, -2)
    T = s.shape[-1]
    mask = torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1)
    s = s.masked_fill(mask, float("-inf"))
    maxlog = s.amax(dim=(-1, -2)).abs().flatten()  # the largest visible logit per (sequence, head)
    maxabs = s.masked_fill(mask, 0.0).abs().amax(dim=(-1, -2)).flatten()
    kbar = k32.mean(dim=2).norm(dim=-1).flatten()
    qnorm = q32.norm(dim=-1).mean(dim=-1).flatten()
    knorm = k32.norm(dim=-1).mean(dim=-1).flatten()
    return {
        "max_logit": float(s.amax()), "max_abs_logit": float(maxabs.max()),
        "max_logit_median_over_heads": float(maxlog.median()),
        "mean_key_norm_max": float(kbar.max()), "mean_key_norm_median": float(kbar.median()),
        "q_norm_mean": float(qnorm.mean()), "k_norm_mean": float(knorm.mean()),
    }


def probe(model, batch, autocast: bool):
    """One forward on ``batch``; returns the per-layer stats of attn_stats."""
    stats = {}

    def on_call(i, orig, q, k, v, args, kwargs):
        stats[i] = attn_stats(q, k)
        return orig(q, k, v, *args, **kwargs)

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), sdpa_tap(on_call), ctx:
        model.loss(batch)
    return stats


class StatsLog(L.Callback):
    def __init__(self, batch, every):
        self.batch, self.every, self.rows = batch, every, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.every and step != trainer.max_steps:
            return
        st = probe(pl_module, self.batch, autocast=False)
        loss = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)
        row = {"step": step, "loss": loss,
               "max_logit": max(s["max_logit"] for s in st.values()),
               "mean_key_norm": max(s["mean_key_norm_max"] for s in st.values())}
        self.rows.append(row)
        print(f"  step {step:4d} loss {loss:.3f} max_logit {row['max_logit']:.3g} "
              f"mean_key_norm {row['mean_key_norm']:.3g}", flush=True)


def capture(model, batch, layers):
    """bf16-autocast forward + backward of model.loss(batch); q, k, v, dO of ``layers`` (flash layout)."""
    saved = {}

    def on_call(i, orig, q, k, v, args, kwargs):
        y = orig(q, k, v, *args, **kwargs)
        if i in layers:
            flash = lambda t: t.detach().transpose(1, 2).contiguous()  # noqa: E731
            saved[i] = {"q": flash(q), "k": flash(k), "v": flash(v), "stats": attn_stats(q, k)}

            def grab(g, i=i):
                saved[i]["do"] = g.detach().transpose(1, 2).contiguous().to(torch.bfloat16)

            if y.requires_grad:
                y.register_hook(grab)
        return y

    model.train()
    model.zero_grad(set_to_none=True)
    with sdpa_tap(on_call), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    for i, d in saved.items():
        assert d["q"].dtype == torch.bfloat16, d["q"].dtype
        assert "do" in d, f"no dO captured for layer {i}"
    return float(loss.detach()), saved


def parse_run(s):
    name, _, kv = s.partition(":")
    cfg = {}
    for part in filter(None, kv.split(",")):
        key, _, val = part.partition("=")
        cfg[key] = float(val)
    return name, cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".captures")
    ap.add_argument("--run", action="append", required=True, help="NAME:muon_lr=X,lr=Y[,weight_decay=Z]")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--capture-batch", type=int, default=4, help="sequences kept in the capture")
    ap.add_argument("--layers", default="0,1,3")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    layers = {int(x) for x in args.layers.split(",")}

    summary = {}
    for spec in args.run:
        name, cfg = parse_run(spec)
        t0 = time.time()
        L.seed_everything(args.seed, verbose=False)
        model = G.GPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                      qkv_bias=True, key_bias=False, qk_norm=False, optimizer="muon",
                      lr=cfg.get("lr", 3e-3), muon_lr=cfg.get("muon_lr", 0.02),
                      weight_decay=cfg.get("weight_decay", 0.1), warmup_steps=int(cfg.get("warmup", 20)))
        dm = G.ByteDataModule(block_size=args.block_size, batch_size=args.batch_size, max_bytes=1_000_000,
                              train_samples=args.steps * args.batch_size, val_samples=args.capture_batch,
                              seed=args.seed)
        dm.setup("fit")
        cap_batch = torch.stack([dm.val_set[i] for i in range(args.capture_batch)])
        log = StatsLog(cap_batch, args.log_every)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, precision="32-true",
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                            callbacks=[log])
        print(f"[{name}] {cfg} training {args.steps} steps", flush=True)
        trainer.fit(model, datamodule=dm)
        loss, saved = capture(model, cap_batch, layers)
        meta = {
            "name": name, "config": cfg, "steps": args.steps, "train_seconds": round(time.time() - t0, 1),
            "model": {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd,
                      "block_size": args.block_size, "qkv_bias": True, "qk_norm": False, "optimizer": "muon"},
            "capture_loss_bf16": loss, "causal": True, "softmax_scale": (args.n_embd // args.n_head) ** -0.5,
            "layer_stats": {i: saved[i]["stats"] for i in sorted(saved)}, "train_log": log.rows,
        }
        tensors = {i: {k: saved[i][k] for k in ("q", "k", "v", "do")} for i in sorted(saved)}
        path = os.path.join(args.out, f"{name}.pt")
        torch.save({"layers": tensors, "meta": meta}, path)
        print(f"[{name}] capture loss {loss:.3f}; saved {path} ({os.path.getsize(path) / 1e6:.2f} MB) "
              f"in {meta['train_seconds']} s", flush=True)
        for i, st in meta["layer_stats"].items():
            print(f"  layer {i}: max_logit {st['max_logit']:.4g} mean_key_norm max {st['mean_key_norm_max']:.4g}"
                  f" median {st['mean_key_norm_median']:.4g} |q| {st['q_norm_mean']:.4g} |k| {st['k_norm_mean']:.4g}")
        summary[name] = meta
    with open(os.path.join(args.out, "capture_meta.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
