"""Packed sequences (``gproj_attn_varlen_func``, flash-attn's varlen layout) on the PyTorch reference.

Ground truth: one float64 attention over all packed tokens under the block-diagonal (per sequence,
bottom-right causal) mask written out pair by pair (tests/_fp64.py: packed_visible), differentiated by
autograd — not split by sequence like the code under test. The Triton kernels' varlen variant is
checked in tests/test_triton_varlen.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_gproj import RECORDER, gproj_attn_func, gproj_attn_varlen_func
from lightning_gproj.kernels import reference
from _fp64 import packed_attention_fp64

U32 = 2.0**-24
#: Ragged lengths: an empty query sequence that has keys, a length-1 sequence, a query sequence with no
#: keys, Nq > Nk (causal rows with no key) and Nq < Nk.
LENS_Q = [5, 0, 1, 3, 20, 9]
LENS_K = [7, 3, 1, 0, 14, 16]


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _packed(seed, lens_q=LENS_Q, lens_k=LENS_K, h=4, hk=2, d=16, shift=4.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(dtype)
    k = (torch.randn(sum(lens_k), hk, d, generator=g) + shift).to(dtype)
    v = torch.randn(sum(lens_k), hk, d, generator=g).to(dtype)
    do = torch.randn(sum(lens_q), h, d, generator=g).to(dtype)
    return q, k, v, do, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k)


def _run(q, k, v, do, cu_q, cu_k, max_q, max_k, **kwargs):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = gproj_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def _rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fix", reference.FIXES)
def test_bf16_matches_fp64_and_single_sequence_calls(fix, causal):
    """o, dq, dk, dv against the float64 packed attention: bf16 rounding level (~2⁻⁹ per element,
    6e-3 Frobenius, as tests/test_triton_kernels.py) for every fix except the uncorrected dq, which
    carries the leak τ r k̄ of the shifted keys (‖k̄‖ = 4√d); each sequence's results are bitwise
    those of gproj_attn_func on that sequence alone (batch 1), and empty rows / keys get exact zeros."""
    q, k, v, do, cu_q, cu_k, max_q, max_k = _packed(1)
    tau = q.shape[-1] ** -0.5
    got = _run(q, k, v, do, cu_q, cu_k, max_q, max_k, causal=causal, fix=fix)
    ref = packed_attention_fp64(q, k, v, do, tau, causal, cu_q, cu_k)
    for name, x, r in zip(("o", "dq", "dk", "dv"), got, ref):
        bound = 3e-2 if (name == "dq" and fix == "none") else 6e-3
        assert _rel(x, r) <= bound, (name, _rel(x, r))
    if fix != "none":
        none = _run(q, k, v, do, cu_q, cu_k, max_q, max_k, causal=causal, fix="none")
        assert _rel(got[1], ref[1]) <= 0.5 * _rel(none[1], ref[1])
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())):
        if q1 == q0 or k1 == k0:  # nothing to attend: zero output, zero gradients
            assert not got[0][q0:q1].any() and not got[1][q0:q1].any()
            assert not got[2][k0:k1].any() and not got[3][k0:k1].any()
            continue
        qs, ks, vs = (x[None, a:e].detach().clone().requires_grad_() for x, a, e in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        o = gproj_attn_func(qs, ks, vs, causal=causal, fix=fix)
        o.backward(do[None, q0:q1])
        assert torch.equal(got[0][q0:q1], o[0].detach()), b
        assert torch.equal(got[1][q0:q1], qs.grad[0]) and torch.equal(got[2][k0:k1], ks.grad[0]), b
        assert torch.equal(got[3][k0:k1], vs.grad[0]), b


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fix", ["gproj", "gproj_uniform"])
def test_gradcheck_fp64(fix, causal):
    """fp64 inputs run with no rounding emulation: finite differences agree for both projections (fix
    "none" is the same path without them), with an empty, a length-1 and a keyless sequence, GQA and
    Nq ≠ Nk."""
    q, k, v, _, cu_q, cu_k, max_q, max_k = _packed(2, [3, 0, 1, 2, 4], [4, 2, 1, 0, 3], h=2, hk=1, d=8,
                                                   shift=0.0, dtype=torch.float64)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: gproj_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, fix=fix), (q, k, v)
    )


def test_fp64_inputs_equal_the_packed_fp64_attention():
    q, k, v, do, cu_q, cu_k, max_q, max_k = _packed(3, dtype=torch.float64)
    for causal in (False, True):
        got = _run(q, k, v, do, cu_q, cu_k, max_q, max_k, causal=causal)
        ref = packed_attention_fp64(q, k, v, do, q.shape[-1] ** -0.5, causal, cu_q, cu_k)
        for x, r in zip(got, ref):
            assert (x - r).abs().max() <= 1e-12 * r.abs().max()


def test_sequences_never_see_each_other():
    """Changing one sequence's keys and values (to NaN and inf included) changes nothing in any other
    sequence's output or gradients, bit for bit."""
    q, k, v, do, cu_q, cu_k, max_q, max_k = _packed(4)
    clean = _run(q, k, v, do, cu_q, cu_k, max_q, max_k, causal=True)
    k0, k1 = cu_k[4].item(), cu_k[5].item()  # the 20-query, 14-key sequence
    q0, q1 = cu_q[4].item(), cu_q[5].item()
    for poison in (lambda x: x + 3.0, lambda x: torch.full_like(x, float("nan")), lambda x: torch.full_like(x, float("inf"))):
        kp, vp = k.clone(), v.clone()
        kp[k0:k1], vp[k0:k1] = poison(k[k0:k1]), poison(v[k0:k1])
        dirty = _run(q, kp, vp, do, cu_q, cu_k, max_q, max_k, causal=True)
        rows = torch.ones(q.shape[0], dtype=torch.bool)
        rows[q0:q1] = False
        keys = torch.ones(k.shape[0], dtype=torch.bool)
        keys[k0:k1] = False
        assert torch.equal(clean[0][rows], dirty[0][rows]) and torch.equal(clean[1][rows], dirty[1][rows])
        assert torch.equal(clean[2][keys], dirty[2][keys]) and torch.equal(clean[3][keys], dirty[3][keys])
    assert not torch.equal(clean[0][q0:q1], dirty[0][q0:q1])  # the test can fail: that sequence did change


@pytest.mark.parametrize("causal", [False, True])
def test_projected_rows_sum_to_zero_per_row(causal):
    """C1 per row, as tests/test_gproj_numerics.py: queries with last coordinate 0 and keys with last
    coordinate c make the last column of dQ exactly τ·c·Σ_j dŜ_ij over the row's own sequence; it
    stays within 2·n_i·u of τ·c·Σ_j |dS_ij| (recursive-summation bound) for gproj, not for none."""
    lens_q, lens_k = [60, 1, 0, 90], [80, 1, 5, 90]
    q, k, v, do, cu_q, cu_k, max_q, max_k = _packed(5, lens_q, lens_k, h=2, hk=2, d=32, shift=3.0, dtype=torch.float32)
    c = 256.0
    q[..., -1] = 0
    k[..., -1] = c
    q, k, v, do = (x.bfloat16() for x in (q, k, v, do))
    tau = 32**-0.5
    from _fp64 import attention_fp64, packed_visible

    vis = packed_visible(cu_q, cu_k, causal)
    *_, ds64 = attention_fp64(q[None], k[None], v[None], do[None], tau, False, visible=vis)
    abs_ds = ds64[0].abs().sum(dim=-1)  # (h, total_q)
    n_keys = vis.sum(dim=-1)
    rows = n_keys > 1
    bound = 2 * n_keys[rows] * U32
    ratios = {}
    for fix in ("gproj", "none"):
        dq = _run(q, k, v, do, cu_q, cu_k, max_q, max_k, causal=causal, fix=fix)[1]
        row_sum = dq[..., -1].double().T / (tau * c)
        ratios[fix] = (row_sum.abs() / abs_ds)[:, rows] / bound
    assert ratios["gproj"].max() <= 1.0
    assert ratios["none"].max() >= 10.0


@pytest.mark.parametrize("fix", ["gproj", "gproj_uniform"])
def test_key_gradients_sum_to_zero_per_sequence(fix):
    """C2 per sequence on the fp32 accumulators: ‖Σ_{j in b} dK_j‖ / ‖dK_b‖_F within a few fp32 u for
    every sequence with keys. A projection over the whole packed tensor (one mean over all keys)
    would leave each sequence's own sum near the uncorrected level: checked to show the bound can fail."""
    q, k, v, do, cu_q, cu_k, max_q, max_k = _packed(6)
    tau = q.shape[-1] ** -0.5
    for causal in (False, True):
        o, m, log2l = reference.forward(q, k, v, tau, causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        grads = {f: reference.backward(do, q, k, v, o, m, log2l, tau, causal, f, grad_dtype=torch.float32,
                                       cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)[1].double() for f in (fix, "none")}
        glob = grads["none"] - grads["none"].mean(dim=0, keepdim=True)  # the wrong, packed-wide projection

        def residuals(dk):
            # sequences with two or more keys that some query sees (the others have dk = 0)
            return [(dk[a:e].sum(dim=0).norm(dim=-1) / dk[a:e].norm(dim=(0, 2))).max().item()
                    for a, e in zip(cu_k[:-1].tolist(), cu_k[1:].tolist()) if e - a > 1 and dk[a:e].norm() > 0]
        assert max(residuals(grads[fix])) <= 4 * U32, residuals(grads[fix])
        assert max(residuals(glob)) >= 100 * U32
        assert max(residuals(grads["none"])) >= 100 * U32


#: (causal, window_size, softcap): a Mistral-style causal window, a two-sided window with softcap,
#: softcap alone.
WINDOWS = [(True, (3, 0), 0.0), (False, (2, 4), 2.0), (True, (-1, -1), 1.5)]


@pytest.mark.parametrize("causal, window, softcap", WINDOWS)
@pytest.mark.parametrize("fix", reference.FIXES)
def test_window_and_softcap_per_sequence(fix, causal, window, softcap):
    """window_size and softcap within each sequence (bottom-right aligned per sequence: local query i
    sees local key j iff i + n_k − n_q − left <= j <= i + n_k − n_q + right): o, dq, dk, dv against the
    float64 packed attention whose mask is written out pair by pair (tests/_fp64.py: packed_visible) at
    the bf16 level of test_bf16_matches_fp64_and_single_sequence_calls; gproj's dq beats none's; each
    sequence's results are bitwise gproj_attn_func's on that sequence alone with the same window and
    softcap."""
    q, k, v, do, cu_q, cu_k, max_q, max_k = _packed(11)
    tau = q.shape[-1] ** -0.5
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    got = _run(q, k, v, do, cu_q, cu_k, max_q, max_k, fix=fix, **kw)
    ref = packed_attention_fp64(q, k, v, do, tau, causal, cu_q, cu_k, window_size=window, softcap=softcap)
    for name, x, r in zip(("o", "dq", "dk", "dv"), got, ref):
        bound = 3e-2 if (name == "dq" and fix == "none") else 6e-3
        assert _rel(x, r) <= bound, (name, _rel(x, r))
    if fix != "none":
        none = _run(q, k, v, do, cu_q, cu_k, max_q, max_k, fix="none", **kw)
        assert _rel(got[1], ref[1]) <= 0.5 * _rel(none[1], ref[1])
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())):
        if q1 == q0 or k1 == k0:
            continue
        qs, ks, vs = (x[None, a:e].detach().clone().requires_grad_() for x, a, e in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        o = gproj_attn_func(qs, ks, vs, fix=fix, **kw)
        o.backward(do[None, q0:q1])
        assert torch.equal(got[0][q0:q1], o[0].detach()), b
        assert torch.equal(got[1][q0:q1], qs.grad[0]) and torch.equal(got[2][k0:k1], ks.grad[0]), b


def test_window_key_sums_per_sequence():
    """C2 with a left window on the fp32 accumulators: per sequence, over the keys some of its queries
    see (keys before the first row's window keep dk = 0 exactly), within 4 fp32 u; the projection uses
    each sequence's own n_k − n_q (a sequence with n_q < n_k has invisible leading keys)."""
    q, k, v, do, cu_q, cu_k, max_q, max_k = _packed(12, [6, 9, 4], [6, 17, 9])
    tau = q.shape[-1] ** -0.5
    vl = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, window_size=(2, 0))
    o, m, log2l = reference.forward(q, k, v, tau, True, **vl)
    dk = reference.backward(do, q, k, v, o, m, log2l, tau, True, "gproj", grad_dtype=torch.float32, **vl)[1].double()
    hidden = torch.zeros(k.shape[0], dtype=torch.bool)
    hidden[6:6 + 17 - 9 - 2] = True  # sequence 1: keys j < 17 − 9 − 2 are seen by no query
    hidden[23:23 + 9 - 4 - 2] = True
    assert not dk[hidden].any() and dk[~hidden].abs().amin(dim=0).sum() > 0
    for a, e in zip(cu_k[:-1].tolist(), cu_k[1:].tolist()):
        assert (dk[a:e].sum(dim=0).norm(dim=-1) / dk[a:e].norm(dim=(0, 2))).max() <= 4 * U32


def test_project_key_sum_acts_per_sequence():
    """reference.project_key_sum_ with cu_seqlens_k: each sequence's keys lose their own mean (so each
    sums to zero), an empty sequence is skipped, and it equals projecting each slice alone."""
    g = torch.Generator().manual_seed(7)
    cu = _cu([4, 0, 1, 6])
    dk = torch.randn(11, 2, 8, generator=g, dtype=torch.float64) + 5.0
    out = reference.project_key_sum_(dk.clone(), cu_seqlens_k=cu)
    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e > a:
            assert torch.allclose(out[a:e], dk[a:e] - dk[a:e].mean(dim=0), rtol=0, atol=1e-13)
            assert out[a:e].sum(dim=0).abs().max() <= 1e-13
    assert not out[4].any()  # a length-1 sequence: its one key's gradient is its own mean


def test_stats_are_recorded_per_sequence():
    """Recording works on packed calls: the mean-key norm is the mean over (sequence with keys, kv head)
    of ‖mean of its keys‖, and the violation statistics are finite and in (0, 1) for fix="none"."""
    q, k, v, do, cu_q, cu_k, max_q, max_k = _packed(8)
    RECORDER.drain()
    with RECORDER.recording():
        _run(q, k, v, do, cu_q, cu_k, max_q, max_k, causal=True, fix="none", stats_name="packed")
    s = RECORDER.drain()["packed"]
    expect = torch.stack([k[a:e].double().mean(dim=0).norm(dim=-1) for a, e in zip(cu_k[:-1].tolist(), cu_k[1:].tolist())
                          if e > a]).mean().item()
    assert s["mean_key_norm"] == pytest.approx(expect, rel=1e-5)
    assert 0 < s["violation_median"] <= s["violation_max"] < 1 and s["leak_ratio"] > 0
    assert math.isfinite(s["max_logit"])


def test_compile_fullgraph():
    q, k, v, do, cu_q, cu_k, max_q, max_k = _packed(9)
    q.requires_grad_()
    eager = gproj_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, a, b: gproj_attn_varlen_func(q, k, v, a, b, max_q, max_k, causal=True),
                       fullgraph=True)
    out = fn(q, k, v, cu_q, cu_k)
    assert torch.equal(out, eager)
    assert torch.equal(torch.autograd.grad(out.float().sum(), q)[0], torch.autograd.grad(eager.float().sum(), q)[0])


@pytest.mark.parametrize(
    "change, exc, words",
    [
        (dict(cu_seqlens_q=[0, 5, 10]), TypeError, r"cu_seqlens_q must be an int32 torch.Tensor of shape \(batch \+ 1,\), got list"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 10])), ValueError, "cu_seqlens_q must be an int32 tensor.*torch.int64"),
        (dict(cu_seqlens_k=torch.tensor([0, 6, 12], dtype=torch.float32)), ValueError, "cu_seqlens_k must be an int32 tensor"),
        (dict(cu_seqlens_q=torch.tensor([[0, 5, 10]], dtype=torch.int32)), ValueError, r"cu_seqlens_q must have shape \(batch \+ 1,\)"),
        (dict(cu_seqlens_q=torch.tensor([0], dtype=torch.int32)), ValueError, r"cu_seqlens_q must have shape \(batch \+ 1,\) with batch >= 1"),
        (dict(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32)), ValueError,
         "cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got 2 and 1"),
        (dict(cu_seqlens_q=torch.tensor([1, 5, 10], dtype=torch.int32)), ValueError, "cu_seqlens_q must start at 0, got 1"),
        (dict(cu_seqlens_k=torch.tensor([0, 7, 6, 12], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 5, 5, 10], dtype=torch.int32)),
         ValueError, r"cu_seqlens_k must not decrease.*cu_seqlens_k\[1\] = 7 > cu_seqlens_k\[2\] = 6"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 9], dtype=torch.int32)), ValueError,
         "cu_seqlens_q must end at the number of packed tokens 10 .*got 9"),
        (dict(cu_seqlens_k=torch.tensor([0, 6, 13], dtype=torch.int32)), ValueError,
         r"cu_seqlens_k must end at the number of packed tokens 12 \(the first dim of k and v\), got 13"),
        (dict(max_seqlen_q=4), ValueError, r"max_seqlen_q \(4\) is smaller than the longest sequence of cu_seqlens_q \(5\)"),
        (dict(max_seqlen_k=5), ValueError, r"max_seqlen_k \(5\) is smaller than the longest sequence of cu_seqlens_k \(6\)"),
        (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be a non-negative int"),
        (dict(max_seqlen_k=6.0), ValueError, "max_seqlen_k must be a non-negative int"),
        (dict(max_seqlen_q=True), ValueError, "max_seqlen_q must be a non-negative int"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 10], dtype=torch.int32, device="meta")), ValueError,
         "cu_seqlens_q must be on q's device cpu"),
        (dict(q=torch.zeros(1, 10, 4, 16)), ValueError, r"q must be 3-D \(total, nheads, headdim\)"),
        (dict(q=torch.zeros(10, 3, 16)), ValueError, "multiple of k/v's nheads"),
        (dict(dropout_p=1.5), ValueError, r"dropout_p must be a float in \[0, 1\)"),
        (dict(fix="bogus"), ValueError, "fix must be one of"),
        (dict(window_size=(-2, 0)), ValueError, r"window_size must be a pair \(left, right\) of ints >= -1"),
        (dict(softcap=-1.0), ValueError, "softcap must be a finite float >= 0"),
    ],
)
def test_bad_input_names_the_argument(change, exc, words):
    args = dict(q=torch.zeros(10, 4, 16), k=torch.zeros(12, 2, 16), v=torch.zeros(12, 2, 16),
                cu_seqlens_q=torch.tensor([0, 5, 10], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 6, 12], dtype=torch.int32),
                max_seqlen_q=5, max_seqlen_k=6)
    args.update(change)
    with pytest.raises(exc, match=words):
        gproj_attn_varlen_func(**args)


def test_max_seqlen_may_be_a_tensor_or_larger_than_needed():
    """HF's position_ids path passes max_seqlen as a 0-d tensor; a larger value only launches idle blocks; a NumPy
    integer (e.g. from np.diff(cu_seqlens).max()) is an int."""
    q, k, v, do, cu_q, cu_k, max_q, max_k = _packed(10)
    o = gproj_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    assert torch.equal(o, gproj_attn_varlen_func(q, k, v, cu_q, cu_k, torch.tensor(max_q), max_k + 50, causal=True))
    assert torch.equal(o, gproj_attn_varlen_func(q, k, v, cu_q, cu_k, np.int64(max_q), np.int32(max_k), causal=True))
