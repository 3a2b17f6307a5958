"""Training-step time of a Hugging Face Llama under Lightning: plain SDPA (cuDNN) vs GProj (issue 12).

Two configurations (``--configs``), each built from a ``LlamaConfig`` with random weights and fed random
tokens (nothing is downloaded):

- ``llama8x2048``: 8 layers, hidden 2048, 16 heads of 128, seq 4096, batch 4;
- ``llama12x1536``: 12 layers, hidden 1536, 12 heads of 128, seq 2048, batch 8.

Both use ``intermediate_size`` ≈ 8/3·hidden rounded up to a multiple of 256 (5632, 4096), vocabulary
32000, no GQA, AdamW (lr 1e-4, fused on CUDA), ``bf16-mixed``. Arms, all in one process, one after the
other on a freshly built model (same seed, same tokens):

- ``cudnn``: ``Trainer(precision="bf16-mixed")``, every SDPA call restricted to the cuDNN backend;
- ``gproj``: ``Trainer(plugins=[GProjPlugin("bf16-mixed", fix="gproj")])``;
- ``none``: the same plugin with ``fix="none"`` (our kernels, no correction).

Each arm runs ``--warmup`` steps (Triton compiles and autotunes in the first ones) then ``--steps``
timed steps. A step is timed from Lightning's ``on_train_batch_start`` to ``on_train_batch_end``
(forward, backward, optimizer step) with CUDA events; reported: the median step time, its 10th and
90th percentiles, tokens/s = batch·seq / median, the peak memory of the arm, the first and last loss
(a sanity check that the arms train alike), and each arm's median over the cudnn arm's. With
``--profile-steps N``, N more steps per arm run under torch.profiler (not timed) and its kernel table
lands beside the JSON: where a gproj step's extra time goes, kernels or the code around them.

``--rounds R`` runs the arms R times per configuration, alternating their order (cudnn, gproj, none, then
none, gproj, cudnn, ...), so that drift over the process (clocks, temperature) falls on every arm alike; the
ratio to cudnn is then the median over rounds of each round's ratio, and every round's ratios are kept
(``ratio_rounds``). Run 18 saw the cuDNN arm alone move 1.3% between device calls.

``--attention-dropout P`` sets the Llama's ``attention_dropout`` (default 0): every arm then trains with attention
dropout P (issue 16), the cudnn arm on cuDNN's or, where cuDNN refuses the call, flash's SDPA kernel.

Usage: python benchmarks/train_step.py [--out PATH] [--configs a,b] [--arms a,b] [--warmup N] [--steps N]
                                      [--profile-steps N] [--rounds R] [--attention-dropout P]
       python benchmarks/train_step.py --smoke --out PATH   (CPU, a 2-layer hidden-64 Llama, a few steps)
Writes PATH (default benchmarks/results/train_step_latest.json). ``--smoke`` times nothing meaningful
(CPU, SDPA's default backend for the cudnn arm, the op's PyTorch reference for the others); it lets a
CPU test check that the script runs and what it writes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

import torch

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "train_step_latest.json")
CONFIGS = {
    "llama8x2048": dict(layers=8, hidden=2048, heads=16, intermediate=5632, vocab=32000, seq=4096, batch=4),
    "llama12x1536": dict(layers=12, hidden=1536, heads=12, intermediate=4096, vocab=32000, seq=2048, batch=8),
}
SMOKE_CONFIGS = {"tiny": dict(layers=2, hidden=64, heads=2, intermediate=128, vocab=256, seq=64, batch=2)}
#: arm: fix; None = plain SDPA (cuDNN backend on CUDA).
ARMS = {"cudnn": None, "gproj": "gproj", "none": "none"}
DEFAULT_ARMS = ("cudnn", "gproj", "none")


def _lightning():
    import lightning as L
    return L


class StepTimer:
    """Times each training step (on_train_batch_start → on_train_batch_end) and records its loss; with
    ``profile_path``, steps from ``profile_from`` on run under torch.profiler, whose kernel table
    (sorted by device time) is written there when training ends."""

    def __init__(self, cuda: bool, profile_from: int | None = None, profile_path: str | None = None):
        self.cuda = cuda
        self.marks: list = []
        self.losses: list[float] = []
        self.profile_from, self.profile_path = profile_from, profile_path
        self.prof = None

    def maybe_profile(self):
        if self.profile_path and len(self.marks) == self.profile_from:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()

    def finish(self):
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            key = "cuda_time_total" if self.cuda else "cpu_time_total"
            with open(self.profile_path, "w") as f:
                f.write(self.prof.key_averages().table(sort_by=key, row_limit=40))
            self.prof = None

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self):
        self.marks.append([self._mark(), None])

    def end(self, loss):
        self.marks[-1][1] = self._mark()
        self.losses.append(loss)

    def times_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self.marks]
        return [(b - a) * 1e3 for a, b in self.marks]


def make_callback(timer: StepTimer):
    L = _lightning()

    class _Cb(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            timer.maybe_profile()
            timer.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            timer.end(outputs["loss"].detach())

        def on_train_end(self, trainer, pl_module):
            timer.finish()

    return _Cb()


def make_module(cfg: dict, sdpa_backend, seed: int, device: str, attention_dropout: float = 0.0):
    import transformers
    L = _lightning()

    class LitLlama(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            with torch.device(device):  # initialized where it trains: a 0.5B model inits slowly on CPU
                self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                    vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                    num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                    num_key_value_heads=cfg["heads"], max_position_embeddings=cfg["seq"], attn_implementation="sdpa",
                    attention_dropout=attention_dropout))

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            ctx = contextlib.nullcontext()
            if sdpa_backend is not None:
                from torch.nn.attention import sdpa_kernel
                ctx = sdpa_kernel(sdpa_backend)
            with ctx:
                return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=self.device.type == "cuda")

    return LitLlama()


def run_arm(cfg_name: str, cfg: dict, arm: str, warmup: int, steps: int, smoke: bool, seed: int = 0,
            profile_steps: int = 0, profile_path: str | None = None, attention_dropout: float = 0.0) -> dict:
    """Train ``warmup + steps (+ profile_steps)`` steps of one arm; the timing summary of the ``steps``
    after the warm-up (profiled steps, if any, come after them and are not timed)."""
    from torch.utils.data import DataLoader, TensorDataset
    L = _lightning()
    cuda = not smoke
    fix = ARMS[arm]
    row = {"config": cfg_name, "arm": arm, **cfg, "head_dim": cfg["hidden"] // cfg["heads"],
           "attention_dropout": attention_dropout, "warmup_steps": warmup, "timed_steps": steps}
    try:
        backend = None
        if fix is None and cuda:
            from torch.nn.attention import SDPBackend
            backend = SDPBackend.CUDNN_ATTENTION
            if attention_dropout > 0:  # cuDNN first, flash where cuDNN refuses dropout
                backend = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
        module = make_module(cfg, backend, seed, "cuda" if cuda else "cpu", attention_dropout)
        g = torch.Generator().manual_seed(seed + 1)
        total = warmup + steps + (profile_steps if profile_path else 0)
        n = total * cfg["batch"]
        data = TensorDataset(torch.randint(0, cfg["vocab"], (n, cfg["seq"]), generator=g))
        loader = DataLoader(data, batch_size=cfg["batch"], shuffle=False, pin_memory=cuda)
        timer = StepTimer(cuda, warmup + steps, profile_path if profile_steps else None)
        kwargs = {}
        plugin = None
        if fix is None:
            kwargs["precision"] = "bf16-mixed"
        else:
            from lightning_gproj import GProjPlugin
            plugin = GProjPlugin("bf16-mixed", fix=fix)
            kwargs["plugins"] = [plugin]
        trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, max_steps=total,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[make_callback(timer)], **kwargs)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.fit(module, train_dataloaders=loader)
        times = timer.times_ms()[warmup:warmup + steps]
        if len(times) != steps:
            raise RuntimeError(f"{len(times)} timed steps recorded, expected {steps}")
        med = statistics.median(times)
        qs = statistics.quantiles(times, n=10) if len(times) >= 2 else [med] * 9
        row.update(step_ms_median=med, step_ms_p10=qs[0], step_ms_p90=qs[-1],
                   tokens_per_s=cfg["batch"] * cfg["seq"] / (med * 1e-3),
                   peak_mib=torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
                   loss_first=float(timer.losses[0]), loss_last=float(timer.losses[-1]),
                   swapped_modules=None if plugin is None else len(plugin.report.swapped),
                   profile=profile_path if profile_steps else None)
    except Exception as exc:
        row["error"] = f"{exc.__class__.__name__}: {str(exc)[:300]}"
    finally:
        module = trainer = loader = data = None  # noqa: F841 (free the arm before the next one)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return row


def env_info(smoke: bool) -> dict:
    import platform

    import lightning
    import transformers
    info = {"torch": torch.__version__, "lightning": lightning.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        pass
    if not smoke and torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    else:
        info["device"] = "cpu"
    return info


def _ratios(res: dict, config: str) -> None:
    """Each round's step-time medians over that round's cudnn arm (``ratio_rounds``), and their median over
    the rounds (``ratio_to_cudnn``); rounds without a cudnn measurement are left out."""
    rows = [r for r in res["results"] if r["config"] == config and "error" not in r]
    per_round = []
    for rnd in sorted({r["round"] for r in rows}):
        base = next((r for r in rows if r["round"] == rnd and r["arm"] == "cudnn"), None)
        if base is not None:
            per_round.append({r["arm"]: r["step_ms_median"] / base["step_ms_median"] for r in rows if r["round"] == rnd})
    if per_round:
        res["ratio_rounds"][config] = per_round
        arms = {a for rr in per_round for a in rr}
        res["ratio_to_cudnn"][config] = {a: statistics.median(rr[a] for rr in per_round if a in rr) for a in arms}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--configs", default=None, help=f"comma-separated, from {sorted(CONFIGS)}")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, from {sorted(ARMS)}")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per arm (default 10; smoke 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per arm (default 30; smoke 2)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after the timed steps, this many more under torch.profiler; kernel table per arm in "
                         "OUT.profile_CONFIG_ARM.txt")
    ap.add_argument("--rounds", type=int, default=1, help="run the arms this many times, alternating their order")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny Llama: checks the script, times nothing")
    ap.add_argument("--attention-dropout", type=float, default=0.0,
                    help="the Llama's attention_dropout (every arm trains with it), in [0, 1)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if not 0.0 <= args.attention_dropout < 1.0:
        ap.error(f"--attention-dropout must be in [0, 1), got {args.attention_dropout}")
    table = SMOKE_CONFIGS if args.smoke else CONFIGS
    configs = args.configs.split(",") if args.configs else list(table)
    arms = args.arms.split(",")
    bad = [c for c in configs if c not in table] + [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"unknown configs/arms {bad}; configs: {sorted(table)}, arms: {sorted(ARMS)}")
    if not args.smoke and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --smoke)")
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 10)
    steps = args.steps if args.steps is not None else (2 if args.smoke else 30)
    res = {"env": env_info(args.smoke), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "smoke": args.smoke, "rounds": args.rounds, "results": [], "ratio_to_cudnn": {}, "ratio_rounds": {}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for c in configs:
        for rnd in range(args.rounds):
            for arm in (arms if rnd % 2 == 0 else arms[::-1]):
                t0 = time.time()
                prof = (f"{os.path.splitext(args.out)[0]}.profile_{c}_{arm}.txt"
                        if args.profile_steps and rnd == 0 else None)
                row = run_arm(c, table[c], arm, warmup, steps, args.smoke, profile_steps=args.profile_steps if prof else 0,
                              profile_path=prof, attention_dropout=args.attention_dropout)
                row["round"] = rnd
                res["results"].append(row)
                print(f"[{time.time() - t0:.0f}s] {c} {arm} round {rnd}: " + (row["error"] if "error" in row else
                      f"step {row['step_ms_median']:.1f} ms (p10 {row['step_ms_p10']:.1f}, p90 {row['step_ms_p90']:.1f}), "
                      f"{row['tokens_per_s']:.0f} tokens/s, loss {row['loss_first']:.3f} -> {row['loss_last']:.3f}"),
                      flush=True)
                _ratios(res, c)
                with open(args.out, "w") as f:  # after every arm: a run cut short keeps what it measured
                    json.dump(res, f, indent=1)
    print(json.dumps(res["ratio_to_cudnn"], indent=1))
    return res


if __name__ == "__main__":
    sys.exit(1 if any("error" in r for r in main()["results"]) else 0)
