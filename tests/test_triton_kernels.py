"""Triton attention kernels (kernels/attention_fwd.py, attention_bwd.py) under Triton's CPU interpreter.

CI has no GPU, so the kernels run with TRITON_INTERPRET=1 on small CPU tensors. ``triton.jit`` picks
compile-or-interpret when a kernel module is imported, and other tests of the suite may import triton
(or our kernels) first without the variable; the kernels are therefore exercised in a fresh
subprocess (tests/_triton_interp_cases.py) that sets TRITON_INTERPRET=1 before anything imports
triton, and which prints its measurements as JSON. This module only holds the thresholds and their
reasons. One subprocess run (~1-2 min on 2 CPU cores) serves every test here.

Shapes: B = 1..2, H = 2, N in {37, 40, 45, 53, 130} (never multiples of the 16×16 interpreter
blocks), d = 32/64, causal and not, GQA 2:1, Nq < Nk and Nq > Nk (rows with no visible key), fp16
with strided q and k. Keys carry a mean offset (+4 per coordinate) so that the leak GProj removes is
well above rounding (DESIGN.md §3).

Key padding (``seqlens_k``): three more cases run through every check below — non-causal GQA with a
length inside a block, causal Nq == Nk with lengths 16 (a block edge) and 1, causal Nq < Nk fp16
strided — against the same reference (which masks per batch row) and a float64 autograd reference
with an explicit boolean key mask; padded keys must get exactly zero dk and dv. Two of them skip the
fold variant to keep the interpreter time down (~15 s added).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
GRADS = ("dq", "dk", "dv")
#: Backward variants the interpreter run measures per case: the fixes of reference.FIXES plus the fold.
VARIANTS = ("none", "gproj", "gproj_fold", "gproj_uniform")


@pytest.fixture(scope="module")
def measured() -> dict:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(HERE / "_triton_interp_cases.py")],
        env=env, capture_output=True, text=True, timeout=900, cwd=str(HERE.parent),
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cases(measured):
    assert len(measured["cases"]) == 5 and len(measured["padded_cases"]) == 3
    assert all(set(c["bwd"]) == set(VARIANTS) for c in measured["cases"])
    assert all({"none", "gproj", "gproj_uniform"} <= set(c["bwd"]) for c in measured["padded_cases"])
    assert any(set(c["bwd"]) == set(VARIANTS) for c in measured["padded_cases"])
    return measured["cases"] + measured["padded_cases"]


def test_forward_matches_reference(measured):
    for c in _cases(measured):
        f = c["fwd"]
        assert not f["nan"], c["shape"]
        assert f["inf_pattern_equal"], c["shape"]  # rows with no visible key: log2l = +inf in both
        # m is a max of fp32 dot products; only their summation order differs (fp32 ulp at |s| ≲ 60 is
        # ~4e-6, a d ≤ 64 term sum can differ by a few of them).
        assert f["m_max_abs_diff"] <= 1e-4, c
        # log2 of l = Σ exp2(...) (l ≤ Nk ≤ 130): reordering the fp32 sum moves it by a few fp32 ulps.
        assert f["log2l_max_abs_diff"] <= 1e-5, c
        # O: the kernel rounds P to 16 bits relative to the *running* max (online softmax) and rescales
        # later; the reference rounds it relative to the final max. Both are the FA rounding model, but
        # individual P̃ differ by up to one 16-bit ulp (2^-8 relative for bf16), so O differs at the
        # output-rounding level: bound 2^-8 ≈ 3.9e-3 relative (measured 2e-4..1.7e-3).
        assert f["o_rel_vs_ref"] <= 3.9e-3, c
        # ...and it is no less accurate than the reference against float64.
        assert f["o_rel_vs_f64"] <= 1.1 * f["ref_o_rel_vs_f64"] + 1e-4, c


def test_backward_rounds_at_the_reference_points(measured):
    """Triton vs kernels/reference.py with the same forward state (m, log2l, o from the reference).

    The kernels and the reference round at the same points (P̃, dS̃, stored outputs) and differ only in
    the fp32 accumulation order of the GEMM reductions. That perturbs the pre-rounding fp32 values by
    ~1e-7 relative, so a 16-bit rounding flips by one ulp only for the rare values within ~1e-7 of a
    rounding boundary; the gradients then agree to ~1e-5..1e-4 relative (measured ≤ 8e-5; fix="gproj"
    dk also rounds −ρ∘Q, whose ρ comes from a differently ordered fp32 sum: ≤ 2e-4).
    A kernel that rounded at a different point (e.g. kept dS or P in fp32, or rounded P·K) would differ
    from the reference by the order of the rounding error itself, i.e. ≳ 0.3× the error against
    float64. The bounds below — 5e-4 absolute and 0.15× the reference's own error against float64 —
    separate the two.
    """
    for c in _cases(measured):
        for fix in c["bwd"]:
            b = c["bwd"][fix]
            assert not b["nan"], (c["shape"], fix)
            for g in GRADS:
                assert b[f"{g}_dtype_ok"], (c["shape"], fix, g)
                assert b[f"{g}_rel_vs_ref"] <= 5e-4, (c["shape"], c["causal"], fix, g, b)
                assert b[f"{g}_rel_vs_ref"] <= 0.15 * b[f"ref_{g}_rel_vs_f64"], (c["shape"], fix, g, b)


def test_backward_against_float64_autograd(measured):
    """Against plain softmax attention differentiated by autograd in float64 on the same inputs."""
    for c in _cases(measured):
        bf16 = "bfloat16" in c["dtype"]
        # 16-bit-level errors: inputs are exact, the rounding of P, dS and the outputs costs
        # ~2^-9 relative per element for bf16 (2^-12 for fp16), i.e. ~2-3e-3 (bf16) Frobenius.
        base = 6e-3 if bf16 else 8e-4
        for fix in c["bwd"]:
            b = c["bwd"][fix]
            for g in ("dk", "dv"):
                assert b[f"{g}_rel_vs_f64"] <= base, (c["shape"], fix, g, b)
        # Uncorrected dq carries the leak τ r k̄ (DESIGN.md §3): with ‖k̄‖ = 4√d it is several times the
        # rounding level; every fix removes it.
        none_dq = c["bwd"]["none"]["dq_rel_vs_f64"]
        for fix, b in c["bwd"].items():
            if fix == "none":
                assert b["dq_rel_vs_f64"] <= (3e-2 if bf16 else 4e-3), (c["shape"], fix, b)
                continue
            dq = b["dq_rel_vs_f64"]
            assert dq <= base, (c["shape"], fix, dq)
            assert dq <= 0.5 * none_dq, (c["shape"], fix, dq, none_dq)
        assert c["fwd"]["o_rel_vs_f64"] <= base, c


def test_conservation_of_key_gradient(measured):
    """C2 (DESIGN.md §2): ‖Σ_j dK_j‖ / ‖dK‖_F of the fp32 accumulators (grad_dtype=torch.float32).

    The projections make every corrected row of dS sum to zero, and both (gproj, fold or not, and
    gproj_uniform) end an fp32 dk with reference.project_key_sum_, so dK sums to zero up to the fp32
    rounding of that last subtraction: a few u = 2⁻²⁴ ≈ 6e-8. Without that last step the residual is
    whatever the two passes disagree on: the 16-bit correction operand (gproj: 1.3–3.8e-6) and any dS
    element the dK pass rounds one ulp away from the dQ pass that summed r (gproj_uniform, fp16 case:
    1.0e-5 when the interpreter's GEMMs summed in the FMA-kernel order of OpenBLAS, ~1e-7 in another
    order: the bound then passed or failed by CPU). The uncorrected kernel leaves the 16-bit rounding
    of dS in it (≥ 3e-4 here).
    """
    u = 2.0**-24
    for c in _cases(measured):
        bw = c["bwd"]
        assert "gproj" in bw and "gproj_uniform" in bw
        for fix, b in bw.items():
            if fix == "none":
                assert b["c2_residual_fp32"] >= 1e-4, (c["shape"], fix)
            else:  # gproj, gproj_fold, gproj_uniform
                assert b["c2_residual_fp32"] <= 4 * u, (c["shape"], fix)


def test_grad_dtype_triple(measured):
    """grad_dtype=(fp32, fp32, None) — what the op asks for under autocast with fp32 q, k and a bf16 v —
    gives the fp32 run's dq and dk (its C2 projection included) and the default run's 16-bit dv, bit
    for bit: the dtypes change only where each gradient is stored."""
    for c in _cases(measured):
        assert c["bwd"]["gproj"]["grad_dtype_triple_matches"], c["shape"]


def test_padded_keys_get_zero_gradients(measured):
    """Keys j >= seqlens_k[b] are masked: their dk and dv are exactly 0 (16-bit and fp32 outputs)."""
    for c in measured["padded_cases"]:
        for fix, b in c["bwd"].items():
            assert b["padded_keys_zero"], (c["shape"], c["seqlens_k"], fix)
            assert b["ref_padded_keys_zero"], (c["shape"], c["seqlens_k"], fix)


def test_values_behind_key_padding_never_reach_a_result(measured):
    """NaN, +inf and 1e10 in the keys and values past seqlens_k: the Triton kernels and the reference
    return bit-identical o, m, log2l, dq, dk, dv to the call with clean padding (every fix, causal and
    not, 16-bit and fp32 gradients), and the hidden keys' dk and dv are exactly 0."""
    poisoned = measured["poisoned_keys"]
    assert len(poisoned) == 2 * 3 * 2  # (triton, reference) × (nan, inf, 1e10) × (causal, not)
    for name, r in poisoned.items():
        assert r["same"], name
        assert r["hidden_zero"], name


def test_interpreter_gemm_does_not_depend_on_the_blas_kernel(measured):
    """Under the interpreter a tile GEMM is acc + (a @ b in float64, rounded once to fp32), bit for bit,
    so the numbers this module checks do not depend on the summation order of the BLAS kernel NumPy
    picks for the CPU (OpenBLAS chooses by processor and OPENBLAS_CORETYPE; an fp32 np.matmul made
    test_conservation_of_key_gradient pass on some machines and fail on others)."""
    assert measured["mma_order_free"] == {"torch.bfloat16": True, "torch.float16": True}


def test_stats_match_reference(measured):
    for c in _cases(measured):
        for fix in c["bwd"]:
            b = c["bwd"][fix]
            # Σ_j |dS̃_ij| is a sum of same-sign terms: a one-ulp flip moves it by ≤ 2^-8 of one term.
            assert b["abs_dS_rel_vs_ref"] <= 1e-4, (c["shape"], fix, b)
            # r_i is itself a sum of rounding residuals, so a single one-ulp flip of one dS̃ element
            # (see test_backward_rounds_at_the_reference_points) is of the size of r_i's entries:
            # agreement is only to a few percent (measured ≤ 5e-2); the leak τ ρ (P̃K) inherits it.
            assert b["r_rel_vs_ref"] <= 0.1, (c["shape"], fix, b)
            assert b["leak_rel_vs_ref"] <= 0.1, (c["shape"], fix, b)


def test_fp8_ds_formats_match_reference(measured):
    """ds_format e4m3 / e5m2: the kernels round dS to 4 / 3 significant bits on the bits, as
    reference.round_significand does, so they agree with the reference as closely as with bf16 dS
    (accumulation order only): ≤ 0.15× the reference's own error against float64. A kernel that kept
    bf16 dS would differ from the reference by about that error itself. With fp32 gradients the
    P-weighted projection leaves Σ_j dK_j at fp32 rounding; fix="none" keeps the coarse residual."""
    cases = measured["fp8_cases"]
    assert len(cases) == 2
    for c in cases:
        assert set(c["bwd"]) == {"none_e4m3", "gproj_e4m3", "none_e5m2", "gproj_e5m2"}
        for name, b in c["bwd"].items():
            assert not b["nan"], (c["shape"], name)
            for g in GRADS:
                assert b[f"{g}_rel_vs_ref"] <= 0.15 * b[f"ref_{g}_rel_vs_f64"], (c["shape"], name, g, b)
            assert b["r_rel_vs_ref"] <= 0.1, (c["shape"], name, b)
        for fmt in ("e4m3", "e5m2"):
            gp, no = c["bwd"][f"gproj_{fmt}"], c["bwd"][f"none_{fmt}"]
            assert gp["c2_residual_fp32"] <= 4 * 2.0**-24, (c["shape"], fmt)
            assert no["c2_residual_fp32"] >= 1e-3, (c["shape"], fmt)
            # the leak: 4 significant bits leave dq of fix="none" far worse than gproj's
            assert gp["dq_rel_vs_f64"] <= 0.5 * no["dq_rel_vs_f64"], (c["shape"], fmt)


def test_fma_safe_constants(measured):
    """DESIGN.md §5: q = k = v = constant must return the constant exactly, never NaN."""
    consts = measured["constants"]
    assert {(x["value"], x["causal"]) for x in consts} == {(133120.0, False), (133120.0, True),
                                                          (1000.0, False), (1000.0, True)}
    for x in consts:
        assert not x["nan"], x
        assert x["exact"], x


def test_supports_and_errors(measured):
    s = measured["supports"]
    assert s["bf16_cpu_interp"] is None
    assert isinstance(s["fp32"], str) and "dtype" in s["fp32"]
    assert isinstance(s["bad_heads"], str) and "nheads" in s["bad_heads"]
    assert isinstance(s["head_dim_300"], str) and "head dim" in s["head_dim_300"]
    # batch·nheads = 65535 fits CUDA's second grid axis; 65536 (dense or as packed sequences) falls back
    assert s["grid_rows_max"] is None
    assert "65536" in s["grid_rows_over"] and "65535" in s["grid_rows_over"]
    assert "65536" in s["grid_rows_packed"]
    assert measured["bad_fix_raises"] is True


def test_fp16_softcap_where_tanh_saturates(measured):
    """fp16 with softcap 1 and τ = 1 (tests/_triton_interp_cases.py): where tanh saturates, X = dZ∘g is below fp16's
    normal range and X̃ / g is far from dZ. GProj's r must take dZ there and its direction drop such entries
    (kernels/reference.py): with X̃ / g dq and dk were 10–77% off, and rows saturated throughout (keys shifted by 4)
    gave a NaN dk (no direction left, ρ = r / 0), while fix none stayed at fp16 level. Triton equals the reference;
    every fix is at fp16 level against float64."""
    cases = measured["fp16_softcap_cases"]
    assert len(cases) == 4
    for c in cases:
        for fix, b in c["bwd"].items():
            assert not b["nan"], (c["case"], fix)
            for g in GRADS:
                assert b[f"{g}_rel_vs_ref"] <= 2e-4, (c["case"], fix, g, b)
                assert b[f"{g}_rel_vs_f64"] <= 2e-3 and b[f"ref_{g}_rel_vs_f64"] <= 2e-3, (c["case"], fix, g, b)
        assert c["bwd"]["gproj"]["dq_rel_vs_f64"] <= 1.5 * c["bwd"]["none"]["dq_rel_vs_f64"], c


def test_window_softcap_kernels(measured):
    """Sliding windows and softcap (tests/_triton_interp_cases.run_window_case): Triton equals the
    reference to fp32 rounding (softcap: its exp2-built tanh against torch.tanh) and both are at bf16
    level against an explicit float64 attention; gproj beats none on dq; rows that see no key get
    exactly 0; C2 holds to fp32 rounding with a window and is NOT imposed under softcap (the fp32 dk
    keeps the float64 gradient's own nonzero key sum)."""
    cases = measured["window_cases"]
    assert len(cases) == 7 and any(c["n_empty"] > 0 for c in cases)
    for c in cases:
        softcap = c["case"][-1] > 0
        assert c["inf_pattern_equal"], c["case"]
        assert c["o_rel_vs_ref"] <= 3.9e-3 and c["o_rel_vs_f64"] <= 4e-3, c
        assert set(c["bwd"]) == {"none", "gproj", "gproj_uniform"}
        for fix, b in c["bwd"].items():
            assert not b["nan"] and b["empty_rows_zero"], (c["case"], fix, b)
            for g in GRADS:
                assert b[f"{g}_rel_vs_ref"] <= (2e-4 if softcap else 1e-6), (c["case"], fix, g, b)
                assert b[f"{g}_rel_vs_f64"] <= 5e-3 or g == "dq" and fix == "none", (c["case"], fix, g, b)
            if softcap:
                # the exact gradient's key sum is far from 0; the kernel's fp32 dk reproduces it
                assert c["c2_f64"] > 0.05
                assert abs(b["c2_residual_fp32"] - c["c2_f64"]) <= 0.02 * c["c2_f64"], (c["case"], fix, b)
            elif fix != "none":
                assert b["c2_residual_fp32"] <= 1e-6, (c["case"], fix, b)
        if c["n_empty"] < 2 * c["case"][0]:  # rows with a real gradient: the leak GProj removes
            assert c["bwd"]["gproj"]["dq_rel_vs_f64"] <= 0.4 * c["bwd"]["none"]["dq_rel_vs_f64"], c
            assert c["bwd"]["gproj"]["dq_rel_vs_f64"] <= 3e-3, c
