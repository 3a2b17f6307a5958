"""GProjFabricPlugin: Fabric(plugins=[...]) swaps attention at setup and trains like the plain run.

Tolerances as in test_plugin.py: "32-true": the runs differ in attention summation order (and the
GProj correction of an fp32 rounding residual, ~1e-7 relative), so four SGD steps agree to 1e-5
relative in the loss; "bf16-mixed" / "bf16-true": both runs round to bf16 (8-bit mantissa, 4e-3 per
rounding) at different points of the attention, so losses agree to 2e-2 relative.
"""

from __future__ import annotations

import inspect
import pickle
import warnings

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.precision import FSDPPrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn

from _attention_models import TinyModel, op_spy  # noqa: F401 (fixture)
from lightning_gproj.fabric import GProjFabricPlugin
from lightning_gproj.plugin import GProjPlugin
from lightning_gproj.swap import GProjFallbackError, GProjFallbackWarning
from lightning_gproj.swap.mha import GProjMultiheadAttention


def _run(steps=4, **fabric_kwargs):
    fabric = L.Fabric(accelerator="cpu", devices=1, **fabric_kwargs)
    torch.manual_seed(0)
    model = TinyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    model, optimizer = fabric.setup(model, optimizer)
    tokens = torch.randint(0, 11, (4, 9), generator=torch.Generator().manual_seed(1))  # one batch: loss falls
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return fabric, model, losses


@pytest.mark.parametrize(
    "precision, tol, dtype",
    [("32-true", 1e-5, torch.float32), ("bf16-mixed", 2e-2, torch.bfloat16), ("bf16-true", 2e-2, torch.bfloat16)],
)
def test_fabric_steps_match_plain_run(precision, tol, dtype, op_spy):
    _, _, plain = _run(precision=precision)
    plugin = GProjFabricPlugin(precision)
    fabric, model, losses = _run(plugins=[plugin])
    assert fabric._precision is plugin
    for a, b in zip(losses, plain):
        assert abs(a - b) <= tol * abs(b)
    assert plain[-1] < plain[0]
    assert len(op_spy.calls) == 8  # 4 steps x 2 layers
    assert {c["stats_name"] for c in op_spy.calls} == {"blocks.0.attn", "blocks.1.attn"}
    assert all(c["q_dtype"] == dtype for c in op_spy.calls)
    assert [r.module_path for r in plugin.report.swapped] == ["blocks.0.attn", "blocks.1.attn"]
    assert isinstance(model.module.blocks[1].attn, GProjMultiheadAttention)
    if precision == "bf16-true":
        assert next(model.parameters()).dtype == torch.bfloat16


def test_autocast_device_follows_the_module():
    plugin = GProjFabricPlugin("bf16-mixed")
    plugin.device = "cuda"  # as the default picks on a machine with CUDA
    model = TinyModel()
    plugin.convert_module(model)  # parameters on CPU: Fabric's accelerator put them there
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert plugin.device == "cpu"
    fixed = GProjFabricPlugin("bf16-mixed", device="cuda")
    fixed.convert_module(model)
    fixed._gproj_follow()
    assert fixed.device == "cuda"  # an explicit device is kept


def test_classes_bases_and_pickling():
    plugin = GProjFabricPlugin("bf16-mixed", include="blocks.0")
    assert isinstance(plugin, MixedPrecision) and isinstance(plugin, GProjFabricPlugin)
    assert type(plugin).__name__ == "GProjFabricMixedPrecision" and type(GProjPlugin("bf16-mixed")).__name__ == "GProjMixedPrecision"
    assert isinstance(GProjFabricPlugin("bf16-true"), HalfPrecision)
    assert type(GProjFabricPlugin("32-true")).__mro__[1:3] == (GProjFabricPlugin, Precision)
    fsdp = GProjFabricPlugin("bf16-mixed", base=FSDPPrecision)
    assert isinstance(fsdp, FSDPPrecision) and fsdp.precision == "bf16-mixed"
    plugin.convert_module(TinyModel())
    clone = pickle.loads(pickle.dumps(plugin))
    assert type(clone) is type(plugin) and clone.include == ("blocks.0",) and "_gproj_module" not in vars(clone)
    with pytest.raises(TypeError, match="`base` must be a subclass of lightning.fabric.plugins.precision.Precision"):
        GProjFabricPlugin(base=nn.Module)
    with pytest.raises(TypeError, match="is a Trainer precision plugin; use lightning_gproj.GProjPlugin with the Trainer"):
        GProjFabricPlugin(base=type(GProjPlugin("32-true")))
    with pytest.raises(ValueError, match="`precision` must be one of"):
        GProjFabricPlugin("bf8")
    assert GProjFabricPlugin("bf16").precision == "bf16-mixed"  # Lightning's legacy alias, as Fabric(precision=) takes it


def test_device_is_validated():
    with pytest.raises(ValueError, match="`device` must be None or a device type torch.autocast accepts .*got 'tpu'"):
        GProjFabricPlugin("bf16-mixed", device="tpu")
    assert GProjFabricPlugin("bf16-mixed", device="cpu").device == "cpu"


def test_trainer_plugin_in_fabric_fails_at_setup_naming_the_fabric_plugin():
    """Fabric hands its model to the precision plugin at setup: the Trainer's plugin refuses it there
    (it would otherwise crash at the first backward, which wants the LightningModule's trainer)."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[GProjPlugin("32-true")])
    with pytest.raises(TypeError, match=r"GProjPlugin is the Trainer's precision plugin.*lightning_gproj\.GProjFabricPlugin"):
        fabric.setup(TinyModel())


def test_one_signature_one_table_distinct_classes():
    from lightning_gproj import fabric, plugin

    assert plugin.PRECISIONS is fabric.PRECISIONS
    assert inspect.signature(GProjPlugin) == inspect.signature(GProjFabricPlugin)
    assert {"attention_dtype", "strict"} <= set(inspect.signature(GProjFabricPlugin).parameters)
    for precision in fabric.PRECISIONS:
        assert type(GProjPlugin(precision)).__name__ == "GProj" + type(GProjFabricPlugin(precision)).__name__[11:]
        assert type(GProjFabricPlugin(precision)).__name__.startswith("GProjFabric")
    plugin32 = GProjFabricPlugin("bf16-mixed", attention_dtype="fp32")  # the Fabric plugin has it too
    plugin32.convert_module(TinyModel())
    assert {site.compute_dtype for site in plugin32.report.sites.values()} == {torch.float32}


class WeightsMHA(nn.Module):
    """nn.MultiheadAttention called with PyTorch's default need_weights=True."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 11)

    def forward(self, tokens):
        x = self.emb(tokens)
        return self.head(x + self.attn(x, x, x)[0])


def _train(model, plugin, steps=2):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    tokens = torch.randint(0, 11, (4, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def test_first_step_warns_when_nothing_was_served_and_strict_raises():
    plugin = GProjFabricPlugin("32-true")
    with pytest.warns(GProjFallbackWarning, match=r"served none of their calls in the first training step.*attn "
                                                   r"\(need_weights=True"):
        _train(WeightsMHA(), plugin)
    lines = plugin.calls_summary().splitlines()
    assert lines[0] == ("GProj attention calls (fix='gproj'): 1 swapped module, 1 served no call "
                        "(the run used their original attention)")
    assert lines[3] == "attn   | 0      | 2"
    with pytest.raises(GProjFallbackError, match="need_weights=True"):
        _train(WeightsMHA(), GProjFabricPlugin("32-true", strict=True))
    served = GProjFabricPlugin("32-true")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        _train(TinyModel(), served)
    assert served.calls_summary().splitlines()[3:] == ["blocks.0.attn | 2      | 0", "blocks.1.attn | 2      | 0"]
