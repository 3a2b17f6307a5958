"""The speed benchmarks' CPU smoke modes (benchmarks/attention.py, benchmarks/train_step.py).

Speed is measured on a GPU, never here: these tests run each script's ``--smoke`` mode (tiny shapes,
Triton's interpreter / a 2-layer Llama on CPU) in a subprocess and check what it writes — the record
format the next GPU session's results will have — not the timings, which mean nothing on CPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

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


def test_kernel_timer_splits_the_profile_at_each_flush():
    """--timer kernels: a call's time is the sum of its kernels' durations between two flushes, host gaps excluded
    (events arrive in any order; a kernel before the first flush belongs to no timed call)."""
    attention = load_script("benchmarks/attention.py", "attention_benchmark")
    events = [("fwd", 120.0, 170.0), ("_l2_flush", 100.0, 110.0), ("warm", 0.0, 50.0), ("_l2_flush", 300.0, 310.0),
              ("bwd", 180.0, 280.0), ("Memset (Device)", 320.0, 321.5), ("fwd", 400.0, 460.0)]
    assert attention.split_calls(events) == pytest.approx([0.150, 0.0615])
    by_name = []
    attention.split_calls(events, by_name)  # --timer kernels' per-kernel breakdown
    assert by_name == [pytest.approx({"fwd": 0.050, "bwd": 0.100}), pytest.approx({"Memset (Device)": 0.0015, "fwd": 0.060})]
    # each kernel's median over the calls, a call without it counting 0 (three calls: the middle value)
    calls = by_name + [{"fwd": 0.070, "bwd": 0.090}]
    assert attention.kernel_medians(calls) == pytest.approx({"fwd": 0.060, "bwd": 0.090, "Memset (Device)": 0.0})


def test_attention_smoke_writes_speed_records(tmp_path):
    out = tmp_path / "speed.json"
    _run(["benchmarks/attention.py", "--smoke", "--out", str(tmp_path), "--json", str(out),
          "--methods", "gproj,none"], tmp_path, TRITON_INTERPRET="1")
    records = json.loads(out.read_text())
    assert isinstance(records, list) and len(records) == 4  # 2 shapes (full, causal) × 2 methods
    assert {(r["method"], r["causal"]) for r in records} == {(m, c) for m in ("gproj", "none") for c in (False, True)}
    for r in records:
        assert "error" not in r, r
        assert {"shape", "causal", "method", "fwd_tflops", "bwd_tflops", "fwdbwd_tflops", "peak_mib"} <= set(r)
        assert len(r["shape"]) == 4 and all(isinstance(x, int) for x in r["shape"])
        assert all(_positive(r[k]) for k in ("fwd_tflops", "bwd_tflops", "fwdbwd_tflops", "fwd_ms", "bwd_ms"))
        assert r["peak_mib"] is None  # CUDA memory statistics only
    full = json.loads((tmp_path / "attention.json").read_text())
    assert full["smoke"] is True and len(full["rows"]) == 4
    assert "| 1×1×24×16 causal |" in (tmp_path / "attention.md").read_text()


def test_attention_varlen_smoke_writes_packed_and_padded_records(tmp_path):
    _run(["benchmarks/attention.py", "--smoke", "--varlen", "--varlen-heads", "1,16", "--out", str(tmp_path)], tmp_path,
         TRITON_INTERPRET="1")
    res = json.loads((tmp_path / "attention_varlen.json").read_text())
    assert res["smoke"] is True
    assert {(r["layout"], r["causal"]) for r in res["rows"]} == {(l, c) for l in ("packed", "padded") for c in (False, True)}
    for r in res["rows"]:
        assert "error" not in r, r
        assert r["lengths"] == [9, 0, 20, 1] and all(_positive(r[k]) for k in ("fwd_ms", "bwd_ms", "fwdbwd_tflops"))


def test_train_step_smoke_writes_step_times(tmp_path):
    out = tmp_path / "train_step.json"
    _run(["benchmarks/train_step.py", "--smoke", "--out", str(out), "--profile-steps", "1"], tmp_path)
    res = json.loads(out.read_text())
    assert res["smoke"] is True and res["env"]["device"] == "cpu"
    rows = res["results"]
    assert [(r["config"], r["arm"]) for r in rows] == [("tiny", "cudnn"), ("tiny", "gproj"), ("tiny", "none")]
    for r in rows:
        assert "error" not in r, r
        assert r["layers"] == 2 and r["hidden"] == 64 and r["timed_steps"] == 2
        assert _positive(r["step_ms_median"]) and r["step_ms_p10"] <= r["step_ms_median"] <= r["step_ms_p90"]
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq"] / (r["step_ms_median"] * 1e-3))
        assert math.isfinite(r["loss_first"]) and math.isfinite(r["loss_last"])
        # the plugin arms swapped both attention layers; the cudnn arm is plain SDPA
        assert r["swapped_modules"] == (None if r["arm"] == "cudnn" else 2)
        # one more step per arm under torch.profiler, its table beside the JSON
        assert r["profile"] == str(tmp_path / f"train_step.profile_tiny_{r['arm']}.txt")
        assert "aten::" in open(r["profile"]).read()
    # same seed, same tokens: the first losses agree to bf16 attention differences
    assert max(r["loss_first"] for r in rows) - min(r["loss_first"] for r in rows) < 0.05
    ratios = res["ratio_to_cudnn"]["tiny"]
    assert set(ratios) == {"cudnn", "gproj", "none"} and ratios["cudnn"] == 1.0


def test_train_step_rounds_alternate_the_arms_and_take_the_median_ratio(tmp_path):
    out = tmp_path / "rounds.json"
    _run(["benchmarks/train_step.py", "--smoke", "--out", str(out), "--arms", "cudnn,gproj", "--rounds", "3"], tmp_path)
    res = json.loads(out.read_text())
    rows = res["results"]
    assert [(r["arm"], r["round"]) for r in rows] == [("cudnn", 0), ("gproj", 0), ("gproj", 1), ("cudnn", 1),
                                                      ("cudnn", 2), ("gproj", 2)]
    by = {(r["arm"], r["round"]): r["step_ms_median"] for r in rows}
    per_round = sorted(by[("gproj", k)] / by[("cudnn", k)] for k in range(3))
    assert [rr["gproj"] for rr in res["ratio_rounds"]["tiny"]] == pytest.approx(
        [by[("gproj", k)] / by[("cudnn", k)] for k in range(3)])
    assert res["ratio_to_cudnn"]["tiny"]["gproj"] == pytest.approx(per_round[1])
    assert res["ratio_to_cudnn"]["tiny"]["cudnn"] == 1.0


def test_fidelity_smoke_with_window_and_softcap_matches_float64(tmp_path):
    """benchmarks/fidelity.py --window/--softcap: our kernels (interpreter) against the float64 reference
    with the same causal sliding window and logit cap. The window and the cap reach both sides or the
    bf16-level bounds fail (a mask or cap on one side only is an O(1) error); fix="none" still leaks
    at ‖μ‖=200, so the reference measures something; under softcap the reference's own C2 is not 0."""
    _run(["benchmarks/fidelity.py", "--smoke", "--out", str(tmp_path), "--methods", "gproj,none", "--mus", "200",
          "--window", "8,0", "--softcap", "30"], tmp_path, TRITON_INTERPRET="1")
    res = json.loads((tmp_path / "fidelity.json").read_text())
    assert res["window_size"] == [8, 0] and res["softcap"] == 30.0 and res["feature"] == "window (8, 0), softcap 30"
    rows = res["rows"]
    # right = 0 is causal already: the full-attention settings are not run twice
    assert sorted((r["group"], r["method"], r["causal"]) for r in rows) == [
        (g, m, True) for g in ("d128", "gqa") for m in ("gproj", "none")]
    by = {(r["group"], r["method"]): r for r in rows}
    for r in rows:
        assert "error" not in r and not r["nan"], r
        assert r["window_size"] == [8, 0] and r["softcap"] == 30.0 and r["mu"] == 200.0
        for key in ("o_frob", "dk_frob", "dv_frob"):
            assert r[key] < 4e-3, (r["group"], r["method"], key, r[key])  # below one bf16 unit (2^-8)
        assert r["c2_ref"] > 1e-3  # C2 fails in exact arithmetic under softcap
    for g in ("d128", "gqa"):
        gp, no = by[(g, "gproj")], by[(g, "none")]
        assert gp["dq_rowmed"] < 4e-3 and gp["dq_frob"] < 4e-3, gp
        assert no["dq_rowmed"] > 5 * gp["dq_rowmed"], (no["dq_rowmed"], gp["dq_rowmed"])
    consts = res["constants"]
    assert {(c["method"], c["causal"], c["value"]) for c in consts} == {
        (m, True, v) for m in ("gproj", "none") for v in (133120.0, 1000.0)}
    assert all(c["exact"] and not c["nan"] for c in consts), consts
    assert "window (8, 0), softcap 30" in (tmp_path / "fidelity.md").read_text()


def test_fidelity_reference_mask_is_flash_attn_window():
    """The float64 reference's visible set, against flash-attn's definition written as a loop."""
    methods = load_script("benchmarks/_methods.py", "benchmark_methods")
    for nq, nk in ((5, 9), (9, 5), (7, 7)):
        for causal in (False, True):
            for left, right in ((-1, -1), (2, 0), (0, 3), (-1, 1), (3, -1)):
                got = methods.visible_mask(nq, nk, causal, (left, right))
                r = 0 if causal else right
                want = [[(left < 0 or j >= i + nk - nq - left) and (r < 0 or j <= i + nk - nq + r)
                         for j in range(nk)] for i in range(nq)]
                assert got.tolist() == want, (nq, nk, causal, left, right)


def test_anchors_take_only_the_features_they_express():
    """_methods.unsupported: fidelity compares an anchor only where it computes the same function (no anchor draws our
    dropout mask); attention.py (timing) also times cudnn / sdpa_flash with SDPA's own dropout; fa4 takes flash-attn's
    softcap and window, sdpa_mask a window, ours everything."""
    methods = load_script("benchmarks/_methods.py", "benchmark_methods")
    feats = {"dropout": dict(dropout_p=0.1), "softcap": dict(softcap=30.0), "window": dict(window_size=(64, 0))}
    takes = {"cudnn": {"dropout_t"}, "sdpa_flash": {"dropout_t"}, "fa4": {"softcap", "window"}, "sdpa_mask": {"window"},
             "gproj": {"dropout", "dropout_t", "softcap", "window"}}
    for name, ok in takes.items():
        for feat, kw in feats.items():
            for timing in (False, True):
                key = feat + ("_t" if timing and feat == "dropout" else "")
                reason = methods.unsupported(name, **kw, timing=timing)
                assert (reason is None) == (key in ok or (feat != "dropout" and feat in ok)), (name, feat, timing, reason)
                if reason is not None:
                    assert reason.startswith(name + ":"), reason
    assert methods.unsupported("cudnn", dropout_p=0.1, softcap=30.0, timing=True) is not None  # every feature counts
    # make(): an anchor refuses dropout unless timing, and our kernels' own arguments (a seed it would not use)
    x = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match="another generator"):
        methods.make("cudnn", x, x, x, x, False, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"cudnn: \['dropout_seed'\] apply to our kernels only"):
        methods.make("cudnn", x, x, x, x, False, dropout_p=0.1, timing=True, dropout_seed=1)
    assert methods.make("cudnn", x, x, x, x, False, dropout_p=0.1, timing=True).dropout_p == 0.1


def test_fidelity_rejects_bad_window():
    fidelity = load_script("benchmarks/fidelity.py", "fidelity_benchmark")
    assert fidelity.parse_window("256,0") == (256, 0) and fidelity.parse_window("-1,3") == (-1, 3)
    for bad in ("256", "a,0", "-2,0", "1,2,3"):
        with pytest.raises(Exception, match="--window"):
            fidelity.parse_window(bad)


def test_train_step_attention_dropout_reaches_every_arm(tmp_path):
    """--attention-dropout: every arm trains the Llama with attention dropout (the first loss moves off the
    dropout-free run's, same seed and tokens), and each row records it."""
    losses = {}
    for p in (0.0, 0.5):
        out = tmp_path / f"drop{p}.json"
        _run(["benchmarks/train_step.py", "--smoke", "--out", str(out), "--arms", "cudnn,gproj",
              "--attention-dropout", str(p)], tmp_path)
        rows = json.loads(out.read_text())["results"]
        assert [r["attention_dropout"] for r in rows] == [p, p] and not any("error" in r for r in rows)
        losses[p] = {r["arm"]: r["loss_first"] for r in rows}
    for arm in ("cudnn", "gproj"):
        assert abs(losses[0.5][arm] - losses[0.0][arm]) > 1e-3, (arm, losses)


SCRIPTS = sorted(p.name for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_script_prints_its_help_without_starting_work(script, tmp_path):
    """``python benchmarks/X.py --help`` prints the usage and exits 0 on a machine without a GPU (six scripts
    started their work, crashed or read --help as an argument; new-user pass 12)."""
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", "--help"], cwd=str(REPO), capture_output=True,
                          text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), (proc.stdout[-2000:], proc.stderr[-2000:])


def test_repro_summary_merges_the_segments_that_logged_and_skips_an_empty_one(tmp_path):
    """A resumed run logs each segment to a new version folder; one that logged nothing (the header only) is skipped,
    the others merged with the later segment winning a step logged twice."""
    summary = load_script("benchmarks/repro_summary.py", "repro_summary")
    for version, text in ((0, "step,loss\n0,3.0\n1,2.0\n"), (1, "step,loss\n"), (2, "step,loss\n1,1.5\n2,1.0\n")):
        (tmp_path / f"version_{version}").mkdir()
        (tmp_path / f"version_{version}" / "metrics.csv").write_text(text)
    assert summary.load(str(tmp_path)) == {"loss": {0: 3.0, 1: 1.5, 2: 1.0}}
