"""Sliding windows and logit softcapping in the op (reference path on CPU) and the HF swap target.

fp64 ground truth: tests/_fp64.attention_fp64 writes the window mask and the softcap out from
flash-attn's definitions and differentiates through autograd in float64. The Triton kernels are checked
under the interpreter in tests/test_triton_kernels.py::test_window_softcap_kernels.
"""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch

from _attention_models import OpSpy, logits_and_grads, op_spy  # noqa: F401 (fixture)
from _fp64 import attention_fp64
from lightning_gproj import gproj_attn_func
from lightning_gproj.kernels import reference as R


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _inputs(nq=40, nk=40, h=2, hk=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, n, hh, 32, generator=g) for n, hh in ((nq, h), (nk, hk), (nk, hk), (nq, h)))
    return q.bfloat16(), (k + 4.0).bfloat16(), v.bfloat16(), do.bfloat16()


@pytest.mark.parametrize("causal,window,softcap", [
    (True, (8, -1), 0.0), (False, (3, 5), 0.0), (False, (-1, -1), 4.0), (True, (6, -1), 2.0),
])
def test_op_matches_fp64_and_gproj_removes_the_leak(causal, window, softcap):
    q, k, v, do = _inputs(nq=37, nk=45)
    o64, dq64, dk64, dv64, _ = attention_fp64(q, k, v, do, 32**-0.5, causal, window_size=window, softcap=softcap)
    errs = {}
    for fix in R.FIXES:
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        o = gproj_attn_func(qq, kk, vv, causal=causal, fix=fix, window_size=window, softcap=softcap)
        o.backward(do)
        assert _rel(o, o64) <= 4e-3
        errs[fix] = [_rel(x.grad, y) for x, y in ((qq, dq64), (kk, dk64), (vv, dv64))]
        assert all(e <= 5e-3 for e in errs[fix][1:]), (fix, errs)
    assert errs["gproj"][0] <= 3e-3 and errs["gproj"][0] <= 0.4 * errs["none"][0], errs


@pytest.mark.parametrize("key_shift", [0.0, 4.0], ids=["saturating", "rows-saturated-throughout"])
def test_fp16_softcap_where_tanh_saturates_matches_fp64(key_shift):
    """fp16, softcap 1, τ = 1: tanh saturates, X = dZ∘g leaves fp16's normal range and X̃ / g is far from dZ. Every
    fix at fp16 level against float64; before r and the direction skipped those entries GProj's dq / dk were
    10–77% off, and rows saturated throughout (keys shifted by 4) gave a NaN dk."""
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, 32, 2, 32, generator=g) for _ in range(4))
    q, k, v, do = q.half(), (k + key_shift).half(), v.half(), do.half()
    _, dq64, dk64, dv64, _ = attention_fp64(q, k, v, do, 1.0, False, softcap=1.0)
    for fix in R.FIXES:
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        gproj_attn_func(qq, kk, vv, softmax_scale=1.0, softcap=1.0, fix=fix).backward(do)
        errs = [_rel(x.grad, y) for x, y in ((qq, dq64), (kk, dk64), (vv, dv64))]
        assert all(e <= 2e-3 for e in errs), (fix, errs)  # NaN fails this too


def test_softcap_capped_domain_zero_sum_and_no_c2_projection():
    """C1 in the capped domain: the corrected operand X̂ = X̃ − ρ W̃ has Σ_j X̂_ij / g_ij = 0 (from the
    reference's own r and the row sums it reports); C2 is NOT imposed under softcap: the fp32 dk keeps
    the float64 gradient's nonzero key sum, while with a window alone it is projected to ~0."""
    q, k, v, do = _inputs()
    tau = 32**-0.5
    _, _, dk64, _, _ = attention_fp64(q, k, v, do, tau, True, softcap=3.0)
    c2_64 = (dk64.sum(dim=1).norm() / dk64.norm()).item()
    assert c2_64 > 0.05  # softcap: a shared key shift is not invisible
    o, m, l2 = R.forward(q, k, v, tau, True, softcap=3.0)
    dk = R.backward(do, q, k, v, o, m, l2, tau, True, "gproj", grad_dtype=torch.float32, softcap=3.0)[1].double()
    assert abs((dk.sum(dim=1).norm() / dk.norm()).item() - c2_64) <= 0.02 * c2_64
    assert _rel(dk, dk64) <= 5e-3
    # window only: C2 holds in exact arithmetic, and the fp32 dk meets it to fp32 rounding
    o, m, l2 = R.forward(q, k, v, tau, True, window_size=(5, -1))
    dk = R.backward(do, q, k, v, o, m, l2, tau, True, "gproj", grad_dtype=torch.float32, window_size=(5, -1))[1]
    assert (dk.double().sum(dim=1).norm() / dk.double().norm()).item() <= 1e-6

    # C1 in the capped domain, written out from the reference's numerics model (one chunk)
    qh, kh, vh, doh, oh = (x.transpose(1, 2).float().repeat_interleave(2 // x.shape[2], 1) for x in (q, k, v, do, o))
    s = qh @ kh.transpose(-1, -2)
    t = torch.tanh(s * tau / 3.0)
    z = (3.0 * t).masked_fill(torch.ones(40, 40, dtype=torch.bool).tril().logical_not(), float("-inf"))
    p = torch.exp2((z - m[..., None]) * R._LOG2E - l2[..., None])
    p16 = p.bfloat16().float()
    g = 1 - t * t
    ds = p * (doh @ vh.transpose(-1, -2) - (doh * oh).sum(-1, keepdim=True))
    x16 = (ds * g).bfloat16().float()
    w16 = (p16 * g).bfloat16().float()
    r = (x16 / g).sum(-1)
    rho = r / (w16 / g).sum(-1)
    x_hat = x16 - rho[..., None] * w16
    size = (x16 / g).abs().sum(-1)
    rows = size >= 1e-3 * size.max()  # rows whose exact dZ is not (near) zero: one-hot rows are noise
    assert ((x_hat / g).sum(-1).abs() / size)[rows].max() <= 1e-5
    assert ((x16 / g).sum(-1).abs() / size)[rows].max() >= 1e-4  # the rounding broke it


def test_window_size_takes_numpy_integers():
    """A window whose sides come from NumPy (np.int64, np.int32) is served like the Python ints."""
    q, k, v, do = _inputs(nq=37, nk=45)
    o64 = attention_fp64(q, k, v, do, 32**-0.5, False, window_size=(3, 5))[0]
    o = gproj_attn_func(q, k, v, window_size=(np.int64(3), np.int32(5)))
    assert _rel(o, o64) <= 4e-3


def test_rows_without_visible_key_get_zero_not_nan():
    q, k, v, do = _inputs(nq=30, nk=20)
    for window in ((0, 0), (2, 1)):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        o = gproj_attn_func(qq, kk, vv, window_size=window)  # rows i < 10 − right see no key
        o.backward(do)
        empty = torch.arange(30) + (20 - 30) + window[1] < 0
        assert empty.any() and (o[0, empty] == 0).all() and (qq.grad[0, empty] == 0).all()
        assert not any(torch.isnan(x).any() for x in (o, qq.grad, kk.grad, vv.grad))


@pytest.mark.parametrize("kwargs,match", [
    (dict(window_size=(-2, 0)), "window_size"), (dict(window_size=(1.5, 0)), "window_size"),
    (dict(window_size=(1,)), "window_size"), (dict(window_size=(True, 0)), "window_size"),
    (dict(softcap=-1.0), "softcap"), (dict(softcap=float("nan")), "softcap"), (dict(softcap="3"), "softcap"),
])
def test_bad_window_or_softcap_raises(kwargs, match):
    q, k, v, _ = _inputs(nq=8, nk=8)
    with pytest.raises(ValueError, match=match):
        gproj_attn_func(q, k, v, **kwargs)


transformers = pytest.importorskip("transformers")


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4, head_dim=8))


def _gemma2():
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=4,
        attn_logit_softcapping=2.0, query_pre_attn_scalar=8))


@pytest.mark.parametrize("build,eager", [(_mistral, False), (_gemma2, True)])
def test_hf_sliding_window_and_softcap_are_served(build, eager, op_spy):
    """Mistral (sliding_window) and Gemma 2 (sliding layers + attention softcap) run every call through
    the op with the right window / softcap, no fallback, and match the original model (fp32)."""
    from lightning_gproj.swap import GProjFallbackWarning, swap_attention

    torch.manual_seed(0)
    model = build().train()
    if eager:
        model.set_attn_implementation("eager")  # SDPA refuses softcap; the reference model runs eager
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))

    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        out, grads = logits_and_grads(swapped, input_ids=ids)
    out_ref, grads_ref = logits_and_grads(model, input_ids=ids)
    assert _rel(out, out_ref) <= 2e-5
    for key in grads_ref:
        assert _rel(grads[key], grads_ref[key]) <= 1e-4, key
    calls = [(c.get("window_size", (-1, -1)), c.get("softcap", 0.0), c["causal"]) for c in op_spy.calls]
    if eager:  # Gemma 2 alternates sliding and global layers, both capped
        assert calls == [((3, 0), 2.0, True), ((-1, -1), 2.0, True)]
    else:
        assert calls == [((3, 0), 0.0, True)] * 2
    sites = [m._gproj_site for m in swapped.modules() if "_gproj_site" in vars(m)]
    assert len(sites) == 2 and all(s.served == 1 and not s.fallbacks for s in sites)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("build,eager", [(_mistral, False), (_gemma2, True)])
def test_hf_sliding_window_with_padding_is_served(build, eager, side, op_spy, monkeypatch):
    """A padded batch (lengths 9 and 5) through Mistral and Gemma 2: the sliding layers get
    ``sdpa_mask``'s band & key-padding mask. Right padding is served with ``seqlens_k`` = (9, 5) and the
    window, left padding as packed sequences (cu_seqlens 0, 9, 14) through the varlen op; no fallback.
    Outputs and parameter gradients match the original model (fp32) on the real tokens (the cotangent
    is 0 on padded positions, whose rows the two attentions fill differently: eager gives a fully
    masked row uniform weights, the op zeros)."""
    import lightning_gproj.ops as ops
    from lightning_gproj.swap import GProjFallbackWarning, swap_attention

    varlen_spy = OpSpy(ops.gproj_attn_varlen_func)
    monkeypatch.setattr(ops, "gproj_attn_varlen_func", varlen_spy)
    torch.manual_seed(0)
    model = build().train()
    if eager:
        model.set_attn_implementation("eager")
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, 5:] = 0
    if side == "left":
        attention_mask = attention_mask.flip(-1)
    real = attention_mask.bool()

    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        out, grads = logits_and_grads(swapped, real, input_ids=ids, attention_mask=attention_mask)
    out_ref, grads_ref = logits_and_grads(model, real, input_ids=ids, attention_mask=attention_mask)
    assert _rel(out[real], out_ref[real]) <= 2e-5
    for key in grads_ref:
        assert _rel(grads[key], grads_ref[key]) <= 1e-4, key
    calls = op_spy.calls if side == "right" else varlen_spy.calls
    sliding = [c for c in calls if c.get("window_size", (-1, -1)) == (3, 0)]
    if side == "right":
        assert sliding and all(c["causal"] and c["seqlens_k"].tolist() == [9, 5] for c in sliding)
    else:
        assert sliding and all(c["causal"] and c["cu_seqlens_q"].tolist() == [0, 9, 14] for c in sliding)
    sites = [m._gproj_site for m in swapped.modules() if "_gproj_site" in vars(m)]
    assert len(sites) == 2 and all(s.served == 1 and not s.fallbacks for s in sites)


def test_hf_sliding_window_single_query_without_mask_is_served(op_spy):
    """Mistral (sliding_window=4) on a 1-token prompt and generating from a 2-token one: the calls with one query
    and no mask (SDPA then attends every key; within the window) run the op without a window, no fallback (they fell
    back with "sliding_window without a causal mask" before; new-user pass, 2026-12-02); logits and tokens equal the
    original model's."""
    from lightning_gproj.swap import GProjFallbackWarning, swap_attention

    torch.manual_seed(0)
    model = _mistral().eval()
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    one = torch.tensor([[7]])
    two = torch.tensor([[7, 3]])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", GProjFallbackWarning)
        out = swapped(input_ids=one).logits
        got = swapped.generate(two, max_new_tokens=2, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert _rel(out, model(input_ids=one).logits) <= 2e-5
        assert torch.equal(got, model.generate(two, max_new_tokens=2, do_sample=False, pad_token_id=0))
    single = [c for c in op_spy.calls if c["q_shape"][1] == 1]
    assert single and all(c.get("window_size", (-1, -1)) == (-1, -1) and not c["causal"] for c in single)


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("source", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("build,eager", [(_mistral, False), (_gemma2, True)])
def test_hf_packed_sequences_with_window_and_softcap_are_served(build, eager, source, use_cache, monkeypatch):
    """Sequences of 5, 1 and 7 tokens packed into one row (position_ids restarting at 0, with or without
    the cu_seq_lens / max_length kwargs; use_cache False: the block-diagonal band mask arrives and is
    checked; True: the whole-row band or no mask arrives) through Mistral (sliding_window=4) and Gemma 2 (sliding and global layers, softcap):
    every call is served by gproj_attn_varlen_func with the window and softcap (no fallback), and in
    float64 the logits and parameter gradients equal the original model's run on each sequence alone
    (gradients summed over the sequences) to 1e-10 relative (Gemma 2: 1e-5, its fp32 norms): the window
    acts within each sequence."""
    import lightning_gproj.ops as ops
    from lightning_gproj.swap import GProjFallbackWarning, swap_attention

    varlen_spy = OpSpy(ops.gproj_attn_varlen_func)
    monkeypatch.setattr(ops, "gproj_attn_varlen_func", varlen_spy)
    torch.manual_seed(0)
    model = build().train().double()
    if eager:
        model.set_attn_implementation("eager")  # SDPA refuses softcap; the reference model runs eager
    swapped = copy.deepcopy(model)
    swap_attention(swapped)
    lens = [5, 1, 7]
    ids = torch.randint(0, 50, (1, sum(lens)), generator=torch.Generator().manual_seed(2))
    weight = torch.cos(torch.arange(sum(lens) * 50, dtype=torch.float64)).view(1, sum(lens), 50)
    # use_cache=False: transformers builds the block-diagonal band from position_ids; with a cache (the
    # default, a new user's first try) one band over the whole row and no mask for global layers: every
    # layer must still treat the row as the same packed sequences.
    kwargs = dict(input_ids=ids, position_ids=torch.cat([torch.arange(n) for n in lens])[None], use_cache=use_cache)
    if source == "cu_seq_lens":
        cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GProjFallbackWarning)
        packed = swapped(**kwargs).logits
    (packed * weight).sum().backward()
    start, alone = 0, []
    for n in lens:
        logits = model(input_ids=ids[:, start:start + n], position_ids=torch.arange(n)[None]).logits
        (logits * weight[:, start:start + n]).sum().backward()
        alone.append(logits.detach())
        start += n
    # Gemma 2 computes its RMSNorm and its eager softmax in float32 even in a float64 model (fp32 rounding).
    tol = 1e-5 if eager else 1e-10
    assert _rel(packed.detach(), torch.cat(alone, dim=1)) <= tol
    for (name, p), (_, p_ref) in zip(swapped.named_parameters(), model.named_parameters()):
        if p_ref.grad is not None:
            assert _rel(p.grad, p_ref.grad) <= tol, name
    calls = [(c["window_size"], c["softcap"], c["causal"], c["cu_seqlens_q"].tolist()) for c in varlen_spy.calls]
    cu_list = [0, 5, 6, 13]
    if eager:
        assert calls == [((3, 0), 2.0, True, cu_list), ((-1, -1), 2.0, True, cu_list)]
    else:
        assert calls == [((3, 0), 0.0, True, cu_list)] * 2


@pytest.mark.parametrize("case", ["hole", "all_padding_row", "exclude_layer"])
def test_hf_gemma2_fallbacks_and_unswapped_layers_match_the_original(case):
    """Calls GProj does not serve on a softcap model run its own eager attention. The masks of
    implementation "gproj" are sdpa_mask's (boolean, or None for plain causal), which eager would add
    to the scores as 0 / 1 or skip: the fallback converts them to eager's additive mask. Checked on a
    padding hole and an all-padding row (both fall back, with a warning) and on a layer left unswapped by
    ``exclude`` (no padding: sdpa_mask gives None there), against the original eager model (fp32) on the
    real tokens, logits and parameter gradients."""
    from lightning_gproj.swap import GProjFallbackWarning, swap_attention

    torch.manual_seed(0)
    model = _gemma2().train()
    model.set_attn_implementation("eager")
    swapped = copy.deepcopy(model)
    swap_attention(swapped, exclude="model.layers.1*" if case == "exclude_layer" else None)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    if case == "hole":
        attention_mask[0, 4] = 0
    elif case == "all_padding_row":
        attention_mask[1] = 0
    real = attention_mask.bool() if case != "all_padding_row" else torch.tensor([[True] * 9, [False] * 9])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, grads = logits_and_grads(swapped, real, input_ids=ids, attention_mask=attention_mask)
    fell = [w for w in caught if issubclass(w.category, GProjFallbackWarning)]
    assert (len(fell) > 0) == (case != "exclude_layer")
    out_ref, grads_ref = logits_and_grads(model, real, input_ids=ids, attention_mask=attention_mask)
    assert _rel(out[real], out_ref[real]) <= 2e-5
    for key in grads_ref:
        assert _rel(grads[key], grads_ref[key]) <= 1e-4, key


def test_softcap_factor_value_and_rejected_arguments():
    """The kernels' softcap argument is −2·log2(e)·τ/cap; τ <= 0, cap <= 0 or an fp32 overflow raise instead of
    giving the compiled kernels' capped logits the wrong sign or NaN."""
    from lightning_gproj.kernels._triton_utils import softcap_factor

    assert softcap_factor(0.125, 30.0) == pytest.approx(-2.0 / math.log(2.0) * 0.125 / 30.0, rel=1e-15)
    for tau, cap in ((0.0, 30.0), (-0.125, 30.0), (1e39, 1.0), (0.125, 0.0), (0.125, -30.0)):
        with pytest.raises(ValueError, match="softmax_scale"):
            softcap_factor(tau, cap)
