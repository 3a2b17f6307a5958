"""flash_attn_func call sites: rebound in the model's module, served by the op, restored on unswap.

flash-attn cannot be installed here, so fake modules ``flash_attn``, ``flash_attn_interface`` and
``flash_attn.cute`` are put in ``sys.modules``; each exports a ``flash_attn_func`` with the real
package's signature, computed by an independent written-out fp32 softmax attention (bottom-right
causal, GQA by repeated heads; not the op, not SDPA). A model module imports it the way models do
(``from flash_attn import flash_attn_func``).

Tolerances (fp32): the op and the written-out attention differ in summation order, and GProj removes
only the fp32 rounding residual of each dS row (~1e-7 relative); with O(1) activations, headdim 8 and
<= 9 keys, outputs and gradients agree to 2e-5 of their max-abs value. Fallbacks run the fake
original with the same arguments, so their results are compared bitwise.
"""

from __future__ import annotations

import copy
import re
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from _attention_models import OpSpy, op_keep_mask, op_spy, reference_attn, rel_err  # noqa: F401 (fixture)
from lightning_gproj.swap import GProjFallbackWarning, swap_attention, unswap_attention
from lightning_gproj.swap.flash_attn import FlashAttnFunc

TOL = 2e-5


def _fa2(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
         alibi_slopes=None, deterministic=False, return_attn_probs=False):
    if dropout_p or alibi_slopes is not None or return_attn_probs:
        # stands for the features the op lacks: a distinct, checkable result
        return torch.zeros_like(q) + 7.0
    return reference_attn(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)


def _fa3(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
         window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
         sm_margin=0, return_attn_probs=False):
    return reference_attn(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)


def _fa4(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False, window_size=(None, None),
         learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, return_lse=False):
    return reference_attn(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)


def _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size=(-1, -1), softcap=0.0):
    """The written-out attention of each packed sequence on its own (zeros where nothing is seen)."""
    out = torch.zeros_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        if cq[b + 1] > cq[b] and ck[b + 1] > ck[b]:
            out[cq[b]:cq[b + 1]] = reference_attn(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]],
                                                  v[None, ck[b]:ck[b + 1]], softmax_scale=softmax_scale, causal=causal,
                                                  window_size=window_size, softcap=softcap)[0]
    return out


def _fa2_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                return_attn_probs=False, block_table=None):
    if dropout_p or block_table is not None:
        return torch.zeros_like(q) + 7.0
    return _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap)


def _fa3_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
                softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
                window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                deterministic=False, sm_margin=0, return_attn_probs=False):
    return _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap)


def _fa4_varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                seqused_k=None, page_table=None, softmax_scale=None, causal=False, window_size=(None, None),
                learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, score_mod=None,
                aux_tensors=None, return_lse=False):
    return _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap)


def _fa3_old(q, k, v, softmax_scale=None, causal=False, deterministic=False):  # returns (out, lse)
    lse = q.new_zeros(q.shape[0], q.shape[2], q.shape[1])  # its value does not matter here
    return reference_attn(q, k, v, softmax_scale=softmax_scale, causal=causal), lse


MODEL_SOURCE = '''
import torch
from torch import nn
from {source} import flash_attn_func as {alias}


class FlashAttention(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2, **kwargs):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.proj = nn.Linear(dim, dim)
        self.kwargs = kwargs

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, -1, self.head_dim).split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        o = {alias}(q, k, v, **self.kwargs){take}
        return self.proj(o.reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.attn = FlashAttention(**kwargs)

    def forward(self, x):
        return x + self.attn(self.norm(x))
'''

VARLEN_MODEL_SOURCE = '''
import torch
from torch import nn
from {source} import flash_attn_varlen_func as {alias}


class PackedAttention(nn.Module):
    """Packed tokens x (total, dim) with cu_seqlens, as a padding-free training loop feeds them."""

    def __init__(self, dim=32, heads=4, kv_heads=2, **kwargs):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.proj = nn.Linear(dim, dim)
        self.kwargs = kwargs

    def forward(self, x, cu_seqlens, max_seqlen):
        q, k, v = self.qkv(x).view(x.shape[0], -1, self.head_dim).split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        if {with_max}:
            o = {alias}(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **self.kwargs)
        else:
            o = {alias}(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, **self.kwargs)
        return self.proj(o.reshape(x.shape[0], -1))
'''


@pytest.fixture
def fake_flash(monkeypatch):
    """Fake flash-attn packages and a factory of model modules importing from them."""
    fa2 = types.ModuleType("flash_attn")
    fa2.flash_attn_func, fa2.flash_attn_varlen_func = _fa2, _fa2_varlen
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func, cute.flash_attn_varlen_func = _fa4, _fa4_varlen
    fa2.cute = cute
    fa3 = types.ModuleType("flash_attn_interface")
    fa3.flash_attn_func, fa3.flash_attn_varlen_func = _fa3, _fa3_varlen
    for name, mod in [("flash_attn", fa2), ("flash_attn.cute", cute), ("flash_attn_interface", fa3)]:
        monkeypatch.setitem(sys.modules, name, mod)

    def model_module(source="flash_attn", alias="flash_attn_func", tag="m", take="", varlen=False, with_max=True):
        name = f"_fake_flash_model_{tag}"
        module = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, module)
        text = (VARLEN_MODEL_SOURCE.format(source=source, alias=alias, with_max=with_max) if varlen
                else MODEL_SOURCE.format(source=source, alias=alias, take=take))
        exec(compile(text, name, "exec"), module.__dict__)
        return module

    return model_module


def _forward_backward(model, x):
    x = x.detach().clone().requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    out = model(x)
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
    return out.detach(), {**{n: p.grad.clone() for n, p in model.named_parameters()}, "x": x.grad.clone()}


SOURCES = {
    "flash_attn": ("flash_attn", "flash_attn_func", _fa2),
    "flash_attn_interface": ("flash_attn_interface", "flash_attn3_func", _fa3),
    "flash_attn.cute": ("flash_attn.cute", "flash_attn_func", _fa4),
}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("source", list(SOURCES))
def test_served_matches_flash_reference_and_restores(source, causal, fake_flash, op_spy):
    pkg, alias, original = SOURCES[source]
    mod = fake_flash(pkg, alias, tag=source.replace(".", "_"))
    torch.manual_seed(0)
    model = nn.Sequential(mod.Block(causal=causal, softmax_scale=0.4), mod.Block(causal=causal))
    swapped = copy.deepcopy(model)
    keys = list(model.state_dict())
    report = swap_attention(swapped)
    assert [r.module_path for r in report.swapped] == ["0.attn", "1.attn"]
    assert report.rows[0].original == f"FlashAttention: {source}.flash_attn_func as {alias}"
    assert f"via rebinding in {mod.__name__}" in report.rows[0].replacement
    assert isinstance(getattr(mod, alias), FlashAttnFunc) and getattr(mod, alias).original is original
    assert list(swapped.state_dict()) == keys

    x = torch.randn(2, 9, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        out, grads = _forward_backward(swapped, x)
    out_ref, grads_ref = _forward_backward(model, x)  # the fake original: the written-out reference
    assert rel_err(out, out_ref) <= TOL
    for name in grads_ref:
        assert rel_err(grads[name], grads_ref[name]) <= TOL, name
    assert [(c["stats_name"], c["causal"], c["softmax_scale"], c["k_shape"]) for c in op_spy.calls] == [
        ("0.attn", causal, 0.4, (2, 9, 2, 8)), ("1.attn", causal, None, (2, 9, 2, 8))]

    assert unswap_attention(swapped) == 2
    assert getattr(mod, alias) is original and "forward" not in vars(swapped[0].attn)
    assert torch.equal(swapped(x), model(x)) and len(op_spy.calls) == 2


FALLBACKS = {
    "dropout_one": (dict(dropout_p=1.0), "dropout_p=1.0 (the op takes a probability in [0, 1))"),
    "bad_window": (dict(window_size=(2.5, 0)), "window_size=(2.5, 0)"),
    "alibi": (dict(alibi_slopes=torch.ones(4)), "alibi_slopes=a tensor of shape (4,)"),
    "probs": (dict(return_attn_probs=True), "return_attn_probs=True"),
    "deterministic_not_bool": (dict(deterministic=1), "deterministic=1"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_unserved_arguments_fall_back_once(case, fake_flash, op_spy):
    kwargs, reason = FALLBACKS[case]
    mod = fake_flash(tag=f"fb_{case}")
    torch.manual_seed(0)
    model = mod.Block(causal=True, **kwargs)
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    x = torch.randn(2, 5, 32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert torch.equal(swapped(x), model(x))
    messages = [str(w.message) for w in record if issubclass(w.category, GProjFallbackWarning)]
    assert len(messages) == 1 and "attn (FlashAttention)" in messages[0] and reason in messages[0], messages
    assert op_spy.calls == [] and swapped.attn.forward.site.fallbacks == {f"flash_attn.flash_attn_func with {reason}": 3}


def test_dropout_is_served(fake_flash, op_spy, monkeypatch):
    """flash_attn_func(dropout_p=0.3) runs the op with dropout_p=0.3 (no fallback): the output is the
    written-out attention with the mask the op draws after the same torch.manual_seed. The varlen
    function passes dropout_p on to gproj_attn_varlen_func."""
    mod = fake_flash(tag="dropout")
    torch.manual_seed(0)
    model = mod.Block(causal=True, dropout_p=0.3)
    swap_attention(model)
    x = torch.randn(2, 5, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        torch.manual_seed(4)
        out = model(x)
    assert op_spy.calls[0]["dropout_p"] == 0.3
    attn = model.attn
    q, k, v = attn.qkv(model.norm(x)).view(2, 5, -1, 8).split([4, 2, 2], dim=2)
    o = reference_attn(q, k, v, causal=True, dropout_p=0.3, keep=op_keep_mask(4, 0.3, 2, 4, 5, 5))
    assert rel_err(out, x + attn.proj(o.reshape(2, 5, -1))) <= TOL

    import lightning_gproj.ops as ops

    varlen_spy = OpSpy(ops.gproj_attn_varlen_func)
    monkeypatch.setattr(ops, "gproj_attn_varlen_func", varlen_spy)
    packed = fake_flash("flash_attn", "flash_attn_varlen_func", tag="vl_dropout", varlen=True).PackedAttention(
        causal=True, dropout_p=0.2)
    swap_attention(packed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        packed(torch.randn(9, 32), torch.tensor([0, 4, 9], dtype=torch.int32), 5)
    assert varlen_spy.calls[0]["dropout_p"] == 0.2


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_is_passed_to_the_op(deterministic, fake_flash, op_spy, monkeypatch):
    """flash_attn_func(deterministic=...) is served and the op gets the flag (True only: False is its default); the
    varlen function passes it to gproj_attn_varlen_func likewise."""
    mod = fake_flash(tag=f"det_{deterministic}")
    torch.manual_seed(0)
    model = mod.Block(causal=True, deterministic=deterministic)
    swap_attention(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        model(torch.randn(2, 5, 32))
    assert len(op_spy.calls) == 1 and op_spy.calls[0].get("deterministic", False) is deterministic

    import lightning_gproj.ops as ops

    varlen_spy = OpSpy(ops.gproj_attn_varlen_func)
    monkeypatch.setattr(ops, "gproj_attn_varlen_func", varlen_spy)
    packed = fake_flash("flash_attn", "flash_attn_varlen_func", tag=f"vl_det_{deterministic}", varlen=True
                        ).PackedAttention(causal=True, deterministic=deterministic)
    swap_attention(packed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        packed(torch.randn(9, 32), torch.tensor([0, 4, 9], dtype=torch.int32), 5)
    assert len(varlen_spy.calls) == 1 and varlen_spy.calls[0].get("deterministic", False) is deterministic


def test_version_returning_lse_is_not_served(fake_flash, monkeypatch, op_spy):
    # an FA3 build whose flash_attn_func always returns (out, lse) and has no return flag
    monkeypatch.setattr(sys.modules["flash_attn_interface"], "flash_attn_func", _fa3_old)
    mod = fake_flash("flash_attn_interface", tag="old", take="[0]")
    torch.manual_seed(0)
    model = mod.Block(causal=True)
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)
    assert report.rows[0].original == "FlashAttention: flash_attn_interface.flash_attn_func as flash_attn_func"
    x = torch.randn(2, 5, 32)
    with pytest.warns(GProjFallbackWarning, match=r"attn \(FlashAttention\).*returns \(out, lse\); the op gives no lse"):
        assert torch.equal(swapped(x), model(x))
    assert op_spy.calls == []


def test_calls_outside_swapped_modules_and_excluded_modules_run_the_original(fake_flash, op_spy):
    mod = fake_flash(tag="scope")
    torch.manual_seed(0)
    model = nn.Sequential(mod.Block(causal=True), mod.Block(causal=True))
    plain = copy.deepcopy(model)
    report = swap_attention(model, exclude="1")
    assert [(r.module_path, r.replacement is not None) for r in report.rows] == [("0.attn", True), ("1.attn", False)]
    x = torch.randn(2, 6, 32)
    assert rel_err(model(x), plain(x)) <= TOL
    assert [c["stats_name"] for c in op_spy.calls] == ["0.attn"]
    q = torch.randn(1, 4, 4, 8)
    assert torch.equal(mod.flash_attn_func(q, q, q), _fa2(q, q, q))  # no swapped module running
    assert len(op_spy.calls) == 1
    other = mod.Block(causal=True)  # a second, unswapped model of the same file keeps the original
    assert torch.equal(other(x), copy.deepcopy(other)(x)) and len(op_spy.calls) == 1


def test_swap_twice_is_idempotent_and_a_second_model_shares_the_binding(fake_flash, op_spy):
    mod = fake_flash(tag="twice")
    torch.manual_seed(0)
    first, second = mod.Block(causal=True), mod.Block(causal=True)
    plain_first, plain_second = copy.deepcopy(first), copy.deepcopy(second)
    swap_attention(first)
    report = swap_attention(first, fix="none")  # undoes the first swap, then swaps again
    assert report.rows[0].reason.startswith("already swapped")
    wrapper = mod.flash_attn_func
    assert isinstance(wrapper, FlashAttnFunc) and wrapper.original is _fa2
    assert first.attn.forward.original is None  # not wrapped twice
    swap_attention(second)
    x = torch.randn(2, 5, 32)
    assert rel_err(first(x), plain_first(x)) <= TOL and rel_err(second(x), plain_second(x)) <= TOL
    assert [(c["stats_name"], c["fix"]) for c in op_spy.calls] == [("attn", "none"), ("attn", "gproj")]
    unswap_attention(first)  # the second model still uses the rebound name
    assert mod.flash_attn_func is wrapper
    unswap_attention(second)
    assert mod.flash_attn_func is _fa2


# (source, kwargs): a causal Mistral-style window, a two-sided one, FA4's None for "unbounded", softcap
# alone and with a window.
WINDOWS = [
    ("flash_attn", dict(causal=True, window_size=(2, 0))),
    ("flash_attn", dict(window_size=(1, 2))),
    ("flash_attn.cute", dict(causal=True, window_size=(3, None))),
    ("flash_attn_interface", dict(softcap=2.0)),
    ("flash_attn", dict(causal=True, window_size=(2, -1), softcap=1.5)),
    # values the op takes besides Python numbers (a new-user pass found them falling back, 2026-12-03)
    ("flash_attn", dict(causal=True, window_size=(np.int64(2), 0), softcap=np.float32(1.5),
                        softmax_scale=torch.tensor(0.3))),
    ("flash_attn_interface", dict(softmax_scale=np.float32(0.3), softcap=torch.tensor(2.0))),
]


@pytest.mark.parametrize("source,kwargs", WINDOWS)
def test_window_and_softcap_are_served(source, kwargs, fake_flash, op_spy):
    """window_size and softcap reach the op (no fallback) and give the written-out attention's
    result and gradients (fp32, the tolerance of the module docstring)."""
    src, alias, _ = SOURCES[source]
    mod = fake_flash(src, alias=alias, tag=f"win_{len(op_spy.calls)}_{abs(hash(str(kwargs)))}")
    torch.manual_seed(0)
    model = mod.Block(**kwargs)
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    x = torch.randn(2, 9, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        out, grads = _forward_backward(swapped, x)
    out_ref, grads_ref = _forward_backward(model, x)
    assert rel_err(out, out_ref) <= TOL
    for name in grads_ref:
        assert rel_err(grads[name], grads_ref[name]) <= TOL, name
    window = tuple(-1 if w is None else w for w in kwargs.get("window_size", (-1, -1)))
    calls = [(c.get("window_size", (-1, -1)), c.get("softcap", 0.0)) for c in op_spy.calls]
    assert calls == [(window, kwargs.get("softcap", 0.0))]
    assert swapped.attn.forward.site.served == 1 and not swapped.attn.forward.site.fallbacks


VARLEN_SOURCES = {
    "flash_attn": ("flash_attn", _fa2_varlen, True),
    "flash_attn_interface": ("flash_attn_interface", _fa3_varlen, True),
    "flash_attn.cute": ("flash_attn.cute", _fa4_varlen, False),  # FA4: max_seqlen left to default (None)
}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("source", list(VARLEN_SOURCES))
def test_varlen_served_matches_flash_reference_and_restores(source, causal, fake_flash, op_spy, monkeypatch):
    """flash_attn_varlen_func of each source is rebound and served by gproj_attn_varlen_func (ragged
    lengths with an empty sequence), gradients matching the written-out per-sequence attention."""
    import lightning_gproj.ops as ops
    from _attention_models import OpSpy

    varlen_spy = OpSpy(ops.gproj_attn_varlen_func)
    monkeypatch.setattr(ops, "gproj_attn_varlen_func", varlen_spy)
    pkg, original, with_max = VARLEN_SOURCES[source]
    mod = fake_flash(pkg, "flash_attn_varlen_func", tag="vl_" + source.replace(".", "_"), varlen=True, with_max=with_max)
    torch.manual_seed(0)
    model = mod.PackedAttention(causal=causal, softmax_scale=0.4)
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)
    assert report.rows[0].original == f"PackedAttention: {source}.flash_attn_varlen_func as flash_attn_varlen_func"
    assert isinstance(mod.flash_attn_varlen_func, FlashAttnFunc) and mod.flash_attn_varlen_func.original is original
    cu = torch.tensor([0, 3, 3, 10, 11], dtype=torch.int32)
    x = torch.randn(11, 32)

    def run(m):
        xx = x.clone().requires_grad_(True)
        for p in m.parameters():
            p.grad = None
        out = m(xx, cu, 7)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
        return out.detach(), {**{n: p.grad.clone() for n, p in m.named_parameters()}, "x": xx.grad.clone()}

    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        out, grads = run(swapped)
    out_ref, grads_ref = run(model)
    assert rel_err(out, out_ref) <= TOL
    for name in grads_ref:
        assert rel_err(grads[name], grads_ref[name]) <= TOL, name
    assert [(c["causal"], c["softmax_scale"], c["k_shape"], c["max_seqlen_q"], c["cu_seqlens_k"].tolist())
            for c in varlen_spy.calls] == [(causal, 0.4, (11, 2, 8), 7, cu.tolist())]
    assert op_spy.calls == []  # the dense op was not used
    assert unswap_attention(swapped) == 1 and mod.flash_attn_varlen_func is original


@pytest.mark.parametrize("kwargs, reason", [
    (dict(dropout_p=-0.1), "dropout_p=-0.1 (the op takes a probability in [0, 1))"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), "block_table=a tensor of shape (2, 1)"),
])
def test_varlen_unserved_arguments_fall_back_once(kwargs, reason, fake_flash, op_spy):
    mod = fake_flash("flash_attn", "flash_attn_varlen_func", tag="vl_fb" + reason[:5], varlen=True)
    torch.manual_seed(0)
    model = mod.PackedAttention(causal=True, **kwargs)
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    x = torch.randn(9, 32)
    with pytest.warns(GProjFallbackWarning, match=re.escape(reason)):
        assert torch.equal(swapped(x, cu, 5), model(x, cu, 5))
    assert swapped.forward.site.fallbacks == {f"flash_attn.flash_attn_varlen_func with {reason}": 1}


# (source, kwargs) of packed calls: a causal Mistral-style window, FA4's None for "unbounded" with softcap,
# a two-sided window with softcap.
VARLEN_WINDOWS = [
    ("flash_attn", dict(causal=True, window_size=(2, 0))),
    ("flash_attn.cute", dict(causal=True, window_size=(3, None), softcap=2.0)),
    ("flash_attn_interface", dict(window_size=(1, 2), softcap=1.5)),
]


@pytest.mark.parametrize("source,kwargs", VARLEN_WINDOWS)
def test_varlen_window_and_softcap_are_served(source, kwargs, fake_flash, monkeypatch):
    """flash_attn_varlen_func with window_size / softcap reaches gproj_attn_varlen_func (no fallback),
    the window within each sequence, and gives the per-sequence written-out attention's result and
    gradients."""
    import lightning_gproj.ops as ops
    from _attention_models import OpSpy

    varlen_spy = OpSpy(ops.gproj_attn_varlen_func)
    monkeypatch.setattr(ops, "gproj_attn_varlen_func", varlen_spy)
    pkg, _, with_max = VARLEN_SOURCES[source]
    mod = fake_flash(pkg, "flash_attn_varlen_func", tag=f"vlw_{abs(hash(str(kwargs)))}", varlen=True,
                     with_max=with_max)
    torch.manual_seed(0)
    model = mod.PackedAttention(softmax_scale=0.4, **kwargs)
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    cu = torch.tensor([0, 3, 3, 10, 11], dtype=torch.int32)
    x = torch.randn(11, 32)

    def run(m):
        xx = x.clone().requires_grad_(True)
        for p in m.parameters():
            p.grad = None
        out = m(xx, cu, 7)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
        return out.detach(), {**{n: p.grad.clone() for n, p in m.named_parameters()}, "x": xx.grad.clone()}

    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        out, grads = run(swapped)
    out_ref, grads_ref = run(model)
    assert rel_err(out, out_ref) <= TOL
    for name in grads_ref:
        assert rel_err(grads[name], grads_ref[name]) <= TOL, name
    window = tuple(-1 if w is None else w for w in kwargs.get("window_size", (-1, -1)))
    assert [(c["window_size"], c["softcap"]) for c in varlen_spy.calls] == [(window, kwargs.get("softcap", 0.0))]
