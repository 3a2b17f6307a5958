"""The public op: input validation, gradcheck, autocast, strided input, stats, torch.compile."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from lightning_gproj import RECORDER, gproj_attn_func, gproj_attn_varlen_func
from lightning_gproj.kernels import reference
from _fp64 import attention_fp64


def _qkv(*shape, dtype=torch.float32):
    return tuple(torch.randn(*shape, dtype=dtype) for _ in range(3))


@pytest.mark.parametrize("fix", reference.FIXES)
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_fp64(fix, causal):
    """fp64 inputs run with no rounding emulation, so every fix is the exact gradient (the
    corrections are at fp64 rounding): finite differences must agree. Nq ≠ Nk and GQA included."""
    torch.manual_seed(0)
    q = torch.randn(1, 5, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 7, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 7, 2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: gproj_attn_func(q, k, v, causal=causal, fix=fix), (q, k, v))


@pytest.mark.parametrize("fix", reference.FIXES)
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_fp64_with_seqlens_k(fix, causal):
    """Key padding per batch row (lengths 7 = none, 3, 1), Nq < Nk and Nq == Nk, GQA."""
    torch.manual_seed(0)
    for nq in (5, 7):
        q = torch.randn(3, nq, 4, 8, dtype=torch.float64, requires_grad=True)
        k = torch.randn(3, 7, 2, 8, dtype=torch.float64, requires_grad=True)
        v = torch.randn(3, 7, 2, 8, dtype=torch.float64, requires_grad=True)
        lens = torch.tensor([7, 3, 1])
        assert torch.autograd.gradcheck(
            lambda q, k, v: gproj_attn_func(q, k, v, causal=causal, fix=fix, seqlens_k=lens), (q, k, v)
        )


def test_seqlens_k_full_length_equals_no_padding():
    torch.manual_seed(6)
    q, k, v = (x.requires_grad_() for x in _qkv(2, 20, 2, 16, dtype=torch.bfloat16))
    for causal in (False, True):
        o = gproj_attn_func(q, k, v, causal=causal, seqlens_k=torch.tensor([20, 20], dtype=torch.int32))
        assert torch.equal(o, gproj_attn_func(q, k, v, causal=causal))
        g = torch.autograd.grad(o.float().sum(), (q, k, v))
        g0 = torch.autograd.grad(gproj_attn_func(q, k, v, causal=causal).float().sum(), (q, k, v))
        assert all(torch.equal(a, b) for a, b in zip(g, g0))


def test_stats_with_seqlens_k_exclude_single_key_rows():
    """A batch row with one valid key has dS ≡ 0: its rows are excluded from the violation, as the
    single-key rows of a causal mask are; the others are still recorded."""
    torch.manual_seed(7)
    q, k, v = (x.requires_grad_() for x in _qkv(2, 32, 2, 32, dtype=torch.bfloat16))
    RECORDER.drain()
    with RECORDER.recording():
        o = gproj_attn_func(q, k + 20, v, fix="none", stats_name="pad", seqlens_k=torch.tensor([1, 32]))
        o.float().square().sum().backward()
    s = RECORDER.drain()["pad"]
    assert 0 < s["violation_median"] <= s["violation_max"] < 1
    with RECORDER.recording():
        o = gproj_attn_func(q, k + 20, v, fix="none", stats_name="one", seqlens_k=torch.tensor([1, 1]))
        o.float().square().sum().backward()
    s = RECORDER.drain()["one"]
    assert math.isnan(s["violation_median"]) and s["violation_max"] == 0.0
    # Every row sees one key: the leak ratio λ is NaN (it was ~800, a false alert at the warn level 1e-2).
    assert math.isnan(s["leak_ratio"])


def test_stats_with_window_and_seqlens_k_exclude_single_key_rows():
    """Key padding cuts a sliding window from above: with Nq = 1, Nk = 6, causal and window (1, 0) each
    row's window holds keys 4 and 5, and seqlens_k = 5 hides key 5, so every row sees key 4 alone
    (float64 reference: o = v of key 4) and has dS ≡ 0. No row is then defined for ρ (median NaN, max
    0), as with seqlens_k = 1 above; a row count min(window, seqlens_k) = 2 recorded ρ = 1 from the
    rounding noise of the computed dS of those rows (16 rows, so that some have some)."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(8, n, 2, 64, generator=g).bfloat16().requires_grad_() for n in (1, 6, 6))
    lens = torch.tensor([5] * 8)
    RECORDER.drain()
    with RECORDER.recording():
        o = gproj_attn_func(q, k, v, causal=True, window_size=(1, 0), seqlens_k=lens, fix="none", stats_name="w")
        o.float().square().sum().backward()
    s = RECORDER.drain()["w"]
    o64 = attention_fp64(q, k, v, torch.ones(8, 1, 2, 64), 0.125, True, key_mask=torch.arange(6)[None] < lens[:, None],
                         window_size=(1, 0))[0]
    assert torch.equal(o64, v.detach()[:, 4:5].double())  # the reference: key 4 alone, weight 1
    assert torch.equal(o.detach().double(), o64)
    assert math.isnan(s["violation_median"]) and s["violation_max"] == 0.0
    assert math.isnan(s["leak_ratio"])  # was 2e33 from the rounding noise of dQ ≈ 0


def test_stats_of_a_layer_called_twice_leave_out_an_undefined_call():
    """A layer called several times in a step (a shared module, gradient accumulation) where one call has
    every query row seeing one key (window (0, 0)): that call's violation median and λ are NaN (undefined)
    and are left out of the step's mean, which was NaN before. Checked against the float64 mean of the
    finite values of the calls, each recorded on its own."""
    torch.manual_seed(3)
    q, k, v = (x.requires_grad_() for x in _qkv(2, 32, 2, 32, dtype=torch.bfloat16))
    calls = [dict(causal=True), dict(causal=True, window_size=(0, 0)), dict(causal=False)]

    def run(kwargs_list):
        RECORDER.drain()
        with RECORDER.recording():
            loss = sum(gproj_attn_func(q, k + 4, v, fix="none", stats_name="shared", **kw).float().square().sum()
                       for kw in kwargs_list)
            loss.backward()
        return RECORDER.drain()["shared"]

    alone = [run([kw]) for kw in calls]
    assert math.isnan(alone[1]["violation_median"]) and math.isnan(alone[1]["leak_ratio"])
    together = run(calls)
    for stat in ("violation_median", "leak_ratio"):
        finite = [a[stat] for a in alone if math.isfinite(a[stat])]
        assert len(finite) == 2 and min(finite) > 0
        assert together[stat] == pytest.approx(float(np.mean(np.array(finite, dtype=np.float64))), rel=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_keys_seen_with_seqlens_k_counts_the_visible_keys(causal):
    """The per-row key count behind the ρ statistics (rows seeing <= 1 key are left out) equals the
    number of keys each row sees under the float64 reference's own mask (attention_fp64: causal,
    window, key padding), for Nq < Nk, Nq == Nk, Nq > Nk and windows cut by the padding."""
    from lightning_gproj.ops import _keys_seen

    for nq, nk in ((3, 8), (8, 8), (9, 5)):
        lens = torch.tensor([nk, max(nk - 3, 1), 1, 2])
        for window in ((-1, -1), (1, 0), (2, 1), (0, 3), (-1, 2), (3, -1)):
            q, k = torch.zeros(4, nq, 1, 8, dtype=torch.float64), torch.zeros(4, nk, 1, 8, dtype=torch.float64)
            v = torch.eye(nk, dtype=torch.float64)[None, :, None, :].expand(4, nk, 1, nk)  # one-hot values
            # Equal scores: o_i is the mean of the one-hot v_j over the keys row i sees; its nonzeros count them.
            o = attention_fp64(q, k, v, torch.zeros(4, nq, 1, nk, dtype=torch.float64), 1.0, causal,
                               key_mask=torch.arange(nk)[None] < lens[:, None], window_size=window)[0]
            expected = (o[:, :, 0] > 0).sum(-1)[:, None, :]  # (batch, 1, Nq), as _keys_seen
            got = _keys_seen(q, k, causal, window, lens.to(torch.int32), None, None)
            assert torch.equal(got, expected), (nq, nk, window)


def test_compile_fullgraph_with_seqlens_k():
    torch.manual_seed(8)
    q, k, v = (x.requires_grad_() for x in _qkv(2, 24, 2, 16, dtype=torch.bfloat16))
    lens = torch.tensor([24, 9])
    eager = gproj_attn_func(q, k, v, causal=True, seqlens_k=lens)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, lens: gproj_attn_func(q, k, v, causal=True, seqlens_k=lens), fullgraph=True)
    out = compiled(q, k, v, lens)
    assert torch.equal(out, eager)
    (dk,) = torch.autograd.grad(out.float().sum(), k)
    (dk_eager,) = torch.autograd.grad(eager.float().sum(), k)
    assert torch.equal(dk, dk_eager) and not dk[1, 9:].any()


@pytest.mark.parametrize(
    "seqlens_k, exc, words",
    [
        ([8, 8], TypeError, r"seqlens_k must be None or an int32/int64 torch.Tensor of shape \(batch,\), got list"),
        (torch.tensor([8.0, 8.0]), TypeError, "seqlens_k must be an int32 or int64 tensor.*torch.float32"),
        (torch.tensor([8, 8], dtype=torch.int16), TypeError, "seqlens_k must be an int32 or int64"),
        (torch.tensor([8]), ValueError, r"seqlens_k must have shape \(batch,\) = \(2,\), got \(1,\)"),
        (torch.tensor([[8, 8]]), ValueError, r"seqlens_k must have shape \(batch,\)"),
        (torch.tensor([8, 0]), ValueError, r"seqlens_k values must lie in \[1, seqlen_k=8\].*min 0"),
        (torch.tensor([9, 8]), ValueError, r"seqlens_k values must lie in \[1, seqlen_k=8\].*max 9"),
        (torch.tensor([8, 8], device="meta"), ValueError, "seqlens_k must be on q's device cpu"),
    ],
)
def test_bad_seqlens_k_names_the_argument(seqlens_k, exc, words):
    q, k, v = _qkv(2, 8, 4, 16)
    with pytest.raises(exc, match=words):
        gproj_attn_func(q, k, v, seqlens_k=seqlens_k)


def test_fp32_matches_fp64_reference():
    torch.manual_seed(1)
    q, k, v = _qkv(2, 33, 2, 16)
    do = torch.randn(2, 33, 2, 16)
    o64, dq64, dk64, dv64, _ = attention_fp64(q, k, v, do, 0.3, True)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = gproj_attn_func(q, k, v, softmax_scale=0.3, causal=True)
    o.backward(do)
    for x, ref in ((o, o64), (q.grad, dq64), (k.grad, dk64), (v.grad, dv64)):
        assert ((x.double() - ref).norm() / ref.norm()).item() < 1e-5  # fp32 arithmetic, N = 33


def test_strided_input_same_as_contiguous():
    """(batch, nheads, seqlen, d) tensors transposed into the flash layout are served as they are."""
    torch.manual_seed(2)
    qh, kh, vh = _qkv(2, 4, 40, 32, dtype=torch.bfloat16)
    strided = [x.transpose(1, 2) for x in (qh, kh, vh)]
    assert not strided[0].is_contiguous()
    contiguous = [x.contiguous() for x in strided]
    assert torch.equal(gproj_attn_func(*strided, causal=True), gproj_attn_func(*contiguous, causal=True))


def test_autocast_casts_fp32_inputs_like_sdpa():
    torch.manual_seed(3)
    q, k, v = _qkv(1, 20, 2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = gproj_attn_func(q, k, v)
    assert o.dtype == torch.bfloat16
    assert torch.equal(o, gproj_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16()))


def test_stats_recorded_only_while_enabled():
    torch.manual_seed(4)
    q, k, v = (x.requires_grad_() for x in _qkv(1, 64, 2, 32, dtype=torch.bfloat16))
    RECORDER.drain()
    gproj_attn_func(q, k, v, stats_name="off").sum().backward()
    assert RECORDER.drain() == {}
    with RECORDER.recording():
        for fix in ("none", "gproj"):
            o = gproj_attn_func(q, k + 20, v, causal=True, fix=fix, stats_name=fix)
            o.float().square().sum().backward()
    stats = RECORDER.drain()
    assert set(stats) == {"none", "gproj"}
    expected_key_norm = (k.float() + 20).mean(dim=1).norm(dim=-1).mean().item()
    # The leak stays in the returned dQ with fix="none" (leak_ratio, alerted on) and is removed by
    # fix="gproj" (leak_removed_ratio, logged only).
    leak_name = {"none": "leak_ratio", "gproj": "leak_removed_ratio"}
    for fix in ("none", "gproj"):
        s = stats[fix]
        assert s["mean_key_norm"] == pytest.approx(expected_key_norm, rel=1e-2)
        assert 0 < s["violation_median"] <= s["violation_max"] < 1
        assert set(s) & set(leak_name.values()) == {leak_name[fix]}
        assert 0 < s[leak_name[fix]] < 1
    # Same inputs and same rounded dS: the violation does not depend on the fix, the leak barely does.
    assert stats["none"]["violation_median"] == pytest.approx(stats["gproj"]["violation_median"])
    assert stats["none"]["leak_ratio"] == pytest.approx(stats["gproj"]["leak_removed_ratio"], rel=0.05)


@pytest.mark.parametrize(("nq", "nk", "causal", "seqlens"), [(40, 40, False, None), (48, 32, True, None), (32, 40, True, [40, 17])])
def test_max_logit_is_the_largest_scaled_score_of_a_visible_pair(nq, nk, causal, seqlens):
    """max_logit = max over (batch, head, i, j visible) of τ q_i·k_j, against float64 on the same bf16
    values. Keys and queries point in opposite directions, so every logit is negative: rows that see
    no key (nq > nk, causal) must not contribute their placeholder m = 0."""
    torch.manual_seed(11)
    q = (torch.randn(2, nq, 4, 32) - 3.0).bfloat16()
    k = (torch.randn(2, nk, 2, 32) + 3.0).bfloat16()  # GQA 2:1
    v = torch.randn(2, nk, 2, 32).bfloat16()
    scale = 0.3
    seqlens_k = None if seqlens is None else torch.tensor(seqlens)
    RECORDER.drain()
    with RECORDER.recording():
        gproj_attn_func(q, k, v, softmax_scale=scale, causal=causal, stats_name="a", seqlens_k=seqlens_k)
        gproj_attn_func(q[:, :, :, :16].contiguous() * 0, k[:, :, :, :16].contiguous(), v[:, :, :, :16].contiguous(),
                        softmax_scale=scale, causal=causal, stats_name="a", seqlens_k=seqlens_k)  # logits 0 < max
    got = RECORDER.drain()["a"]["max_logit"]
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double().repeat_interleave(2, dim=2)) * scale
    visible = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        visible = visible.tril(nk - nq)
    visible = visible.expand(2, 1, nq, nk)
    if seqlens_k is not None:
        visible = visible & (torch.arange(nk)[None, :] < seqlens_k[:, None])[:, None, None, :]
    expected = s.masked_fill(~visible, -math.inf).amax().item()
    assert expected < -1.0  # every visible logit is negative here
    # Two calls of the layer in the step: the maximum of both (the second one's logits are all 0).
    assert got == pytest.approx(max(expected, 0.0))
    RECORDER.drain()
    with RECORDER.recording():
        gproj_attn_func(q, k, v, softmax_scale=scale, causal=causal, stats_name="a", seqlens_k=seqlens_k)
    assert RECORDER.drain()["a"]["max_logit"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("case", ["dense", "padded", "packed", "packed_dropout_autocast", "strided_autocast"])
def test_custom_op_pair_passes_opcheck(case):
    """torch.library.opcheck on lightning_gproj::attn_fwd (and through its autograd, attn_bwd) for each
    kind of call the one op pair serves: its schema, autograd registration, and fake impl (the output
    and row-statistics shapes and dtypes, dense (batch, nheads, seqlen_q) or packed (nheads, total_q),
    must match the real kernels') under AOT dispatch."""
    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16).requires_grad_(True)

    options = {}
    if case == "strided_autocast":  # fp32 q, k transposed from (batch, nheads, seqlen, headdim): cast copies keep the strides
        q, k = (torch.randn(2, h, n, 16, generator=g).transpose(1, 2).requires_grad_(True) for h, n in ((4, 6), (2, 7)))
        v = leaf(2, 7, 2, 16)
        options = dict(compute_dtype=torch.bfloat16)
    elif case in ("dense", "padded"):
        q, k, v = leaf(2, 6, 4, 16), leaf(2, 7, 2, 16), leaf(2, 7, 2, 16)
        if case == "padded":
            options = dict(seqlens_k=torch.tensor([7, 3], dtype=torch.int32), deterministic=True)
    else:
        q, k, v = leaf(10, 4, 16), leaf(9, 2, 16), leaf(9, 2, 16)
        options = dict(cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
                       cu_seqlens_k=torch.tensor([0, 5, 9], dtype=torch.int32), max_seqlen_q=6, max_seqlen_k=5)
        if case == "packed_dropout_autocast":
            options.update(compute_dtype=torch.float16, window_left=2, dropout_p=0.1,
                           rng=torch.tensor([123, 0], dtype=torch.int64))
    result = torch.library.opcheck(torch.ops.lightning_gproj.attn_fwd.default, (q, k, v, 0.25, True, "gproj", "a"),
                                   options)
    assert set(result.values()) == {"SUCCESS"}, result


def test_compile_fullgraph_has_no_graph_break():
    torch.manual_seed(5)
    q, k, v = (x.requires_grad_() for x in _qkv(1, 24, 2, 16, dtype=torch.bfloat16))
    eager = gproj_attn_func(q, k, v, causal=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: gproj_attn_func(q, k, v, causal=True), fullgraph=True)
    out = compiled(q, k, v)
    assert torch.equal(out, eager)
    (dq,) = torch.autograd.grad(out.float().sum(), q)
    (dq_eager,) = torch.autograd.grad(eager.float().sum(), q)
    assert torch.equal(dq, dq_eager)


def test_compile_under_autocast_with_mixed_input_dtypes():
    """fp32 q, k and a bf16 v under autocast, as a bf16-mixed Llama calls attention: the compiled op
    (fullgraph; the cast copies are outputs the backward saves) gives eager's output and gradients, in
    eager's dtypes."""
    torch.manual_seed(7)
    q, k = (x.float().requires_grad_() for x in _qkv(1, 24, 2, 16)[:2])
    v = _qkv(1, 24, 2, 16, dtype=torch.bfloat16)[2].requires_grad_()

    def f(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return gproj_attn_func(q, k, v, causal=True)

    eager = f(q, k, v)
    grads_eager = torch.autograd.grad(eager.float().sum(), (q, k, v))
    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert torch.equal(out, eager)
    for x, y in zip(grads, grads_eager):
        assert x.dtype == y.dtype and torch.equal(x, y)


def test_compile_under_autocast_with_sdpa_layout_inputs():
    """fp32 q, k, v in the SDPA layout (``layout="bhsd"``: the op gets them transposed, not contiguous)
    under autocast, compiled with Inductor (fullgraph): the 16-bit copies the op returns for its backward
    must have the strides its fake impl declares, contiguous (Inductor asserts each output's strides;
    ``Tensor.to`` alone would keep the transposed ones). Output and gradients equal eager's, and both are
    within bf16 error of a float64 reference on the bf16-rounded inputs."""
    torch.manual_seed(11)
    q, k, v = (x.requires_grad_() for x in _qkv(2, 2, 12, 16))  # (batch, nheads, seqlen, headdim)
    do = torch.randn(2, 2, 12, 16)

    def f(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return gproj_attn_func(q, k, v, causal=True, layout="bhsd")

    eager = f(q, k, v)
    grads_eager = torch.autograd.grad(eager, (q, k, v), do.bfloat16())
    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), do.bfloat16())
    assert torch.equal(out, eager)
    for x, y in zip(grads, grads_eager):
        assert x.dtype == y.dtype == torch.float32 and torch.equal(x, y)
    o64, dq64, dk64, dv64, _ = attention_fp64(*(x.detach().transpose(1, 2).bfloat16() for x in (q, k, v)),
                                              do.transpose(1, 2).bfloat16(), 16 ** -0.5, True)
    for got, ref in zip((out, *grads), (o64, dq64, dk64, dv64)):
        got = got.transpose(1, 2).double()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2


def test_compile_dynamic_float_arguments_match_eager():
    """torch.compile(dynamic=True) passes softcap, softmax_scale and dropout_p as SymFloats: the op's
    checks must trace them (math.isfinite of a SymFloat stopped the fullgraph trace) and the compiled
    call must give the eager output for each value."""
    torch.manual_seed(6)
    q, k, v = _qkv(1, 24, 2, 16, dtype=torch.bfloat16)
    torch._dynamo.reset()

    def f(q, k, v, cap, scale, p):
        return gproj_attn_func(q, k, v, causal=True, softcap=cap, softmax_scale=scale, dropout_p=p)
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for cap, scale, p in ((30.0, 0.25, 0.0), (5.0, 0.5, 0.1)):
        torch.manual_seed(1)  # the dropout seed is drawn from torch's generator
        got = compiled(q, k, v, cap, scale, p)
        torch.manual_seed(1)
        assert torch.equal(got, f(q, k, v, cap, scale, p))


@pytest.mark.parametrize(
    "cap, scale, p, words",
    [
        (0.0, -0.5, 0.0, r"softmax_scale must be a positive float ≤ 2.36e\+38 .* got -0.5"),
        (0.0, float("nan"), 0.0, r"softmax_scale must be a positive float .* got nan"),
        (0.0, True, 0.0, r"softmax_scale must be a positive float .* got True"),
        (0.0, torch.tensor([0.25, 0.5]), 0.0, r"softmax_scale must be .* got a 1-D torch.float32 tensor on cpu"),
        (-1.0, 0.25, 0.0, r"softcap must be a finite float >= 0 \(0: no capping\), got -1.0"),
        (float("nan"), 0.25, 0.0, r"softcap must be a finite float >= 0 \(0: no capping\), got nan"),
        (torch.tensor([5.0, 6.0]), 0.25, 0.0, r"softcap must be .* got a 1-D torch.float32 tensor on cpu"),
        (0.0, 0.25, 1.0, r"dropout_p must be a float in \[0, 1\) .* got 1.0"),
        (0.0, 0.25, torch.tensor([0.1, 0.2]), r"dropout_p must be .* got a 1-D torch.float32 tensor on cpu"),
    ],
)
def test_compile_dynamic_bad_float_arguments_name_the_argument_and_value(cap, scale, p, words):
    """Under torch.compile(dynamic=True, fullgraph=True) Dynamo wraps the op's ValueError in its own
    exception; the message must still carry the op's text with the refused value (the value is not in
    the source line Dynamo quotes, so a match proves the ValueError was built). Formatting a float
    module constant with a format spec, or the repr of a tensor, is not traceable there and replaced
    the op's message by Dynamo's own 'BUILD_STRING type error' / 'repr() on tensor'."""
    q, k, v = _qkv(1, 24, 2, 16, dtype=torch.bfloat16)
    torch._dynamo.reset()

    def f(q, k, v, cap, scale, p):
        return gproj_attn_func(q, k, v, causal=True, softcap=cap, softmax_scale=scale, dropout_p=p)
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    with pytest.raises(Exception, match=words):
        compiled(q, k, v, cap, scale, p)
    with pytest.raises(ValueError, match=words):  # eager: the same message
        f(q, k, v, cap, scale, p)


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda q, k, v: (q, k[:, :, :1, :8], v[:, :, :1, :8]), ValueError, "head dim"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch"),
        (lambda q, k, v: (q, k, v[:, :5]), ValueError, "same shape"),
        (lambda q, k, v: (q, k[:, :, :3], v[:, :, :3]), ValueError, "multiple"),
        (lambda q, k, v: (q, k.double(), v), TypeError, "dtype"),
        (lambda q, k, v: (q.long(), k, v), TypeError, "q must be a bf16, fp16, fp32 or fp64 tensor"),
        (lambda q, k, v: (q.to(torch.float8_e4m3fn), k, v), TypeError, "q must be a bf16"),
        (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
        (lambda q, k, v: (q.numpy(), k, v), TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v: (q[..., :12], k[..., :12], v[..., :12]), ValueError, "headdim"),
        (lambda q, k, v: (q[:, :0], k, v), ValueError, "non-empty"),
    ],
)
def test_bad_input_names_the_argument(make, exc, words):
    q, k, v = _qkv(2, 8, 4, 16)
    with pytest.raises(exc, match=words):
        gproj_attn_func(*make(q, k, v))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"dropout_p": 1.0}, r"dropout_p must be a float in \[0, 1\)"),
        ({"dropout_p": -0.1}, r"dropout_p must be a float in \[0, 1\)"),
        ({"dropout_p": float("nan")}, r"dropout_p must be a float in \[0, 1\)"),
        ({"dropout_p": "0.1"}, r"dropout_p must be a float in \[0, 1\)"),
        ({"dropout_p": torch.tensor([0.1, 0.2])}, r"dropout_p must be a float in \[0, 1\)"),
        ({"fix": "fast"}, "fix must be one of"),
        ({"softmax_scale": -1.0}, "softmax_scale"),
        ({"softmax_scale": float("nan")}, "softmax_scale"),
        ({"softmax_scale": 3e38}, "softmax_scale"),  # τ·log2e would overflow fp32: NaN, not an error, before
        ({"softmax_scale": torch.tensor([0.1, 0.2])}, "softmax_scale"),
        ({"softmax_scale": "0.1"}, "softmax_scale"),
        # A meta tensor has no value to read: refused by name, not by Tensor.item()'s own error.
        ({"dropout_p": torch.tensor(0.1, device="meta")}, r"dropout_p must be a float in \[0, 1\)"),
        ({"softmax_scale": torch.tensor(0.1, device="meta")}, "softmax_scale"),
        ({"softcap": torch.tensor(30.0, device="meta")}, "softcap must be a finite float"),
        # A learnable τ or cap would get no gradient (the op takes them as constants): refused, not silently detached.
        ({"softmax_scale": torch.nn.Parameter(torch.tensor(0.25))}, r"softmax_scale .* requires grad .*x\.detach\(\)"),
        ({"softcap": torch.nn.Parameter(torch.tensor(30.0))}, r"softcap .* requires grad .*x\.detach\(\)"),
        ({"dropout_p": torch.tensor(0.1, requires_grad=True)}, r"dropout_p .* requires grad"),
    ],
)
def test_bad_options_name_the_argument(kwargs, words):
    q, k, v = _qkv(1, 8, 2, 16)
    with pytest.raises(ValueError, match=words):
        gproj_attn_func(q, k, v, **kwargs)


@pytest.mark.parametrize("arg", ["causal", "deterministic"])
@pytest.mark.parametrize("value, words", [(np.bool_(True), "got numpy.bool"), (1, "got int"), (None, "got NoneType")])
def test_non_bool_flags_name_their_type(arg, value, words):
    q, k, v = _qkv(1, 8, 2, 16)
    with pytest.raises(TypeError, match=arg + r" must be a Python bool \(True or False\), " + words):
        gproj_attn_func(q, k, v, **{arg: value})
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match=arg + r" must be a Python bool \(True or False\), " + words):
        gproj_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, **{arg: value})


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_reaches_the_triton_backward(monkeypatch, packed, deterministic):
    """The op's ``deterministic`` rides from the forward call through autograd (and torch.compile's view of the op
    pair) to the Triton backward, whose one-pass rule reads it (tests/test_onepass_backward.py); the PyTorch reference
    is deterministic and does not take it. Stand-ins for the Triton kernels run the reference, so the gradients are
    the reference's, checked against float64."""
    import lightning_gproj.ops as ops
    from lightning_gproj.kernels import attention_bwd, attention_fwd

    seen = []

    def backward(*args, deterministic=None, **kwargs):
        seen.append(deterministic)
        return reference.backward(*args, **kwargs)

    monkeypatch.setattr(ops, "_use_triton", lambda *a: True)
    monkeypatch.setattr(attention_fwd, "forward", reference.forward)
    monkeypatch.setattr(attention_bwd, "backward", backward)
    q, k, v = (x.double().requires_grad_(True) for x in _qkv(1, 8, 2, 16))
    do = torch.randn(1, 8, 2, 16, dtype=torch.float64)
    if packed:  # two sequences, 3 and 5 tokens
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        o = gproj_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, causal=True, deterministic=deterministic)[None]
    else:
        o = gproj_attn_func(q, k, v, causal=True, deterministic=deterministic)
    o.backward(do)
    assert seen == [deterministic]
    parts = (slice(0, 3), slice(3, 8)) if packed else (slice(0, 8),)
    for part in parts:
        want = attention_fp64(*(x.detach()[:, part] for x in (q, k, v, do)), 16 ** -0.5, True)[:4]
        for got, ref in zip((o, q.grad, k.grad, v.grad), want):
            assert torch.allclose(got.detach()[:, part], ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), torch.tensor(0.3, dtype=torch.float64)])
def test_softmax_scale_takes_numpy_numbers_and_one_element_tensors(scale):
    """A NumPy scalar or a one-element float tensor holding τ means float(τ): the fp64 reference with
    τ = float(scale) (0.3 rounded as the scale's own dtype rounds it)."""
    q, k, v = _qkv(1, 8, 2, 16)
    o = gproj_attn_func(q, k, v, softmax_scale=scale)
    tau = float(scale)
    s64 = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * tau
    o64 = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s64, dim=-1), v.double())
    assert ((o.double() - o64).norm() / o64.norm()).item() < 1e-6


def test_softcap_takes_numpy_numbers_and_one_element_tensors():
    q, k, v = _qkv(1, 8, 2, 16)
    ref = gproj_attn_func(q, k, v, softcap=5.0)
    for cap in (np.float32(5.0), torch.tensor(5.0)):
        assert torch.equal(gproj_attn_func(q, k, v, softcap=cap), ref)
    with pytest.raises(ValueError, match="softcap"):
        gproj_attn_func(q, k, v, softcap=torch.tensor([5.0, 6.0]))


def test_meta_tensors_give_shapes_without_computing():
    """Shape-only calls (Lightning's measure_flops runs the model on the meta device) get the output
    and gradients as meta tensors of the right shapes, no error."""
    q = torch.empty(2, 8, 4, 16, device="meta", requires_grad=True)
    k = torch.empty(2, 5, 2, 16, device="meta", requires_grad=True)
    o = gproj_attn_func(q, k, k, causal=True)
    assert o.device.type == "meta" and o.shape == (2, 8, 4, 16)
    o.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and q.grad.device.type == "meta"


def test_stats_name_must_be_a_string():
    q, k, v = _qkv(1, 8, 2, 16)
    with pytest.raises(TypeError, match="stats_name"):
        gproj_attn_func(q, k, v, stats_name=5)


def test_double_backward_is_refused_by_name():
    """A gradient with create_graph=True works (and equals the plain one); differentiating it again raises
    an error that says what is unsupported and what to use, not torch's generic missing-formula one."""
    torch.manual_seed(8)
    q, k, v = (x.requires_grad_() for x in _qkv(1, 8, 2, 16, dtype=torch.bfloat16))
    (g,) = torch.autograd.grad(gproj_attn_func(q, k, v, causal=True).float().sum(), q, create_graph=True)
    (g_plain,) = torch.autograd.grad(gproj_attn_func(q, k, v, causal=True).float().sum(), q)
    assert torch.equal(g, g_plain)
    with pytest.raises(RuntimeError, match="no second derivative.*create_graph=True"):
        g.float().sum().backward()


def test_autocast_saves_the_16_bit_copies():
    """Under autocast the op keeps, for its backward, the bf16 copies it computed with — not the fp32
    inputs (twice the memory, and a second cast in the backward) — and still returns the fp32 inputs
    fp32 gradients equal to the reference's fp32 accumulators on those copies."""
    torch.manual_seed(6)
    q, k, v = (x.float().requires_grad_() for x in _qkv(1, 40, 2, 16))
    saved = []

    def pack(x):
        saved.append((x.dtype, tuple(x.shape)))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), torch.autocast("cpu", dtype=torch.bfloat16):
        o = gproj_attn_func(q, k, v, causal=True, fix="gproj")
    assert (torch.bfloat16, tuple(q.shape)) in saved
    assert (torch.float32, tuple(q.shape)) not in saved, saved
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    assert dq.dtype == dk.dtype == dv.dtype == torch.float32
    qb, kb, vb = (x.detach().bfloat16() for x in (q, k, v))
    o_ref, m, log2l = reference.forward(qb, kb, vb, 16**-0.5, True)
    ref = reference.backward(do, qb, kb, vb, o_ref, m, log2l, 16**-0.5, True, "gproj", grad_dtype=torch.float32)
    for x, y in zip((dq, dk, dv), ref[:3]):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)


def test_autocast_fp32_inputs_get_unrounded_fp32_gradients():
    """Under autocast an fp32 k gets the fp32 accumulators as its gradient: Σ_j dK_j = 0 (C2,
    DESIGN.md §2) holds to fp32 rounding with fix="gproj", where a bf16 copy of the same dK breaks it
    by ~√N·2⁻⁹; a bf16 v next to it still gets a bf16 gradient."""
    torch.manual_seed(5)
    q, k, v = _qkv(2, 96, 2, 32)
    k = k + 30.0  # a large mean key, where the zero-sum leak matters
    v = v.bfloat16()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    do = torch.randn(2, 96, 2, 32, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = gproj_attn_func(q, k, v, causal=True, fix="gproj")
    assert o.dtype == torch.bfloat16
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do.bfloat16())
    assert (dq.dtype, dk.dtype, dv.dtype) == (torch.float32, torch.float32, torch.bfloat16)

    def c2(dk):
        return (dk.double().sum(dim=1).norm() / dk.double().norm()).item()

    assert c2(dk) < 1e-5
    assert c2(dk.bfloat16()) > 1e-4  # the rounding the fp32 gradient avoids
    # Same values as the reference's fp32 accumulators on the bf16-cast inputs.
    qb, kb, vb = q.detach().bfloat16(), k.detach().bfloat16(), v.detach()
    o_ref, m, log2l = reference.forward(qb, kb, vb, 32**-0.5, True)
    _, dk_ref, _, _ = reference.backward(do.bfloat16(), qb, kb, vb, o_ref, m, log2l, 32**-0.5, True, "gproj",
                                         grad_dtype=torch.float32)
    assert torch.equal(o, o_ref)
    assert torch.equal(dk, dk_ref)


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.float16, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.float16),
        (torch.float16, torch.float16, torch.float16),
        (torch.float32, torch.float64, torch.float32),
        (torch.float64, torch.float64, torch.float64),
    ],
)
def test_autocast_dtypes_follow_sdpa(dtypes):
    """Under autocast the op accepts and casts exactly what autocast lets SDPA accept (fp16 / bf16 / fp32
    cast to the autocast dtype, fp64 kept), returns o in SDPA's dtype, and each gradient in its input's."""
    torch.manual_seed(6)
    q, k, v = (x.to(dt).requires_grad_() for x, dt in zip(_qkv(1, 12, 2, 16, dtype=torch.float64), dtypes))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        try:
            ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        except RuntimeError:
            ref = None
        if ref is None:
            with pytest.raises(TypeError, match="must share one dtype after autocast casts fp16/bf16/fp32 inputs"):
                gproj_attn_func(q, k, v)
            return
        o = gproj_attn_func(q, k, v)
    assert o.dtype == ref.dtype
    assert (o.transpose(1, 2).double() - ref.double()).norm() <= 2e-2 * ref.double().norm()
    grads = torch.autograd.grad(o.float().sum(), (q, k, v))
    assert [g.dtype for g in grads] == list(dtypes)


@pytest.mark.parametrize("causal", [False, True])
def test_layout_bhsd_equals_transposed_bshd(causal):
    """layout="bhsd" takes SDPA's (batch, nheads, seqlen, headdim) and returns o in it: the same numbers
    as the flash layout on the transposed tensors, gradients included (GQA, Nq != Nk)."""
    torch.manual_seed(8)
    q = torch.randn(2, 4, 6, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    o = gproj_attn_func(q, k, v, causal=causal, layout="bhsd")
    assert o.shape == (2, 4, 6, 16)
    ref = gproj_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), causal=causal).transpose(1, 2)
    assert torch.equal(o, ref)
    do = torch.randn_like(o)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(o, (q, k, v), do),
                                                 torch.autograd.grad(ref, (q, k, v), do)))


def test_sdpa_layout_in_the_flash_layout_is_caught_where_the_shapes_tell():
    """What can be caught: SDPA-layout cross-attention (Nq = 6, Nk = 9 read as head counts) raises,
    naming layout='bhsd'; SDPA-layout tensors with more than 256 "heads" along dim 2 and fewer
    positions along dim 1 warn; layout="bshd" states the layout and silences the warning."""
    q = torch.randn(1, 4, 6, 16)
    k = v = torch.randn(1, 4, 9, 16)
    with pytest.raises(ValueError, match=r"nheads \(6\) must be a multiple of k/v's nheads \(9\).*layout='bhsd'"):
        gproj_attn_func(q, k, v)
    assert gproj_attn_func(q, k, v, layout="bhsd").shape == (1, 4, 6, 16)
    q, k, v = _qkv(1, 4, 320, 8)  # SDPA layout: 4 heads, 320 positions
    with pytest.warns(UserWarning, match=r"320 heads and 4 positions.*pass layout='bhsd'"):
        gproj_attn_func(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gproj_attn_func(q, k, v, layout="bshd")  # stated: no warning
        gproj_attn_func(q, k, v, layout="bhsd")
    with pytest.raises(ValueError, match=r"layout must be None or one of \('bshd', 'bhsd'\)"):
        gproj_attn_func(q, k, v, layout="nhd")
