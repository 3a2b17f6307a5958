"""Fix "none"'s one-pass Hopper backward (kernels/attention_bwd_onepass.py) on a machine without a GPU.

Its numerics need an H200 (benchmarks/gpu_check.py --cases hopper_bwd: dq, dk, dv against reference.py and the two
passes). What CI checks: the kernel compiles for sm_90 with this Triton in both masks, with the Hopper paths it was
written for (chained wgmma, TMA loads, one bulk reduce-add of dQ per tile and consumer from 16-byte shared stores); its
host side and its two Triton kernels (D, the un-permute of dq's chunks) under the interpreter against float64; and the
rule that decides which calls attention_bwd.backward hands it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_gproj.kernels import attention_bwd as B
from lightning_gproj.kernels import attention_bwd_hopper as HB
from lightning_gproj.kernels import attention_bwd_onepass as OP
from lightning_gproj.kernels import attention_fwd_hopper as HF

from _hopper import Routed, StubKernel, assert_hopper_kernel

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("causal, dtype, grad_dtype, ones, head_dim, split", [
    (False, torch.bfloat16, None, (), 128, None), (True, torch.bfloat16, None, (), 128, None),
    (False, torch.float16, None, ("GROUP",), 128, None), (True, torch.bfloat16, torch.float32, ("GROUP",), 128, None),
    (False, torch.bfloat16, None, (), 64, None), (True, torch.float16, None, ("GROUP",), 64, None),
    (True, torch.bfloat16, None, (), 64, False),
], ids=["full", "causal", "fp16-1group", "causal-fp32grads", "d64-full", "d64-causal-fp16-1group", "d64-causal-colsplit"])
def test_compiles_for_sm90_with_one_bulk_reduce_per_tile(causal, dtype, grad_dtype, ones, head_dim, split):
    kernel = OP.compile_sm90(causal, dtype, grad_dtype, ones, head_dim, split)
    split = OP.keysplit(head_dim, causal) if split is None else split
    # Two consumers × (Sᵀ, dPᵀ, dV, dK and dQ: two 64-key halves, or one GEMM over its own keys) per (Q, dO) tile.
    assert_hopper_kernel(kernel, 2 * (5 if split else 6))
    ptx = kernel.asm["ptx"]
    # dQ: one 2-D bulk reduce-add a tile and consumer (split by columns and causal: one more, for the second
    # consumer's empty first tile), staged by 16-byte stores (thread-major layout: d / 16 of them for a [64, d / 2]
    # partial, d / 8 for [64, d]); never an element-wise atomic.
    assert ptx.count("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add") == (3 if causal and not split else 2)
    assert ptx.count("st.shared.v4.b32") >= head_dim // (8 if split else 16)
    assert not re.search(r"\s(atom|red)\.global", ptx)


@pytest.fixture(scope="module")
def interp() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(HERE / "_onepass_interp_cases.py")], env=env, capture_output=True,
                          text=True, timeout=600, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["bshd", "bhsd_fp16", "fp32_grads", "d64", "d64_causal"])
def test_host_side_and_small_kernels_under_the_interpreter(interp, case):
    """backward() on CPU tensors, the Gluon launch replaced by a stand-in that adds a known dQ into the chunks as
    bulk_bases lays them out: one program per (128 keys, batch · kv head), every kernel parameter one argument, the
    chunk buffer zeroed and O(N) (B·N·H·d floats); D = rowsum(dO∘O) to fp32 rounding (o in either memory order) and
    dq = τ·dQ rounded once (within an ulp: the interpreter's bf16 casts truncate)."""
    got = interp[case]
    b, n, h, hk, d = {"bshd": (2, 256, 4, 2, 128), "bhsd_fp16": (1, 384, 2, 1, 128), "fp32_grads": (1, 128, 2, 2, 128),
                      "d64": (2, 256, 4, 2, 64), "d64_causal": (2, 256, 4, 4, 64)}[case]
    assert got["grid"] == [n // 128, b * hk] and got["n_args"] == got["n_names"] and not got["keypad"]
    assert got["acc_zero"] and got["acc_numel"] == b * n * h * d
    # a [64, d / 2] partial per consumer; causal at d 64, split by keys: [64, d], the chunk pair
    assert got["block"] == [d // (4 if case == "d64_causal" else 8), 256]
    assert (got["H"], got["GROUP"], got["N_CTX"]) == (h, h // hk, n)
    assert got["tau"] == 1.25 and got["c"] == pytest.approx(1.25 * 1.4426950408889634, rel=1e-12)
    assert got["delta_rel"] < 1e-6
    assert got["dq_ulps"] <= 1.0
    assert all(got["dk_dv"]) and got["offsets_bijective"]


def test_split_by_keys_only_at_head_dim_64():
    with pytest.raises(ValueError, match="split: .*head dim 64 only, got head_dim=128"):
        OP.compile_sm90(True, head_dim=128, split=True)


def _t(b=2, n=256, h=4, d=128, dtype=torch.bfloat16):
    return torch.zeros(b, n, h, d, dtype=dtype)


@pytest.mark.parametrize("n, d, causal, hk, env, deterministic, served", [
    (256, 128, False, 4, "1", False, True), (384, 128, False, 4, "1", False, True),
    (256, 128, False, 1, "1", False, True),  # GQA, full attention
    (256, 128, True, 4, "1", False, False), (8192, 128, True, 4, "1", False, True),
    (8192, 128, True, 2, "1", False, False),  # causal with GQA: the two passes
    (4096, 128, True, 4, "1", False, False),  # causal d 128 below 8192 keys: the two passes
    (2048, 64, True, 4, "1", False, True), (1024, 64, True, 4, "1", False, False),  # causal d 64 from 2048 keys
    (4096, 64, True, 1, "1", False, False),  # causal d 64 with GQA: the two passes
    (320, 128, False, 4, "1", False, False), (256, 64, False, 4, "1", False, True),
    (256, 128, False, 4, "0", False, False), (256, 128, False, 4, "1", True, False),
    (256, 96, False, 4, "1", False, False),
], ids=["full", "full-384", "full-gqa", "causal-short", "causal-long", "causal-long-gqa", "causal-4096", "causal-d64",
        "causal-d64-1024", "causal-d64-gqa",
        "seqlen-320", "d64", "env-off", "deterministic", "d96"])
def test_serves_dense_full_or_long_causal(monkeypatch, n, d, causal, hk, env, deterministic, served):
    monkeypatch.setenv("GPROJ_ONEPASS_BWD", env)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    q = torch.empty(1, n, 4, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, n, hk, d, dtype=torch.bfloat16, device="meta")
    assert OP.serves(q, k, k, q, causal) == served
    assert not OP.serves(q, k, k, q, causal, deterministic=True)  # the call's own flag (flash-attn's)


@pytest.mark.parametrize("kwargs, onepass", [
    (dict(), True),
    (dict(grad_dtype=torch.float32), True),
    (dict(grad_dtype=(torch.bfloat16, torch.bfloat16, torch.float32)), True),
    (dict(causal=True), False),  # short causal rows: the two passes (run 43: one pass 2–5% slower at 2048 and 4096)
    (dict(causal=True, long_causal=True), True),
    (dict(fix="gproj"), False), (dict(fix="gproj_uniform"), False),
    (dict(want_stats=True), False),
    (dict(window_size=(64, 64)), False), (dict(softcap=30.0), False),
    (dict(dropout_p=0.1, dropout_seed=1), False),
    (dict(seqlens_k=torch.tensor([256, 200])), False),
    (dict(packed=True), False),  # packed sequences (one cu_seqlens): the one pass would attend across them
    (dict(ds_format="e4m3"), False),
    (dict(o_dtype=torch.float16), False),  # an o the Gluon passes do not read: the tl.dot dQ pass
    (dict(env="0"), False),
    (dict(deterministic=True), False),  # flash-attn's flag: the bit-reproducible two passes
    (dict(deterministic=False), True),
])
def test_backward_routes_dense_fix_none_to_the_one_pass(monkeypatch, kwargs, onepass):
    """With on_sm90 forced true (the real predicates otherwise), attention_bwd.backward hands the one pass exactly the
    dense fix "none" calls without statistics, window, softcap, dropout, key padding, packing or an FP8 dS (causal only
    from CAUSAL_MIN_SEQLEN), with o as the Gluon passes read it, the D buffer, dq in the requested dtype and dk, dv
    dtypes; every other call runs two passes."""
    seen = {}

    def fake_onepass(q, k, v, do, o, m, log2l, delta, dq, c, tau, causal, dk_dtype, dv_dtype, descriptors=None):
        seen.update(dq=dq.dtype, dk=dk_dtype, dv=dv_dtype, o=o.dtype, delta=delta.shape, causal=causal)
        raise Routed

    def fake_dkdv(*args, **kw):
        raise Routed

    kwargs = dict(kwargs)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # supports()' CPU condition; no kernel below really launches
    monkeypatch.setenv("GPROJ_ONEPASS_BWD", kwargs.pop("env", "1"))
    monkeypatch.setenv("GPROJ_HOPPER_DROPOUT", "1")  # dropout calls reach the Gluon passes' predicate
    monkeypatch.setattr(HB, "on_sm90", lambda x: True)
    monkeypatch.setattr(HF, "on_sm90", lambda x: True)  # packed_ok's
    monkeypatch.setattr(OP, "backward", fake_onepass)
    monkeypatch.setattr(HB, "dq_pass", lambda *a, **kw: None)
    monkeypatch.setattr(HB, "dkdv", fake_dkdv)
    monkeypatch.setattr(B, "_dq_kernel", StubKernel())
    monkeypatch.setattr(B, "_dkdv_kernel", StubKernel(Routed()))  # the second of two passes, either kind
    if kwargs.pop("long_causal", False):
        monkeypatch.setitem(OP.CAUSAL_MIN_SEQLEN, 128, 256)
    b, n, h, d = 2, 256, 2, 128
    q, k, v, do = (torch.randn(b, n, h, d, dtype=torch.bfloat16) for _ in range(4))
    o = torch.randn(b, n, h, d, dtype=kwargs.pop("o_dtype", torch.bfloat16))
    m, log2l = torch.zeros(b, h, n), torch.full((b, h, n), 8.0)
    if kwargs.pop("packed", False):  # the two rows as two sequences of one packed batch, total 512
        q, k, v, do, o = (x.reshape(b * n, h, d) for x in (q, k, v, do, o))
        m, log2l = m.transpose(0, 1).reshape(h, b * n), log2l.transpose(0, 1).reshape(h, b * n)
        cu = torch.tensor([0, n, 2 * n], dtype=torch.int32)
        kwargs.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n)
    causal = kwargs.pop("causal", False)
    fix = kwargs.pop("fix", "none")
    want_stats = kwargs.pop("want_stats", False)
    with pytest.raises(Routed):
        B.backward(do, q, k, v, o, m, log2l, d ** -0.5, causal, fix, want_stats, **kwargs)
    assert ("dq" in seen) == onepass
    if onepass:
        want = kwargs.get("grad_dtype", torch.bfloat16)
        want = want if isinstance(want, tuple) else (want,) * 3
        assert seen == dict(dq=want[0], dk=want[1], dv=want[2], o=torch.bfloat16, delta=(b, h, n), causal=causal)
