"""ZeroSumMonitor's hooks on attention it does not serve: the C2 residual and the probe.

Every number the monitor logs is compared with a computation made here from tensors the test model
captured itself (its own hooks on q, k, v, the SDPA output and dK), in float64 by explicit autograd of
a hand-written attention — never with the monitor's own helpers.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_gproj import GProjPlugin, gproj_attn_func, gproj_attn_varlen_func
from lightning_gproj.callbacks import ZeroSumMonitor, probe_backward, reference_dq
from lightning_gproj.callbacks.capture import AttentionCapture, slice_call

#: Each test starts and ends with the global recorder off and empty (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("recorder_off")

E, H, D, N, B = 32, 4, 8, 16, 2


def read_metrics(log_dir: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    with open(Path(log_dir) / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in ("", None):
                    out.setdefault(key, {})[int(row["step"])] = float(value)
    return out


def fit(module, callbacks, tmp_path, max_steps, **kwargs):
    logger = CSVLogger(tmp_path, name="logs", version=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=logger, log_every_n_steps=1,
        callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )
    trainer.fit(module)
    return read_metrics(logger.log_dir)


class Attention(nn.Module):
    """Causal SDPA self-attention that keeps what it saw: q, k, v, dO and dK of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.calls: list[dict[str, torch.Tensor]] = []

    def forward(self, x):
        q, k, v = (t.reshape(B, N, H, D).transpose(1, 2) for t in self.qkv(x).split(E, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if torch.is_grad_enabled():
            call = {"q": q.detach().clone(), "k": k.detach().clone(), "v": v.detach().clone()}
            self.calls.append(call)
            o.register_hook(lambda g: call.__setitem__("do", g.detach().clone()))
            k.register_hook(lambda g: call.__setitem__("dk", g.detach().clone()))
        return o.transpose(1, 2).reshape(B, N, E)


class TwoLayers(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Module() for _ in range(2))
        for block in self.blocks:
            block.attn = Attention()
        self.head = nn.Linear(E, 1)

    def training_step(self, batch, batch_idx):
        x = batch
        for block in self.blocks:
            x = x + block.attn(x)
        return self.head(x).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        data = torch.randn(8, B, N, E, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(list(data), batch_size=None)


def fp64_dq(q, k, v, do):
    """dQ of causal softmax attention in float64 by autograd of the textbook formula."""
    q = q.double().requires_grad_(True)
    s = q @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
    p = s.softmax(-1)
    (p @ v.double()).backward(do.double())
    return q.grad, p


def test_probe_numbers_match_float64_on_the_captured_tensors(tmp_path):
    model = TwoLayers()
    monitor = ZeroSumMonitor(
        every_n_steps=1, probe_every_n_steps=1, probe_heads=2, probe_queries=12, print_summary=False
    )
    logged = fit(model, [monitor], tmp_path, max_steps=4, precision="bf16-mixed")

    # Round robin over the layers in call order (step 0: the first call seen).
    layers = ["blocks.0.attn", "blocks.1.attn"]
    assert monitor.sdpa_layers == layers
    for step in range(4):
        layer = layers[step % 2]
        attn = model.blocks[step % 2].attn
        call = attn.calls[step]
        assert call["q"].dtype == torch.bfloat16  # SDPA ran in bf16 under autocast
        q, k, v, do = call["q"][:1, :2, :12], call["k"][:1, :2, :12], call["v"][:1, :2, :12], call["do"][:1, :2, :12]
        # The user's kernel: SDPA autograd in bf16 on the same slice.
        qk = q.clone().requires_grad_(True)
        F.scaled_dot_product_attention(qk, k, v, is_causal=True).backward(do)
        dq_kernel = qk.grad.double()
        dq, p = fp64_dq(q, k, v, do)
        err = dq_kernel - dq
        heads = [float(err[0, h].norm() / dq[0, h].norm()) for h in range(2)]
        pk = (p @ k.double()) / math.sqrt(D)
        leak = (err * pk).sum(-1, keepdim=True) / (pk * pk).sum(-1, keepdim=True) * pk
        expected = {
            "probe_dq_error": sum(heads) / 2,
            "probe_dq_error_max": max(heads),
            "probe_leak_ratio": float(leak.detach().norm() / dq.detach().norm()),
        }
        for stat, value in expected.items():
            assert logged[f"gproj/{layer}/{stat}"][step] == pytest.approx(value, rel=1e-5), (step, stat)
        other = layers[(step + 1) % 2]
        assert step not in logged.get(f"gproj/{other}/probe_dq_error", {})
        # bf16 rounding: a real, nonzero, small dQ error
        assert 1e-4 < expected["probe_dq_error"] < 0.1
    step, cap, result = monitor.last_probe
    assert step == 3 and cap.layer == "blocks.1.attn" and torch.equal(cap.q, model.blocks[1].attn.calls[3]["q"][:1, :2, :12])


def test_probe_layers_restrict_the_round_robin(tmp_path):
    model = TwoLayers()
    monitor = ZeroSumMonitor(every_n_steps=10**6, probe_every_n_steps=1, probe_layers=["blocks.1.*"], print_summary=False)
    logged = fit(model, [monitor], tmp_path, max_steps=3)
    assert sorted(logged["gproj/blocks.1.attn/probe_dq_error"]) == [0, 1, 2]
    assert not [k for k in logged if k.startswith("gproj/blocks.0.attn/probe")]
    with pytest.raises(ValueError, match="`probe_layers`"):
        ZeroSumMonitor(probe_layers="blocks.1.attn")


def test_c2_residual_of_unswapped_sdpa_matches_the_key_gradient(tmp_path):
    model = TwoLayers()
    monitor = ZeroSumMonitor(every_n_steps=2, probe_every_n_steps=None, print_summary=False)
    logged = fit(model, [monitor], tmp_path, max_steps=4, precision="bf16-mixed")
    for i, layer in enumerate(["blocks.0.attn", "blocks.1.attn"]):
        series = logged[f"gproj/{layer}/c2_residual"]
        assert sorted(series) == [0, 2]
        for step in (0, 2):
            dk = model.blocks[i].attn.calls[step]["dk"].double()
            expected = float(dk.sum(dim=2).norm() / dk.norm())
            assert series[step] == pytest.approx(expected, rel=1e-4)
            assert series[step] > 1e-4  # bf16 dS: the zero sum is broken
    # the summary's rows for these unswapped layers come from SDPA's own kernel, and it says so
    table = monitor.summary()
    assert "blocks.0.attn" in table and "c2_residual" in table
    assert table.endswith("c2_residual and probe_* measure every SDPA call, also those the op did not serve "
                          "(fallbacks, unswapped layers); the other columns come from op calls only.")


def test_c2_residual_vanishes_in_float64_and_covers_the_op(tmp_path):
    """Float64 SDPA: rounding-level residual. A model calling the GProj op (bf16 reference) directly:
    the residual read by the hook equals the one computed from dK the model saw."""

    class OpModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(E, 3 * E)
            self.dk: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            q, k, v = (t.reshape(B, N, H, D).to(torch.bfloat16) for t in self.qkv(batch).split(E, dim=-1))
            k.register_hook(lambda g: self.dk.append(g.detach().clone()))
            return gproj_attn_func(q, k, v, causal=True, fix="none", stats_name="layer0").float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(list(torch.randn(4, B, N, E)), batch_size=None)

    model = OpModel()
    logged = fit(model, [ZeroSumMonitor(every_n_steps=1, probe_every_n_steps=None, print_summary=False)], tmp_path, 2)
    for step in (0, 1):
        dk = model.dk[step].double()
        assert logged["gproj/layer0/c2_residual"][step] == pytest.approx(float(dk.sum(1).norm() / dk.norm()), rel=1e-4)

    model64 = TwoLayers().double()
    model64.train_dataloader = lambda: torch.utils.data.DataLoader(list(torch.randn(4, B, N, E, dtype=torch.float64)), batch_size=None)
    logged = fit(model64, [ZeroSumMonitor(every_n_steps=1, probe_every_n_steps=None, print_summary=False)], tmp_path / "64", 2, precision="64-true")
    assert 0 <= max(logged["gproj/blocks.0.attn/c2_residual"].values()) < 1e-12


def test_c2_hook_covers_dense_op_calls_only():
    """The op also serves packed sequences; their k is (total_k, nheads_k, headdim), whose dim 1 holds
    heads, not keys, so the C2 hook leaves those calls out. A dense call in the same capture gets its
    term, ‖Σ_j dK_j‖ and ‖dK‖_F of the dK computed here."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 4, 16, generator=g).bfloat16()
    k, v = (torch.randn(2, 6, 2, 16, generator=g).bfloat16().requires_grad_(True) for _ in range(2))
    qp = torch.randn(10, 4, 16, generator=g).bfloat16()
    kp, vp = (torch.randn(10, 2, 16, generator=g).bfloat16().requires_grad_(True) for _ in range(2))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    capture = AttentionCapture({}, [], c2=True)
    capture.start()
    try:
        o = gproj_attn_func(q, k, v, causal=True, fix="none", stats_name="dense")
        o_packed = gproj_attn_varlen_func(qp, kp, vp, cu, cu, 6, 6, causal=True, fix="none", stats_name="packed")
    finally:
        capture.stop()
    (o.float().pow(2).sum() + o_packed.float().pow(2).sum()).backward()
    assert kp.grad is not None
    assert list(capture.c2_terms) == ["dense"]
    ((key_sum, norm),) = capture.c2_terms["dense"]
    dk = k.grad.double()
    assert float(key_sum) == pytest.approx(float(dk.sum(dim=1).norm()), rel=1e-5)
    assert float(norm) == pytest.approx(float(dk.norm()), rel=1e-5)
    assert float(key_sum) > 1e-4 * float(norm)  # fix="none", bf16 dS: a residual to compare


def test_c2_residual_leaves_out_calls_with_zero_key_gradient():
    """Two calls of one layer: one where every query row sees a single key (seqlen 1, so dS ≡ 0 and
    dK ≡ 0: ‖Σ_j dK_j‖ / ‖dK‖_F is 0/0) and an ordinary one. The layer's residual is the ordinary
    call's (computed here from its dK in float64), not half of it; the 0/0 call alone gives NaN."""
    g = torch.Generator().manual_seed(2)
    capture = AttentionCapture({}, [], c2=True)
    ks = []
    capture.start()
    try:
        outs = []
        for n in (1, 8):
            q = torch.randn(2, n, 2, 16, generator=g).bfloat16()
            k, v = (torch.randn(2, n, 2, 16, generator=g).bfloat16().requires_grad_(True) for _ in range(2))
            ks.append(k)
            outs.append(gproj_attn_func(q, k, v, causal=True, fix="none", stats_name="layer"))
    finally:
        capture.stop()
    sum(o.float().pow(2).sum() for o in outs).backward()
    assert ks[0].grad.abs().max().item() == 0.0
    dk = ks[1].grad.double()
    (value,) = capture.c2_residuals().values()
    assert float(value) == pytest.approx(float(dk.sum(dim=1).norm() / dk.norm()), rel=1e-5)
    assert float(value) > 1e-4
    capture.c2_terms = {"layer": [(torch.tensor(0.0), torch.tensor(0.0))]}
    assert math.isnan(float(capture.c2_residuals()["layer"]))


def test_c2_residual_keeps_a_call_with_non_finite_key_gradient():
    """Only a call whose dK is all zero (0/0) is left out of the layer's mean: a call whose dK holds a
    NaN (‖dK‖_F = NaN) makes the layer's residual NaN, as it did before the 0/0 rule, rather than being
    dropped so that the layer looks healthy. Two ordinary calls of the same layer: the residual is the
    mean of their ratios (computed here from their dK in float64)."""
    g = torch.Generator().manual_seed(3)
    dks = [torch.randn(2, 8, 2, 16, generator=g, dtype=torch.float64) for _ in range(2)]
    dks[1][:, :, 0] += 0.5  # a key-sum residual to measure
    terms = [(torch.linalg.vector_norm(dk.sum(dim=1)), torch.linalg.vector_norm(dk)) for dk in dks]
    expected = sum(float(a / b) for a, b in terms) / 2
    capture = AttentionCapture({}, [], c2=True)
    capture.c2_terms = {"layer": list(terms) + [(torch.tensor(0.0, dtype=torch.float64),) * 2]}
    assert float(capture.c2_residuals()["layer"]) == pytest.approx(expected, rel=1e-12)
    nan_dk = dks[0].clone()
    nan_dk[0, 3, 1, 5] = float("nan")
    nan_term = (torch.linalg.vector_norm(nan_dk.sum(dim=1)), torch.linalg.vector_norm(nan_dk))
    capture.c2_terms = {"layer": list(terms) + [nan_term]}
    assert math.isnan(float(capture.c2_residuals()["layer"]))


def test_slice_keeps_the_semantics_of_the_full_call():
    """GQA, a boolean padding mask and is_causal: the probe slice's float64 dQ equals the rows of the
    full call's float64 dQ (computed by autograd through SDPA in float64)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 10, 8, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, 2, 10, 8, generator=g, dtype=torch.float64), torch.randn(2, 2, 10, 8, generator=g, dtype=torch.float64)
    do = torch.randn(2, 4, 10, 8, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., 7:] = False  # padding of the last keys of batch row 0
    for attn_mask, causal, nq in ((mask, False, 6), (None, True, 6)):
        qf = q.clone().requires_grad_(True)
        F.scaled_dot_product_attention(qf, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=True).backward(do)
        qs, ks, vs, ms = slice_call(q, k, v, attn_mask, causal, True, heads=3, queries=nq)
        assert qs.shape == (1, 3, nq, 8) and ks.shape[1] == 3
        dq, _ = reference_dq(qs, ks, vs, do[:1, :3, :nq], ms, causal)
        torch.testing.assert_close(dq, qf.grad[:1, :3, :nq], rtol=1e-10, atol=1e-12)
        result = probe_backward(qs, ks, vs, do[:1, :3, :nq], ms, causal)  # a float64 "kernel": no error
        assert float(result.dq_error_max) < 1e-12 and float(result.leak_ratio) < 1e-12


def test_swapped_attention_is_not_probed_but_gets_c2(tmp_path):
    """With GProjPlugin the SDPA calls go to the op: the probe sees no SDPA call; C2 and the op's
    statistics are logged under the same module path."""
    model = TwoLayers()
    monitor = ZeroSumMonitor(every_n_steps=1, probe_every_n_steps=1, print_summary=False)
    logged = fit(model, [monitor], tmp_path, max_steps=2, plugins=[GProjPlugin("bf16-mixed", fix="none")])
    assert monitor.sdpa_layers == [] and monitor.last_probe is None
    for layer in ("blocks.0.attn", "blocks.1.attn"):
        assert sorted(logged[f"gproj/{layer}/c2_residual"]) == [0, 1]
        assert sorted(logged[f"gproj/{layer}/leak_ratio"]) == [0, 1]
        assert not [k for k in logged if "probe" in k]


class PlainAttention(nn.Module):
    """Causal SDPA self-attention without hooks of its own (they would stop a fullgraph compile themselves)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x):
        q, k, v = (t.reshape(B, N, H, D).transpose(1, 2) for t in self.qkv(x).split(E, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, N, E)


class CompiledAttention(pl.LightningModule):
    """One attention layer called from ``forward`` (what Lightning compiles)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = PlainAttention()
        self.head = nn.Linear(E, 1)

    def forward(self, x):
        return self.head(self.attn(x))

    def training_step(self, batch, batch_idx):
        return self(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        data = torch.randn(4, B, N, E, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(list(data), batch_size=None)


def test_monitor_under_torch_compile_samples_what_dynamo_lets_it(tmp_path):
    """trainer.fit(torch.compile(model)): with fullgraph=False the sampled steps' C2 residual and probe are those of
    the eager run (the hooks graph-break); with fullgraph=True a gradient hook in the graph is a side effect Dynamo
    refuses (new-user pass 8: the run died at step 0), so C2 and the probe are not sampled, one warning says so, and
    the run and the other signals (the key bias here) go on — also with only the attention layer compiled, as a module
    or as its forward."""
    import warnings

    import torch._dynamo

    def run(compile_kw, sub, part=None):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = CompiledAttention()
        if part == "module":  # only the attention layer compiled, inside the module
            model.attn = torch.compile(model.attn, backend="aot_eager", **compile_kw)
            module = model
        elif part == "forward":  # its forward replaced by a compiled function
            model.attn.forward = torch.compile(model.attn.forward, backend="aot_eager", **compile_kw)
            module = model
        else:
            module = torch.compile(model, backend="aot_eager", **compile_kw) if compile_kw is not None else model
        monitor = ZeroSumMonitor(every_n_steps=1, probe_every_n_steps=1, print_summary=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logged = fit(module, [monitor], tmp_path / sub, max_steps=2)
        torch._dynamo.reset()
        return logged, [str(w.message) for w in caught if "ZeroSumMonitor" in str(w.message)]

    eager, eager_warned = run(None, "eager")
    stats = ("c2_residual", "probe_dq_error", "key_bias_grad_norm")
    assert all(sorted(eager[f"gproj/attn/{s}"]) == [0, 1] for s in stats) and not eager_warned
    graph_breaks, warned = run({"fullgraph": False}, "default")
    for s in stats:
        for step in (0, 1):
            assert graph_breaks[f"gproj/attn/{s}"][step] == pytest.approx(eager[f"gproj/attn/{s}"][step], rel=1e-4)
    assert not warned
    one_graph, warned = run({"fullgraph": True}, "fullgraph")
    assert not [k for k in one_graph if k.endswith(("c2_residual", "probe_dq_error"))]
    for step in (0, 1):
        assert one_graph["gproj/attn/key_bias_grad_norm"][step] == pytest.approx(eager["gproj/attn/key_bias_grad_norm"][step], rel=1e-4)
    assert len(warned) == 1 and "fullgraph=True" in warned[0]
    # the same with only the attention layer compiled (metric names keep its path: the wrapper is transparent)
    for how in ("module", "forward"):
        part, warned = run({"fullgraph": True}, how, part=how)
        assert not [k for k in part if k.endswith(("c2_residual", "probe_dq_error"))], how
        assert sorted(part["gproj/attn/key_bias_grad_norm"]) == [0, 1], how
        assert len(warned) == 1 and "fullgraph=True" in warned[0], how
