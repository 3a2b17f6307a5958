"""Attention dropout (dropout_p > 0): the Philox keep mask, the zero-sum law with dropout, the Triton
kernels' DROPOUT variant under the interpreter, and the op's reproducibility.

Ground truth is a float64 autograd attention with the keep mask of ``reference.dropout_keep_mask``
applied explicitly (tests/_fp64.py): o = (P ∘ M / (1 − p̂)) V, p̂ the rounded p of the 8-bit keep test
(_fp64.dropout_scale). The Triton measurements come from one subprocess run of
tests/_triton_dropout_cases.py (~35 s on 2 CPU cores; see tests/test_triton_kernels.py for why a
subprocess).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_gproj import gproj_attn_func, gproj_attn_varlen_func
from lightning_gproj.kernels import reference as R
from _attention_models import op_keep_mask
from _fp64 import attention_fp64, dropout_scale, median_head_error

HERE = Path(__file__).resolve().parent
GRADS = ("dq", "dk", "dv")


# --------------------------------------------------------------------------------------- Philox, mask


def test_philox_matches_the_random123_known_answers():
    """Philox4x32-10 known-answer vectors of Random123 (kat_vectors: counter, key -> output)."""
    z, f = torch.tensor(0), torch.tensor(0xFFFFFFFF)
    assert [int(x) for x in R.philox4x32(0, z, z, z, z)] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert [int(x) for x in R.philox4x32(2**64 - 1, f, f, f, f)] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    pi = [torch.tensor(x) for x in (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)]
    key = 0x299F31D0 << 32 | 0xA4093822
    assert [int(x) for x in R.philox4x32(key, *pi)] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_is_one_minus_p(p):
    """2·4·64·64 = 32768 elements: the kept fraction lies within 5 binomial standard deviations of 1 − p."""
    keep = R.dropout_keep_mask(1234, 0, p, 2, 4, 64, (0, 64), (0, 64))
    n = keep.numel()
    assert abs(keep.float().mean().item() - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n)


def _documented_keep(seed: int, offset: int, p: float, nheads: int, n_k: int, b: int, h: int, i: int, j: int) -> bool:
    """Element (b, h, i, j) of the keep mask as reference.dropout_keep_mask's docstring states it, from one
    philox4x32 call: G = ⌈n_k / 16⌉, g = j // 16, c = j % 16, counters (i·G + g mod 2³², b·nheads + h,
    offset, i·G + g div 2³²); byte c % 4 (0: the lowest) of output word c // 4 against
    min(round(p·2⁸), 2⁸ − 1)."""
    lin, c = i * -(-n_k // 16) + j // 16, j % 16
    words = R.philox4x32(seed, *(torch.tensor(x) for x in (lin % 2**32, b * nheads + h, offset, lin >> 32)),
                         rounds=R.PHILOX_ROUNDS)
    return ((int(words[c // 4]) >> (8 * (c % 4))) & 0xFF) >= min(round(p * 2**8), 2**8 - 1)


def test_mask_element_is_the_documented_philox_byte():
    """dropout_keep_mask, element for element, equals the documented formula computed directly
    (:func:`_documented_keep`), both from the full mask and from a one-element window of rows and
    columns: n_k = 53 (the last group, keys 48..52, partial) at places c = 0, 7 and 15 of a group, keys of
    the last group and 30 random elements; n_k = 2³³ + 5, where the group counter crosses 2³² (c3 = 1)
    and the last group holds keys 2³³ .. 2³³ + 4. The sample holds kept and dropped elements."""
    seed, offset, p, batch, nheads = 2**63 + 5, 11, 0.37, 2, 3
    mask = R.dropout_keep_mask(seed, offset, p, batch, nheads, 53, (0, 20), (0, 53))
    gen = torch.Generator().manual_seed(0)
    picks = [(0, 0, 0, 0), (0, 0, 0, 7), (0, 0, 0, 15), (0, 1, 5, 8), (1, 2, 19, 15), (1, 2, 19, 48), (0, 1, 7, 50), (1, 0, 3, 52)]
    picks += [tuple(int(torch.randint(0, n, (1,), generator=gen)) for n in (batch, nheads, 20, 53)) for _ in range(30)]
    expected = []
    for b, h, i, j in picks:
        want = _documented_keep(seed, offset, p, nheads, 53, b, h, i, j)
        one = R.dropout_keep_mask(seed, offset, p, batch, nheads, 53, (i, i + 1), (j, j + 1))
        assert bool(mask[b, h, i, j]) == want and bool(one[b, h, 0, 0]) == want, (b, h, i, j)
        expected.append(want)
    n_k = 2**33 + 5
    for i, j in ((3, 0), (3, 15), (9, 2**33 - 1), (9, 2**33), (9, 2**33 + 4), (11, 2**32 + 3)):
        assert (i * -(-n_k // 16) + j // 16 >= 2**32) == (i >= 9)
        want = _documented_keep(seed, offset, p, nheads, n_k, 1, 2, i, j)
        one = R.dropout_keep_mask(seed, offset, p, batch, nheads, n_k, (i, i + 1), (j, j + 1))
        assert bool(one[1, 2, 0, 0]) == want, (i, j)
        expected.append(want)
    assert any(expected) and not all(expected)


def test_mask_depends_on_seed_offset_and_position():
    """Same seed and offset: the same mask; another seed or offset: independent masks (elements differ
    with probability 2p(1 − p) = 0.42 at p = 0.3; 5 sigma band on 4096 elements). Rows, columns and
    heads draw from distinct counters, and the 16 keys of a group from distinct bytes: a mask
    that repeated over them would agree far more often."""
    p, n = 0.3, 4096

    def mask(seed, offset):
        return R.dropout_keep_mask(seed, offset, p, 1, 2, 32, (0, 64), (0, 32))

    base = mask(7, 0)
    assert torch.equal(base, mask(7, 0))
    band = 5 * math.sqrt(0.42 * 0.58 / n)
    for other in (mask(8, 0), mask(7 + 2**32, 0), mask(7, 1)):
        assert abs((other != base).float().mean().item() - 0.42) <= band
    assert abs((base[0, 0] != base[0, 1]).float().mean().item() - 0.42) <= 5 * math.sqrt(0.42 * 0.58 / 2048)
    assert abs((base[0, :, :32] != base[0, :, 32:]).float().mean().item() - 0.42) <= band
    groups = base.view(1, 2, 64, 2, 16)  # (…, group, place c)
    for c, other in ((0, 1), (0, 2), (1, 3), (0, 4), (0, 7), (0, 8), (3, 12), (0, 15)):
        differ = (groups[..., c] != groups[..., other]).float().mean().item()
        assert abs(differ - 0.42) <= 5 * math.sqrt(0.42 * 0.58 / 256), (c, other)


# ----------------------------------------------------------------------------------- the zero-sum law


def test_zero_sum_law_holds_for_the_undropped_p():
    """With O = (P ∘ M) V / (1 − p̂) (p̂ the rounded p, _fp64.dropout_scale): dS = P ∘ (dP' − D), dP' = ∂L/∂P (through the mask), D = Σ_j P dP'
    = rowsum(dO ∘ O). Each row of dS sums to zero (to float64 rounding) for the undropped P; the same
    expression with the dropped P ∘ M / (1 − p̂) in its place does not sum to zero, and dS is not zero
    on the dropped entries (−P_ij D_i)."""
    torch.manual_seed(0)
    b, n, h, d, p = 1, 48, 2, 16, 0.3
    q, k, v, do = (torch.randn(b, n, h, d, dtype=torch.float64) for _ in range(4))
    keep = R.dropout_keep_mask(99, 0, p, b, h, n, (0, n), (0, n))
    o, _, _, _, ds = attention_fp64(q, k, v, do, d**-0.5, True, keep=keep, dropout_p=p)
    # dS ≡ 0 on causal row 0 (one key seen) and on rows whose seen keys are all dropped (dP' = D = 0).
    scale = ds.abs().sum(dim=-1)
    live = scale > 0
    assert live.sum() >= 0.9 * live.numel()
    assert (ds.sum(dim=-1)[live].abs() / scale[live]).max() <= 1e-12
    # D from the dropped output equals Σ_j P_ij dP'_ij: D = rowsum(dO ∘ O) needs no change
    s = torch.einsum("bihd,bjhd->bhij", q, k) * d**-0.5
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    P = torch.softmax(s, dim=-1)
    dp_dropped = torch.einsum("bihd,bjhd->bhij", do, v) * keep * dropout_scale(p)
    D = (do * o).sum(dim=-1).transpose(1, 2)
    assert torch.allclose(D, (P * dp_dropped).sum(dim=-1), rtol=1e-12, atol=1e-12)
    Pd = P * keep * dropout_scale(p)
    wrong = Pd * (dp_dropped - (Pd * dp_dropped).sum(dim=-1, keepdim=True))
    assert (wrong.sum(dim=-1)[live].abs() / scale[live]).median() >= 1e-2
    dropped = ~keep & (P > 0)
    assert torch.allclose(ds[dropped], -(P * D[..., None])[dropped], rtol=1e-10, atol=1e-15)


def _grads(q, k, v, do, fix, seed, p, causal=False):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    torch.manual_seed(seed)
    o = gproj_attn_func(q, k, v, causal=causal, fix=fix, dropout_p=p)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def test_gproj_with_dropout_removes_the_leak():
    """bf16 through the op (the reference on CPU), keys with a large mean (the leak τ r k̄ dominates an
    uncorrected dq): against float64 with the op's own mask, fix="gproj" keeps dq at the bf16 level
    and at least 3× below fix="none"; o, dk, dv at the bf16 level; the zero-sum violation of the
    gproj-corrected rows is gone (C2 on the fp32 dk of the reference: ~fp32 rounding)."""
    torch.manual_seed(4)
    b, n, h, d, p = 1, 96, 2, 32, 0.2
    q = torch.randn(b, n, h, d).bfloat16()
    k = (torch.randn(b, n, h, d) + 8).bfloat16()
    v, do = torch.randn(b, n, h, d).bfloat16(), torch.randn(b, n, h, d).bfloat16()
    keep = op_keep_mask(5, p, b, h, n, n)
    o64, dq64, dk64, dv64, _ = attention_fp64(q, k, v, do, d**-0.5, True, keep=keep, dropout_p=p)
    err = {}
    for fix in ("none", "gproj"):
        o, dq, dk, dv = _grads(q, k, v, do, fix, 5, p, causal=True)
        err[fix] = median_head_error(dq, dq64)
        for x, ref in ((o, o64), (dk, dk64), (dv, dv64)):
            assert median_head_error(x, ref) <= 6e-3, fix
    assert err["gproj"] <= 6e-3
    assert err["gproj"] * 3 <= err["none"], err
    o, m, l2 = R.forward(q, k, v, d**-0.5, True, dropout_p=p, dropout_seed=123)
    c2 = {}
    for fix in ("none", "gproj"):
        dk32 = R.backward(do, q, k, v, o, m, l2, d**-0.5, True, fix, grad_dtype=torch.float32, dropout_p=p,
                          dropout_seed=123)[1].double()
        c2[fix] = (dk32.sum(dim=1).norm() / dk32.norm()).item()
    assert c2["gproj"] <= 1e-6 and c2["none"] >= 1e-4, c2


def test_recorded_statistics_with_dropout(recorder_off):
    """The monitors' statistics with dropout: the zero-sum violation is recorded for both fixes, and
    the leak ratio recorded for fix="none" is what the gradients show, ‖dq_none − dq_gproj‖ / ‖dq_gproj‖
    (the same seed, hence the same mask, for both calls; 2% for the bf16 storage of the two dq)."""
    from lightning_gproj.stats import RECORDER

    torch.manual_seed(6)
    q, do = torch.randn(1, 64, 2, 32).bfloat16(), torch.randn(1, 64, 2, 32).bfloat16()
    k, v = (torch.randn(1, 64, 2, 32) + 8).bfloat16(), torch.randn(1, 64, 2, 32).bfloat16()
    stats, dq = {}, {}
    for fix in ("none", "gproj"):
        with RECORDER.recording():
            dq[fix] = _grads(q, k, v, do, fix, 7, 0.1, causal=True)[1].double()
            stats[fix] = RECORDER.drain()["attention"]
    assert all(math.isfinite(stats[f]["violation_median"]) for f in ("none", "gproj"))
    leak = ((dq["none"] - dq["gproj"]).norm() / dq["gproj"].norm()).item()
    assert leak >= 0.01  # keys shifted by 8: the leak is several times the bf16 rounding level (~2e-3)
    assert stats["none"]["leak_ratio"] == pytest.approx(leak, rel=2e-2)
    assert stats["gproj"]["leak_removed_ratio"] == pytest.approx(leak, rel=2e-2)


# -------------------------------------------------------------------------------- the op, reproducible


def test_same_seed_same_result_bit_for_bit():
    """Two calls after the same torch.manual_seed: identical o and gradients; another seed: different;
    dropout_p = 0 does not advance the generator."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, 24, 2, 16).bfloat16() for _ in range(4))
    a, b_, c = _grads(q, k, v, do, "gproj", 1, 0.25), _grads(q, k, v, do, "gproj", 1, 0.25), _grads(q, k, v, do, "gproj", 2, 0.25)
    assert all(torch.equal(x, y) for x, y in zip(a, b_))
    assert all(not torch.equal(x, y) for x, y in zip(a, c))
    torch.manual_seed(1)
    seeded = gproj_attn_func(q, k, v, dropout_p=0.25)
    assert torch.equal(seeded, a[0])
    state = torch.get_rng_state()
    gproj_attn_func(q, k, v, dropout_p=0.0)
    assert torch.equal(state, torch.get_rng_state())


def test_dv_uses_the_forward_mask_and_numpy_p():
    """fp64 through the op: o and every gradient equal float64 autograd with the mask the op drew
    (dV = ((P ∘ M)/(1 − p))ᵀ dO); p given as a NumPy number or a one-element tensor means float(p)."""
    import numpy as np

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 20, 2, 16, dtype=torch.float64) for _ in range(4))
    keep = op_keep_mask(9, 0.4, 1, 2, 20, 20)
    ref = attention_fp64(q, k, v, do, 16**-0.5, False, keep=keep, dropout_p=0.4)[:4]
    for p in (0.4, np.float64(0.4), torch.tensor(0.4, dtype=torch.float64)):
        got = _grads(q, k, v, do, "gproj", 9, p)
        for x, y in zip(got, ref):
            assert torch.allclose(x, y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("p", [1e-3, 0.3, 0.9999])
def test_kept_weights_are_scaled_by_one_over_the_kept_probability(p):
    """fp64 through the op: o and every gradient equal float64 attention with the op's mask and the
    kept weights scaled by 1/(1 − p̂), p̂ = min(round(p·2⁸), 2⁸ − 1)/2⁸ the drop probability of the
    8-bit keep test (_fp64.dropout_scale), so E[M]/(1 − p̂) = 1. 1/(1 − p) would be off by
    (1 − p̂)/(1 − p): 1 + 1e-3 at p = 1e-3 (p̂ = 0, nothing dropped), 1 − 1.1e-3 at 0.3, 39 at 0.9999."""
    torch.manual_seed(0)
    b, nq, nk, h, d = 2, 64, 130, 4, 16
    q, do = (torch.randn(b, nq, h, d, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, nk, h, d, dtype=torch.float64) for _ in range(2))
    keep = op_keep_mask(3, p, b, h, nq, nk)
    assert keep.any() and (p < 2**-9) == bool(keep.all())  # p = 0.9999 keeps ~1/256 of the weights here
    ref = attention_fp64(q, k, v, do, d**-0.5, True, keep=keep, dropout_p=p)[:4]
    got = _grads(q, k, v, do, "gproj", 3, p, causal=True)
    for x, y in zip(got, ref):
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("p, applied", [(1e-3, 0.0), (0.01, 3 / 256), (0.999, 255 / 256), (0.1, None), (0.5, None),
                                        (0.9, None), (0.0, None)])
def test_a_p_the_byte_test_cannot_apply_within_10_percent_warns(p, applied):
    """p is applied as round(p·256)/256: where that is more than 10% off p (or 1 − p off 1 − p) the op says so once,
    naming the p applied; 0.1, 0.5, 0.9 (off by ≤ 1.6%) and 0 (off) pass silently."""
    q = torch.randn(1, 8, 1, 8, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gproj_attn_func(q, q, q, dropout_p=p)
    said = [str(w.message) for w in seen if "dropout_p" in str(w.message)]
    if applied is None:
        assert said == []
    else:
        assert len(said) == 1 and f"is applied as {applied:g}" in said[0], said


def test_saturated_threshold_is_still_unbiased():
    """p = 1 − 1e-9: the 8-bit threshold saturates at 2⁸ − 1 (a weight is kept with probability
    2⁻⁸, not 1e-9). q = k = 0 and v = 1 make each output element the kept share of its row times the
    scale, so the mean over 2²² weights estimates E[M]·scale: within 5 binomial standard deviations of
    1 (≈ 16384 weights kept), where 1/(1 − p) would give 2⁻⁸ · 1e9 ≈ 3.9e6; and exactly the mean of
    the op's mask times 1/(1 − p̂)."""
    p, nq, nk, h = 1 - 1e-9, 512, 1024, 8
    q, k, v = torch.zeros(1, nq, h, 8), torch.zeros(1, nk, h, 8), torch.ones(1, nk, h, 8)
    q, k, v = (x.double() for x in (q, k, v))
    keep = op_keep_mask(5, p, 1, h, nq, nk)
    torch.manual_seed(5)
    o = gproj_attn_func(q, k, v, dropout_p=p)
    mean = o[..., 0].mean().item()
    kept = 2**-8  # the saturated threshold's keep probability
    assert abs(mean - 1) <= 5 * math.sqrt((1 - kept) / (kept * keep.numel()))
    assert mean == pytest.approx(keep.double().mean().item() * dropout_scale(p), rel=1e-12)


def test_varlen_mask_is_over_packed_rows_and_each_sequences_keys():
    """gproj_attn_varlen_func (fp64) against float64 attention over all packed tokens with the mask of
    dropout_keep_mask(batch=1) over the packed query rows and each sequence's own keys (the second
    sequence's keys start at packed key 6, inside a group of 16); a single packed sequence equals the
    dense call."""
    from _fp64 import packed_attention_fp64

    torch.manual_seed(1)
    cu = torch.tensor([0, 6, 6, 17], dtype=torch.int32)
    q, k, v, do = (torch.randn(17, 2, 16, dtype=torch.float64) for _ in range(4))
    keep = op_keep_mask(3, 0.3, 1, 2, 17, 17, cu_seqlens=(cu, cu))
    ref = packed_attention_fp64(q, k, v, do, 16**-0.5, True, cu, cu, keep=keep, dropout_p=0.3)
    q_, k_, v_ = (x.clone().requires_grad_() for x in (q, k, v))
    torch.manual_seed(3)
    o = gproj_attn_varlen_func(q_, k_, v_, cu, cu, 11, 11, causal=True, dropout_p=0.3)
    o.backward(do)
    for x, y in zip((o.detach(), q_.grad, k_.grad, v_.grad), ref):
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-12)
    one = torch.tensor([0, 17], dtype=torch.int32)
    torch.manual_seed(3)
    packed = gproj_attn_varlen_func(q, k, v, one, one, 17, 17, causal=True, dropout_p=0.3)
    torch.manual_seed(3)
    assert torch.equal(packed, gproj_attn_func(q[None], k[None], v[None], causal=True, dropout_p=0.3)[0])


def test_activation_checkpointing_recomputes_the_same_mask():
    """torch.utils.checkpoint restores the CPU RNG state before recomputing, so the recomputed forward
    draws the same seed: gradients equal those of the plain run."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 16, 2, 16, dtype=torch.float64) for _ in range(4))
    plain = _grads(q, k, v, do, "gproj", 4, 0.5)
    qc, kc, vc = (x.clone().requires_grad_() for x in (q, k, v))
    torch.manual_seed(4)
    o = checkpoint(lambda a, b, c: gproj_attn_func(a, b, c, dropout_p=0.5), qc, kc, vc, use_reentrant=False)
    o.backward(do)
    assert torch.equal(o.detach(), plain[0])
    assert all(torch.equal(x, y) for x, y in zip((qc.grad, kc.grad, vc.grad), plain[1:]))


def test_compiles_in_one_graph_and_draws_a_seed_per_call():
    """torch.compile(fullgraph=True) traces the seed draw and the op with no graph break; the compiled
    call draws a fresh seed per call (two seeds, two masks) and equals the eager call after the same
    torch.manual_seed (aot_eager: the same op on the same seed)."""
    import torch._dynamo

    def f(q, k, v):
        return gproj_attn_func(q, k, v, causal=True, dropout_p=0.3)

    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    explanation = torch._dynamo.explain(f)(q, k, v)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(1)
    a = compiled(q, k, v)
    a.sum().backward()
    torch.manual_seed(2)
    b = compiled(q, k, v)
    torch.manual_seed(1)
    assert torch.equal(a, f(q, k, v)) and not torch.equal(a, b)
    torch._dynamo.reset()


# ------------------------------------------------------------------------- Triton, under the interpreter


@pytest.fixture(scope="module")
def measured() -> dict:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(HERE / "_triton_dropout_cases.py")], env=env, capture_output=True,
                          text=True, timeout=900, cwd=str(HERE))
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_philox_is_bit_exact(measured):
    """tl.philox (all four outputs, reference.PHILOX_ROUNDS rounds) and the kernels' dropout_keep, as
    built and transposed, equal the PyTorch Philox and dropout_keep_mask bit for bit, for seeds 0, 1,
    < 2³², >= 2³², >= 2⁶³ and 2⁶⁴ − 1 and an offset of 2³² − 1; n_k not a multiple of 8, a tile that
    starts at key 2²⁸ − 64, the group counter crosses 2³² (c3 is used)."""
    ph = measured["philox"]
    assert len(ph["philox_equal"]) == 6 and all(ph["philox_equal"])
    assert len(ph["keep_equal"]) == 12 and all(ph["keep_equal"])
    assert len(ph["keep_t_equal"]) == 12 and all(ph["keep_t_equal"])


def test_triton_kernel_passes_apply_the_reference_mask(measured):
    """The keep mask read off the outputs of the forward, the dQ pass and the dK/dV pass (whose tile is
    [keys, queries]) equals reference.dropout_keep_mask element for element: a dense GQA call with
    n_k = 53 (tiles with a partial last group) and packed sequences whose keys start at packed keys
    0, 7, 10, 29 (an empty sequence among them). The decoded values sit within 0.1 of integers (the
    readout is sound), and each mask drops a share near p = 0.5 (so equality is not trivial)."""
    cases = measured["masks"]
    assert [len(c["fwd"]) for c in cases] == [2, 3]
    for c in cases:
        assert all(c["fwd"]) and all(c["dq"]) and all(c["dkdv"]), c
        assert c["decode_off"] <= 0.1, c
        assert all(0.3 <= f <= 0.7 for f in c["kept_frac"]), c


def test_triton_dropout_forward(measured):
    """Same bounds as tests/test_triton_kernels.py (its docstrings give the reasons): o against the
    reference within one 16-bit ulp relative (2⁻⁸) and no less accurate than it against float64 with
    the same mask; m is the undropped P's; the same seed gives the same o bit for bit, another seed
    another mask (o moves by the dropout's own size, ≫ rounding)."""
    for c in measured["dense"] + measured["varlen"]:
        assert c["o_rel_vs_ref"] <= 3.9e-3, c["case"]
        assert c["o_rel_vs_f64"] <= 1.1 * c["ref_o_rel_vs_f64"] + 1e-4, c["case"]
    for c in measured["dense"]:
        assert c["same_seed_equal"] and c["other_seed_rel"] >= 0.1, c["case"]
        assert c["m_equal_undropped"] <= 1e-6, c["case"]


def test_triton_dropout_backward(measured):
    """Against the reference (same forward state and mask): 5e-4 and 0.15× the reference's own float64
    error, as without dropout. Against float64 with the forward's mask: the bf16 level (6e-3) for
    dk, dv and gproj's dq, which also beats fix="none"'s dq (keys shifted by 4) by 2×; against float64
    with another seed's mask every gradient is off by ≥ 10% — so the backward regenerates the forward's
    mask. Two runs are bit-identical; C2 of the fp32 dk holds for gproj with dropout (no softcap)."""
    cases = measured["dense"] + measured["varlen"]
    assert len(measured["dense"]) == 3 and len(measured["varlen"]) == 1
    for c in cases:
        for fix, b in c["bwd"].items():
            assert not b["nan"], (c["case"], fix)
            for g in GRADS:
                assert b[f"{g}_rel_vs_ref"] <= 5e-4, (c["case"], fix, g, b)
                assert b[f"{g}_rel_vs_ref"] <= 0.15 * b[f"ref_{g}_rel_vs_f64"], (c["case"], fix, g, b)
            for g in ("dk", "dv"):
                assert b[f"{g}_rel_vs_f64"] <= 6e-3, (c["case"], fix, g, b)
            if "repeat_equal" in b:
                assert b["repeat_equal"], (c["case"], fix)
                assert all(b[f"{g}_rel_vs_other_mask"] >= 0.1 for g in GRADS), (c["case"], fix, b)
        gp, none = c["bwd"]["gproj"], c["bwd"]["none"]
        assert gp["dq_rel_vs_f64"] <= 6e-3 and gp["dq_rel_vs_f64"] <= 0.5 * none["dq_rel_vs_f64"], c["case"]
        if "c2_residual_fp32" in gp:
            assert gp["c2_residual_fp32"] <= 1e-6 and none["c2_residual_fp32"] >= 1e-4, c["case"]
