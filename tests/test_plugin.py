"""GProjPlugin: a Lightning precision plugin that swaps attention, reports it, then defers to its base.

Tolerances. "32-true": the plugin run and the plain run differ only in how attention is summed (and,
for fp32 inputs, the GProj correction of an fp32 rounding residual, ~1e-7 relative); five SGD steps
on a two-block model carry these few-ulp differences into the loss at < 1e-5 relative. "64-true":
the same at double precision, 1e-12. "bf16-mixed": both runs round to bf16 (8-bit mantissa, 4e-3
per rounding) at different points of the attention, so losses agree to 2e-2 relative.
"""

from __future__ import annotations

import copy
import csv
import logging
import pickle
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from _attention_models import TinyModel, op_spy  # noqa: F401 (fixture)
from lightning_gproj.fabric import GProjFabricPlugin
from lightning_gproj.plugin import GProjPlugin
from lightning_gproj.swap import GProjFallbackError, GProjFallbackWarning
from lightning_gproj.swap.mha import GProjMultiheadAttention


class LitTiny(L.LightningModule):
    def __init__(self, seed: int = 0, checkpointing: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.model = TinyModel()
        self.checkpointing = checkpointing
        self.losses: list[float] = []

    def forward(self, tokens):
        if not self.checkpointing:
            return self.model(tokens)
        x = self.model.emb(tokens)
        for block in self.model.blocks:  # activation checkpointing: the backward recomputes each block
            x = checkpoint(block, x, use_reentrant=False)
        return self.model.head(x)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randint(0, 11, (20, 9), generator=g)), batch_size=4)


def _attached(module: L.LightningModule) -> L.LightningModule:
    """``module`` attached to a Trainer, as the Trainer's strategy hands it to ``convert_module``."""
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                               enable_progress_bar=False, enable_model_summary=False)
    return module


def _fit(plugin=None, precision="32-true", tmp_path=None, steps=5, checkpointing=False):
    module = LitTiny(checkpointing=checkpointing)
    kwargs = dict(plugins=[plugin]) if plugin is not None else dict(precision=precision)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, **kwargs,
    )
    trainer.fit(module)
    return trainer, module


@pytest.mark.parametrize("precision, tol", [("32-true", 1e-5), ("64-true", 1e-12)])
def test_fit_matches_plain_run(precision, tol, op_spy, tmp_path):
    _, plain = _fit(precision=precision, tmp_path=tmp_path)
    plugin = GProjPlugin(precision)
    trainer, swapped = _fit(plugin, tmp_path=tmp_path)
    assert len(swapped.losses) == 5
    for a, b in zip(swapped.losses, plain.losses):
        assert abs(a - b) <= tol * abs(b)
    assert plain.losses[-1] < plain.losses[0]  # it trains
    assert len(op_spy.calls) == 10  # 5 steps x 2 attention layers
    assert {c["stats_name"] for c in op_spy.calls} == {"model.blocks.0.attn", "model.blocks.1.attn"}
    assert next(swapped.parameters()).dtype == (torch.float64 if precision == "64-true" else torch.float32)
    assert trainer.precision_plugin is plugin and [r.module_path for r in plugin.report.swapped] == [
        "model.blocks.0.attn", "model.blocks.1.attn"]


def test_fit_bf16_mixed_runs_the_op_under_autocast(op_spy, tmp_path):
    _, plain = _fit(precision="bf16-mixed", tmp_path=tmp_path, steps=3)
    plugin = GProjPlugin()  # bf16-mixed; device "cpu" here (no CUDA)
    assert type(plugin).__name__ == "GProjMixedPrecision" and plugin.device == "cpu"
    _, swapped = _fit(plugin, tmp_path=tmp_path, steps=3)
    for a, b in zip(swapped.losses, plain.losses):
        assert abs(a - b) <= 2e-2 * abs(b)
    assert op_spy.calls and all(c["q_dtype"] == torch.bfloat16 for c in op_spy.calls)


def test_fit_bf16_true_runs_the_op_on_bf16_weights(op_spy, tmp_path):
    _, plain = _fit(precision="bf16-true", tmp_path=tmp_path, steps=3)
    plugin = GProjPlugin("bf16-true")
    assert isinstance(plugin, HalfPrecision)
    _, swapped = _fit(plugin, tmp_path=tmp_path, steps=3)
    for a, b in zip(swapped.losses, plain.losses):
        assert abs(a - b) <= 2e-2 * abs(b)
    assert len(op_spy.calls) == 6 and all(c["q_dtype"] == torch.bfloat16 for c in op_spy.calls)
    assert next(swapped.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("precision, tol", [("32-true", 1e-5), ("bf16-mixed", 2e-2)])
def test_fit_with_activation_checkpointing_recomputes_through_the_op(precision, tol, op_spy, tmp_path):
    _, plain = _fit(precision=precision, tmp_path=tmp_path, steps=3, checkpointing=True)
    _, swapped = _fit(GProjPlugin(precision), tmp_path=tmp_path, steps=3, checkpointing=True)
    for a, b in zip(swapped.losses, plain.losses):
        assert abs(a - b) <= tol * abs(b)
    # forward + recomputation in the backward, 2 layers, 3 steps
    assert len(op_spy.calls) == 12
    assert [c["stats_name"] for c in op_spy.calls[:4]] == [
        "model.blocks.0.attn", "model.blocks.1.attn", "model.blocks.1.attn", "model.blocks.0.attn"]


def test_checkpoint_of_plugin_run_loads_strict_into_plain_model(op_spy, tmp_path):
    trainer, swapped = _fit(GProjPlugin("32-true"), tmp_path=tmp_path, steps=2)
    path = tmp_path / "gproj.ckpt"
    trainer.save_checkpoint(path)
    plain = LitTiny(seed=123)
    assert list(plain.state_dict()) == list(swapped.state_dict())
    plain.load_state_dict(torch.load(path, weights_only=True)["state_dict"], strict=True)
    for (name, a), b in zip(plain.state_dict().items(), swapped.state_dict().values()):
        assert torch.equal(a, b), name
    assert type(plain.model.blocks[1].attn) is nn.MultiheadAttention and "forward" not in vars(plain.model.blocks[0].attn)


def test_convert_module_reports_is_idempotent_and_converts(op_spy):
    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    lit = _attached(LitTiny())
    model = lit.model
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler = Grab(level=logging.INFO)
    logger.addHandler(handler)
    try:
        plugin = GProjPlugin("bf16-true", fix="none", exclude="model.blocks.1*")
        assert isinstance(plugin, HalfPrecision)
        out = plugin.convert_module(lit)
        assert out is lit and model.head.weight.dtype == torch.bfloat16  # the base converted
        assert plugin.convert_module(lit) is lit  # a second conversion prints nothing
    finally:
        logger.removeHandler(handler)
    assert len(records) == 1
    assert "GProj attention swap (fix='none'): 1 swapped, 1 left alone" in records[0]
    assert "model.blocks.0.attn | SDPAAttention: F.scaled_dot_product_attention | gproj_attn_func(fix='none')" in records[0]
    assert "model.blocks.1.attn | nn.MultiheadAttention" in records[0]
    assert "excluded by pattern 'model.blocks.1*'" in records[0]
    assert model.blocks[0].attn.forward.original is None and type(model.blocks[1].attn) is nn.MultiheadAttention


def test_fsdp_strategy_accepts_a_plugin_built_on_fsdp_precision(op_spy):
    plugin = GProjPlugin("bf16-mixed", base=FSDPPrecision)
    assert isinstance(plugin, GProjPlugin) and isinstance(plugin, FSDPPrecision)
    assert type(plugin) is type(GProjPlugin("32-true", base=FSDPPrecision))  # one class per base, cached
    strategy = FSDPStrategy(precision_plugin=plugin)
    assert strategy.precision_plugin is plugin
    assert strategy.mixed_precision_config.param_dtype == torch.bfloat16  # the base's own logic
    with pytest.raises(TypeError, match="FSDPPrecision"):
        FSDPStrategy(precision_plugin=GProjPlugin("bf16-mixed"))
    # Lightning 2.6.6 refuses FSDPStrategy on accelerator="cpu", so the Trainer is not built here; the
    # strategy's setup calls precision_plugin.convert_module before wrapping the model, as tested below.
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        L.Trainer(accelerator="cpu", devices=1, strategy=FSDPStrategy(), plugins=[plugin])
    lit = _attached(LitTiny())
    assert plugin.convert_module(lit) is lit
    assert isinstance(lit.model.blocks[1].attn, GProjMultiheadAttention)

    deepspeed = GProjPlugin("bf16-mixed", base=DeepSpeedPrecision)  # the strategy itself needs deepspeed
    assert isinstance(deepspeed, DeepSpeedPrecision) and type(deepspeed).__name__ == "GProjDeepSpeedPrecision"

    wrapped = GProjPlugin.from_precision(FSDPPrecision("32-true"), fix="gproj_uniform")
    assert isinstance(wrapped, FSDPPrecision) and wrapped.precision == "32-true" and wrapped.fix == "gproj_uniform"
    assert FSDPStrategy(precision_plugin=wrapped).precision_plugin is wrapped


def test_plugin_pickles_and_names_its_base():
    plugin = GProjPlugin("16-mixed", include=["blocks.0"], device="cpu")
    assert isinstance(plugin, MixedPrecision) and plugin.scaler is not None
    clone = pickle.loads(pickle.dumps(plugin))
    assert type(clone) is type(plugin) and clone.include == ("blocks.0",) and clone.precision == "16-mixed"
    assert type(copy.deepcopy(plugin)) is type(plugin)
    assert type(GProjPlugin("32-true")).__mro__[1:4] == (GProjPlugin, GProjFabricPlugin, Precision)
    assert repr(GProjPlugin("32-true", fix="none")) == (
        "GProjPrecision(precision='32-true', fix='none', include=None, exclude=None)")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(precision="bf8"), ValueError, r"`precision` must be one of \('bf16-mixed', '16-mixed', '32-true'"),
        (dict(precision=8), ValueError, "`precision` must be one of"),
        (dict(precision=True), ValueError, "`precision` must be one of"),
        (dict(fix="uniform"), ValueError, r"`fix` must be one of \('none', 'gproj', 'gproj_uniform'\)"),
        (dict(include=5), TypeError, "`include` must be None, a glob string or a sequence of glob strings"),
        (dict(exclude=[None]), TypeError, "`exclude` must be None"),
        (dict(catch_all="yes"), TypeError, "`catch_all` must be a bool"),
        (dict(base=nn.Module), TypeError, "`base` must be a subclass of lightning.pytorch.plugins.precision.Precision"),
        (dict(precision="bf16-mixed", base=Precision), ValueError, "is not what the base Precision runs"),
        (dict(device="tpu"), ValueError, r"`device` must be None or a device type torch.autocast accepts .*got 'tpu'"),
        (dict(device="cuda:0"), ValueError, "`device` must be None"),
        (dict(device=0), ValueError, "`device` must be None"),
        (dict(precision="32-true", device="cpu"), ValueError, r"`device` sets the autocast device of a MixedPrecision "
         r"base; base Precision \(precision='32-true'\) takes none"),
        (dict(precision="bf16-true", device="cuda"), ValueError, r"base HalfPrecision \(precision='bf16-true'\)"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        GProjPlugin(**kwargs)


@pytest.mark.parametrize("plugin", [GProjPlugin, GProjFabricPlugin])
@pytest.mark.parametrize("precision, base", [("32-true", "Precision"), ("64-true", "DoublePrecision"),
                                             ("bf16-true", "HalfPrecision"), ("bf16-mixed", "MixedPrecision")])
def test_a_misspelt_argument_is_named_with_the_plugins_own_arguments(plugin, precision, base):
    # Extra keywords go to the base precision's constructor; with "32-true" / "64-true" that is object's, whose
    # message ("object.__init__() takes exactly one argument") named neither the argument nor the plugin.
    with pytest.raises(TypeError) as err:
        plugin(precision, fixx="none")
    message = str(err.value)
    assert message.startswith(f"{plugin.__name__} got keyword argument(s) ['fixx'] that are not its own (precision, fix, "
                              f"include, exclude, catch_all, base, device, attention_dtype, ds_format, strict, mode); "
                              f"other keywords go to the base precision {base}'s constructor, which refused them: "), message


@pytest.mark.parametrize("alias, unified", [("bf16", "bf16-mixed"), (16, "16-mixed"), ("16", "16-mixed"), (32, "32-true"),
                                            ("32", "32-true"), (64, "64-true"), ("64", "64-true")])
def test_lightning_legacy_precision_aliases_are_accepted(alias, unified):
    """The values Trainer(precision=...) still takes for historical reasons (a new-user pass found them refused,
    breaking configs whose precision moves into the plugin as the README says): converted as Lightning does."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plugin = GProjPlugin(alias)
    assert plugin.precision == unified
    assert isinstance(plugin, GProjPlugin(unified).__class__.__mro__[1])
    # Lightning's own warning for 16 and "bf16", once per construction (the class lookup in __new__ saw it twice)
    legacy = [w for w in record if "historical reasons" in str(w.message)]
    assert len(legacy) == (alias in (16, "16", "bf16")), [str(w.message) for w in record]


def test_attention_dtype_fp32_runs_swapped_attention_in_fp32_under_bf16_mixed(op_spy, monkeypatch, tmp_path):
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        if not torch.is_autocast_enabled("cpu"):  # Site.attention's fp32 call runs with autocast off
            seen.append((q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    plugin = GProjPlugin("bf16-mixed", fix="none", attention_dtype="fp32")
    _, swapped = _fit(plugin, tmp_path=tmp_path, steps=3)
    assert not op_spy.calls  # the op is not used
    assert all(site.compute_dtype == torch.float32 for site in plugin.report.sites.values())
    assert len(seen) == 6 and set(seen) == {(torch.float32,) * 3}  # 3 steps x 2 attention layers
    assert swapped.losses[-1] < swapped.losses[0]
    with pytest.raises(ValueError, match=r"`attention_dtype` must be one of \(None, 'fp32', 'bf16'\)"):
        GProjPlugin(attention_dtype="fp16")


@pytest.mark.parametrize("ds_format", ["bf16", "e5m2"])
def test_attention_dtype_fp32_in_an_fp32_model_is_plain_fp32_attention(ds_format, op_spy, tmp_path):
    """The "fp32" arm under 32-true, where q is already fp32: plain SDPA, fix and ds_format unused (a new-user
    pass found fix and an FP8 ds_format applied there, the losses 1e-4 off). Losses equal the unswapped run's."""
    _, plain = _fit(precision="32-true", tmp_path=tmp_path)
    plugin = GProjPlugin("32-true", fix="gproj", ds_format=ds_format, attention_dtype="fp32")
    _, swapped = _fit(plugin, tmp_path=tmp_path)
    assert not op_spy.calls
    for a, b in zip(swapped.losses, plain.losses):
        assert abs(a - b) <= 1e-6 * abs(b)


def test_attention_dtype_bf16_runs_the_op_on_bf16_inputs_in_an_fp32_model(op_spy, tmp_path):
    plugin = GProjPlugin("32-true", attention_dtype="bf16")
    _, swapped = _fit(plugin, tmp_path=tmp_path, steps=3)
    assert len(op_spy.calls) == 6  # 3 steps x 2 attention layers, every call served by the op
    assert {c["dtypes"] for c in op_spy.calls} == {(torch.bfloat16,) * 3}
    assert not any(c["autocast"] for c in op_spy.calls)
    assert {c["fix"] for c in op_spy.calls} == {"gproj"}
    assert next(swapped.parameters()).dtype == torch.float32
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in swapped.parameters())
    assert ("attention_dtype='bf16': swapped attention runs through the op on bf16 q, k, v; the rest of the "
            "model at precision '32-true'") in " ".join(plugin.report.table().split())
    assert swapped.losses[-1] < swapped.losses[0]


class LitWeightsMHA(L.LightningModule):
    """nn.MultiheadAttention called with PyTorch's default need_weights=True: every call falls back."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 11)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        x = self.emb(tokens)
        x = x + self.attn(x, x, x)[0]  # need_weights defaults to True
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), tokens.flatten())

    configure_optimizers = LitTiny.configure_optimizers
    train_dataloader = LitTiny.train_dataloader


def _fit_logged(module, plugin, tmp_path, steps=3):
    """Fit with a CSVLogger; returns (info messages, the last row of metrics.csv)."""
    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler = Grab(level=logging.INFO)
    logger.addHandler(handler)
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, logger=L.pytorch.loggers.CSVLogger(tmp_path, name="run"),
            log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            plugins=[plugin],
        )
        trainer.fit(module)
    finally:
        logger.removeHandler(handler)
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return records, {k: v for row in rows for k, v in row.items() if v != ""}


def test_fallback_on_every_call_is_reported_at_the_first_step_and_after_fit(tmp_path):
    """need_weights=True: the swap reports the module swapped, but no call runs the op. The first
    optimizer step warns, and after fit the calls summary says so and is logged to the loggers."""
    with pytest.warns(GProjFallbackWarning, match=r"1 of 1 swapped attention modules served none of their calls in the "
                                                   r"first training step.*attn \(need_weights=True"):
        records, metrics = _fit_logged(LitWeightsMHA(), GProjPlugin("32-true"), tmp_path)
    summary = next(r for r in records if r.startswith("GProj attention calls"))
    assert summary.startswith("GProj attention calls (fix='gproj'): 1 swapped module, 1 served no call")
    assert "attn   | 0      | 3" in summary and "need_weights=True" in summary
    assert float(metrics["gproj_calls/attn/served"]) == 0 and float(metrics["gproj_calls/attn/fallbacks"]) == 3


class HelperAttention(nn.Module):
    """SDPA in a helper method its parent calls directly; ``forward`` is never run."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def attend(self, q, k, v):
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x):
        raise AssertionError("the parent bypasses forward")


class LitHelperAttention(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 32)
        self.attn = HelperAttention()
        self.head = nn.Linear(32, 11)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        x = self.emb(tokens)
        b, n, e = x.shape
        q, k, v = self.attn.qkv(x).view(b, n, 3, 4, e // 4).permute(2, 0, 3, 1, 4)
        x = x + self.attn.attend(q, k, v).transpose(1, 2).reshape(b, n, e)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), tokens.flatten())

    configure_optimizers = LitTiny.configure_optimizers
    train_dataloader = LitTiny.train_dataloader


def test_a_swapped_module_its_parent_bypasses_is_reported_at_the_first_step(tmp_path, op_spy):
    """New-user pass 8: the parent calls the swapped module's helper, not its forward — the module is reported
    swapped, serves nothing and counts no fallback; the first optimizer step says so, naming it."""
    with pytest.warns(GProjFallbackWarning, match=r"1 of 1 swapped attention modules saw no call in the first training "
                                                   r"step: attn\. .*self\.attn\.attend"):
        records, metrics = _fit_logged(LitHelperAttention(), GProjPlugin("32-true", attention_dtype="bf16"), tmp_path)
    assert not op_spy.calls
    assert float(metrics["gproj_calls/attn/served"]) == 0 and float(metrics["gproj_calls/attn/fallbacks"]) == 0


def test_a_catch_all_region_that_serves_nothing_itself_is_not_warned_about(tmp_path, op_spy):
    """catch_all=True adds a site for the whole model that serves only calls no swapped module inside serves: with
    every call served by the attention modules it sees none, and that is not worth a warning (review of new-user
    pass 8's fix)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        plugin = GProjPlugin("32-true", catch_all=True)
        _fit_logged(LitTiny(), plugin, tmp_path)
    sites = plugin.report.sites
    assert sites[""].catch_all and sites[""].served == 0
    assert [sites[p].served for p in ("model.blocks.0.attn", "model.blocks.1.attn")] == [3, 3]


def test_served_calls_are_summarized_without_a_warning(tmp_path, op_spy):
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        records, metrics = _fit_logged(LitTiny(), GProjPlugin("32-true"), tmp_path)
    summary = next(r for r in records if r.startswith("GProj attention calls"))
    assert summary.splitlines()[0] == "GProj attention calls (fix='gproj'): 2 swapped modules"
    assert "model.blocks.0.attn | 3      | 0" in summary and "model.blocks.1.attn | 3      | 0" in summary
    assert float(metrics["gproj_calls/model.blocks.0.attn/served"]) == 3
    assert float(metrics["gproj_calls/model.blocks.1.attn/fallbacks"]) == 0


def test_strict_raises_on_the_first_fallback(tmp_path):
    with pytest.raises(GProjFallbackError, match=r"attn \(nn.MultiheadAttention\) cannot serve this call exactly: "
                                                 r"need_weights=True"):
        _fit_logged(LitWeightsMHA(), GProjPlugin("32-true", strict=True), tmp_path)


def test_fabric_plugin_in_a_trainer_is_refused_naming_the_trainer_plugin():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=r"GProjFabricMixedPrecision\(.*lightning_gproj\.GProjPlugin"):
        L.Trainer(accelerator="cpu", devices=1, plugins=[GProjFabricPlugin("bf16-mixed")])
