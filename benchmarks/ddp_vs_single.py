"""The example GPT on N data-parallel processes against one process with the same global batch, step by step.

    python benchmarks/ddp_vs_single.py run --procs 1 --out DIR1 [gpt.py overrides ...]
    python benchmarks/ddp_vs_single.py run --procs 2 --out DIR2 [--lightning-sampler] [gpt.py overrides ...]
    python benchmarks/ddp_vs_single.py compare DIR1 DIR2

``run`` is ``examples/gpt.py fit --config examples/configs/gpt_ddp.yaml`` with ``devices=PROCS`` and
``data.batch_size = 16 / PROCS`` (the reference command of docs/multi_gpu.md for one process), plus a callback
that records, per optimizer step and rank, the window indices of the batch (checked against the batch itself),
the rank's mean loss, and the ``GradNormMonitor`` global norm; then the validation history. Lightning's
``ddp`` re-runs this script for the other ranks. Extra arguments go to the CLI (e.g.
``--trainer.accelerator=cpu``, ``--trainer.plugins.init_args.precision=32-true``, a smaller model).
``--lightning-sampler`` restores the loader of before the fix (Lightning injects its own, shuffling, sampler);
``--perturb EPS`` scales one weight matrix by 1 + EPS at the start: two one-process runs, with and without, give
the noise floor against which a data-parallel run is judged.

``compare`` prints per step: the loss of one process, the mean over the ranks of the other, their difference,
both global gradient norms and their relative difference, whether the steps saw the same windows; then the
validation losses and the largest / mean loss differences.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(procs: int, out: Path, lightning_sampler: bool, perturb: float, overrides: list[str]) -> None:
    import importlib.util

    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from lightning_gproj.callbacks import GradNormMonitor

    spec = importlib.util.spec_from_file_location("gpt_example", REPO / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    if lightning_sampler:
        gpt.ByteDataModule.train_dataloader = lambda self: DataLoader(
            self.train_set, batch_size=self.hparams.batch_size, shuffle=False, drop_last=True)
    seen: dict = {"loss": {}, "grad_norm": {}, "windows": {}}

    class Record(Callback):
        def on_train_start(self, trainer, pl_module):
            self.order = list(trainer.train_dataloader.sampler)
            if perturb:
                with torch.no_grad():
                    pl_module.blocks[0].mlp[0].weight.mul_(1 + perturb)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            n = batch.shape[0]
            windows = self.order[batch_idx * n:(batch_idx + 1) * n]
            assert torch.equal(batch.cpu(), torch.stack([trainer.datamodule.train_set[i] for i in windows]))
            seen["windows"][trainer.global_step] = windows

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["loss"][trainer.global_step - 1] = float(outputs["loss"])

    class CLI(gpt.GPTCLI):
        def before_fit(self):
            gn = next(c for c in self.trainer.callbacks if isinstance(c, GradNormMonitor))
            observe = gn.observe

            def recording(step, norm, layers, *args):
                seen["grad_norm"][step] = norm
                return observe(step, norm, layers, *args)

            gn.observe = recording
            self.trainer.callbacks.append(Record())
            super().before_fit()

        def after_fit(self):
            seen["val"] = self.model.val_history
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{self.trainer.global_rank}.json").write_text(json.dumps(seen))
            super().after_fit()

    args = ["fit", "--config", str(REPO / "examples" / "configs" / "gpt_ddp.yaml"), f"--trainer.devices={procs}",
            f"--data.batch_size={16 // procs}", "--trainer.logger=false"]
    if procs == 1:
        args.append("--trainer.strategy=auto")
    CLI(gpt.GPT, gpt.ByteDataModule, args=args + overrides, save_config_kwargs={"overwrite": True})


def compare(one: Path, many: Path) -> None:
    ref = json.loads((one / "rank0.json").read_text())
    ranks = [json.loads(p.read_text()) for p in sorted(many.glob("rank*.json"))]  # one process: a perturbed run
    diffs = []
    print("step   loss(1)   loss(N)      diff   |g|(1)   |g|(N)   rel.diff  same windows")
    for step in sorted(ref["loss"], key=int):
        loss = sum(r["loss"][step] for r in ranks) / len(ranks)
        same = sorted(w for r in ranks for w in r["windows"][step]) == sorted(ref["windows"][step])
        g1, gn = ref["grad_norm"][step], ranks[0]["grad_norm"][step]
        diffs.append(abs(loss - ref["loss"][step]))
        print(f"{int(step):4d} {ref['loss'][step]:9.5f} {loss:9.5f} {loss - ref['loss'][step]:+9.2e} "
              f"{g1:8.4f} {gn:8.4f} {(gn - g1) / g1:+9.1e}  {same}")
    print("val (step, loss), 1 process:", [(s, round(v, 4)) for s, v in ref["val"]])
    print("val (step, loss), N processes:", [(s, round(v, 4)) for s, v in ranks[0]["val"]])
    peak = lambda r: max(r["grad_norm"].items(), key=lambda kv: kv[1])  # noqa: E731
    late = f"{sum(diffs[50:]) / len(diffs[50:]):.3g}" if len(diffs) > 50 else "-"
    print(f"max |loss diff| {max(diffs):.3g}; mean over steps 50+: {late}; "
          f"grad-norm peak (step, norm): 1 process {peak(ref)}, N processes {peak(ranks[0])}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--procs", type=int, choices=(1, 2), required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--lightning-sampler", action="store_true")
    r.add_argument("--perturb", type=float, default=0.0,
                   help="scale blocks.0.mlp.0.weight by 1 + PERTURB at the start (the noise floor of a run)")
    c = sub.add_parser("compare")
    c.add_argument("one", type=Path)
    c.add_argument("many", type=Path)
    args, rest = parser.parse_known_args(argv)
    if args.command == "run":
        run(args.procs, args.out, args.lightning_sampler, args.perturb, rest)
    else:
        compare(args.one, args.many)


if __name__ == "__main__":
    main(sys.argv[1:])
