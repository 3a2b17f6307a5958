"""GProj in torch's flash-attention registry (lightning_gproj/sdpa_registry.py) and the plugins' ``mode``.

CPU has no CUDA flash backend, so what runs here: the registration, activation and restore through
``torch.nn.attention``'s own functions; the aten-schema kernels (``flash_forward``, ``flash_backward``)
called directly and through ``torch.ops.aten._scaled_dot_product_flash_attention``'s own autograd
formula (the kernels installed for the CPU key in a test-only ``torch.library`` scope, which the
production code installs for CUDA), and ``F.scaled_dot_product_attention`` itself on CPU through
adapters of the same kernels for CPU SDPA's flash ops (``_scaled_dot_product_flash_attention_for_cpu``,
whose schema differs: (output, logsumexp) only); every test-only registration is removed at its end.
Numbers: against float64 attention computed here through autograd, and bit for bit against
:func:`lightning_gproj.gproj_attn_func` (the same op underneath). The Triton path of these kernels runs
under the interpreter in tests/test_sdpa_registry_triton.py.

Tolerances (bf16 inputs, N ≤ 24, d = 32, keys offset by +3): o and dq, dk, dv within 2e-2 relative
Frobenius error of float64 (bf16 rounds at 2⁻⁹ relative per operand, a few roundings deep), lse within
1e-5 (fp32 sums of exactly represented bf16 products).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings

import lightning as L
import pytest
import torch
import torch.nn.attention as attention
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import lightning_gproj
from _attention_models import SDPAAttention
from _fp64 import attention_fp64
from lightning_gproj import sdpa_registry as R
from lightning_gproj.fabric import MODES, GProjFabricPlugin
from lightning_gproj.kernels.reference import FIXES
from lightning_gproj.plugin import GProjPlugin
from lightning_gproj.stats import RECORDER
from lightning_gproj.swap import GProjFallbackError, GProjFallbackWarning, SwapReport

FLASH = int(SDPBackend.FLASH_ATTENTION)


@pytest.fixture(autouse=True)
def clean_registry():
    """Each test starts and ends with no flash-attention impl active, the default settings, and the
    process's SDPA priority order."""
    order = torch._C._get_sdp_priority_order()
    attention.restore_flash_attention_impl(_raise_warn=False)
    R._SETTINGS = R._Settings()
    yield
    attention.restore_flash_attention_impl(_raise_warn=False)
    R._SETTINGS = R._Settings()
    torch._C._set_sdp_priority_order(order)


@contextlib.contextmanager
def cpu_kernels():
    """The production kernels installed for the CPU key (R._Handle, which activation uses for CUDA)."""
    handle = R._Handle("CPU")
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def cpu_sdpa_through_gproj():
    """F.scaled_dot_product_attention on CPU, flash backend, served by flash_forward / flash_backward:
    adapters for CPU SDPA's own flash ops (they take an attn_mask and return (output, logsumexp))."""

    def forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        assert attn_mask is None
        out = R.flash_forward(query, key, value, dropout_p, is_causal, scale=scale)
        return out[0], out[1]

    def backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
        assert attn_mask is None
        none = torch.empty(0)
        return R.flash_backward(grad_out, query, key, value, out, logsumexp, None, None, query.shape[2], key.shape[2],
                                dropout_p, is_causal, none, none, scale=scale)

    lib = torch.library.Library("aten", "IMPL", "CPU")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        lib.impl("_scaled_dot_product_flash_attention_for_cpu", forward, "CPU")
        lib.impl("_scaled_dot_product_flash_attention_for_cpu_backward", backward, "CPU")
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            yield
    finally:
        lib._destroy()


def _inputs(b=2, h=4, hk=2, nq=24, nk=24, d=32, seed=0, dtype=torch.bfloat16):
    """SDPA-layout (batch, nheads, seqlen, headdim) q, k, v, dO; keys offset by +3 (a mean key GProj acts on)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g)
    k = torch.randn(b, hk, nk, d, generator=g) + 3.0
    v = torch.randn(b, hk, nk, d, generator=g)
    do = torch.randn(b, h, nq, d, generator=g)
    return tuple(x.to(dtype) for x in (q, k, v, do))


def _lse_fp64(q, k, scale, causal):
    """log Σ_j exp(τ q_i·k_j) over visible keys, float64, (batch, nheads, Nq)."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        s = s.masked_fill(~torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq), -math.inf)
    return torch.logsumexp(s, dim=-1)


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _gproj(q, k, v, do, causal, scale, fix):
    """o and dq, dk, dv of gproj_attn_func on leaf copies of q, k, v (SDPA layout)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = lightning_gproj.gproj_attn_func(q, k, v, softmax_scale=scale, causal=causal, fix=fix, layout="bhsd")
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def _fp64(q, k, v, do, causal, scale):
    """float64 o, dq, dk, dv in SDPA layout (tests/_fp64.py works in flash layout)."""
    o, dq, dk, dv, _ = attention_fp64(*(x.transpose(1, 2) for x in (q, k, v, do)), scale, causal)
    return tuple(x.transpose(1, 2) for x in (o, dq, dk, dv))


# ------------------------------------------------------------------------------------------ registry


def test_registered_activated_and_restored_through_torch():
    assert R.missing_api() is None
    assert "GProj" in attention.list_flash_attention_impls() and attention.current_flash_attention_impl() is None
    torch._C._set_sdp_priority_order([3, 2, 1, 0, 4])  # cuDNN first: what GProj must override while active
    lightning_gproj.activate_sdpa_registry(fix="none", ds_format="e4m3")
    assert attention.current_flash_attention_impl() == "GProj" and R.active()
    assert torch._C._get_sdp_priority_order() == [FLASH, 3, 2, 0, 4]
    # cuDNN off while active: torch 2.11 on an H200 picked it over a first-listed flash (NOTES.md run 11)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert R._SETTINGS == R._Settings("none", "e4m3", False)
    lightning_gproj.restore_sdpa_registry()
    assert attention.current_flash_attention_impl() is None and not R.active()
    assert torch._C._get_sdp_priority_order() == [3, 2, 1, 0, 4]
    assert torch.backends.cuda.cudnn_sdp_enabled()
    # torch's own switch activates the same registration (with the settings last chosen)
    attention.activate_flash_attention_impl("GProj")
    assert attention.current_flash_attention_impl() == "GProj" and torch._C._get_sdp_priority_order()[0] == FLASH
    attention.restore_flash_attention_impl()
    assert torch._C._get_sdp_priority_order() == [3, 2, 1, 0, 4]


def test_activation_installs_the_cuda_kernels_and_restore_removes_them():
    """The two SDPA flash ops get this module's kernels for the CUDA key while active, and lose them after
    (this CPU build of torch has no CUDA kernel of its own for them)."""
    ops = ("aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_backward")
    assert not any(torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") for op in ops)
    with lightning_gproj.use_sdpa_registry():
        for op in ops:
            cuda = [line for line in torch._C._dispatch_dump(op).splitlines() if line.startswith("CUDA:")]
            assert len(cuda) == 1 and "lightning_gproj/sdpa_registry.py" in cuda[0]
    assert not any(torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") for op in ops)


def test_context_manager_restores_the_previous_impl_and_settings(monkeypatch):
    removed = []

    class Handle:
        def remove(self):
            removed.append(True)

    monkeypatch.setitem(torch.nn.attention._registry._FLASH_ATTENTION_IMPLS, "Other", lambda: Handle())
    attention.activate_flash_attention_impl("Other")
    with lightning_gproj.use_sdpa_registry(fix="gproj_uniform") as calls:
        assert attention.current_flash_attention_impl() == "GProj" and removed == [True]
        assert R._SETTINGS.fix == "gproj_uniform" and calls is R.CALLS
        with lightning_gproj.use_sdpa_registry(fix="none", strict=True):
            assert R._SETTINGS == R._Settings("none", "bf16", True)
        assert attention.current_flash_attention_impl() == "GProj" and R._SETTINGS.fix == "gproj_uniform"
    assert attention.current_flash_attention_impl() == "Other" and R._SETTINGS == R._Settings()
    R.restore_sdpa_registry()  # GProj not active: leaves "Other" alone
    assert attention.current_flash_attention_impl() == "Other"


def test_bad_settings_raise_naming_the_argument():
    with pytest.raises(ValueError, match=r"`fix` must be one of \('none', 'gproj', 'gproj_uniform'\), got 'gproj2'"):
        lightning_gproj.activate_sdpa_registry(fix="gproj2")
    with pytest.raises(ValueError, match="`ds_format` must be one of"):
        with lightning_gproj.use_sdpa_registry(ds_format="fp8"):
            pass
    with pytest.raises(TypeError, match="`strict` must be a bool"):
        lightning_gproj.activate_sdpa_registry(strict="yes")
    assert attention.current_flash_attention_impl() is None


def test_missing_registry_is_named_with_the_torch_version(monkeypatch):
    monkeypatch.delattr(torch.nn.attention, "activate_flash_attention_impl")
    missing = R.missing_api()
    assert missing == (f"torch {torch.__version__} has no flash-attention registry "
                       f"(torch.nn.attention.activate_flash_attention_impl missing)")
    with pytest.raises(RuntimeError, match=r"registry mode is unavailable: torch .*activate_flash_attention_impl missing\)"):
        lightning_gproj.activate_sdpa_registry()
    assert not R.active()


def test_schema_mismatch_is_detected(monkeypatch):
    """A torch whose op takes other arguments than the kernels: missing_api says so (nothing registers)."""
    def renamed(query, key, value, dropout_p=0.0, causal=False, return_debug_mask=False, *, scale=None):
        raise AssertionError("never called")

    monkeypatch.setattr(R, "flash_forward", renamed)
    missing = R.missing_api()
    assert missing is not None and "aten::_scaled_dot_product_flash_attention has arguments" in missing
    assert "'is_causal'" in missing and "'causal'" in missing


# ------------------------------------------------------------------------------------------ aten contract


def test_kernels_follow_torchs_declared_schema():
    """Argument names, order, keyword-only split and defaults as torch declares them; as many returns."""
    for op, fn in ((torch.ops.aten._scaled_dot_product_flash_attention, R.flash_forward),
                   (torch.ops.aten._scaled_dot_product_flash_attention_backward, R.flash_backward)):
        schema = op.default._schema
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params] == [a.name for a in schema.arguments]
        assert [p.kind is p.KEYWORD_ONLY for p in params] == [a.kwarg_only for a in schema.arguments]
        for p, a in zip(params, schema.arguments):
            if a.has_default_value():
                assert p.default == a.default_value, p.name
    assert len(torch.ops.aten._scaled_dot_product_flash_attention.default._schema.returns) == 9
    assert len(torch.ops.aten._scaled_dot_product_flash_attention_backward.default._schema.returns) == 3


@pytest.mark.parametrize("layout", ["bhsd", "bshd_view"])
@pytest.mark.parametrize("causal", [False, True])
def test_outputs_match_torchs_meta_kernel(layout, causal):
    """Shapes, dtypes and strides of every returned value as torch's meta kernels declare them (what
    torch.compile assumes): output like query, lse (B, H, N) fp32, Philox placeholders (2,) and () uint64,
    empty debug mask, max_q / max_k; gradients like their inputs."""
    q, k, v, do = _inputs()
    if layout == "bshd_view":  # as models make them: (batch, seqlen, heads, dim) memory seen as SDPA layout
        q, k, v, do = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, do))
    meta = [x.to("meta") for x in (q, k, v, do)]
    declared = torch.ops.aten._scaled_dot_product_flash_attention(*meta[:3], 0.0, causal, scale=0.2)
    ours = R.flash_forward(q, k, v, 0.0, causal, scale=0.2)
    assert len(ours) == len(declared) == 9
    for mine, theirs in zip(ours, declared):
        if isinstance(theirs, torch.Tensor):
            assert (mine.shape, mine.dtype, mine.stride()) == (theirs.shape, theirs.dtype, theirs.stride())
            assert mine.device == q.device
        else:
            assert mine == theirs  # None, None, max_q, max_k
    assert ours[1].shape == (2, 4, 24) and ours[1].dtype == torch.float32
    assert not ours[6].any() and not ours[7].any() and ours[8].numel() == 0
    declared_g = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        meta[3], *meta[:3], declared[0], declared[1], None, None, 24, 24, 0.0, causal, declared[6], declared[7], scale=0.2)
    grads = R.flash_backward(do, q, k, v, ours[0], ours[1], None, None, 24, 24, 0.0, causal, ours[6], ours[7], scale=0.2)
    for mine, theirs in zip(grads, declared_g):
        assert (mine.shape, mine.dtype, mine.stride()) == (theirs.shape, theirs.dtype, theirs.stride())


# ------------------------------------------------------------------------------------------ numerics


CASES = [  # (b, h, hk, nq, nk, d), causal, scale
    ((2, 4, 2, 24, 24, 32), True, None),
    ((1, 2, 2, 16, 20, 32), False, 0.3),
]


@pytest.mark.parametrize("fix", FIXES)
@pytest.mark.parametrize("case", CASES, ids=["causal_gqa", "cross_scale"])
def test_kernels_equal_gproj_attn_func_and_match_fp64(case, fix):
    shape, causal, scale = case
    q, k, v, do = _inputs(*shape)
    tau = scale if scale is not None else shape[-1] ** -0.5
    R._SETTINGS = R._Settings(fix=fix)
    out = R.flash_forward(q, k, v, 0.0, causal, scale=scale)
    grads = R.flash_backward(do, q, k, v, out[0], out[1], None, None, shape[3], shape[4], 0.0, causal, out[6], out[7],
                             scale=scale)
    expected = _gproj(q, k, v, do, causal, scale, fix)
    for name, mine, theirs in zip(("o", "dq", "dk", "dv"), (out[0], *grads), expected):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name
    reference = _fp64(q, k, v, do, causal, tau)
    for name, mine, ref in zip(("o", "dq", "dk", "dv"), (out[0], *grads), reference):
        assert _rel(mine, ref) <= 2e-2, name
    lse64 = _lse_fp64(q, k, tau, causal)
    assert (out[1].double() - lse64).abs().max().item() <= 1e-5 * lse64.abs().max().item()


@pytest.mark.parametrize("fix", ["none", "gproj"])
def test_dropout_is_served_with_gprojs_philox_state(fix, monkeypatch):
    """dropout_p > 0: flash_forward draws the op's seed (after the same torch.manual_seed, o and the
    gradients equal gproj_attn_func(dropout_p=...) bit for bit, which tests/test_dropout.py checks
    against float64 with the same mask) and returns it as philox_seed = (seed, offset), (2,) uint64,
    from which flash_backward regenerates the mask. A dropout backward with an lse that is not
    flash_forward's (its forward ran FA2) runs PyTorch's flash backward."""
    q, k, v, do = _inputs()
    R._SETTINGS = R._Settings(fix=fix)
    torch.manual_seed(11)
    out = R.flash_forward(q, k, v, 0.2, True)
    assert out[6].shape == (2,) and out[6].dtype == torch.uint64 and out[7].shape == () and out[7].dtype == torch.uint64
    grads = R.flash_backward(do, q, k, v, out[0], out[1], None, None, 24, 24, 0.2, True, out[6], out[7])
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    torch.manual_seed(11)
    o = lightning_gproj.gproj_attn_func(*leaves, causal=True, fix=fix, layout="bhsd", dropout_p=0.2)
    o.backward(do)
    for name, mine, theirs in zip(("o", "dq", "dk", "dv"), (out[0], *grads), (o, *(x.grad for x in leaves))):
        assert torch.equal(mine, theirs), name
    assert not torch.equal(out[0], R.flash_forward(q, k, v, 0.0, True)[0])  # the mask did drop
    native = []
    monkeypatch.setattr(R, "_native_backward", lambda *args: native.append(args) or "native")
    assert R.flash_backward(do, q, k, v, out[0], out[1].clone(), None, None, 24, 24, 0.2, True, out[6], out[7]) == "native"
    assert len(native) == 1


def test_backward_rebuilds_row_stats_from_a_foreign_lse():
    """An lse that is not flash_forward's (PyTorch's own, a copy) still gives the right gradients."""
    q, k, v, do = _inputs()
    out = R.flash_forward(q, k, v, 0.0, True)
    exact = R.flash_backward(do, q, k, v, out[0], out[1], None, None, 24, 24, 0.0, True, out[6], out[7])
    lse = out[1].clone()
    assert lse.untyped_storage().nbytes() == lse.numel() * 4
    rebuilt = R.flash_backward(do, q, k, v, out[0], lse, None, None, 24, 24, 0.0, True, out[6], out[7])
    reference = _fp64(q, k, v, do, True, 32 ** -0.5)
    for mine, theirs, ref in zip(rebuilt, exact, reference[1:]):
        assert _rel(mine, ref) <= 2e-2
        assert _rel(mine, theirs) <= 2e-2


def test_aten_op_autograd_runs_the_kernels(recorder_off):
    """torch's own autograd formula of the SDPA flash op (saving lse, calling the backward op) with the
    kernels installed for the CPU key: the result is gproj_attn_func's, the counts move, and the health
    statistics are recorded under "sdpa_registry"."""
    q, k, v, do = _inputs()
    expected = _gproj(q, k, v, do, True, None, "gproj")
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    before = R.CALLS.snapshot()
    RECORDER.enabled = True
    with cpu_kernels():
        out = torch.ops.aten._scaled_dot_product_flash_attention(*leaves, 0.0, True)
        out[0].backward(do)
    RECORDER.enabled = False
    assert R.CALLS.snapshot() == (before[0] + 1, before[1] + 1, before[2])
    for mine, theirs in zip((out[0], *(x.grad for x in leaves)), expected):
        assert torch.equal(mine, theirs)
    stats = RECORDER.drain()["sdpa_registry"]
    assert 0 < stats["violation_median"] <= stats["violation_max"] < 1 and stats["mean_key_norm"] > 10


@pytest.mark.parametrize("fix", ["gproj", "none"])
def test_sdpa_call_on_cpu_dispatches_to_gproj(fix):
    """A real F.scaled_dot_product_attention call (causal, GQA through enable_gqa) reaches the kernels."""
    q, k, v, do = _inputs()
    expected = _gproj(q, k, v, do, True, None, fix)
    plain = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*plain, is_causal=True, enable_gqa=True).backward(do)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    before = R.CALLS.snapshot()
    R._SETTINGS = R._Settings(fix=fix)
    with cpu_sdpa_through_gproj():
        o = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        o.backward(do)
    assert R.CALLS.snapshot()[:2] == (before[0] + 1, before[1] + 1)
    for mine, theirs in zip((o, *(x.grad for x in leaves)), expected):
        assert torch.equal(mine, theirs)
    # and not what CPU's own flash kernel gives (so the equality above is not vacuous)
    assert not torch.equal(leaves[0].grad, plain[0].grad)


def test_unserved_calls_run_pytorchs_kernel_or_raise_when_strict(monkeypatch):
    q, k, v, _ = _inputs()
    assert R.serve_reason(q, k, v, 1.0) == "dropout_p=1 (GProj takes a probability in [0, 1))"
    assert R.serve_reason(q, k, v, 0.1) is None
    assert R.serve_reason(q, k, v, 0.0, return_debug_mask=True) == "return_debug_mask=True"
    assert R.serve_reason(q.float(), k.float(), v.float(), 0.0) == "dtype torch.float32 (GProj serves fp16 and bf16 here)"
    assert R.serve_reason(q[..., :12], k[..., :12], v[..., :12], 0.0) == "head dim 12 (GProj takes multiples of 8 up to 256)"
    assert R.serve_reason(q, k, v, 0.0) is None
    native = []
    monkeypatch.setattr(R, "_native_forward", lambda *args: native.append(args) or "native")
    monkeypatch.setattr(R, "_warned", set())
    before = R.CALLS.fallbacks["return_debug_mask=True"]
    with pytest.warns(GProjFallbackWarning, match="return_debug_mask=True ran PyTorch's flash kernel"):
        assert R.flash_forward(q, k, v, 0.1, True, True) == "native"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        R.flash_forward(q, k, v, 0.1, True, True)
    assert len(native) == 2 and native[0][3:] == (0.1, True, True, None)
    assert R.CALLS.fallbacks["return_debug_mask=True"] == before + 2
    R._SETTINGS = R._Settings(strict=True)
    with pytest.raises(GProjFallbackError, match="cannot serve a flash-backend call with return_debug_mask=True"):
        R.flash_forward(q, k, v, 0.1, True, True)
    assert len(native) == 2


# ------------------------------------------------------------------------------------------ plugins


class LitSDPA(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 32)
        self.attn = SDPAAttention(is_causal=True)
        self.head = nn.Linear(32, 11)
        self.impl_during_training: list = []

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        self.impl_during_training.append(attention.current_flash_attention_impl())
        logits = self.head(self.attn(self.emb(tokens[:, :-1])))
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 11, (8, 9), generator=g)),
                                           batch_size=4)


def _trainer(plugin, tmp_path, logger=False):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=logger, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, plugins=[plugin])


@pytest.mark.parametrize("door", [GProjPlugin, GProjFabricPlugin])
def test_bad_mode_raises_naming_mode_and_values(door):
    assert MODES == ("swap", "sdpa_registry")
    with pytest.raises(ValueError, match=r"`mode` must be one of \('swap', 'sdpa_registry'\), got 'registry'"):
        door("32-true", mode="registry")
    for attention_dtype in ("fp32", "bf16"):
        with pytest.raises(ValueError, match=f"`attention_dtype='{attention_dtype}'` applies to swapped modules, "
                                             f"and `mode='sdpa_registry'` swaps none"):
            door("32-true", mode="sdpa_registry", attention_dtype=attention_dtype)
    assert door("32-true").mode == "swap"


def test_trainer_registry_mode_activates_for_fit_and_reports(tmp_path, caplog):
    """bf16-mixed on CPU: SDPA's CPU flash ops run GProj's kernels (test adapters); the plugin activated
    torch's registry for the fit only, swapped nothing, and reported the mode and the calls served."""
    from lightning.pytorch.loggers import CSVLogger

    plugin = GProjPlugin("bf16-mixed", fix="none", mode="sdpa_registry")
    module = LitSDPA()
    caplog.set_level("INFO")
    with cpu_sdpa_through_gproj(), warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)  # calls were served: no first-step warning
        trainer = _trainer(plugin, tmp_path, logger=CSVLogger(tmp_path))
        trainer.fit(module)
    assert module.impl_during_training == ["GProj", "GProj"]
    assert attention.current_flash_attention_impl() is None and R._SETTINGS == R._Settings()
    assert isinstance(plugin.report, R.RegistryReport) and plugin.report.swapped == []
    assert not any(hasattr(m, "_gproj_site") for m in module.modules())
    messages = [r.getMessage() for r in caplog.records]
    table = next(m for m in messages if m.startswith("GProj attention (mode='sdpa_registry', fix='none')"))
    assert "impl 'GProj' active" in table and "no module swapped" in table
    calls = next(m for m in messages if m.startswith("GProj attention calls (mode='sdpa_registry'"))
    assert calls == ("GProj attention calls (mode='sdpa_registry', fix='none'): 2 forward and 2 backward "
                     "flash-backend calls served, 0 ran PyTorch's flash kernel")
    logged = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "gproj_calls/sdpa_registry/served" in logged.splitlines()[0]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_registry_mode_warns_once_when_nothing_reached_gproj(precision, tmp_path, caplog):
    """Without the CPU adapters no CPU SDPA call reaches GProj. bf16-mixed: the first step says so;
    32-true: the setup already says why (fp32 tensors), and the first step does not repeat it. The
    summary says it in both."""
    plugin = GProjPlugin(precision, mode="sdpa_registry")
    caplog.set_level("INFO")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(plugin, tmp_path).fit(LitSDPA())
    said = [str(w.message) for w in caught if issubclass(w.category, GProjFallbackWarning)]
    assert len(said) == 1, said
    if precision == "32-true":
        assert said[0].startswith("GProj (mode='sdpa_registry') with precision='32-true': SDPA calls get fp32/fp64")
        assert "'bf16-mixed'" in said[0] and "attention_dtype='bf16'" in said[0]
    else:
        assert "mode='sdpa_registry'): no F.scaled_dot_product_attention call" in said[0]
    calls = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GProj attention calls"))
    assert calls.splitlines()[0].endswith(": 0 forward and 0 backward flash-backend calls served, 0 ran PyTorch's flash kernel")
    assert "no SDPA call reached the flash backend" in calls
    assert attention.current_flash_attention_impl() is None


def test_fabric_registry_mode_activates_at_setup_and_restores_at_teardown():
    plugin = GProjFabricPlugin("32-true", fix="gproj_uniform", mode="sdpa_registry")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup(nn.Sequential(SDPAAttention(is_causal=True)))
    assert attention.current_flash_attention_impl() == "GProj" and R._SETTINGS.fix == "gproj_uniform"
    assert plugin.report.table().startswith("GProj attention (mode='sdpa_registry', fix='gproj_uniform')")
    fabric.setup(model.module)  # a second conversion: still active, one activation
    fabric.strategy.teardown()
    assert attention.current_flash_attention_impl() is None
    assert repr(plugin).endswith("mode='sdpa_registry')")


def test_missing_registry_warns_once_and_keeps_the_module_swap(monkeypatch):
    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl")
    plugin = GProjFabricPlugin("32-true", mode="sdpa_registry")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Sequential(SDPAAttention(is_causal=True))
    with pytest.warns(GProjFallbackWarning) as record:
        fabric.setup(model)
        table = plugin.report.table()
        fabric.setup(model)
    messages = [str(w.message) for w in record if issubclass(w.category, GProjFallbackWarning)]
    assert messages == [
        f"GProj: mode='sdpa_registry' needs torch's flash-attention registry, but torch {torch.__version__} has no "
        f"flash-attention registry (torch.nn.attention.register_flash_attention_impl missing); keeping the module "
        f"swap (mode='swap')."
    ]
    assert isinstance(plugin.report, SwapReport) and [r.module_path for r in plugin.report.swapped] == ["0"]
    assert table.startswith("GProj attention swap (fix='gproj'): 1 swapped, 0 left alone")
    assert table.endswith("mode='sdpa_registry' asked for, but torch's flash-attention registry is missing; the module "
                          "swap\nserves instead")
    assert attention.current_flash_attention_impl() is None
