"""A small byte-level GPT trained through LightningCLI: the demo and test bed of lightning-gproj.

No tokenizer: every byte is a token (vocab 256). Attention calls
``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` in ``CausalSelfAttention.forward``, which
is the call ``GProjPlugin`` detects and routes to the GProj kernel.

By default the data are the Python standard library's own ``.py`` files (read as bytes, sorted paths,
capped at ``max_bytes``), split into train and validation *by file*; ``--data.path`` takes your own
text file(s) or folder instead.

Run:
    python examples/gpt.py fit --config examples/configs/gpt_demo.yaml
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB_SIZE = 256  # one token per byte


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention over ``(batch, seqlen, n_embd)``.

    ``key_bias`` adds a learnable vector to every key. It shifts all scores of a row by the same amount,
    which softmax ignores, so its exact gradient is Σ_j dK_j = 0 (DESIGN §2, C2); a BF16 kernel that
    breaks the zero-sum of dS gives it a spurious gradient, which is why the reproduction needs it.
    """

    def __init__(self, n_embd: int, n_head: int, qkv_bias: bool = True, key_bias: bool = False,
                 qk_norm: bool = False):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=qkv_bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=qkv_bias)
        self.key_bias = nn.Parameter(torch.zeros(n_embd)) if key_bias else None
        self.q_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        if self.key_bias is not None:
            k = k + self.key_bias
        # (B, T, C) -> (B, n_head, T, head_dim): the layout SDPA expects.
        q = self.q_norm(q.view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, qkv_bias: bool, key_bias: bool, qk_norm: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, qkv_bias, key_bias, qk_norm)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CombinedOptimizer(torch.optim.Optimizer):
    """Steps several optimizers as one, so Lightning's automatic optimization (one optimizer) works.

    ``param_groups`` are the sub-optimizers' own group dicts, so an LR scheduler on this object scales
    all of them.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        super().__init__(params, {})
        self.optimizers = optimizers
        self.param_groups = [g for opt in optimizers for g in opt.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def state_dict(self):
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict):
        for opt, sd in zip(self.optimizers, state_dict["optimizers"]):
            opt.load_state_dict(sd)


class GPT(L.LightningModule):
    """Byte-level GPT (GPT-2 layout: pre-LayerNorm, learned positions, tied embedding / LM head).

    Args:
        n_layer, n_head, n_embd, block_size: model shape; ``block_size`` is the context length in bytes.
        qkv_bias: bias on the q/k/v and output projections (GPT-2 and Qwen2 have one).
        key_bias: an extra learnable bias added to the keys (its exact gradient is zero, see above).
        qk_norm: RMSNorm on q and k per head (off by default: the unstable setting of the design notes).
        optimizer: ``"adamw"``, or ``"muon"`` (``torch.optim.Muon`` on the 2-D hidden matrices of the
            blocks, AdamW on embeddings, biases and norms); falls back to AdamW with a warning when the
            installed torch has no ``torch.optim.Muon``.
        lr, weight_decay, betas: AdamW settings. muon_lr, muon_momentum: Muon settings.
        key_bias_lr: AdamW learning rate of the key biases (default ``lr``; no weight decay); the dose
            knob of the reproduction in docs/reproduction.md.
        warmup_steps: linear warm-up, then cosine decay to ``min_lr_ratio * lr`` over the run.
    """

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 128,
        qkv_bias: bool = True,
        key_bias: bool = False,
        qk_norm: bool = False,
        dropout: float = 0.0,
        optimizer: str = "adamw",
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        muon_lr: float = 0.02,
        muon_momentum: float = 0.95,
        key_bias_lr: float | None = None,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
    ):
        super().__init__()
        if optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be 'adamw' or 'muon', got {optimizer!r}")
        if key_bias_lr is not None and not key_bias_lr > 0:
            raise ValueError(f"key_bias_lr must be None (use lr) or a positive float, got {key_bias_lr!r}")
        self.save_hyperparameters()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(VOCAB_SIZE, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, qkv_bias, key_bias, qk_norm) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        self.val_history: list[tuple[int, float]] = []  # (global_step, val_loss) of every validation
        # ndim of each parameter as built: FSDP1 (use_orig_params) keeps these Parameter objects but turns
        # them into 1-D views of each rank's shard before configure_optimizers sees them.
        self._built_ndim = {id(p): p.ndim for p in self.parameters()}

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (batch, seqlen) int64 bytes, seqlen <= block_size -> logits (batch, seqlen, 256)."""
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """batch: (batch, block_size + 1) bytes -> mean next-byte cross-entropy in nats."""
        x, y = batch[:, :-1], batch[:, 1:]
        logits = self(x)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), y.reshape(-1))

    def configure_model(self) -> None:
        """FSDP2 under Lightning's ``ModelParallelStrategy`` (``examples/configs/gpt_fsdp2.yaml``): each block
        is sharded with ``fully_shard`` over the data-parallel mesh, then the root (embeddings, final norm and
        the tied LM head, which must stay in one group). No-op under other strategies (no device mesh) and
        when already sharded (Lightning calls this hook again for every stage).

        Raises:
            ValueError: a tensor-parallel mesh dimension larger than 1 (not implemented for this model).
        """
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.blocks[0], FSDPModule):
            return
        if mesh["tensor_parallel"].size() != 1:
            raise ValueError(f"tensor_parallel_size must be 1 for this GPT (FSDP2 only), got {mesh['tensor_parallel'].size()}")
        data_parallel = mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=data_parallel)
        fully_shard(self, mesh=data_parallel)

    def _key_biases(self) -> dict[str, torch.Tensor]:
        """``{layer: b_k}`` as whole fp32 vectors (a DTensor under FSDP2 is gathered); a layer whose bias
        this rank holds only a shard of (FSDP1 units per block, outside their forward) is left out."""
        out = {}
        for i, block in enumerate(self.blocks):
            b = block.attn.key_bias
            if b is None:
                continue
            b = b.detach()
            if hasattr(b, "full_tensor"):  # DTensor
                b = b.full_tensor()
            if b.numel() == self.hparams.n_embd:
                out[f"blocks.{i}.attn"] = b.float()
        return out

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if getattr(self, "_key_bias_init", None):
            checkpoint["key_bias_init"] = {k: v.cpu() for k, v in self._key_bias_init.items()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "key_bias_init" in checkpoint:
            self._key_bias_init = dict(checkpoint["key_bias_init"])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)  # mean over ranks under DDP/FSDP
        # Key-bias drift ‖b_k(t) - b_k(0)‖, before this step's update. b_k(0) is taken at the first step (or
        # restored from a checkpoint on resume), here rather than in on_train_start, where FSDP1 holds each
        # rank's shard only; after the forward it holds the whole parameters of the root unit.
        biases = self._key_biases()
        if not getattr(self, "_key_bias_init", None):
            self._key_bias_init = {name: b.clone() for name, b in biases.items()}
        for name, b in biases.items():
            if name in self._key_bias_init:
                self.log(f"key_bias_drift/{name}", (b - self._key_bias_init[name].to(b.device)).norm())
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True, on_epoch=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        val = self.trainer.callback_metrics.get("val_loss")
        if val is not None:
            self.val_history.append((self.trainer.global_step, float(val)))

    def _param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
        """(hidden 2-D matrices of the blocks, other decayed, not decayed); each parameter once."""
        hidden, decay, no_decay = [], [], []
        for name, p in self.named_parameters():  # the tied lm_head weight is listed once, as tok_emb
            if not p.requires_grad:
                continue
            ndim = self._built_ndim.get(id(p), p.ndim)  # FSDP2 DTensors are new objects with the full ndim
            if name.startswith("blocks.") and ndim == 2:
                hidden.append(p)
            elif ndim >= 2:
                decay.append(p)
            else:
                no_decay.append(p)
        return hidden, decay, no_decay

    def configure_optimizers(self):
        hp = self.hparams
        hidden, decay, no_decay = self._param_groups()
        use_muon = hp.optimizer == "muon"
        if use_muon and not hasattr(torch.optim, "Muon"):
            import warnings

            warnings.warn(f"torch {torch.__version__} has no torch.optim.Muon; using AdamW", stacklevel=2)
            use_muon = False
        key_biases = {id(b.attn.key_bias) for b in self.blocks if b.attn.key_bias is not None}
        adamw_groups = [{"params": decay, "weight_decay": hp.weight_decay},
                        {"params": [p for p in no_decay if id(p) not in key_biases], "weight_decay": 0.0}]
        if key_biases:
            adamw_groups.append({"params": [p for p in no_decay if id(p) in key_biases], "weight_decay": 0.0,
                                 "lr": hp.lr if hp.key_bias_lr is None else hp.key_bias_lr})
        if use_muon:
            adamw = torch.optim.AdamW(adamw_groups, lr=hp.lr, betas=hp.betas)
            muon = torch.optim.Muon(hidden, lr=hp.muon_lr, momentum=hp.muon_momentum,
                                    weight_decay=hp.weight_decay)
            optimizer = CombinedOptimizer([muon, adamw])
        else:
            adamw_groups[0]["params"] = hidden + decay
            optimizer = torch.optim.AdamW(adamw_groups, lr=hp.lr, betas=hp.betas)

        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup, floor = hp.warmup_steps, hp.min_lr_ratio

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def stdlib_source_files(subpackages: bool = False) -> list[Path]:
    """The standard library's ``.py`` files of the running interpreter, sorted: the top-level ones
    (~5 MB for CPython 3.11/3.12), or with ``subpackages`` every one below it as well (its test suite
    included, ~160 MB; installed packages under ``site-packages`` / ``dist-packages`` excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not subpackages:
        return sorted(root.glob("*.py"))
    return sorted(f for f in root.rglob("*.py")
                  if not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts))


def _expand(paths: list[str | os.PathLike]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(f for f in sorted(p.rglob("*")) if f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"data path {p} does not exist")
    return files


class RandomWindows(Dataset):
    """``num_samples`` contiguous windows of ``block_size + 1`` bytes at seeded random offsets."""

    def __init__(self, data: torch.Tensor, block_size: int, num_samples: int, seed: int):
        if data.numel() < block_size + 2:
            raise ValueError(f"{data.numel()} bytes is too little for windows of {block_size + 1} bytes")
        self.data, self.block_size = data, block_size
        g = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, data.numel() - block_size - 1, (num_samples,), generator=g)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.offsets[i])
        return self.data[start:start + self.block_size + 1].long()


class ByteDataModule(L.LightningDataModule):
    """Bytes of text files, split into train and validation by file.

    Args:
        path: file(s) or folder(s) of your own text; ``None`` uses the standard library's ``.py`` files.
        stdlib_subpackages: with ``path=None``, also the ``.py`` files of the standard library's
            subpackages (~160 MB instead of ~5 MB; see :func:`stdlib_source_files`).
        block_size: context length; samples are ``block_size + 1`` bytes (inputs and shifted targets).
        max_bytes: files are read in sorted order until this many bytes (the last one is cut), which
            keeps the run fast and deterministic.
        val_every: every ``val_every``-th file (index ``i % val_every == 0``) is held out for validation.
        train_samples, val_samples: windows per training epoch / in the fixed validation set.
    """

    def __init__(
        self,
        path: list[str] | str | None = None,
        block_size: int = 128,
        batch_size: int = 32,
        max_bytes: int = 2_000_000,
        stdlib_subpackages: bool = False,
        val_every: int = 10,
        train_samples: int = 100_000,
        val_samples: int = 256,
        seed: int = 1337,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.train_files: list[Path] = []
        self.val_files: list[Path] = []

    def _read(self) -> tuple[bytes, bytes]:
        hp = self.hparams
        if hp.path is None:
            files = stdlib_source_files(hp.stdlib_subpackages)
        else:
            files = _expand([hp.path] if isinstance(hp.path, (str, os.PathLike)) else list(hp.path))
        self.train_files, self.val_files = [], []
        train, val, total = [], [], 0
        for i, f in enumerate(files):
            if total >= hp.max_bytes:
                break
            data = f.read_bytes()[: hp.max_bytes - total]
            total += len(data)
            (val if i % hp.val_every == 0 else train).append(data)
            (self.val_files if i % hp.val_every == 0 else self.train_files).append(f)
        if not train or not val:
            raise ValueError(f"need at least {hp.val_every} files to split by file; got {len(files)}"
                             f" (or raise max_bytes={hp.max_bytes})")
        return b"\n".join(train), b"\n".join(val)

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "train_set"):
            return
        hp = self.hparams
        train, val = self._read()
        as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
        self.train_set = RandomWindows(as_tensor(train), hp.block_size, hp.train_samples, hp.seed)
        self.val_set = RandomWindows(as_tensor(val), hp.block_size, hp.val_samples, hp.seed + 1)

    def train_dataloader(self) -> DataLoader:
        """Windows in dataset order on any number of devices (they already sit at random offsets).

        Data-parallel strategies get a ``DistributedSampler(shuffle=False)`` built here: rank r of R then
        takes windows r, r + R, r + 2R, …, so optimizer step s covers windows ``s·R·B … (s+1)·R·B − 1``,
        exactly step s of one device with batch R·B. Lightning would otherwise inject its own sampler,
        which shuffles the training set whatever the loader's ``shuffle`` says (lightning 2.6.6,
        ``_process_dataloader``), and the runs would see other windows than one device.
        """
        sampler = None
        trainer = self.trainer
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
        if kwargs and kwargs.get("num_replicas", 1) > 1:
            sampler = DistributedSampler(self.train_set, shuffle=False, **kwargs)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, sampler=sampler,
                          num_workers=self.hparams.num_workers, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, shuffle=False,
                          num_workers=self.hparams.num_workers)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


class ValidateAtStart(Callback):
    """Records the validation that Lightning's sanity check runs before the first training step, over every
    validation batch (``GPTCLI`` sets ``num_sanity_val_steps`` to all), as the validation at step 0:
    appended to ``val_history`` and sent to every logger at step 0, which Lightning does not do for a
    sanity check.

    Why not ``trainer.validate()`` before ``fit``: under ``FSDPStrategy``, ``validate`` wraps the
    LightningModule in FSDP and leaves its parameters as 1-D views of each rank's shard; ``fit`` then wraps
    the module again, flattens those views as if they were the parameters, and the first training forward
    fails (``RuntimeError: 'weight' must be 2-D`` in the embedding; lightning 2.6.6 with torch 2.11 and
    2.13). The sanity check runs inside ``fit``, on the model ``fit`` set up, under every strategy.
    """

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            return
        val = trainer.callback_metrics.get("val_loss")
        if val is None:
            return
        pl_module.val_history.append((trainer.global_step, float(val)))
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"val_loss": float(val)}, step=trainer.global_step)


class GPTCLI(LightningCLI):
    """LightningCLI that validates at step 0 of ``fit`` (:class:`ValidateAtStart`; so the starting val loss
    is logged) and prints the first and last validation loss after it."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.block_size", "data.block_size")
        parser.add_argument("--validate_first", type=bool, default=True,
                            help="validate at step 0 of fit (skipped when resuming from --ckpt_path)")

    def before_fit(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        # Not when resuming: the step-0 validation is of the initial weights (and Lightning skips the
        # sanity check of a restarted loop anyway).
        if config.get("validate_first", True) and not config.get("ckpt_path"):
            self.trainer.num_sanity_val_steps = float("inf")  # every validation batch, as Trainer(-1) does
            self.trainer.callbacks.append(ValidateAtStart())

    def after_fit(self) -> None:
        hist = getattr(self.model, "val_history", [])
        if self.trainer.is_global_zero and hist:
            (s0, v0), (s1, v1) = hist[0], hist[-1]
            if len(hist) == 1:  # no validation after the first (e.g. max_steps below val_check_interval)
                print(f"val_loss: {v0:.4f} nats at step {s0} (no later validation ran)")
            else:
                print(f"val_loss: {v0:.4f} nats at step {s0} -> {v1:.4f} nats at step {s1} "
                      f"(change {v1 - v0:+.4f})")


def main(args=None, run: bool = True) -> GPTCLI:
    return GPTCLI(GPT, ByteDataModule, args=args, run=run, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
