"""The speed benchmarks' CPU smoke modes (benchmarks/attention.py).

Speed is measured on a GPU, never here: these tests run the script's ``--smoke`` mode (tiny shapes,
Triton's interpreter) in a subprocess and check what it writes — the record format the next GPU
session's results will have — not the timings, which mean nothing on CPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from _scripts import REPO, load_script

ISSUE_SHAPES = {(4, 16, 2048, 128), (1, 16, 8192, 128), (2, 16, 4096, 64), (1, 8, 16384, 128)}


def _run(args, tmp_path, **env):
    proc = subprocess.run([sys.executable, *args], cwd=str(REPO), env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _positive(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_attention_runs_every_shape_with_and_without_causal_mask():
    attention = load_script("benchmarks/attention.py", "attention_benchmark")
    assert {s[:4] for s in attention.SHAPES if s[4]} == {s[:4] for s in attention.SHAPES if not s[4]} >= ISSUE_SHAPES
    assert len(attention.SHAPES) == len(set(attention.SHAPES))


def test_attention_smoke_writes_speed_records(tmp_path):
    out = tmp_path / "speed.json"
    _run(["benchmarks/attention.py", "--smoke", "--out", str(tmp_path), "--json", str(out),
          "--methods", "gproj,none_1p"], tmp_path, TRITON_INTERPRET="1")
    records = json.loads(out.read_text())
    assert isinstance(records, list) and len(records) == 4  # 2 shapes (full, causal) × 2 methods
    assert {(r["method"], r["causal"]) for r in records} == {(m, c) for m in ("gproj", "none_1p") for c in (False, True)}
    for r in records:
        assert "error" not in r, r
        assert {"shape", "causal", "method", "fwd_tflops", "bwd_tflops", "fwdbwd_tflops", "peak_mib"} <= set(r)
        assert len(r["shape"]) == 4 and all(isinstance(x, int) for x in r["shape"])
        assert all(_positive(r[k]) for k in ("fwd_tflops", "bwd_tflops", "fwdbwd_tflops", "fwd_ms", "bwd_ms"))
        assert r["peak_mib"] is None  # CUDA memory statistics only
    full = json.loads((tmp_path / "attention.json").read_text())
    assert full["smoke"] is True and len(full["rows"]) == 4
    assert "| 1×1×24×16 causal |" in (tmp_path / "attention.md").read_text()
