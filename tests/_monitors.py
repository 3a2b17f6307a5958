"""Models and helpers shared by the monitor tests (test_zero_sum, test_grad_norm, test_key_bias,
test_monitors): every logged value is read back from a CSVLogger's metrics.csv and compared with a
computation the test does on its own, never with a constant copied from a previous run."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_gproj import stats

E, H, N, B = 8, 2, 5, 2  # embedding, heads, sequence length, batch


# ----------------------------------------------------------------------------- helpers


def read_metrics(logger: CSVLogger) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` from the logger's metrics.csv."""
    out: dict[str, dict[int, float]] = {}
    path = Path(logger.log_dir) / "metrics.csv"
    if not path.exists():  # nothing was logged at all
        return out
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in ("", None):
                    out.setdefault(key, {})[step] = float(value)
    return out


def fit(
    module: pl.LightningModule, callbacks: list, tmp_path: Path, max_steps: int, devices: int = 1,
    ckpt_path: str | None = None, **kwargs,
):
    """A CPU fit logging every step to ``tmp_path/logs/version_0``: (trainer, :func:`read_metrics`)."""
    logger = CSVLogger(tmp_path, name="logs", version=0)  # fixed: with ddp the workers create it
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=max_steps,
        logger=logger,
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, read_metrics(logger)


def loader(n_batches: int, shape: tuple[int, ...], seed: int = 0) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(n_batches, *shape, generator=g)
    return torch.utils.data.DataLoader(list(data), batch_size=None)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal softmax attention, (batch, seqlen, nheads, headdim)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
    p = s.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


class RecordingAttention(nn.Module):
    """Reference attention that writes into ``stats.RECORDER`` as the op does (docs/architecture.md).

    Forward statistics are the contract's formulas computed from q and k; backward ones are distinct
    per call (so mean and max over calls can be told apart). Every value written while the recorder
    is enabled is also kept in :attr:`written` as (step, statistic, value), for the test to compare.
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.calls = 0
        self.step = 0
        self.written: list[tuple[int, str, float]] = []
        self.enabled_at: list[int] = []  # steps at which a forward saw the recorder enabled

    def _record(self, **values: torch.Tensor) -> None:
        stats.RECORDER.record(self.name, **values)
        self.written += [(self.step, key, float(v)) for key, v in values.items()]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = causal_attention(q, k, v)
        if stats.RECORDER.enabled:
            self.enabled_at.append(self.step)
            self.calls += 1
            call = self.calls
            self._record(
                mean_key_norm=k.detach().mean(1).norm(dim=-1).mean(),  # mean over (b, h) of |mean_j k_j|
                mean_query_norm=q.detach().mean(1).norm(dim=-1).mean(),
            )

            def backward_stats(grad: torch.Tensor) -> None:
                self._record(
                    violation_median=torch.tensor(1e-3 * call),
                    violation_max=torch.tensor(1e-2 * call),
                    leak_ratio=grad.detach().norm() * 1e-3,
                )

            if o.requires_grad:  # not in a validation forward
                o.register_hook(backward_stats)
        return o


class AttnModel(pl.LightningModule):
    """One causal self-attention layer with a fused, biased qkv projection (GPT-2 style, no RoPE)."""

    def __init__(self, n_batches: int = 64) -> None:
        super().__init__()
        self.n_batches = n_batches
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(E, 3 * E)
        self.attn.proj = nn.Linear(E, E)
        self.core = RecordingAttention("layer0")
        self.bias_grads: dict[int, dict[str, float]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.reshape(*x.shape[:2], H, E // H) for t in self.attn.qkv(x).split(E, dim=-1))
        return self.attn.proj(self.core(q, k, v).reshape(x.shape))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.core.step = self.global_step
        return self(batch).pow(2).mean()

    def on_before_optimizer_step(self, optimizer) -> None:
        # Runs after the callbacks' hook, before the step: the same gradients the monitor read.
        gb, gw = self.attn.qkv.bias.grad, self.attn.qkv.weight.grad
        self.bias_grads[self.global_step] = {
            "key_bias": float(gb[E : 2 * E].norm()),
            "key_weight": float(gw[E : 2 * E].norm()),
            "query_bias": float(gb[:E].norm()),
            "query_weight": float(gw[:E].norm()),
        }

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return loader(self.n_batches, (B, N, E))


class RunClosureOnly(torch.optim.SGD):
    """An optimizer that never changes the parameters (so non-finite gradients cannot poison them)."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.0)

    def step(self, closure=None):
        return None if closure is None else closure()


class LayeredModel(pl.LightningModule):
    """loss = Σ_i f_i(step) · sum(blocks[i](x)) + sum(head(x)): the gradient of block i is exactly
    f_i(step) times a fixed tensor, so the test controls every layer's gradient norm step by step."""

    def __init__(self, factors: list[list[float]]) -> None:
        super().__init__()
        self.factors = factors
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in factors)
        self.head = nn.Linear(4, 1)
        self.norms: dict[int, dict[str, float]] = {}  # independent norms, read in on_before_optimizer_step

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        step = self.global_step
        loss = self.head(batch).sum()
        for f, block in zip(self.factors, self.blocks):
            loss = loss + f[step] * block(batch).sum()
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        grads = {n: p.grad for n, p in self.named_parameters()}
        blocks = [f"blocks.{i}" for i in range(len(self.factors))]
        layers = {b: [g for n, g in grads.items() if n.startswith(f"{b}.")] for b in blocks}
        layers["head"] = [grads["head.weight"], grads["head.bias"]]
        self.norms[self.global_step] = {
            "global": float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()]))),
            **{k: float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in v]))) for k, v in layers.items()},
        }

    def configure_optimizers(self):
        return RunClosureOnly(self.parameters())

    def train_dataloader(self):
        x = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
        return torch.utils.data.DataLoader([x] * 64, batch_size=None)


def wobble(n: int, amplitude: float, phase: float) -> list[float]:
    return [1.0 + amplitude * math.sin(1.3 * s + phase) for s in range(n)]
