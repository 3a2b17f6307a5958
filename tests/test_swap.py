"""swap_attention: swapped models match the originals; fallbacks warn once and keep the original.

Tolerances. fp32: the swapped model computes the same attention as SDPA / nn.MultiheadAttention in
fp32 with another summation order, and for fp32 inputs the GProj correction only removes the fp32
rounding residual of each dS row (~1e-7 relative); with O(1) activations, headdim 4 and <= 10 keys
these differences stay at a few ulp, so outputs and gradients agree to 2e-5 of their max-abs value.
fp64: the same argument at double precision gives 1e-12. Fallbacks run the very original code with
the same arguments, so their results are compared bitwise.
"""

from __future__ import annotations

import copy
import functools
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from _attention_models import (
    Block,
    ExternalHelperAttention,
    HelperMethodAttention,
    Projections,
    SDPAAttention,
    TinyModel,
    _external_attention,
    op_spy,  # noqa: F401 (fixture)
    op_keep_mask,
    reference_attn,
    rel_err,
)
from torch.nn.functional import scaled_dot_product_attention as _aliased_sdpa

from lightning_gproj.swap import GProjFallbackError, GProjFallbackWarning, SwapReport, swap_attention, unswap_attention
from lightning_gproj.swap.mha import GProjMultiheadAttention

DTYPES = [pytest.param(torch.float32, 2e-5, id="fp32"), pytest.param(torch.float64, 1e-12, id="fp64")]


def _tril(n_q, n_k, device):  # SDPA bool mask, True = attend; bottom-right aligned
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)


def _forward_backward(model, *inputs):
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    for p in model.parameters():
        p.grad = None
    out = model(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    grads.update({f"input{i}": x.grad.clone() for i, x in enumerate(inputs) if x.grad is not None})
    return out.detach(), grads


def _assert_close(model, swapped, inputs, tol):
    out_ref, grads_ref = _forward_backward(model, *inputs)
    out, grads = _forward_backward(swapped, *inputs)
    assert rel_err(out, out_ref) <= tol, "output"
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert rel_err(grads[name], grads_ref[name]) <= tol, name


def _fallback_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, GProjFallbackWarning)]


# ---------------------------------------------------------------------------------------------- SDPA


SDPA_SERVED = {
    "plain": (dict(), False),
    "is_causal": (dict(is_causal=True), True),
    "causal_bool_mask": (dict(attn_mask=_tril), True),
    "all_true_mask": (dict(attn_mask=lambda n, m, d: torch.ones(1, 1, n, m, dtype=torch.bool, device=d)), False),
    "key_padding_mask_all_true": (dict(attn_mask=lambda n, m, d: torch.ones(2, 1, 1, m, dtype=torch.bool, device=d)), False),
    "scale": (dict(scale=0.3, is_causal=True), True),
    "gqa": (dict(kv_heads=2, enable_gqa=True, is_causal=True), True),
    "explicit_zero_dropout": (dict(dropout_p=0.0), False),
}


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("case", list(SDPA_SERVED))
def test_sdpa_served_matches_original(case, dtype, tol, op_spy):
    kwargs, causal = SDPA_SERVED[case]
    torch.manual_seed(0)
    model = Block(SDPAAttention(32, 4, **kwargs)).to(dtype)
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)
    assert [(r.module_path, r.replacement is not None) for r in report.rows] == [("attn", True)]
    x = torch.randn(2, 8, 32, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        _assert_close(model, swapped, [x], tol)
    assert len(op_spy.calls) == 1
    call = op_spy.calls[0]
    assert call["causal"] is causal and call["fix"] == "gproj" and call["stats_name"] == "attn"
    assert call["q_shape"] == (2, 8, 4, 8)  # (batch, seqlen, nheads, headdim)
    assert call["softmax_scale"] == kwargs.get("scale")
    assert report.sites["attn"].served == 1


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_sdpa_cross_attention_bottom_right_mask(dtype, tol, op_spy):
    # An explicit bool mask with Nq < Nk that is the bottom-right causal mask is served as causal=True;
    # checked against the written-out reference too (independent of SDPA).
    torch.manual_seed(0)
    model = SDPAAttention(32, 4, attn_mask=_tril).to(dtype)
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    x, memory = torch.randn(2, 5, 32, dtype=dtype), torch.randn(2, 9, 32, dtype=dtype)
    _assert_close(model, swapped, [x, memory], tol)
    assert op_spy.calls[0]["causal"] is True and op_spy.calls[0]["k_shape"] == (2, 9, 4, 8)
    q = model.q(x).view(2, 5, 4, 8)
    k, v = model.kv(memory).view(2, 9, 2, 4, 8).unbind(2)
    expected = model.proj(reference_attn(q, k, v, causal=True).reshape(2, 5, 32))
    assert rel_err(swapped(x, memory), expected) <= tol


def _float_causal(n, m, d):
    return torch.zeros(n, m, device=d).masked_fill(~_tril(n, m, d), float("-inf"))


def _key_padding(n, m, d):  # (batch, 1, 1, Nk): batch 0 has its last two keys padded
    mask = torch.ones(2, 1, 1, m, dtype=torch.bool, device=d)
    mask[0, ..., -2:] = False
    return mask


def _random_bool(n, m, d):
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(n, m, generator=g) > 0.5
    mask[:, 0] = True
    return mask.to(d)


def _left_padding(n, m, d):  # batch 0 has its first two keys padded
    mask = torch.ones(2, 1, 1, m, dtype=torch.bool, device=d)
    mask[0, ..., :2] = False
    return mask


def _padding_hole(n, m, d):  # batch 1 has key 3 masked, keys after it visible
    mask = torch.ones(2, 1, 1, m, dtype=torch.bool, device=d)
    mask[1, ..., 3] = False
    return mask


def _no_valid_key(n, m, d):  # batch 0 sees no key at all
    mask = torch.ones(2, 1, 1, m, dtype=torch.bool, device=d)
    mask[0] = False
    return mask


# SDPA key-padding masks served with seqlens_k: name -> (SDPAAttention kwargs, causal, seqlens_k for Nk = 8)
SDPA_PADDED = {
    "key_padding": (dict(attn_mask=_key_padding), False, [6, 8]),
    "key_padding_is_causal": (dict(attn_mask=_key_padding, is_causal=True), True, [6, 8]),
    "causal_and_key_padding_mask": (dict(attn_mask=lambda n, m, d: _key_padding(n, m, d) & _tril(n, m, d)), True, [6, 8]),
    "key_padding_per_query_rows": (dict(attn_mask=lambda n, m, d: _key_padding(n, m, d).expand(2, 1, n, m)), False, [6, 8]),
    "key_padding_broadcast_batch": (dict(attn_mask=lambda n, m, d: (torch.arange(m, device=d) < 3).view(1, 1, 1, m)), False, [3, 3]),
}


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("case", list(SDPA_PADDED))
def test_sdpa_right_key_padding_is_served(case, dtype, tol, op_spy):
    """Right key padding (alone, with is_causal, or as one causal & padding mask) runs the op with
    seqlens_k. No query row is fully masked in these patterns (each batch row keeps >= 1 key and
    causal rows see key 0), so SDPA's output is defined on every row and all rows are compared."""
    kwargs, causal, lengths = SDPA_PADDED[case]
    torch.manual_seed(0)
    model = Block(SDPAAttention(32, 4, **kwargs)).to(dtype)
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)
    x = torch.randn(2, 8, 32, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        _assert_close(model, swapped, [x], tol)
    assert len(op_spy.calls) == 1 and report.sites["attn"].served == 1
    call = op_spy.calls[0]
    assert call["causal"] is causal and call["seqlens_k"].tolist() == lengths


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_sdpa_cross_attention_key_padding(dtype, tol, op_spy):
    torch.manual_seed(0)
    model = SDPAAttention(32, 4, attn_mask=_key_padding).to(dtype)
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    x, memory = torch.randn(2, 5, 32, dtype=dtype), torch.randn(2, 9, 32, dtype=dtype)
    _assert_close(model, swapped, [x, memory], tol)
    assert op_spy.calls[0]["causal"] is False and op_spy.calls[0]["seqlens_k"].tolist() == [7, 9]


SDPA_FALLBACK = {
    "float_mask": (dict(attn_mask=_float_causal), "attn_mask of dtype torch.float32"),
    "left_key_padding": (dict(attn_mask=_left_padding), "key-padding attn_mask that is not right padding"),
    "key_padding_hole": (dict(attn_mask=_padding_hole), "key-padding attn_mask that is not right padding"),
    "key_padding_no_valid_key": (dict(attn_mask=_no_valid_key), "key-padding attn_mask that is not right padding"),
    "arbitrary_bool_mask": (dict(attn_mask=_random_bool), "boolean attn_mask is not the causal mask"),
    "is_causal_nq_ne_nk": (dict(is_causal=True), "is_causal with Nq=5 != Nk=9"),
    "top_left_bool_mask_nq_ne_nk": (dict(attn_mask=lambda n, m, d: torch.ones(n, m, dtype=torch.bool).tril()), "not the causal mask"),
}


@pytest.mark.parametrize("case", list(SDPA_FALLBACK))
def test_sdpa_fallback_warns_once_and_matches_original(case, op_spy):
    kwargs, reason = SDPA_FALLBACK[case]
    torch.manual_seed(0)
    model = SDPAAttention(32, 4, **kwargs)
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 9, 32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.manual_seed(1)  # same dropout pattern for both
            out = swapped(x, memory)
            torch.manual_seed(1)
            assert torch.equal(out, model(x, memory))
    messages = _fallback_warnings(record)
    assert len(messages) == 1, messages
    assert "<root> (SDPAAttention)" in messages[0] and reason in messages[0]
    assert op_spy.calls == []


def test_sdpa_one_dimensional_mask_falls_back_to_the_original_error(op_spy):
    """SDPA refuses a 1-D attn_mask (torch 2.13: IndexError, whatever the values); swapped, the call falls back with
    one warning and the user sees the original's own error, not a result (a new-user pass found such a mask served
    as key padding, 2026-12-03)."""

    class OneD(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.tensor([True] * 4 + [False]))

    q = torch.randn(2, 4, 5, 16)
    with pytest.raises(Exception) as original:
        OneD()(q, q, q)
    swapped = OneD()
    swap_attention(swapped)
    with warnings.catch_warnings(record=True) as record, pytest.raises(type(original.value)) as served:
        warnings.simplefilter("always")
        swapped(q, q, q)
    assert str(served.value) == str(original.value)
    messages = _fallback_warnings(record)
    assert len(messages) == 1 and "attn_mask of shape (5,)" in messages[0], messages
    assert op_spy.calls == []


def _prefix_lm(n, m, d):  # bidirectional over the first 3 positions, causal after them (True above the diagonal)
    i, j = torch.arange(n, device=d)[:, None], torch.arange(m, device=d)[None, :]
    return (j <= i) | (j < 3)


@pytest.mark.parametrize("mask", [_prefix_lm, lambda n, m, d: _prefix_lm(n, m, d) & _key_padding(n, m, d)],
                         ids=["prefix_lm", "prefix_lm_and_key_padding"])
def test_sdpa_mask_true_above_the_diagonal_is_not_served_as_causal(mask, op_spy):
    """A mask that equals causal (& right padding) on and below the diagonal but lets rows see later keys (a prefix-LM
    block), without is_causal, is not causal attention: it falls back with one warning and the output is SDPA's,
    which differs from causal attention's here (issue found by a new-user pass, 2026-12-02)."""
    torch.manual_seed(0)
    model = SDPAAttention(32, 4, attn_mask=mask)
    causal = SDPAAttention(32, 4, is_causal=True)
    causal.load_state_dict(model.state_dict())
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    x = torch.randn(2, 8, 32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = swapped(x)
        out2 = swapped(x)
    messages = _fallback_warnings(record)
    assert len(messages) == 1 and "not the causal mask" in messages[0], messages
    assert op_spy.calls == []
    assert torch.equal(out, model(x)) and torch.equal(out2, out)
    assert (out - causal(x)).abs().max() > 1e-2  # the two attentions really differ on these inputs


def test_sdpa_dropout_is_served(op_spy):
    """SDPA with dropout_p > 0 runs the op with that dropout_p (no fallback): the output equals the
    written-out attention with the mask the op draws after the same torch.manual_seed; dropout_p = 1
    (outside [0, 1)) falls back."""
    torch.manual_seed(0)
    model = SDPAAttention(32, 4, dropout_p=0.5, is_causal=True)
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)
    x = torch.randn(2, 6, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        torch.manual_seed(3)
        out = swapped(x)
    assert op_spy.calls[0]["dropout_p"] == 0.5 and report.sites[""].served == 1
    q = model.q(x).view(2, 6, 4, 8)
    k, v = model.kv(x).view(2, 6, 2, 4, 8).unbind(2)
    keep = op_keep_mask(3, 0.5, 2, 4, 6, 6)
    expected = model.proj(reference_attn(q, k, v, causal=True, dropout_p=0.5, keep=keep).reshape(2, 6, 32))
    assert rel_err(out, expected) <= 1e-5
    one = SDPAAttention(32, 4, dropout_p=1.0)
    swap_attention(one)
    with pytest.warns(GProjFallbackWarning, match=r"dropout_p=1.0 \(the op takes a probability in \[0, 1\)\)"):
        one(x)


def test_sdpa_dropout_rounding_warns_once_per_call_not_twice(op_spy):
    """dropout_p = 0.01, which the 8-bit keep test applies as 3/256: one swapped SDPA call gives exactly one
    "applied as" warning (the op's own), not a second one from the swap's pre-check of dropout_p, and the call is
    still served with dropout_p = 0.01."""
    torch.manual_seed(0)
    model = SDPAAttention(32, 4, dropout_p=0.01, is_causal=True)
    report = swap_attention(model)
    x = torch.randn(2, 6, 32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(x)
    said = [str(w.message) for w in seen if "is applied as" in str(w.message)]
    assert said == [said[0]] and f"dropout_p=0.01 is applied as {3 / 256:g}" in said[0], said
    assert op_spy.calls[0]["dropout_p"] == 0.01 and report.sites[""].served == 1


def test_mha_dropout_is_served_while_training(op_spy):
    """nn.MultiheadAttention(dropout=p): training calls run the op with dropout_p = p (no fallback) and
    equal the written-out attention with the op's mask; eval calls pass dropout_p = 0."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True, dropout=0.25)
    model = nn.Sequential()
    model.add_module("mha", mha)
    swap_attention(model)
    x = torch.randn(2, 6, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        torch.manual_seed(5)
        out, _ = model.mha(x, x, x, need_weights=False)
        model.eval()
        model.mha(x, x, x, need_weights=False)
    assert [c.get("dropout_p", 0.0) for c in op_spy.calls] == [0.25, 0.0]
    q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).view(2, 6, 3, 4, 8).unbind(2)
    keep = op_keep_mask(5, 0.25, 2, 4, 6, 6)
    expected = F.linear(reference_attn(q, k, v, dropout_p=0.25, keep=keep).reshape(2, 6, 32), mha.out_proj.weight,
                        mha.out_proj.bias)
    assert rel_err(out, expected) <= 1e-5


def test_fallback_on_head_dims_the_op_does_not_take(op_spy):
    torch.manual_seed(0)
    model = nn.ModuleDict({"sdpa": SDPAAttention(16, 4, is_causal=True), "mha": nn.MultiheadAttention(12, 3)})
    plain = copy.deepcopy(model)
    swap_attention(model)
    x = torch.randn(2, 5, 16)
    with pytest.warns(GProjFallbackWarning, match=r"sdpa \(SDPAAttention\).*headdim 4 \(the op takes multiples of 8"):
        assert torch.equal(model["sdpa"](x), plain["sdpa"](x))
    y = torch.randn(5, 2, 12)
    with pytest.warns(GProjFallbackWarning, match=r"mha \(nn.MultiheadAttention\).*headdim 4"):
        assert torch.equal(model["mha"](y, y, y, need_weights=False)[0], plain["mha"](y, y, y, need_weights=False)[0])
    assert op_spy.calls == []


def test_sdpa_fallback_on_3d_inputs(op_spy):
    class ThreeD(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    model = nn.Sequential()
    model.add_module("inner", ThreeD())
    swap_attention(model)
    q, k, v = torch.randn(3, 3, 5, 4).unbind(0)
    with pytest.warns(GProjFallbackWarning, match=r"inner \(ThreeD\).*not 4-D"):
        assert torch.equal(model.inner(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert op_spy.calls == []


def test_sdpa_fp32_and_bf16_inputs_under_autocast_are_served(op_spy):
    # Rotary embeddings in fp32 leave q, k fp32 next to a bf16 v; autocast casts all three to bf16
    # for SDPA, and the op does the same. Both then compute in bf16 (8-bit mantissa, 4e-3 per
    # rounding) with different rounding points, so they agree to 2e-2 of the max-abs value.
    class Attend(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    model = Attend()
    swap_attention(model)
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 4, 6, 8).unbind(0)
    v = torch.randn(2, 4, 6, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        out = model(q, k, v)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert rel_err(out.float(), ref.float()) <= 2e-2
    assert [(c["dtypes"], c["autocast"]) for c in op_spy.calls] == [((torch.float32, torch.float32, torch.bfloat16), True)]


def test_sdpa_helper_method_is_detected(op_spy):
    torch.manual_seed(0)
    model = Block(HelperMethodAttention(32, 4))
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)
    assert [r.module_path for r in report.swapped] == ["attn"]
    _assert_close(model, swapped, [torch.randn(2, 6, 32)], 2e-5)
    assert [c["causal"] for c in op_spy.calls] == [True]


class AliasedSDPAAttention(Projections):
    """Calls SDPA under another name: ``from torch.nn.functional import scaled_dot_product_attention as …``."""

    def forward(self, x, memory=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x)
        return self.proj(_aliased_sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_sdpa_imported_under_another_name_is_detected(op_spy, dtype, tol):
    """A module whose code calls SDPA through an alias of the function (its name not in the code) is found by the
    global the name is bound to, swapped and served: as the unswapped module to fp32 / fp64 rounding."""
    torch.manual_seed(0)
    model = Block(AliasedSDPAAttention(32, 4)).to(dtype)
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)
    assert [r.module_path for r in report.swapped] == ["attn"]
    _assert_close(model, swapped, [torch.randn(2, 6, 32, dtype=dtype)], tol)
    assert [c["causal"] for c in op_spy.calls] == [True]


class _AliasNamedBlock(nn.Module):
    """A block whose child attribute is spelled like a module-level alias of SDPA (``_aliased_sdpa``): its code
    names it only as an attribute (``self._aliased_sdpa``), and never calls SDPA itself."""

    def __init__(self):
        super().__init__()
        self._aliased_sdpa = SDPAAttention(32, 4)

    def forward(self, x):
        return x + self._aliased_sdpa(x)


def test_attribute_spelled_like_an_sdpa_alias_is_not_a_call(op_spy):
    """Only a global load of a name bound to SDPA counts as calling it: a parent whose code reads an attribute
    spelled like the alias is not a target, so its mode does not serve the SDPA calls of an excluded child."""
    torch.manual_seed(0)
    model = nn.Sequential(_AliasNamedBlock(), _AliasNamedBlock())
    report = swap_attention(model, exclude="0._aliased_sdpa")
    assert [r.module_path for r in report.swapped] == ["1._aliased_sdpa"]
    model(torch.randn(2, 6, 32))
    assert [c["stats_name"] for c in op_spy.calls] == ["1._aliased_sdpa"]


_partial_sdpa = functools.partial(F.scaled_dot_product_attention, is_causal=True)


def _closure_attention_class():
    attend = F.scaled_dot_product_attention  # a local of the enclosing function: a closure variable of forward

    class ClosureSDPA(Projections):
        def forward(self, x, memory=None):
            b, n, _ = x.shape
            q, k, v = self.qkv(x)
            return self.proj(attend(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1))

    return ClosureSDPA


class PartialSDPA(Projections):
    def forward(self, x, memory=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x)
        return self.proj(_partial_sdpa(q, k, v).transpose(1, 2).reshape(b, n, -1))


class ClassAttributeSDPA(Projections):
    attend = staticmethod(F.scaled_dot_product_attention)

    def forward(self, x, memory=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x)
        return self.proj(self.attend(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1))


class DefaultArgumentSDPA(Projections):
    def forward(self, x, memory=None, attend=F.scaled_dot_product_attention):
        b, n, _ = x.shape
        q, k, v = self.qkv(x)
        return self.proj(attend(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("make", [PartialSDPA, _closure_attention_class(), ClassAttributeSDPA, DefaultArgumentSDPA],
                         ids=["partial", "closure", "class_attribute", "default_argument"])
def test_sdpa_held_by_a_partial_closure_class_attribute_or_default_is_detected(op_spy, make):
    """SDPA reached without its name or a global alias in the code is found (before: only catch_all=True served
    these), swapped and served as the unswapped module computes it, in float64."""
    torch.manual_seed(0)
    model = Block(make(32, 4)).double()
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)
    assert [r.module_path for r in report.swapped] == ["attn"]
    _assert_close(model, swapped, [torch.randn(2, 6, 32, dtype=torch.float64)], 1e-12)
    assert [c["causal"] for c in op_spy.calls] == [True]


class ParentCallingSDPA(Projections):
    """Calls SDPA itself and holds a child attention module that calls SDPA too."""

    def __init__(self, dim=32, heads=4):
        super().__init__(dim, heads)
        self.inner = Block(SDPAAttention(dim, heads, is_causal=True))

    def forward(self, x, memory=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x)
        y = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))
        return self.inner(y)


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_excluded_child_of_a_swapped_sdpa_module_keeps_the_original(op_spy, dtype, tol):
    """The parent's TorchFunctionMode sees every SDPA call inside its forward: an excluded child's call must still
    run the original SDPA (before, it was served under the parent's name), without a catch-all."""
    torch.manual_seed(0)
    model = ParentCallingSDPA().to(dtype)
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped, exclude="inner")
    assert [r.module_path for r in report.swapped] == [""]
    assert ("inner", "excluded by pattern 'inner'; SDPA calls inside keep the original") in [
        (r.module_path, r.reason) for r in report.left_alone]
    _assert_close(model, swapped, [torch.randn(2, 6, 32, dtype=dtype)], tol)
    assert [c["causal"] for c in op_spy.calls] == [False]  # the parent's call only (the child's is causal)
    assert unswap_attention(swapped) == 2 and "forward" not in vars(swapped.inner)


def test_catch_all_serves_external_helpers_and_respects_exclude(op_spy):
    torch.manual_seed(0)
    model = nn.Sequential(Block(ExternalHelperAttention(32, 4)), Block(ExternalHelperAttention(32, 4)))
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)  # module-level helper: invisible without catch_all
    assert report.rows == []
    assert "no attention found" in report.table()
    swapped(torch.randn(1, 4, 32))
    assert op_spy.calls == []

    report = swap_attention(swapped, catch_all=True, exclude="1")
    assert [(r.module_path, r.replacement is not None) for r in report.rows] == [("0.attn", True), ("", True), ("1", False)]
    assert report.rows[0].reason == "attention by class name"
    assert "excluded by pattern '1'" in report.rows[2].reason
    x = torch.randn(2, 6, 32)
    _assert_close(model, swapped, [x], 2e-5)
    assert [c["stats_name"] for c in op_spy.calls] == ["0.attn"]  # block 0 only, named after its attention


def test_catch_all_names_other_calls_after_the_topmost_module(op_spy):
    class Mixer(nn.Module):  # no "attention" in the class name: calls carry the root's name
        def __init__(self):
            super().__init__()
            self.inner = ExternalHelperAttention(32, 4)

        def forward(self, x):
            q, k, v = self.inner.qkv(x)
            return self.inner.proj(_external_attention(q, k, v).transpose(1, 2).flatten(2))

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("mixer", Mixer())
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped, include="mixer", catch_all=True)
    assert [(r.module_path, r.original) for r in report.rows] == [
        ("mixer.inner", "ExternalHelperAttention: SDPA calls from helpers"), ("mixer", "Mixer: any other SDPA call inside")]
    _assert_close(model, swapped, [torch.randn(2, 6, 32)], 2e-5)
    assert [c["stats_name"] for c in op_spy.calls] == ["mixer"]


def test_catch_all_keeps_left_alone_mha_and_mha_fallbacks_original(op_spy):
    # nn.MultiheadAttention calls SDPA internally; a catch-all must not serve that call for an MHA that
    # was left alone (add_bias_kv) or that fell back (key_padding_mask).
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "kept": nn.MultiheadAttention(32, 4, add_bias_kv=True, batch_first=True),
        "swapped": nn.MultiheadAttention(32, 4, batch_first=True),
    })
    plain = copy.deepcopy(model)
    swap_attention(model, catch_all=True)
    assert not isinstance(model["kept"], GProjMultiheadAttention)
    x = torch.randn(2, 5, 32)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[:, 0] = True  # left padding: falls back
    for name, kwargs in [("kept", {}), ("swapped", dict(key_padding_mask=kpm))]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GProjFallbackWarning)
            out = model[name](x, x, x, need_weights=False, **kwargs)[0]
        assert torch.equal(out, plain[name](x, x, x, need_weights=False, **kwargs)[0])
    assert op_spy.calls == []


# ----------------------------------------------------------------------------------------------- MHA


def _causal_float(n):
    return nn.Transformer.generate_square_subsequent_mask(n)


MHA_SERVED = {
    "plain": (dict(), False),
    "causal_hint": (dict(attn_mask=lambda n: _causal_float(n), is_causal=True), True),
    "causal_float_mask": (dict(attn_mask=lambda n: _causal_float(n)), True),
    "causal_bool_mask": (dict(attn_mask=lambda n: torch.ones(n, n, dtype=torch.bool).triu(1)), True),
}


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("case", list(MHA_SERVED))
@pytest.mark.parametrize("inputs", ["self", "cross", "unbatched"])
def test_mha_served_matches_original(case, batch_first, inputs, dtype, tol, op_spy):
    kwargs, causal = MHA_SERVED[case]
    torch.manual_seed(0)
    model = nn.MultiheadAttention(32, 4, batch_first=batch_first, dropout=0.1).to(dtype).eval()
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)
    assert isinstance(swapped, GProjMultiheadAttention)
    assert report.rows[0].replacement.startswith("GProjMultiheadAttention")
    n = 6
    shape = (n, 32) if inputs == "unbatched" else ((2, n, 32) if batch_first else (n, 2, 32))
    query = torch.randn(shape, dtype=dtype)
    memory = torch.randn(shape, dtype=dtype) if inputs == "cross" else query
    kwargs = {k: (v(n).to(dtype) if callable(v) and k == "attn_mask" and case != "causal_bool_mask" else v(n) if callable(v) else v) for k, v in kwargs.items()}

    class Call(nn.Module):  # fixes the keyword arguments, passes the same tensor thrice for self-attention
        def __init__(self, mha):
            super().__init__()
            self.mha = mha

        def forward(self, q, m):
            m = q if inputs != "cross" else m
            return self.mha(q, m, m, need_weights=False, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        _assert_close(Call(model), Call(swapped), [query, memory], tol)
    assert len(op_spy.calls) == 1
    assert op_spy.calls[0]["causal"] is causal and op_spy.calls[0]["stats_name"] == "<root>"  # the swapped root, as its fallbacks name it
    assert op_spy.calls[0]["q_shape"] == (1 if inputs == "unbatched" else 2, n, 4, 8)


def test_mha_without_bias_is_served(op_spy):
    torch.manual_seed(0)
    model = nn.MultiheadAttention(32, 2, bias=False)  # headdim 16, sequence-first
    swapped = copy.deepcopy(model)
    swap_attention(swapped)

    class Call(nn.Module):
        def __init__(self, mha):
            super().__init__()
            self.mha = mha

        def forward(self, x, memory):
            return self.mha(x, memory, memory, need_weights=False)

    _assert_close(Call(model), Call(swapped), [torch.randn(5, 3, 32), torch.randn(7, 3, 32)], 2e-5)
    assert [(c["q_shape"], c["k_shape"], c["causal"]) for c in op_spy.calls] == [((3, 5, 2, 16), (3, 7, 2, 16), False)]


def test_mha_key_padding_mask_that_masks_nothing_is_served(op_spy):
    torch.manual_seed(0)
    model = nn.MultiheadAttention(32, 4, batch_first=True)
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    x = torch.randn(2, 6, 32)
    for kpm in (torch.zeros(2, 6, dtype=torch.bool), torch.zeros(2, 6)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", GProjFallbackWarning)
            out = swapped(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
        assert rel_err(out, model(x, x, x, key_padding_mask=kpm, need_weights=False)[0]) <= 2e-5
    assert len(op_spy.calls) == 2


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("inputs", ["self_causal", "self", "cross", "unbatched"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_mha_right_key_padding_is_served(inputs, batch_first, dtype, tol, mask_dtype, op_spy):
    """A key_padding_mask that masks a suffix of each row's keys — boolean (True = ignore) or float (0 = keep,
    -inf = ignore, added to the scores) — runs the op with seqlens_k, alone or with the causal mask. Every query row
    keeps >= 1 visible key (padded query rows of self-attention too), so all rows are compared."""
    torch.manual_seed(0)
    model = nn.MultiheadAttention(32, 4, batch_first=batch_first).to(dtype).eval()
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    n, s = 6, (9 if inputs == "cross" else 6)
    batch = 1 if inputs == "unbatched" else 2
    kpm = torch.arange(s)[None, :] >= torch.tensor([s - 2, 1][:batch])[:, None]
    lengths = [s - 2, 1][:batch]
    if inputs == "unbatched":
        kpm = kpm[0]
    if mask_dtype != torch.bool:
        kpm = torch.zeros(kpm.shape, dtype=mask_dtype).masked_fill(kpm, float("-inf"))
    shape = (n, 32) if inputs == "unbatched" else ((2, n, 32) if batch_first else (n, 2, 32))
    mshape = (s, 32) if inputs == "unbatched" else ((2, s, 32) if batch_first else (s, 2, 32))
    query, memory = torch.randn(shape, dtype=dtype), torch.randn(mshape, dtype=dtype)
    extra = dict(attn_mask=torch.ones(n, n, dtype=torch.bool).triu(1)) if inputs == "self_causal" else {}

    class Call(nn.Module):
        def __init__(self, mha):
            super().__init__()
            self.mha = mha

        def forward(self, q, m):
            m = m if inputs == "cross" else q
            return self.mha(q, m, m, key_padding_mask=kpm, need_weights=False, **extra)

    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        _assert_close(Call(model), Call(swapped), [query, memory], tol)
    assert len(op_spy.calls) == 1
    call = op_spy.calls[0]
    assert call["causal"] is (inputs == "self_causal") and call["seqlens_k"].tolist() == lengths



def test_transformer_encoder_layer_with_right_padding_is_served(op_spy):
    """nn.TransformerEncoderLayer turns a boolean src_key_padding_mask into a float one of 0 and -inf before it calls
    its self-attention: still right padding, served with seqlens_k; float64, against the unswapped layer (PyTorch's own
    attention) on the kept positions."""
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).double().eval()
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    kpm = torch.arange(6)[None, :] >= torch.tensor([6, 3])[:, None]
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        out = swapped(x, src_key_padding_mask=kpm)
    ref = model(x, src_key_padding_mask=kpm)
    keep = ~kpm
    assert rel_err(out[keep], ref[keep]) <= 1e-12
    assert len(op_spy.calls) == 1 and op_spy.calls[0]["seqlens_k"].tolist() == [6, 3]

MHA_FALLBACK = {
    "need_weights_default": (dict(), "need_weights=True"),
    "left_key_padding_mask": (dict(need_weights=False, key_padding_mask=torch.tensor([[True] + [False] * 5] * 2)),
                              "key_padding_mask that is not right padding"),
    "float_key_bias": (dict(need_weights=False, key_padding_mask=torch.tensor([[0.0] * 5 + [-1.0]] * 2)),
                       "key_padding_mask that is not right padding"),
    "non_causal_mask": (dict(need_weights=False, attn_mask=torch.eye(6, dtype=torch.bool)), "not the causal mask"),
    # a causal sliding window (not the causal mask) with the is_causal hint and right padding: the original merges the
    # padding into the mask and drops the hint (new-user pass 8: the swap trusted the hint, 62% off, silently)
    "causal_hint_window_mask_key_padding": (dict(
        need_weights=False, is_causal=True,
        attn_mask=(torch.arange(6)[None, :] > torch.arange(6)[:, None]) | (torch.arange(6)[None, :] < torch.arange(6)[:, None] - 2),
        key_padding_mask=torch.arange(6)[None, :] >= torch.tensor([[4], [6]])), "not the causal mask"),
}


@pytest.mark.parametrize("case", list(MHA_FALLBACK))
def test_mha_fallback_warns_once_and_matches_original(case, op_spy):
    kwargs, reason = MHA_FALLBACK[case]
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("mha", nn.MultiheadAttention(32, 4, batch_first=True))
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    x = torch.randn(2, 6, 32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.manual_seed(1)
            out, weights = swapped.mha(x, x, x, **kwargs)
            torch.manual_seed(1)
            out_ref, weights_ref = model.mha(x, x, x, **kwargs)
            assert torch.equal(out, out_ref)
            assert (weights is None and weights_ref is None) or torch.equal(weights, weights_ref)
    messages = _fallback_warnings(record)
    assert len(messages) == 1 and "mha (nn.MultiheadAttention)" in messages[0] and reason in messages[0], messages
    assert op_spy.calls == []
    assert swapped.mha._gproj_site.fallbacks[next(iter(swapped.mha._gproj_site.fallbacks))] == 3


def test_mha_causal_hint_in_inference_follows_the_mask_as_the_fast_path_does(op_spy):
    """In eval mode without gradients nn.MultiheadAttention may take its fast path, which applies attn_mask and ignores
    is_causal (review of new-user pass 8's fix): a causal sliding-window mask with the hint falls back there and
    equals the original; with gradients the original trusts the hint, and so does the swap (served, causal)."""
    torch.manual_seed(0)
    model = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    x = torch.randn(2, 10, 32)
    i, j = torch.arange(10)[:, None], torch.arange(10)[None, :]
    window = (j > i) | (j < i - 2)
    kwargs = dict(attn_mask=window, is_causal=True, need_weights=False)
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        out, ref = swapped(x, x, x, **kwargs)[0], model(x, x, x, **kwargs)[0]
    assert torch.equal(out, ref) and op_spy.calls == []
    assert "not the causal mask" in _fallback_warnings(record)[0]
    out = swapped(x, x, x, **kwargs)[0]  # gradients on: the hint is trusted, as the original's slow path does
    plain = model(x, x, x, attn_mask=j > i, need_weights=False)[0]
    assert len(op_spy.calls) == 1 and op_spy.calls[0]["causal"] and rel_err(out, plain) <= 1e-6


@pytest.mark.parametrize(
    "kwargs, reason",
    [(dict(add_bias_kv=True), "add_bias_kv=True"), (dict(add_zero_attn=True), "add_zero_attn=True"),
     (dict(kdim=8, vdim=8), "kdim/vdim (8/8) differ from embed_dim 32")],
)
def test_mha_static_properties_are_left_alone(kwargs, reason):
    model = nn.Sequential(nn.MultiheadAttention(32, 4, **kwargs))
    report = swap_attention(model)
    assert type(model[0]) is nn.MultiheadAttention
    assert report.rows == [("0", "nn.MultiheadAttention", None, reason)]
    assert f"0      | nn.MultiheadAttention | left alone\n    {reason}" in report.table()


def test_transformer_encoder_causal_training_is_served(op_spy):
    # nn.TransformerEncoderLayer calls its MultiheadAttention with need_weights=False (and, with
    # is_causal=True, the causal hint): both layers must run the op, with the same results.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)
    assert [r.module_path for r in report.swapped] == ["layers.0.self_attn", "layers.1.self_attn"]
    mask = nn.Transformer.generate_square_subsequent_mask(7)

    class Causal(nn.Module):
        def __init__(self, encoder):
            super().__init__()
            self.encoder = encoder

        def forward(self, x):
            return self.encoder(x, mask=mask, is_causal=True)

    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        _assert_close(Causal(model), Causal(swapped), [torch.randn(2, 7, 32)], 2e-5)
    assert [(c["stats_name"], c["causal"]) for c in op_spy.calls] == [("layers.0.self_attn", True), ("layers.1.self_attn", True)]


# ------------------------------------------------------------------------ model-level contracts


def test_report_state_dict_include_exclude(op_spy):
    torch.manual_seed(0)
    model = TinyModel()
    keys = list(model.state_dict())
    plain = copy.deepcopy(model)
    report = swap_attention(model)
    assert isinstance(report, SwapReport)
    assert [(r.module_path, r.replacement is not None) for r in report.rows] == [("blocks.0.attn", True), ("blocks.1.attn", True)]
    table = report.table()
    assert "2 swapped, 0 left alone" in table
    assert "blocks.0.attn | SDPAAttention: F.scaled_dot_product_attention | gproj_attn_func(fix='gproj') via TorchFunctionMode" in table
    assert "blocks.1.attn | nn.MultiheadAttention" in table
    assert list(model.state_dict()) == keys
    plain.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(plain.state_dict(), strict=True)

    report = swap_attention(model, include="blocks.1")
    assert [(r.module_path, r.reason) for r in report.left_alone] == [("blocks.0.attn", "not matched by include=['blocks.1']")]
    assert type(model.blocks[0].attn.__dict__.get("forward")) is type(None)
    report = swap_attention(model, exclude=["blocks.1*"], fix="none")
    assert [(r.module_path, r.reason) for r in report.left_alone] == [("blocks.1.attn", "excluded by pattern 'blocks.1*'")]
    assert type(model.blocks[1].attn) is nn.MultiheadAttention
    model(torch.randint(0, 11, (2, 5)))
    assert [(c["stats_name"], c["fix"]) for c in op_spy.calls] == [("blocks.0.attn", "none")]


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_idempotent_and_unswap(dtype, tol, op_spy):
    torch.manual_seed(0)
    model = TinyModel().to(dtype)
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    site = swapped.blocks[0].attn.forward.site
    report = swap_attention(swapped, fix="gproj_uniform")
    wrapper = swapped.blocks[0].attn.forward
    assert wrapper.original is None and wrapper.site is site  # not wrapped twice
    assert type(swapped.blocks[1].attn) is GProjMultiheadAttention
    assert all(r.reason.startswith("already swapped") for r in report.rows)
    assert report.table() == "GProj attention swap (fix='gproj_uniform'): model already converted (2 modules)"
    tokens = torch.randint(0, 11, (2, 7))
    out = swapped(tokens)
    assert [c["fix"] for c in op_spy.calls] == ["gproj_uniform"] * 2
    assert rel_err(out, model(tokens)) <= tol

    assert unswap_attention(swapped) == 2
    assert "forward" not in swapped.blocks[0].attn.__dict__ and type(swapped.blocks[1].attn) is nn.MultiheadAttention
    assert torch.equal(swapped(tokens), model(tokens))
    assert len(op_spy.calls) == 2


def test_swapping_again_with_another_fix_restarts_the_call_counts(op_spy):
    """The calls summary names the current fix; its counts must be of calls under that fix (a second fit with another
    fix used to add its calls to the first one's). The same fix keeps counting."""
    model = TinyModel()
    tokens = torch.randint(0, 11, (2, 7))
    report = swap_attention(model, fix="gproj")
    model(tokens)
    assert [s.served for s in report.sites.values()] == [1, 1]
    again = swap_attention(model, fix="gproj")
    model(tokens)
    assert [s.served for s in again.sites.values()] == [2, 2]
    other = swap_attention(model, fix="none")
    assert [s.served for s in other.sites.values()] == [0, 0]
    model(tokens)
    assert [s.served for s in other.sites.values()] == [1, 1]
    assert other.calls_table().splitlines()[0].startswith("GProj attention calls (fix='none')")


class SharedLayers(nn.Module):
    """ALBERT-style sharing: one SDPA block held as ``shared`` and as ``blocks.0``, run twice; one
    nn.MultiheadAttention held as ``mha`` and as ``blocks.1.attn``, run once."""

    def __init__(self):
        super().__init__()
        self.shared = Block(SDPAAttention(32, 4, is_causal=True))
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.blocks = nn.ModuleList([self.shared, Block(self.mha)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.shared(x)


def test_a_module_at_two_paths_is_swapped_and_reported_once(op_spy):
    """Each module was listed (and counted in the calls summary) once per path it is reachable at."""
    torch.manual_seed(0)
    model = SharedLayers()
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped)
    assert [(r.module_path, r.replacement is not None) for r in report.rows] == [("shared.attn", True), ("mha", True)]
    assert report.aliases == {"shared.attn": ["blocks.0.attn"], "mha": ["blocks.1.attn"]}
    assert list(report.sites) == ["shared.attn", "mha"]
    table = report.table().splitlines()
    assert table[0] == "GProj attention swap (fix='gproj'): 2 swapped, 0 left alone"
    assert table[3].startswith("shared.attn (also: blocks.0.attn) | SDPAAttention: F.scaled_dot_product_attention |")
    _assert_close(model, swapped, [torch.randn(2, 6, 32)], 2e-5)
    assert [c["stats_name"] for c in op_spy.calls] == ["shared.attn", "mha", "shared.attn"]
    assert [(s.served, s.fallback_count) for s in report.sites.values()] == [(2, 0), (1, 0)]
    calls = report.calls_table().splitlines()
    assert calls[0] == "GProj attention calls (fix='gproj'): 2 swapped modules"
    assert [[cell.strip() for cell in line.split(" | ")] for line in calls[3:]] == [
        ["shared.attn (also: blocks.0.attn)", "2", "0"], ["mha (also: blocks.1.attn)", "1", "0"]]

    again = swap_attention(swapped, catch_all=True)  # the catch-all walk too
    assert [(r.module_path, r.reason) for r in again.rows] == [
        ("shared.attn", "already swapped"), ("mha", again.rows[1].reason), ("", "calls are named after this module")]
    assert again.sites["shared.attn"] is report.sites["shared.attn"]


@pytest.mark.parametrize("catch_all", [False, True])
def test_a_module_at_two_paths_is_selected_at_one_and_excluded_at_any(catch_all, op_spy):
    """include may name any of a shared module's paths; exclude at any path leaves it alone (before, each
    path got its own row, and a module swapped at one path was reported left alone at the other)."""
    torch.manual_seed(0)
    model = SharedLayers()
    swapped = copy.deepcopy(model)
    report = swap_attention(swapped, include="blocks.1", catch_all=catch_all)
    rows = [(r.module_path, r.replacement is not None) for r in report.rows if r.module_path in ("shared.attn", "mha")]
    assert rows == [("shared.attn", False), ("mha", True)]
    assert isinstance(swapped.mha, GProjMultiheadAttention)

    report = swap_attention(swapped, exclude="blocks.0", catch_all=catch_all)
    left = [r for r in report.rows if r.module_path == "shared.attn"]
    assert [(r.replacement, r.reason) for r in left] == [(None, "excluded by pattern 'blocks.0' (at blocks.0.attn)")]
    assert "shared.attn" not in report.sites and "blocks.0.attn" not in report.sites
    assert len(report.rows) == len({r.module_path for r in report.rows})
    op_spy.calls.clear()
    _assert_close(model, swapped, [torch.randn(2, 6, 32)], 2e-5)
    assert [c["stats_name"] for c in op_spy.calls] == ["mha"]


def test_activation_checkpointing_recomputes_through_the_op(op_spy):
    torch.manual_seed(0)

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block(SDPAAttention(32, 4, is_causal=True))

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)

    model = Checkpointed()
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    _assert_close(model, swapped, [torch.randn(2, 8, 32)], 2e-5)
    assert [c["stats_name"] for c in op_spy.calls] == ["block.attn", "block.attn"]  # forward + recompute


def test_deepcopy_keeps_the_swap(op_spy):
    model = Block(SDPAAttention(32, 4, is_causal=True))
    swap_attention(model)
    clone = copy.deepcopy(model)
    assert clone.attn.forward.module is clone.attn
    clone(torch.randn(1, 3, 32))
    assert len(op_spy.calls) == 1


def test_bad_arguments():
    model = TinyModel()
    with pytest.raises(ValueError, match=r"`fix` must be one of \('none', 'gproj', 'gproj_uniform'\), got 'pweighted'"):
        swap_attention(model, fix="pweighted")
    with pytest.raises(TypeError, match="`include` must be None, a glob string or a sequence"):
        swap_attention(model, include=3)
    with pytest.raises(TypeError, match="`exclude` must be None"):
        swap_attention(model, exclude=["a", 1])
    # An empty pattern matches the root's path "" and so the whole model: refused, not read as "nothing"
    with pytest.raises(ValueError, match="`include` has an empty pattern"):
        swap_attention(model, include="")
    with pytest.raises(ValueError, match=r"`exclude` has an empty pattern: .* None to exclude nothing, .* got \['blocks\.\*', ''\]"):
        swap_attention(model, exclude=["blocks.*", ""])
    with pytest.raises(TypeError, match="`model` must be a torch.nn.Module"):
        swap_attention(lambda x: x)
    assert "forward" not in model.blocks[0].attn.__dict__


def test_fp32_remediation_keeps_the_key_padding(op_spy):
    """A site with compute_dtype=float32 (the monitors' "fp32" remediation) serves a padded bf16 call
    with SDPA in fp32 under the same causal & padding mask: equal to the original run in fp32."""
    torch.manual_seed(0)
    mask = lambda n, m, d: _key_padding(n, m, d) & _tril(n, m, d)  # noqa: E731
    model = SDPAAttention(32, 4, attn_mask=mask)
    swapped = copy.deepcopy(model).bfloat16()
    report = swap_attention(swapped)
    report.sites[""].compute_dtype = torch.float32
    x = torch.randn(2, 8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        out = swapped(x.bfloat16())
    assert op_spy.calls == [] and report.sites[""].served == 1
    q, k, v = (t.float() for t in swapped.qkv(x.bfloat16()))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask(8, 8, x.device)).bfloat16()
    expected = swapped.proj(expected.transpose(1, 2).reshape(2, 8, 32))
    assert torch.equal(out, expected)


def test_first_conversion_prints_the_full_table():
    model = TinyModel()
    report = swap_attention(model)
    assert not report.reconverted and report.table().startswith("GProj attention swap (fix='gproj'): 2 swapped, 0 left alone\n")
    again = swap_attention(model, exclude="blocks.1*")  # a left-alone row: the full table again
    assert not again.reconverted and "1 swapped, 1 left alone" in again.table() and "already swapped" in again.table()


def _causal_sdpa_site(compute_dtype):
    """A model whose module "attn" calls causal SDPA, swapped, its site set to ``compute_dtype``."""

    class Attend(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    model = nn.Module()
    model.add_module("attn", Attend())
    report = swap_attention(model)
    report.sites["attn"].compute_dtype = compute_dtype
    return model, report


def test_fp32_compute_site_records_the_mean_key_norm():
    """A site running fp32 SDPA (compute_dtype, the plugin's attention_dtype="fp32") still records the
    forward statistics a monitor compares across arms: ‖mean_j k_j‖ averaged over (batch, head)."""
    from lightning_gproj import RECORDER

    model, report = _causal_sdpa_site(torch.float32)
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 6, 8, dtype=torch.float64).unbind(0)  # (batch, nheads, seqlen, d)
    k = k + 5.0
    RECORDER.drain()
    with RECORDER.recording():
        model.attn(q.float(), k.float(), v.float())
    stats = RECORDER.drain()["attn"]
    assert float(stats["mean_key_norm"]) == pytest.approx(k.mean(dim=2).norm(dim=-1).mean().item(), rel=1e-5)
    assert float(stats["mean_query_norm"]) == pytest.approx(q.mean(dim=2).norm(dim=-1).mean().item(), rel=1e-5)


def test_bf16_compute_site_runs_the_op_on_rounded_inputs_and_returns_fp32(op_spy):
    """compute_dtype=bf16 (the plugin's attention_dtype="bf16") on fp32 inputs: the output and the
    gradients are those of attention on the bf16-rounded q, k, v (float64 reference of those rounded
    values, to bf16 accuracy), returned in fp32, and the op saw bf16 tensors."""

    model, report = _causal_sdpa_site(torch.bfloat16)
    torch.manual_seed(0)
    q, k, v, do = torch.randn(4, 2, 3, 40, 16).unbind(0)  # (batch, nheads, seqlen, d), fp32
    k = k + 4.0
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = model.attn(*leaves)
    o.backward(do)
    assert o.dtype == torch.float32 and all(t.grad.dtype == torch.float32 for t in leaves)

    rounded = [t.to(torch.bfloat16).double().requires_grad_() for t in (q, k, v)]
    s = rounded[0] @ rounded[1].transpose(-1, -2) / 4.0
    s = s.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf"))
    o64 = torch.softmax(s, dim=-1) @ rounded[2]
    o64.backward(do.double())
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    assert rel(o, o64) < 8e-3  # bf16 output rounding (2^-8) and P rounding
    for leaf, ref in zip(leaves, rounded):
        assert rel(leaf.grad, ref.grad) < 1.5e-2
    assert [c["dtypes"] for c in op_spy.calls] == [(torch.bfloat16,) * 3]  # the op saw the rounded inputs
    assert report.sites["attn"].served == 1


def test_strict_swap_raises_instead_of_falling_back(op_spy):
    """strict=True: a call a swapped module cannot serve raises GProjFallbackError naming the module and
    the reason (and is counted); calls it can serve still run the op."""

    class FloatMask(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(6, 6))

    model = nn.Module()
    model.add_module("mha", nn.MultiheadAttention(32, 4, batch_first=True))
    model.add_module("sdpa", FloatMask())
    report = swap_attention(model, strict=True)
    x = torch.randn(2, 6, 32)
    with pytest.raises(GProjFallbackError, match=r"^GProj: mha \(nn.MultiheadAttention\) cannot serve this call "
                                                 r"exactly: need_weights=True"):
        model.mha(x, x, x)
    q = torch.randn(2, 4, 6, 8)
    with pytest.raises(GProjFallbackError, match=r"sdpa \(FloatMask\) cannot serve this call exactly: attn_mask of dtype"):
        model.sdpa(q, q, q)
    assert report.sites["mha"].fallback_count == report.sites["sdpa"].fallback_count == 1
    model.mha(x, x, x, need_weights=False)
    assert len(op_spy.calls) == 1
    with pytest.raises(TypeError, match="`strict` must be a bool"):
        swap_attention(model, strict="yes")


@pytest.mark.parametrize("scale", [torch.tensor([0.3]), torch.tensor(0.3), np.float32(0.3), 0.3])
def test_fp32_arm_takes_every_scale_the_op_takes(scale):
    """A site in the fp32 remediation arm runs SDPA itself, which takes a float only: a (1,) tensor scale (the op and
    the swaps' checks take it) raised a TypeError there (review of session 27). Checked against float64 attention."""
    from _fp64 import attention_fp64
    from lightning_gproj.swap._common import Site

    site = Site("m", "Module", "gproj")
    site.compute_dtype = torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 4, 8, generator=g) for _ in range(3))
    o = site.attention(q, k, v, softmax_scale=scale, causal=True)
    want = attention_fp64(q.double(), k.double(), v.double(), torch.zeros(2, 5, 4, 8, dtype=torch.float64), 0.3, True)[0]
    assert torch.allclose(o.double(), want, atol=1e-6)
