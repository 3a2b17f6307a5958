"""GProj numerics against float64: conservation laws, the synthetic key-offset sweep, sharp attention.

The op runs the PyTorch reference on CPU (the Triton kernels are checked against it in
test_triton_kernels.py). Ground truth is plain softmax attention in float64 on the same bf16 inputs.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from lightning_gproj import gproj_attn_func
from lightning_gproj.kernels import reference
from _fp64 import attention_fp64, median_head_error

U32 = 2.0**-24  # unit roundoff of fp32


def _grads(q, k, v, do, fix, causal, scale=None):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = gproj_attn_func(q, k, v, softmax_scale=scale, causal=causal, fix=fix)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [False, True])
def test_projected_rows_sum_to_zero(causal):
    """C1 (DESIGN.md §2) seen from outside: if every query has last coordinate 0 and every key has
    last coordinate c, the scores — hence P, dP and the rounded dS — do not depend on c, and the last
    column of dQ is exactly τ·c·Σ_j dŜ_ij: the row sum of the dS the gradient was built from.

    Bound: that column is an fp32 sum of the n_i terms dŜ_ij·c; recursive summation errs by at most
    (n_i − 1)·u·c·Σ_j |dŜ_ij| (Higham, Accuracy and Stability, §4.2), plus one rounding of the
    correction term; Σ_j |dŜ_ij| is within 2× of the float64 Σ_j |dS_ij|. So |row sum| / (τ c Σ|dS|)
    ≤ 2·n_i·u. fix="none" must violate it (its rows sum to r_i ≠ 0), or the test could not fail."""
    torch.manual_seed(2)
    n, h, d, c = 256, 2, 32, 256.0
    scale = d**-0.5
    q = torch.randn(1, n, h, d)
    q[..., -1] = 0
    k = torch.randn(1, n, h, d) + 3
    k[..., -1] = c
    q, k = q.bfloat16(), k.bfloat16()
    v, do = torch.randn(1, n, h, d).bfloat16(), torch.randn(1, n, h, d).bfloat16()
    *_, ds64 = attention_fp64(q, k, v, do, scale, causal)
    abs_ds = ds64.abs().sum(dim=-1)  # (1, h, n)
    n_keys = torch.arange(1, n + 1) if causal else torch.full((n,), n)
    rows = n_keys > 1  # a row seeing one key has dS ≡ 0: nothing to normalize by
    bound = 2 * n_keys[rows] * U32

    ratios = {}
    for fix in ("gproj", "none"):
        _, dq, _, _ = _grads(q, k, v, do, fix, causal, scale)
        row_sum = dq[..., -1].double().transpose(1, 2) / (scale * c)
        ratios[fix] = (row_sum.abs() / abs_ds)[..., rows] / bound
    assert ratios["gproj"].max() <= 1.0
    assert ratios["none"].max() >= 10.0


@pytest.mark.parametrize("causal", [False, True])
def test_key_gradients_sum_to_zero(causal):
    """C2: Σ_j dK_j = τ Σ_i q_i Σ_j dŜ_ij = 0. Checked on the fp32 accumulators (grad_dtype=fp32;
    a bf16-stored dK carries its own ~2⁻⁹ storage rounding). Both projections end with
    reference.project_key_sum_, so what is left is the fp32 rounding of that last subtraction, a few u
    relative to ‖dK‖_F (measured 1.2–2.3 u); fix="none" leaves the leak τ Σ_i r_i q_i, far above it."""
    torch.manual_seed(3)
    n, h, d = 256, 2, 32
    scale = d**-0.5
    q = torch.randn(1, n, h, d).bfloat16()
    k = (torch.randn(1, n, h, d) + 3).bfloat16()
    v, do = torch.randn(1, n, h, d).bfloat16(), torch.randn(1, n, h, d).bfloat16()
    o, m, log2l = reference.forward(q, k, v, scale, causal)
    residual = {}
    for fix in ("gproj", "gproj_uniform", "none"):
        _, dk, _, _ = reference.backward(do, q, k, v, o, m, log2l, scale, causal, fix, grad_dtype=torch.float32)
        dk = dk.double()
        residual[fix] = (dk.sum(dim=1).norm(dim=-1) / dk.norm(dim=(1, 3))).max().item()
    assert residual["gproj"] <= 4 * U32
    assert residual["gproj_uniform"] <= 4 * U32
    assert residual["none"] >= 10 * n * U32


def _offset_keys(mu: float, sigma: float, n: int, h: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(1, n, h, d, generator=g)
    direction = torch.randn(1, 1, h, d, generator=g)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    q = (sigma * torch.randn(1, n, h, d, generator=g)).bfloat16()
    v = torch.randn(1, n, h, d, generator=g).bfloat16()
    do = torch.randn(1, n, h, d, generator=g).bfloat16()
    return q, (noise + mu * direction).bfloat16(), v, do


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sigma", [1.0, 3.0])
def test_synthetic_key_offset_sweep(causal, sigma):
    """DESIGN.md §6 sweep at CPU size (N = 512, d = 64): keys = μ + N(0, 1), ‖μ‖ ∈ {0, 50, 200, 1000}.

    The uncorrected dQ error grows with ‖μ‖ (the leak τ r_i k̄_i), GProj's stays flat; dV does not
    depend on the fix; GProj's dK is no worse than the uncorrected one."""
    n, h, d = 512, 4, 64
    scale = d**-0.5
    errors = {}
    for mu in (0.0, 50.0, 200.0, 1000.0):
        q, k, v, do = _offset_keys(mu, sigma, n, h, d, seed=0)
        _, dq64, dk64, dv64, _ = attention_fp64(q, k, v, do, scale, causal)
        dv_by_fix = {}
        for fix in reference.FIXES:
            _, dq, dk, dv = _grads(q, k, v, do, fix, causal)
            errors[mu, fix] = (median_head_error(dq, dq64), median_head_error(dk, dk64))
            dv_by_fix[fix] = dv
        assert torch.equal(dv_by_fix["none"], dv_by_fix["gproj"])
        assert torch.equal(dv_by_fix["none"], dv_by_fix["gproj_uniform"])
        assert median_head_error(dv_by_fix["none"], dv64) < 5e-3  # bf16 storage level (2⁻⁸ = 3.9e-3)
        assert errors[mu, "gproj"][1] <= errors[mu, "none"][1]
    assert errors[1000.0, "none"][0] >= 10 * errors[0.0, "none"][0]
    for mu in (50.0, 200.0, 1000.0):
        assert errors[mu, "gproj"][0] <= 1.25 * errors[0.0, "gproj"][0]


@pytest.mark.parametrize("causal", [False, True])
def test_sharp_attention_on_clustered_keys(causal):
    """Keys in 4 far-apart clusters, each query aligned with one: the keys a row attends to have a
    mean (its cluster's centre) far from the global mean. The P-weighted projection removes the
    leak there; the uniform one (which subtracts the global/prefix mean key) barely helps — the
    property that decided `fix="gproj"` on real activations (DESIGN.md §4)."""
    g = torch.Generator().manual_seed(1)
    n, h, d, clusters = 512, 4, 64, 4
    centres = torch.randn(h, clusters, d, generator=g)
    centres = 40 * centres / centres.norm(dim=-1, keepdim=True)
    key_cluster = torch.randint(0, clusters, (n,), generator=g)
    query_cluster = torch.randint(0, clusters, (n,), generator=g)
    k = (centres[:, key_cluster].transpose(0, 1)[None] + torch.randn(1, n, h, d, generator=g)).bfloat16()
    q = (0.5 * centres[:, query_cluster].transpose(0, 1)[None] + torch.randn(1, n, h, d, generator=g)).bfloat16()
    v = torch.randn(1, n, h, d, generator=g).bfloat16()
    do = torch.randn(1, n, h, d, generator=g).bfloat16()
    scale = d**-0.5
    _, dq64, _, _, _ = attention_fp64(q, k, v, do, scale, causal)
    err = {fix: median_head_error(_grads(q, k, v, do, fix, causal)[1], dq64) for fix in reference.FIXES}
    assert err["gproj"] * 5 <= err["none"]
    assert err["gproj"] < err["gproj_uniform"]


@pytest.mark.parametrize("value", [133120.0, 1000.0])
def test_constant_inputs_return_the_constant(value):
    """The forward FMA channel (DESIGN.md §1, §5): with q = k = v = constant every P row is uniform
    and o must be the constant exactly — an FMA-contracted exponent gives NaN for 133120."""
    x = torch.full((1, 64, 2, 64), value).bfloat16()
    for causal in (False, True):
        o = gproj_attn_func(x, x, x, causal=causal)
        assert torch.equal(o, x)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(50, 50, 4, 4), (37, 61, 4, 2), (61, 37, 4, 1)])
def test_bf16_forward_and_backward_close_to_fp64(causal, shape):
    """Any Nq, Nk, GQA/MQA: o, dq, dk, dv within bf16 accuracy of float64 (errors of a few 2⁻⁹)."""
    nq, nk, h, hk = shape
    torch.manual_seed(4)
    q = torch.randn(2, nq, h, 32).bfloat16()
    k, v = torch.randn(2, nk, hk, 32).bfloat16(), torch.randn(2, nk, hk, 32).bfloat16()
    do = torch.randn(2, nq, h, 32).bfloat16()
    o64, dq64, dk64, dv64, _ = attention_fp64(q, k, v, do, 32**-0.5, causal)
    o, dq, dk, dv = _grads(q, k, v, do, "gproj", causal)
    if causal and nq > nk:  # rows that see no key: output and gradient exactly 0
        assert torch.equal(o[:, : nq - nk], torch.zeros_like(o[:, : nq - nk]))
        assert torch.equal(dq[:, : nq - nk], torch.zeros_like(dq[:, : nq - nk]))
        o64, dq64, o, dq = (x[:, nq - nk :] for x in (o64, dq64, o, dq))
    for x, ref in ((o, o64), (dq, dq64), (dk, dk64), (dv, dv64)):
        assert median_head_error(x, ref) < 1e-2
        assert math.isfinite(x.float().abs().max().item())


def _right_padding(lens, nk):
    return torch.arange(nk)[None, :] < torch.tensor(lens)[:, None]  # (batch, nk), True = valid key


@pytest.mark.parametrize("fix", reference.FIXES)
@pytest.mark.parametrize("causal, nq", [(False, 48), (True, 48), (True, 30)])
def test_key_padding_matches_fp64_with_explicit_mask(fix, causal, nq):
    """seqlens_k against float64 autograd with an explicit boolean key mask (and-ed with the causal
    mask): bf16 inputs within bf16 accuracy (median per-head error < 1e-2, as the unpadded test
    above); fp32 inputs (no rounding emulation, the corrections at fp32 rounding) to 1e-5; padded
    keys get exactly zero dk and dv; a batch row with one valid key is included."""
    lens, nk, h, hk, d = [48, 19, 1], 48, 4, 2, 32
    mask = _right_padding(lens, nk)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, nq, h, d, generator=g)
    k = torch.randn(3, nk, hk, d, generator=g) + 2
    v, do = torch.randn(3, nk, hk, d, generator=g), torch.randn(3, nq, h, d, generator=g)
    scale = d**-0.5
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        qd, kd, vd, dod = (x.to(dtype) for x in (q, k, v, do))
        o64, dq64, dk64, dv64, _ = attention_fp64(qd, kd, vd, dod, scale, causal, key_mask=mask)
        qd, kd, vd = (x.detach().clone().requires_grad_() for x in (qd, kd, vd))
        o = gproj_attn_func(qd, kd, vd, causal=causal, fix=fix, seqlens_k=torch.tensor(lens))
        o.backward(dod)
        # Batch row 2 sees one key: there dS ≡ 0, so its dq and dk are 0 in exact arithmetic (no
        # relative error to take); they are compared in absolute terms below.
        for x, ref in ((o, o64), (qd.grad[:2], dq64[:2]), (kd.grad[:2], dk64[:2]), (vd.grad, dv64)):
            if dtype == torch.float32:
                assert ((x.double() - ref).norm() / ref.norm()).item() < tol, (dtype, fix)
            else:
                assert median_head_error(x, ref) < tol, (dtype, fix)
        if fix != "none":  # the projections zero the single-key row's dS (fix="none" keeps its residual)
            assert qd.grad[2].abs().max() <= 1e-6 * qd.grad.abs().max(), (dtype, fix)
            assert kd.grad[2].abs().max() <= 1e-6 * kd.grad.abs().max(), (dtype, fix)
        pad = ~mask
        assert not kd.grad[pad].any() and not vd.grad[pad].any()
        assert torch.isfinite(o).all() and torch.isfinite(qd.grad).all()


def test_key_padding_equals_truncated_keys():
    """Batch row b padded to length L computes exactly what the op computes on its first L keys alone
    (non-causal; causal with Nq == L: the bottom-right alignment of the truncated call is then the
    same as the padded one's only when Nq == Nk, so Nq == Nk == L here)."""
    torch.manual_seed(6)
    q = torch.randn(2, 40, 2, 32).bfloat16()
    k, v = (torch.randn(2, 40, 2, 32) + 1).bfloat16(), torch.randn(2, 40, 2, 32).bfloat16()
    do = torch.randn(2, 40, 2, 32).bfloat16()
    lens = torch.tensor([40, 23])
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = gproj_attn_func(qq, kk, vv, seqlens_k=lens)
    out.backward(do)
    q1, k1, v1 = (x[1:].detach().clone().requires_grad_() for x in (q, k[:, :23], v[:, :23]))
    out1 = gproj_attn_func(q1, k1, v1)
    out1.backward(do[1:])
    assert torch.equal(out[1:], out1)
    assert torch.equal(qq.grad[1:], q1.grad)
    assert torch.equal(kk.grad[1:, :23], k1.grad) and torch.equal(vv.grad[1:, :23], v1.grad)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3), nk=st.integers(1, 40), hk=st.integers(1, 3), d=st.sampled_from([1, 8, 16]),
    padded=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_project_key_sum_is_an_orthogonal_projection_onto_c2(batch, nk, hk, d, padded, seed):
    """project_key_sum_ maps dk onto {Σ_{valid j} dK_j = 0, masked keys 0} and is orthogonal there: it
    never moves dk farther from any gradient g satisfying C2 (so from the exact one), keeps masked keys
    at 0, and leaves a dk that already satisfies C2 unchanged (float64 throughout)."""
    g_ = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, nk + 1, (batch,), generator=g_) if padded else None
    valid = torch.ones(batch, nk, dtype=torch.bool) if lens is None else torch.arange(nk)[None, :] < lens[:, None]
    valid = valid[:, :, None, None]
    n_valid = valid.sum(dim=1, keepdim=True).double()

    def on_c2(x):  # an independent construction of a point satisfying C2: centre over the valid keys
        x = x * valid
        return (x - x.sum(dim=1, keepdim=True) / n_valid) * valid

    g = on_c2(torch.randn(batch, nk, hk, d, generator=g_, dtype=torch.float64))
    dk = torch.randn(batch, nk, hk, d, generator=g_, dtype=torch.float64) * valid
    projected = reference.project_key_sum_(dk.clone(), lens)
    assert torch.allclose(projected, on_c2(dk), rtol=0, atol=1e-12)
    # With the key sums handed in (as the Triton dK/dV kernel accumulates them): the same projection.
    given = reference.project_key_sum_(dk.clone(), lens, key_sums=(dk * valid).sum(dim=1))
    assert torch.allclose(given, on_c2(dk), rtol=0, atol=1e-12)
    assert (projected * ~valid).abs().max().item() == 0.0
    assert (projected.sum(dim=1).abs().max().item()) <= 1e-12 * max(1.0, dk.abs().sum().item())
    assert (projected - g).norm() <= (dk - g).norm() + 1e-12
    assert torch.allclose(reference.project_key_sum_(g.clone(), lens), g, rtol=0, atol=1e-12)
