"""ZeroSumMonitor: the attention health signals of DESIGN.md §8, sampled every N optimizer steps.

Two sources:

* the op's statistics: on a sampled step the monitor enables :data:`lightning_gproj.stats.RECORDER`
  from ``on_train_batch_start`` until the backward is done, then drains it (the op fills it from
  ``gproj_attn_func(..., stats_name=LAYER)``; see docs/architecture.md, "Stats contract"). A model
  without swapped attention records nothing, and nothing is logged for these signals;
* the key-bias gradient, for any model whatever its kernel: the gradient of a key bias is exactly
  Σ_j dK_j (summed over batch and positions), which conservation law C2 (DESIGN.md §2) makes 0 in exact
  arithmetic. It is read from ``param.grad`` in ``on_before_optimizer_step`` (after every backward of the
  step, after AMP unscaling, before clipping), so it needs no hook and includes gradient accumulation.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_gproj import stats as _stats

from ._base import (
    Monitor,
    check_bool,
    check_int,
    check_prefix,
    finite_max,
    fmt,
    format_table,
    guarded,
    log_to_loggers,
    step_index,
)

#: Order of the columns of the summary table (statistics not seen are left out).
_SUMMARY_STATS = (
    "violation_median",
    "violation_max",
    "leak_ratio",
    "mean_key_norm",
    "mean_query_norm",
    "key_bias_grad_ratio",
)

#: Key-bias detection, by parameter name. A module with one of these names owning a ``bias`` is a
#: key projection (HF Llama/Qwen2/OPT/BART/Whisper ``k_proj``, BERT/ViT ``key``, diffusers ``to_k``,
#: DistilBERT ``k_lin``, Meta-style ``wk``, plain ``k``); its sibling ``weight`` is the key weight.
SEPARATE_KEY_MODULES = ("k_proj", "key", "to_k", "k_lin", "wk", "k")
#: Parameters added to the keys directly (``k = k + key_bias``), as in examples/gpt.py's ``key_bias``; the
#: key weight beside them is looked up in the same module (a separate or fused projection), if any.
DIRECT_KEY_BIASES = ("key_bias", "k_bias")
#: Modules whose output is the concatenation [q | k | v] of three equal parts (GPT-2 ``c_attn``, timm and
#: others ``qkv``/``qkv_proj``/``Wqkv``); the key part is the middle third. Accepted only when the
#: weight is (3E, E) or (E, 3E) with 3E the bias length, so fused GQA projections (unequal parts) are
#: skipped rather than sliced wrong. Per-head interleaved layouts (GPT-NeoX/Falcon ``query_key_value``)
#: are deliberately not listed. ``nn.MultiheadAttention``'s ``in_proj_bias`` (same [q | k | v] layout)
#: is handled too.
FUSED_QKV_MODULES = ("c_attn", "qkv", "qkv_proj", "Wqkv", "in_proj")


@dataclasses.dataclass(frozen=True)
class KeyBias:
    """A key bias found in the model and the key weight it is compared with.

    ``layer`` is the attention module's path (the parent of the key projection, or the
    ``nn.MultiheadAttention`` itself). ``bias_part`` = ``(start, length)`` of the key part of the bias and
    ``weight_part`` = ``(dim, start, length)`` of the key part of the weight, ``None`` meaning all of it.
    """

    layer: str
    bias_name: str
    weight_name: str
    bias: torch.nn.Parameter
    weight: torch.nn.Parameter | None
    bias_part: tuple[int, int] | None = None
    weight_part: tuple[int, int, int] | None = None

    def grad_norms(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(‖∇b_k‖₂, ‖∇W_k‖_F) as fp32 (or wider) 0-dim tensors; the second is None without a key
        weight (or its gradient); None when the bias has no gradient."""
        gb = self.bias.grad
        if gb is None:
            return None
        gb = gb.detach()
        if self.bias_part is not None:
            gb = gb.narrow(0, *self.bias_part)
        gw = None if self.weight is None else self.weight.grad
        if gw is not None:
            gw = gw.detach()
            if self.weight_part is not None:
                gw = gw.narrow(*self.weight_part)
        return _norm(gb), None if gw is None else _norm(gw)


def _norm(x: torch.Tensor) -> torch.Tensor:
    # Accumulate 16-bit gradients in fp32; keep fp64 as fp64.
    return torch.linalg.vector_norm(x, dtype=torch.promote_types(x.dtype, torch.float32))


def _fused_parts(weight: torch.Tensor, bias: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int, int]] | None:
    """Key parts of a [q | k | v] projection, or None if the shapes do not prove that layout."""
    n = bias.numel()
    if bias.ndim != 1 or weight.ndim != 2 or n % 3:
        return None
    e = n // 3
    # (3E, E): nn.Linear and in_proj_weight; (E, 3E): GPT-2's Conv1D. Anything else is not [q|k|v].
    if tuple(weight.shape) == (n, e):
        return (e, e), (0, e, e)
    if tuple(weight.shape) == (e, n):
        return (e, e), (1, e, e)
    return None


def find_key_biases(module: torch.nn.Module) -> list[KeyBias]:
    """Key biases of ``module`` by the name heuristic above (see :data:`SEPARATE_KEY_MODULES`).

    Returns at most one entry per attention layer, in ``named_parameters`` order. A parameter that
    matches a name but not the expected shapes is skipped, never guessed. A layer with both a
    projection bias and a vector added to the keys (:data:`DIRECT_KEY_BIASES`) reports the latter: both
    receive Σ_j dK_j, the direct one is what the optimizer moves as a pure key offset.
    """
    params = dict(module.named_parameters())
    found: dict[str, KeyBias] = {}
    direct: dict[str, KeyBias] = {}
    for name, bias in params.items():
        owner, _, attr = name.rpartition(".")
        dot = f"{owner}." if owner else ""
        if attr in DIRECT_KEY_BIASES and bias.ndim == 1:
            weight_name, weight, part = _key_weight_of(params, dot, bias.numel())
            direct.setdefault(owner, KeyBias(owner, name, weight_name, bias, weight, None, part))
        elif attr == "in_proj_bias":  # nn.MultiheadAttention: the owner is the attention module
            if f"{dot}in_proj_weight" in params:
                weight = params[f"{dot}in_proj_weight"]
                parts = _fused_parts(weight, bias)
                if parts is not None:
                    found.setdefault(owner, KeyBias(owner, name, f"{dot}in_proj_weight", bias, weight, *parts))
            elif f"{dot}k_proj_weight" in params:  # kdim != embed_dim: separate key weight
                weight, n = params[f"{dot}k_proj_weight"], bias.numel()
                if n % 3 == 0 and weight.ndim == 2 and weight.shape[0] == n // 3:
                    kb = KeyBias(owner, name, f"{dot}k_proj_weight", bias, weight, (n // 3, n // 3))
                    found.setdefault(owner, kb)
        elif attr == "bias" and f"{dot}weight" in params:
            parent, _, proj = owner.rpartition(".")
            weight = params[f"{dot}weight"]
            if proj in SEPARATE_KEY_MODULES:
                if weight.ndim == 2 and bias.ndim == 1 and bias.numel() in weight.shape:
                    found.setdefault(parent or owner, KeyBias(parent or owner, name, f"{dot}weight", bias, weight))
            elif proj in FUSED_QKV_MODULES:
                parts = _fused_parts(weight, bias)
                if parts is not None:
                    kb = KeyBias(parent or owner, name, f"{dot}weight", bias, weight, *parts)
                    found.setdefault(parent or owner, kb)
    found.update(direct)
    order = {name: i for i, name in enumerate(params)}
    return sorted(found.values(), key=lambda kb: order[kb.bias_name])


def _key_weight_of(
    params: dict[str, torch.nn.Parameter], dot: str, n: int
) -> tuple[str, torch.nn.Parameter | None, tuple[int, int, int] | None]:
    """The key weight beside a direct key bias of length ``n`` in the module ``dot``, if one is found."""
    for proj in SEPARATE_KEY_MODULES:
        weight = params.get(f"{dot}{proj}.weight")
        if weight is not None and weight.ndim == 2 and n in weight.shape:
            return f"{dot}{proj}.weight", weight, None
    for name in [f"{dot}{proj}.weight" for proj in FUSED_QKV_MODULES] + [f"{dot}in_proj_weight"]:
        weight = params.get(name)
        if weight is not None and weight.ndim == 2:
            if tuple(weight.shape) == (3 * n, n):
                return name, weight, (0, n, n)
            if tuple(weight.shape) == (n, 3 * n):
                return name, weight, (1, n, n)
    return "", None, None


@dataclasses.dataclass
class _Track:
    """Last and peak value of one statistic of one layer, and the step of each."""

    last: float | None = None
    last_step: int | None = None
    peak: float | None = None
    peak_step: int | None = None
    samples: int = 0

    def add(self, value: float, step: int) -> None:
        self.last, self.last_step, self.samples = value, step, self.samples + 1
        new_peak = finite_max(self.peak, value)
        if new_peak != self.peak:
            self.peak, self.peak_step = new_peak, step


class ZeroSumMonitor(Monitor):
    """Log the zero-sum health signals of the attention backward every ``every_n_steps`` steps.

    Logged metrics (DESIGN.md §8), ``{p}`` = ``prefix``, ``{layer}`` = the ``stats_name`` given to
    ``gproj_attn_func`` (default ``"attention"``), ``{attn}`` = the attention module's path:

    ``{p}/{layer}/violation_median``
        Median over query rows of ρ_i = |r_i| / Σ_j |dS̃_ij|, r_i = Σ_j dS̃_ij over the valid keys of
        row i, dS̃ the 16-bit dS the GEMMs consumed. Dimensionless, in [0, 1]. Exactly 0 in exact
        arithmetic (conservation law C1); the BF16 rounding of dS makes it nonzero. Backward.
    ``{p}/{layer}/violation_max``
        Maximum over rows of ρ_i (the maximum over the step's calls of the layer). Dimensionless.
    ``{p}/{layer}/leak_ratio``
        λ = ‖τ r ∘ (P K)‖_F / ‖dQ_gproj‖_F: the share of the query gradient that is leak — removed by
        ``fix="gproj"``, kept by an uncorrected kernel. Dimensionless. Backward.
    ``{p}/{layer}/mean_key_norm``
        Mean over (batch, head) of ‖mean_j k_j‖: the mean-key norm ‖k̄‖ the leak grows with. Units of k
        (the attention's key activations, before the softmax scale). Forward.
    ``{p}/{layer}/mean_query_norm``
        Mean over (batch, head) of ‖mean_i q_i‖. Units of q. Forward.
    ``{p}/{attn}/key_bias_grad_norm``
        ‖∇b_k‖₂, the L2 norm of the key bias's gradient = ‖Σ_{batch, j} dK_j‖, in loss units per unit of
        key. 0 in exact arithmetic (C2) whatever kernel computed it: any value is rounding error, which
        Adam-style optimizers turn into full-size steps of the bias (the mean key drifts).
    ``{p}/{attn}/key_bias_grad_ratio``
        ‖∇b_k‖₂ / ‖∇W_k‖_F, the key bias gradient relative to the layer's key weight gradient.
        Dimensionless. A cheap stand-in for the C2 residual ‖Σ_j dK_j‖ / ‖dK‖_F of §8 (which needs a hook
        on dK itself, a later issue): both numerators are the same sum; the denominator here also scales
        with the layer's input norm, so compare the ratio over time within a layer, not across models.
        The "0 in exact arithmetic" holds only when the bias reaches the scores as one shared offset of
        all keys: no RoPE and no QK-norm between the bias and q·k (GPT-2, examples/gpt.py without
        ``qk_norm``). With RoPE after the bias (Qwen2) or a key norm, the exact gradient is not 0 and
        the value is a plain gradient statistic.

    Statistics the op adds later are logged the same way under ``{p}/{layer}/{name}``.

    Key-bias detection is by parameter name (:data:`SEPARATE_KEY_MODULES`, :data:`FUSED_QKV_MODULES`,
    ``nn.MultiheadAttention.in_proj_bias``); fused projections are sliced only when the shapes prove the
    [q | k | v] layout of three equal parts. It runs at ``on_train_start`` (after ``configure_model``);
    :attr:`key_biases` lists what was found. Models without a key bias just log no key-bias metrics.

    Sampling: step s (0-based optimizer step, Lightning's logging step axis) is sampled when
    ``s % every_n_steps == 0``; every micro-batch of an accumulated step is recorded. The values are
    sent to ``trainer.loggers`` at step s directly (not through ``self.log``, which would re-write a
    stale value at every later logging step; see ``callbacks/_base.py``), on global rank zero.

    Across ranks (``sync_dist=True``) the values of every rank are reduced before logging, with one
    collective for all ``*_max`` statistics (max) and one for the rest (mean — of per-rank medians for
    ``violation_median``). ``trainer.strategy.reduce`` on two stacked tensors is used rather than
    ``self.log(..., sync_dist=True)`` (one all-reduce per key: 5 × layers per sampled step) or
    torchmetrics (which accumulate over steps; these are per-step values). All ranks must see the same
    layers, as DDP already requires; if the counts differ the monitor logs rank zero's own values.

    Never stops training: an exception in a hook is reported once as a
    :class:`~lightning_gproj.callbacks.MonitorDisabledWarning`, the recorder is restored to its previous
    state, and the monitor switches itself off. Under DDP an error on one rank only can leave the other
    ranks waiting in the collective above; set ``sync_dist=False`` if that is a concern.

    At the end of training, rank zero prints a table (``rank_zero_info``): per layer the last and peak
    value of each signal; :meth:`summary` returns it.

    Args:
        every_n_steps: sample every N optimizer steps (int >= 1).
        key_bias: log the key-bias gradient signals (bool).
        sync_dist: reduce the values over ranks before logging (bool).
        prefix: metric name prefix (non-empty str, no trailing '/').
        print_summary: print the summary table at the end of training (bool).
        recorder: the :class:`~lightning_gproj.stats.StatsRecorder` to drive; default
            :data:`lightning_gproj.stats.RECORDER`, the one the op writes into.

    Raises:
        ValueError: an argument outside the accepted values (the message names it).
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        *,
        key_bias: bool = True,
        sync_dist: bool = True,
        prefix: str = "gproj",
        print_summary: bool = True,
        recorder: _stats.StatsRecorder | None = None,
    ) -> None:
        super().__init__()
        self.every_n_steps = check_int("every_n_steps", every_n_steps, 1)
        self.key_bias = check_bool("key_bias", key_bias)
        self.sync_dist = check_bool("sync_dist", sync_dist)
        self.prefix = check_prefix("prefix", prefix)
        self.print_summary = check_bool("print_summary", print_summary)
        if recorder is not None and not isinstance(recorder, _stats.StatsRecorder):
            raise ValueError(f"`recorder` must be a lightning_gproj.stats.StatsRecorder or None, got {recorder!r}")
        # The default is looked up at use, not stored: under ddp_spawn the callback is pickled into each
        # worker, where the op writes into that process's own lightning_gproj.stats.RECORDER.
        self._recorder = recorder
        #: Key biases found at ``on_train_start`` (empty with ``key_bias=False``).
        self.key_biases: list[KeyBias] = []
        #: ``{layer: {statistic: _Track}}``: last and peak of every logged value.
        self.tracks: dict[str, dict[str, _Track]] = {}
        self._recording_step: int | None = None  # step whose recording we started, while it runs
        self._previous_enabled = False
        self._mismatch_warned = False

    # ------------------------------------------------------------------ recorder on / off

    @property
    def recorder(self) -> _stats.StatsRecorder:
        """The recorder this monitor drives (``lightning_gproj.stats.RECORDER`` unless one was given)."""
        return _stats.RECORDER if self._recorder is None else self._recorder

    def _start_recording(self, step: int) -> None:
        self._previous_enabled = self.recorder.enabled
        self.recorder.enabled = True
        self._recording_step = step

    def _stop_recording(self) -> dict[str, dict[str, float]]:
        """Restore the recorder's previous state and return what it holds."""
        self.recorder.enabled = self._previous_enabled
        self._recording_step = None
        return self.recorder.drain()

    def _on_disable(self) -> None:
        if self._recording_step is not None:
            self._stop_recording()

    def _sampled(self, step: int) -> bool:
        return step % self.every_n_steps == 0

    # ------------------------------------------------------------------ hooks

    @guarded
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.key_biases = find_key_biases(pl_module) if self.key_bias else []

    @guarded
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        step = step_index(trainer)
        if self._recording_step is not None and self._recording_step != step:
            # The step we sampled ended without reaching our drain point (e.g. skipped): drop its values.
            self._stop_recording()
        if self._recording_step is None and self._sampled(step):
            self._start_recording(step)

    @guarded
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        step = step_index(trainer)
        if not self._sampled(step):
            return
        values: dict[str, float | torch.Tensor] = {}
        # Automatic optimization: every backward of the step (all accumulated micro-batches) is done
        # here. Manual optimization drains at on_train_batch_end instead, after all user backwards.
        if pl_module.automatic_optimization and self._recording_step == step:
            values.update(self._flatten(self._stop_recording()))
        if self.key_biases:
            values.update(self._key_bias_values(optimizer))
        self._emit(trainer, pl_module, values, step)

    @guarded
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = step_index(trainer)
        if not pl_module.automatic_optimization and self._recording_step == step:
            self._emit(trainer, pl_module, self._flatten(self._stop_recording()), step)

    @guarded
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._recording_step is not None:
            self._stop_recording()
        if self.print_summary and trainer.is_global_zero:
            rank_zero_info(self.summary())

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        # Not guarded by design: restoring the recorder must also happen after the monitor disabled itself
        # (it already did then) and must not mask the run's own exception.
        try:
            if self._recording_step is not None:
                self._stop_recording()
        except Exception:  # noqa: BLE001
            pass

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.on_exception(trainer, pl_module, RuntimeError("teardown"))

    # ------------------------------------------------------------------ values

    def _flatten(self, stats: dict[str, dict[str, float]]) -> dict[str, float]:
        return {f"{self.prefix}/{layer}/{key}": value for layer, d in stats.items() for key, value in d.items()}

    def _key_bias_values(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        # Only the biases this optimizer steps (several optimizers: each sees its own parameters).
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        out: dict[str, torch.Tensor] = {}
        for kb in self.key_biases:
            if id(kb.bias) not in stepped:
                continue
            norms = kb.grad_norms()
            if norms is None:
                continue
            bias_norm, weight_norm = norms
            out[f"{self.prefix}/{kb.layer}/key_bias_grad_norm"] = bias_norm
            if weight_norm is not None:
                out[f"{self.prefix}/{kb.layer}/key_bias_grad_ratio"] = bias_norm / weight_norm.to(bias_norm.device)
        return out

    def _emit(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        values: dict[str, float | torch.Tensor],
        step: int,
    ) -> None:
        if not values and not (self.sync_dist and trainer.world_size > 1):
            return
        device = trainer.strategy.root_device
        keys = sorted(values)
        is_max = [k.endswith("_max") for k in keys]
        flat = torch.zeros(len(keys), dtype=torch.float32, device=device)
        for i, key in enumerate(keys):
            flat[i] = torch.as_tensor(values[key]).reshape(())  # a device-side copy, no host sync
        if self.sync_dist and trainer.world_size > 1:
            flat = self._reduce(trainer, flat, is_max)
        numbers = flat.tolist()  # one device -> host copy for all values
        metrics = dict(zip(keys, numbers))
        for key, value in metrics.items():
            layer, _, stat = key[len(self.prefix) + 1 :].rpartition("/")
            self.tracks.setdefault(layer, {}).setdefault(stat, _Track()).add(value, step)
        log_to_loggers(trainer, metrics, step)

    def _reduce(self, trainer: "pl.Trainer", flat: torch.Tensor, is_max: list[bool]) -> torch.Tensor:
        n = flat.numel()
        sizes = torch.tensor([n, -n], device=flat.device, dtype=torch.float32)
        counts = trainer.strategy.reduce(sizes, reduce_op="max")  # (max n, -min n) in one collective
        if int(counts[0]) != n or int(-counts[1]) != n:
            if not self._mismatch_warned:
                self._mismatch_warned = True
                warnings.warn(
                    "ZeroSumMonitor: ranks recorded different sets of layers; logging each rank's own values "
                    "without reduction from now on where they differ.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return flat
        mask = torch.tensor(is_max, device=flat.device, dtype=torch.bool)
        maxed = trainer.strategy.reduce(flat.clone(), reduce_op="max")
        meaned = trainer.strategy.reduce(flat.clone(), reduce_op="mean")
        return torch.where(mask, maxed, meaned)

    # ------------------------------------------------------------------ summary

    def summary(self) -> str:
        """Per layer, ``last / peak`` of each signal seen (the table printed at the end of training)."""
        if not self.tracks:
            what = "no attention statistics were recorded (no gproj_attn_func with stats enabled in the model?)"
            if self.key_bias and not self.key_biases:
                what += " and no key bias was found"
            return f"ZeroSumMonitor: {what}; nothing was logged."
        stats = [s for s in _SUMMARY_STATS if any(s in t for t in self.tracks.values())]
        stats += sorted({s for t in self.tracks.values() for s in t} - set(stats) - {"key_bias_grad_norm"})
        rows = []
        for layer in sorted(self.tracks):
            t = self.tracks[layer]
            samples = max(tr.samples for tr in t.values())
            cells = [f"{fmt(t[s].last)} / {fmt(t[s].peak)}" if s in t else "-" for s in stats]
            rows.append([layer, str(samples), *cells])
        table = format_table(["layer", "samples", *stats], rows)
        return f"ZeroSumMonitor (last / peak per layer, every {self.every_n_steps} steps):\n{table}"

