"""The SDPA-registry kernels on the Triton path (Triton's CPU interpreter, in a subprocess:
tests/_sdpa_registry_interp.py, which holds no thresholds).

Cases: bf16, keys offset by +4; causal GQA 2:1 (B=1, H=2, N=37, d=32) with fix "none" and "gproj";
non-causal Nq=40 < Nk=45 (d=32) with "gproj". Each runs torch's autograd of
``aten::_scaled_dot_product_flash_attention`` with the registry's kernels installed for the CPU key.

Bounds: the result is gproj_attn_func's bit for bit (the same op and kernels on the same inputs); against
float64 the bf16 level of tests/test_triton_kernels.py (6e-3 relative Frobenius for o, dk, dv and a
corrected dq; 3e-2 for the uncorrected dq, which carries the leak); lse to 1e-4 absolute (fp32 sums of
exact products, |lse| ≈ 5 here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def measured() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "_sdpa_registry_interp.py")], env=env, capture_output=True,
                          text=True, timeout=900, cwd=str(HERE.parent))
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _runs(measured):
    runs = [(c, fix, r) for c in measured["cases"] for fix, r in c["fixes"].items()]
    assert len(runs) == 3
    return runs


def test_triton_kernels_served_the_aten_op(measured):
    for c, fix, r in _runs(measured):
        assert r["launches"] == {"fwd": 1, "bwd": 1}, (c["shape"], fix)


def test_equal_to_gproj_attn_func_bit_for_bit(measured):
    for c, fix, r in _runs(measured):
        assert r["bit_identical"] == {"o": True, "dq": True, "dk": True, "dv": True}, (c["shape"], fix)


def test_against_float64(measured):
    for c, fix, r in _runs(measured):
        err = r["rel_vs_f64"]
        assert err["o"] <= 6e-3 and err["dk"] <= 6e-3 and err["dv"] <= 6e-3, (c["shape"], fix, err)
        assert err["dq"] <= (3e-2 if fix == "none" else 6e-3), (c["shape"], fix, err)
        assert r["lse_shape"] == [c["shape"][0], c["shape"][1], c["shape"][3]]
        assert r["lse_max_abs_vs_f64"] <= 1e-4, (c["shape"], fix, r)
    causal = next(c for c in measured["cases"] if c["causal"])["fixes"]
    assert causal["gproj"]["rel_vs_f64"]["dq"] <= 0.5 * causal["none"]["rel_vs_f64"]["dq"]
