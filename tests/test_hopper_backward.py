"""The sm_90 Gluon backward passes (kernels/attention_bwd_hopper.py) on a machine without a GPU.

Their numerics need an H200 (benchmarks/gpu_check.py --cases hopper_bwd: dq, dk, dv against reference.py and the
tl.dot kernels, the fp32-dk C2). What CI can check: the kernel compiles for sm_90 with this Triton (ahead of
time, Triton's bundled ptxas) in every variant a launch builds, uses the Hopper paths it was written for and fits
the shared memory; its predicate accepts exactly the inputs it handles; and attention_bwd routes to them only the
calls whose features they implement (a wrongly routed window or softcap call would lose its mask or its tanh).
"""

from __future__ import annotations

import math
import pytest
import torch

from lightning_gproj.kernels import attention_bwd as B
from lightning_gproj.kernels import attention_bwd_hopper as HB
from lightning_gproj.kernels import attention_fwd_hopper as HF

from _hopper import Routed, StubKernel, TlDot, assert_hopper_kernel, assert_softcap_code


_VARIANTS = [(False, False), (True, False), (False, True), (True, True)]
_VARIANT_IDS = ["none", "gproj", "none-softcap", "gproj-softcap"]


@pytest.mark.parametrize("gproj, softcap", _VARIANTS, ids=_VARIANT_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, dk_dtype, ones", [
    (torch.bfloat16, None, ()), (torch.float16, None, ("GROUP",)), (torch.bfloat16, torch.float32, ("key_sums",)),
], ids=["bf16", "fp16-1group", "fp32dk-keysums"])
def test_compiles_for_sm90_with_wgmma_tma_and_register_split(gproj, softcap, causal, dtype, dk_dtype, ones):
    kernel = HB.compile_sm90(dtype, gproj, causal, dk_dtype, ones, softcap)
    # Two consumers × (Sᵀ, dPᵀ, dV, dK [, GProj's dK term]) per (Q, dO) tile.
    assert_hopper_kernel(kernel, 2 * (5 if gproj else 4))
    assert_softcap_code(kernel.asm["ptx"], softcap)
    # m, log2l, D of each tile by 4-byte cp.async (a row need not start on TMA's 16-byte boundary), tied to the ring
    # slot's barrier; Q, dO[, −ρ∘Q] by 2-D TMA boxes, no 1-D box.
    ptx = kernel.asm["ptx"]
    assert ptx.count("cp.async.ca.shared.global [") >= 3 and "cp.async.mbarrier.arrive.shared" in ptx
    assert "cp.async.bulk.tensor.1d" not in ptx


@pytest.mark.parametrize("gproj, softcap", _VARIANTS, ids=_VARIANT_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, dq_dtype, ones", [
    (torch.bfloat16, None, ()), (torch.float16, None, ("GROUP", "store_qr")), (torch.bfloat16, torch.float32, ()),
], ids=["bf16", "fp16-1group-qr", "fp32dq"])
def test_dq_pass_compiles_for_sm90_with_wgmma_tma_and_register_split(gproj, softcap, causal, dtype, dq_dtype, ones):
    kernel = HB.compile_dq_sm90(dtype, gproj, causal, dq_dtype, ones, softcap)
    ptx = kernel.asm["ptx"]
    # Two consumers × (S, dP, dQ [, P̃K and without softcap the row sums of P̃ and dS̃ against e0]) per K/V tile.
    assert_hopper_kernel(kernel, 2 * ((4 if softcap else 6) if gproj else 3))
    # The e0 tile's wgmma (N = ROWSUM_N) for gproj; softcap sums its rows on the ALUs (1/g per score).
    assert (f"wgmma.mma_async.sync.aligned.m64n{HB.ROWSUM_N}k16" in ptx) == (gproj and not softcap)
    assert_softcap_code(ptx, softcap)


@pytest.mark.parametrize("causal, softcap, head_dim, edges, dk_dtype, ones", [
    (False, False, 128, False, None, ()), (True, False, 128, False, None, ()), (True, True, 128, False, None, ()),
    (False, False, 64, False, None, ()), (True, False, 128, True, None, ()),
    (False, False, 128, False, torch.float32, ("key_sums",)),
], ids=["full", "causal", "causal-softcap", "d64", "causal-edges", "fp32dk-keysums"])
def test_persistent_dkdv_variant_compiles_for_sm90(causal, softcap, head_dim, edges, dk_dtype, ones):
    """The persistent dK/dV kernel (fix "none", dkdv_schedule): the same Hopper paths and wgmma count as the
    loop-less one, and a second K/V buffer (the next block's K and V load while this one's last tiles run)."""
    kernel = HB.compile_sm90(torch.bfloat16, False, causal, dk_dtype, ones, softcap, edges=edges, head_dim=head_dim,
                             persist=True)
    plain = HB.compile_sm90(torch.bfloat16, False, causal, dk_dtype, ones, softcap, edges=edges, head_dim=head_dim)
    assert_hopper_kernel(kernel, 2 * 4)
    assert kernel.asm["ptx"].count("wgmma.mma_async") == plain.asm["ptx"].count("wgmma.mma_async")
    assert_softcap_code(kernel.asm["ptx"], softcap)
    k_and_v = 2 * HB.BLOCK_N * head_dim * 2  # bytes of one block's K and V in bf16
    assert kernel.metadata.shared >= plain.metadata.shared + k_and_v


@pytest.mark.parametrize("gproj", [False, True], ids=["none", "gproj"])
@pytest.mark.parametrize("which", ["dq", "dkdv"])
def test_head_dim_64_compiles_for_sm90(gproj, which):
    """Both passes at head dim 64 (served since run 30): the same Hopper paths and wgmma count as at 128, with the
    narrower tiles (shared memory below the head-dim-128 build's)."""
    compile_ = HB.compile_dq_sm90 if which == "dq" else HB.compile_sm90
    kernel = compile_(torch.bfloat16, gproj, True, None, (), False, head_dim=64)
    wide = compile_(torch.bfloat16, gproj, True, None, (), False, head_dim=128)
    assert_hopper_kernel(kernel, 2 * ((6 if gproj else 3) if which == "dq" else (5 if gproj else 4)))
    assert kernel.metadata.shared < wide.metadata.shared


@pytest.mark.parametrize("gproj, softcap", _VARIANTS, ids=_VARIANT_IDS)
@pytest.mark.parametrize("which", ["dq", "dkdv"])
def test_window_variants_compile_for_sm90(gproj, softcap, which):
    """The sliding-window variants (bf16; the window bounds are runtime arguments): the same Hopper paths, and the
    window's edge tests compiled in (two more integer comparisons per tile than without a window)."""
    compile_ = HB.compile_dq_sm90 if which == "dq" else HB.compile_sm90
    kernel = compile_(torch.bfloat16, gproj, False, None, (), softcap, window=True)
    plain = compile_(torch.bfloat16, gproj, False, None, (), softcap)
    assert_hopper_kernel(kernel, 2 * ((4 if softcap else 6) if gproj else 3) if which == "dq" else 2 * (5 if gproj else 4))
    assert kernel.asm["ptx"].count("setp.") > plain.asm["ptx"].count("setp.")


def _t(b=2, n=256, h=4, d=128, dtype=torch.bfloat16):
    return torch.zeros(b, n, h, d, dtype=dtype)


def test_accepts_the_shapes_it_is_written_for():
    assert HB.accepts(_t(), _t(h=2), _t(h=2), _t())
    assert HB.accepts(_t(n=200), _t(n=200, h=2), _t(n=200, h=2), _t(n=200))  # the edge variant
    assert HB.accepts(_t(dtype=torch.float16), _t(h=1, dtype=torch.float16), _t(h=1, dtype=torch.float16),
                      _t(dtype=torch.float16))
    # do in any strides (copied for the kernel), q in (B, H, N, d) memory
    assert HB.accepts(_t(), _t(), _t(), torch.zeros(2, 256, 4, 144, dtype=torch.bfloat16)[..., :128])
    assert HB.accepts(torch.zeros(2, 4, 256, 128, dtype=torch.bfloat16).transpose(1, 2), _t(), _t(), _t())


@pytest.mark.parametrize("why, q, k, v, do", [
    ("head dim 32", _t(d=32), _t(d=32), _t(d=32), _t(d=32)),
    ("seqlen_q != seqlen_k", _t(n=128), _t(), _t(), _t(n=128)),
    ("do dtype differs", _t(), _t(), _t(), _t(dtype=torch.float16)),
    ("do shape differs", _t(), _t(), _t(), _t(h=2)),
    ("fp32", *(_t(dtype=torch.float32) for _ in range(4))),
    ("strided q", torch.zeros(2, 256, 4, 144, dtype=torch.bfloat16)[..., :128], _t(), _t(), _t()),
])
def test_rejects_what_it_cannot_serve(why, q, k, v, do):
    assert not HB.accepts(q, k, v, do), why


@pytest.mark.parametrize("why, x", [
    ("batch 1 with an odd batch stride (PyTorch calls it contiguous)", torch.zeros(256, 1, 4, 128, dtype=torch.bfloat16).transpose(0, 1)),
    ("misaligned", torch.zeros(2 * 256 * 4 * 128 + 1, dtype=torch.bfloat16)[1:].view(2, 256, 4, 128)),
    ("a strided slice", torch.zeros(2, 256, 4, 144, dtype=torch.bfloat16)[..., :128]),
])
def test_tma_ready_copies_what_the_kernels_cannot_read(why, x):
    """do and o reach the kernels through tma_ready: a fresh copy in standard strides where x's memory is not in a
    served order — .contiguous() would hand the first two back unchanged (a review finding, run 19)."""
    from lightning_gproj.kernels.attention_fwd_hopper import _tma_view

    assert _tma_view(x) is None, why
    y = HB.tma_ready(x)
    assert y is not None and _tma_view(y) is not None and torch.equal(y, x), why
    ok = _t()
    assert HB.tma_ready(ok) is ok


def test_not_served_off_sm90_or_when_disabled(monkeypatch):
    q = _t()
    assert not HB.serves(q, q, q, q)  # CPU tensors
    monkeypatch.setenv("GPROJ_HOPPER_BWD", "0")
    assert not HB.enabled()


@pytest.mark.parametrize("kwargs, dq_routed, dkdv_routed, gemm_term", [
    (dict(fix="none"), True, True, False),
    (dict(fix="none", want_stats=True), False, True, False),  # r, abs_dS, leak: the tl.dot dQ pass
    (dict(fix="none", o_dtype=torch.float16), False, True, False),  # the Gluon dQ pass reads o as q's dtype
    (dict(fix="gproj"), True, True, True),
    (dict(fix="gproj_uniform"), False, True, False),  # r without the projection: the tl.dot dQ pass
    (dict(fix="none", grad_dtype=torch.float32), True, True, False),
    (dict(fix="gproj", grad_dtype=torch.float32), True, True, True),
    (dict(fix="gproj", dk_fold=True), True, False, False),  # r from the Gluon dQ pass, the fold in tl.dot dK/dV
    (dict(fix="gproj", ds_format="e4m3"), False, False, None),
    (dict(fix="gproj", softcap=30.0), True, True, True),
    (dict(fix="none", softcap=30.0), True, True, False),
    (dict(fix="gproj", window_size=(64, 0)), True, True, True),
    (dict(fix="none", window_size=(100, 37), softcap=30.0), True, True, False),
    (dict(fix="gproj_uniform", window_size=(64, 0)), False, False, None),  # the in-kernel uniform direction
    (dict(fix="gproj", dropout_p=0.1, dropout_seed=1), True, True, True),  # dropout: both Gluon passes
    (dict(fix="none", dropout_p=0.2, dropout_seed=2**40 + 7, dropout_offset=3), True, True, False),
    (dict(fix="gproj", dropout_p=0.1, dropout_seed=1, window_size=(64, 0), softcap=30.0), True, True, True),
    (dict(fix="gproj", dropout_p=0.1, seqlens_k=torch.tensor([256, 200])), True, True, True),
    (dict(fix="gproj", dropout_p=0.1, dk_fold=True), True, False, False),  # the fold: tl.dot dK/dV, as without
    (dict(fix="gproj", dropout_p=0.1, env="0"), False, False, True),  # GPROJ_HOPPER_DROPOUT=0: all on tl.dot
    (dict(fix="gproj", env="0"), True, True, True),  # which leaves calls without dropout alone
    (dict(fix="gproj", seqlens_k=torch.tensor([256, 200])), True, True, True),  # key padding: both Gluon passes
    (dict(fix="none", seqlens_k=torch.tensor([256, 200]), window_size=(-1, 0)), True, True, False),  # causal + padding
    (dict(fix="none", seqlens_k=torch.tensor([256, 200]), window_size=(64, 0)), False, False, None),  # not with a window
    (dict(fix="gproj_uniform", softcap=30.0), False, False, None),  # the in-kernel uniform direction
])
def test_backward_routes_only_the_features_the_gluon_passes_implement(monkeypatch, kwargs, dq_routed, dkdv_routed,
                                                                       gemm_term):
    """With on_sm90 forced true (the real predicate otherwise), attention_bwd.backward must hand the Gluon passes
    exactly the calls whose features they implement, with GProj's dK operand −ρ∘Q for fix="gproj" (own GEMM) and
    none otherwise; every other call stays on the tl.dot kernels."""
    seen = {}

    def fake_dq_pass(q, k, v, do, o, m, log2l, delta, dq, c, tau, causal, r=None, qr=None, softcap=0.0, window=None,
                     seqlens_k=None, descriptors=None, **drop):
        seen["descriptors"] = descriptors
        # the call's own dropout arguments, only with dropout
        assert drop == ({name: kwargs.get(name, 0) for name in ("dropout_p", "dropout_seed", "dropout_offset")}
                        if "dropout_p" in kwargs else {})
        seen["dq"] = ("gluon", qr is not None, r is not None)
        assert softcap == kwargs.get("softcap", 0.0) and window == expected_window
        assert_seqlens(seqlens_k)
        if r is not None:
            assert r.shape == m.shape and r.dtype == torch.float32

    class DqLauncher:
        def __getitem__(self, grid):
            return lambda *a, **meta: seen.__setitem__("dq", ("tl.dot", meta["STORE_QR"], meta["GPROJ"]))

    def fake_dkdv(q, k, v, do, m, log2l, delta, qr, *args, seqlens_k=None, descriptors=None, **drop):
        seen["qr"] = qr
        assert drop == ({name: kwargs.get(name, 0) for name in ("dropout_p", "dropout_seed", "dropout_offset")}
                        if "dropout_p" in kwargs else {})
        assert descriptors == {} and (seen.get("descriptors") is descriptors or seen["dq"][0] == "tl.dot")  # one dict
        assert args[-2:] == (kwargs.get("softcap", 0.0), expected_window)  # the softcap and the window, last
        assert_seqlens(seqlens_k)
        raise Routed

    def assert_seqlens(seqlens_k):  # key padding reaches both Gluon passes as int32 key lengths
        if "seqlens_k" in kwargs:
            assert seqlens_k.dtype == torch.int32 and seqlens_k.tolist() == kwargs["seqlens_k"].tolist()
        else:
            assert seqlens_k is None

    # The Gluon passes take the window as (wl, wr) >= 0 (these calls are causal: right = 0); no window: None.
    expected_window = {(64, 0): (64, 0), (100, 37): (100, 0)}.get(kwargs.get("window_size"))

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # supports()' CPU condition; no kernel below really launches
    kwargs = dict(kwargs)
    monkeypatch.setenv("GPROJ_HOPPER_DROPOUT", kwargs.pop("env", "1"))
    monkeypatch.setenv("GPROJ_ONEPASS_BWD", "0")  # the two passes (the one pass's routing: test_onepass_backward.py)
    monkeypatch.setattr(HB, "on_sm90", lambda x: True)  # the real predicate, off the GPU
    monkeypatch.setattr(HB, "dkdv", fake_dkdv)
    monkeypatch.setattr(HB, "dq_pass", fake_dq_pass)
    monkeypatch.setattr(B, "_dq_kernel", DqLauncher())
    monkeypatch.setattr(B, "_dkdv_kernel", StubKernel(TlDot()))
    torch.manual_seed(0)
    b, n, h, d = 2, 256, 2, 128
    q, k, v, do = (torch.randn(b, n, h, d, dtype=torch.bfloat16) for _ in range(4))
    o = torch.randn(b, n, h, d, dtype=kwargs.pop("o_dtype", torch.bfloat16))
    m = torch.zeros(b, h, n)
    log2l = torch.full((b, h, n), 8.0)
    causal = "window_size" in kwargs
    fix = kwargs.pop("fix")
    want_stats = kwargs.pop("want_stats", False)
    try:
        B.backward(do, q, k, v, o, m, log2l, d ** -0.5, causal, fix, want_stats, **kwargs)
        raise AssertionError("neither dK/dV kernel was launched")
    except TlDot:
        assert not dkdv_routed, "the Gluon dK/dV pass was skipped"
    except Routed:
        assert dkdv_routed, "a call with a feature the Gluon dK/dV pass lacks was routed to it"
        assert (seen["qr"] is not None) == gemm_term
        if gemm_term:
            assert seen["qr"].shape == q.shape and seen["qr"].dtype == q.dtype and seen["qr"].is_contiguous()
    assert seen["dq"][0] == ("gluon" if dq_routed else "tl.dot"), seen["dq"]
    if gemm_term is not None:  # either dQ pass writes −ρ∘Q exactly when Gluon's dK/dV reads it
        assert seen["dq"][1] == gemm_term
    if dq_routed:  # the Gluon dQ pass projects (and writes r) exactly for fix="gproj"
        assert seen["dq"][2] == (fix == "gproj")


@pytest.mark.parametrize("gproj, softcap", _VARIANTS, ids=_VARIANT_IDS)
def test_host_side_launches_match_the_kernel_signatures(monkeypatch, gproj, softcap):
    """dq_pass and dkdv up to the launch, on CPU tensors: descriptors build for (B, N, H, d) and (B, H, N, d)
    memory and every kernel parameter gets exactly one argument (a stale name or a missing argument would
    otherwise surface only on an H200)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    launched = []

    class Launcher:
        def __init__(self, kernel_for, variant):
            self.names = kernel_for(*variant).arg_names

        def __getitem__(self, grid):
            def launch(*args, num_warps):
                assert len(args) == len(self.names), (len(args), self.names)
                named = dict(zip(self.names, args))
                assert named["cap"] == (30.0 if softcap else 1.0) and named["sc"] == pytest.approx(-2 * math.log2(math.e) * 0.1 / named["cap"])
                assert (named["wl"], named["wr"]) == ((100, 3) if softcap else (0, 0))
                assert all(isinstance(a, TensorDescriptor) for a in args[:5])
                if "TILES" in self.names:  # the dK/dV kernel: its key blocks per head and block slots
                    m_blocks = n // HB.BLOCK_N
                    assert named["M_BLOCKS"] == m_blocks
                    assert named["TILES"] == (m_blocks * b * hk if softcap or gproj else (m_blocks + m_blocks % 2) * b * hk)
                if "e0_desc" in self.names:  # with gproj the e0 tile: ones in column 0 of TILE_ROWS × ROWSUM_N
                    e0 = args[5]
                    assert isinstance(e0, TensorDescriptor) and (e0.block_shape == [HB.TILE_ROWS, HB.ROWSUM_N]) == gproj
                    if gproj:
                        want = torch.zeros(HB.TILE_ROWS, HB.ROWSUM_N)
                        want[:, 0] = 1
                        assert torch.equal(e0.base.float(), want)
                launched.append(grid)
            return launch

    monkeypatch.delenv("GPROJ_BWD_PERSISTENT", raising=False)
    variants = []
    for name in ("_dq_kernel_for", "_dkdv_kernel_for"):
        def kernel_for(*variant, real=getattr(HB, name)):
            variants.append(variant)
            return Launcher(real, variant)
        monkeypatch.setattr(HB, name, kernel_for)
    b, n, h, hk, d = 2, 256, 4, 2, 128
    q, do, o = _t(b, n, h, d), _t(b, n, h, d), torch.zeros(b, h, n, d, dtype=torch.bfloat16).transpose(1, 2)
    k, v = _t(b, n, hk, d), _t(b, n, hk, d)
    m, log2l, delta = (torch.zeros(b, h, n) for _ in range(3))
    qr = torch.zeros_like(q) if gproj else None
    dq = torch.empty(b, n, h, d)
    r = torch.empty(b, h, n) if gproj else None
    # The softcap variants also with a window (its bounds checked above).
    cap, window = (30.0, (100, 3)) if softcap else (0.0, None)
    HB.dq_pass(q, k, v, do, o, m, log2l, delta, dq, 1.0, 0.1, not softcap, r, qr, cap, window)
    dk, dv, key_sums = HB.dkdv(q, k, v, do, m, log2l, delta, qr, 1.0, 0.1, False, torch.float32, torch.bfloat16, True,
                               cap, window)
    # Fix "none" without a window: the persistent dK/dV kernel (dkdv_schedule), on a CPU tensor one program per item
    # of two blocks.
    persist = not (softcap or gproj)
    assert launched == [(n // 128, b * h), ((n // HB.BLOCK_N) * b * hk // 2,) if persist else (n // HB.BLOCK_N, b * hk)]
    # (GPROJ, CAUSAL, SOFTCAP, WINDOW, VARLEN, EDGES, KEYPAD, DROPOUT[, persist]) of each launch
    assert variants == [(gproj, not softcap, softcap, softcap, False, False, False, False),
                        (gproj, False, softcap, softcap, False, False, False, False, persist)]
    assert dk.dtype == torch.float32 and dv.dtype == torch.bfloat16 and dk.shape == dv.shape == k.shape
    assert key_sums.shape == (b, hk, d) and key_sums.dtype == torch.float64


@pytest.mark.parametrize("window, packed, keypad, dropout, gproj, m_blocks, rows, expected", [
    (False, False, False, False, False, 16, 64, (True, 1024, (132,))),
    (False, False, False, False, False, 3, 33, (False, 99, (3, 33))),
    (False, False, False, False, False, 5, 60, (True, 360, (132,))),
    (False, False, False, False, False, 16, 8, (False, 128, (16, 8))),
    (True, False, False, False, False, 16, 64, (False, 1024, (16, 64))),
    (False, True, False, False, False, 16, 64, (False, 1024, (16, 64))),
    (False, False, True, False, False, 5, 8, (False, 40, (5, 8))),
    (False, False, False, True, False, 5, 8, (False, 40, (5, 8))),
    (False, False, False, False, True, 16, 64, (False, 1024, (16, 64))),
], ids=["dense", "dense, fewer items than SMs", "dense, odd blocks",
        "GQA 8:1 4x16x2048 (64 items, run 42: -36% persistent)", "window", "packed", "key padding", "dropout", "gproj"])
def test_dkdv_schedule_is_persistent_where_the_kernel_loops(monkeypatch, window, packed, keypad, dropout, gproj,
                                                            m_blocks, rows, expected):
    """(persist, TILES, grid) of the dK/dV pass: dense inputs without GProj's dK term run the persistent kernel over
    items of two key-block slots (each head's an even number, so a causal head's heaviest block pairs with its lightest), one
    program per SM; windows, packed sequences, key padding, dropout and gproj the kernel without the loop, grid (key
    blocks, rows) — the grid must match the variant (a loop-less kernel on fewer programs than blocks would leave keys
    without gradients). GPROJ_BWD_PERSISTENT=0 turns the loop off (A/B timing); a persistent variant where it is not
    allowed is refused. Fewer items than SMs: no loop either (two blocks one after the other on one SM where two SMs
    run them at once: a 4×16×2048×128 GQA 8:1 backward lost 36% that way, run 42)."""
    monkeypatch.delenv("GPROJ_BWD_PERSISTENT", raising=False)
    monkeypatch.setattr(HF, "_sm_count", lambda device: 132)  # kernels/attention_fwd_hopper.paired_items'
    cuda = torch.device("cuda", 0)
    assert HB.dkdv_schedule(m_blocks, rows, window, packed, keypad, dropout, gproj, cuda) == expected
    monkeypatch.setenv("GPROJ_BWD_PERSISTENT", "0")
    assert HB.dkdv_schedule(m_blocks, rows, window, packed, keypad, dropout, gproj, cuda) == (
        False, m_blocks * rows, (m_blocks, rows))
    if gproj or not HF.persistent(window, packed, keypad, dropout):  # the features, not the grid, decide the variant
        with pytest.raises(ValueError, match="persist"):
            HB.compile_sm90(torch.bfloat16, gproj, False, window=window, varlen=packed, keypad=keypad, dropout=dropout,
                            edges=packed, persist=True)


def test_e0_tile_is_cached_except_under_graph_capture(monkeypatch):
    """The e0 tile is built once per (device, dtype); while a CUDA graph is captured a fresh one is built (a cached
    tile whose fill was only recorded would be read unfilled by eager calls before the first replay)."""
    ones_col0 = torch.zeros(HB.TILE_ROWS, HB.ROWSUM_N)
    ones_col0[:, 0] = 1
    first, again = HB._e0(torch.device("cpu"), torch.bfloat16), HB._e0(torch.device("cpu"), torch.bfloat16)
    assert first is again and torch.equal(first.base.float(), ones_col0)
    assert HB._e0(torch.device("cpu"), torch.float16).base.dtype == torch.float16
    built = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(HB, "_e0_tile", lambda device, dtype: built.append(device) or "fresh")
    monkeypatch.setattr(HB, "_e0_cached", lambda device, dtype: "cached")
    assert HB._e0(torch.device("cuda", 0), torch.bfloat16) == "fresh" and built == [torch.device("cuda", 0)]
    assert HB._e0(torch.device("cpu"), torch.bfloat16) == "cached"  # no capture on a CPU tensor


@pytest.mark.parametrize("which", ["dq", "dkdv"])
@pytest.mark.parametrize("gproj, causal, varlen", [
    (False, False, True), (True, False, True), (False, True, True), (True, True, True), (True, True, False),
], ids=["packed-none", "packed-gproj", "packed-none-causal", "packed-gproj-causal", "edges-gproj-causal"])
def test_packed_and_edge_variants_compile_for_sm90(gproj, which, causal, varlen):
    """Packed sequences and a seqlen that is not a multiple of 128 (bf16): the same Hopper paths, with the sequence
    bounds tested (rows past a sequence's end read no statistics, keys past it are masked or not stored)."""
    compile_ = HB.compile_dq_sm90 if which == "dq" else HB.compile_sm90
    kernel = compile_(torch.bfloat16, gproj, causal, None, (), False, varlen=varlen, edges=True)
    plain = compile_(torch.bfloat16, gproj, causal, None, (), False)
    assert_hopper_kernel(kernel, 2 * (6 if gproj else 3) if which == "dq" else 2 * (5 if gproj else 4))
    assert kernel.asm["ptx"].count("setp.") > plain.asm["ptx"].count("setp.")


def test_packed_launches_one_program_row_per_sequence_and_head(monkeypatch):
    """dq_pass and dkdv with cu_seqlens, on CPU tensors: grids over the longest sequence's blocks and nseq·nheads
    (nheads_k for dK/dV), cu_seqlens as the CU argument, every kernel parameter given once; key sums refused."""
    launched = {}

    class Launcher:
        def __init__(self, name, kernel_for, variant):
            self.name, self.names = name, kernel_for(*variant).arg_names
            # the packed variant, with its sequence edges; dK/dV's not the persistent one (dense inputs only)
            assert variant[4:] == (True, True, False, False) + ((False,) if name == "_dkdv_kernel_for" else ())

        def __getitem__(self, grid):
            def launch(*args, num_warps):
                assert len(args) == len(self.names)
                launched[self.name] = (grid, dict(zip(self.names, args))["CU"])
            return launch

    for name in ("_dq_kernel_for", "_dkdv_kernel_for"):
        monkeypatch.setattr(HB, name, lambda *variant, name=name, real=getattr(HB, name): Launcher(name, real, variant))
    total, h, hk, d = 300, 4, 2, 128
    q, do, o, qr = (_t(1, total, h, d) for _ in range(4))
    k, v = _t(1, total, hk, d), _t(1, total, hk, d)
    m, log2l, delta, r = (torch.zeros(1, h, total) for _ in range(4))
    cu = torch.tensor([0, 40, 300], dtype=torch.int32)
    HB.dq_pass(q, k, v, do, o, m, log2l, delta, torch.empty(1, total, h, d), 1.0, 0.1, True, r, qr, cu_seqlens=cu,
               max_seqlen=260)
    HB.dkdv(q, k, v, do, m, log2l, delta, qr, 1.0, 0.1, True, torch.bfloat16, torch.bfloat16, False, cu_seqlens=cu,
            max_seqlen=260)
    assert launched["_dq_kernel_for"] == ((3, 2 * h), cu) and launched["_dkdv_kernel_for"] == ((3, 2 * hk), cu)
    with pytest.raises(ValueError, match="key sums"):
        HB.dkdv(q, k, v, do, m, log2l, delta, qr, 1.0, 0.1, True, torch.float32, torch.bfloat16, True, cu_seqlens=cu,
                max_seqlen=260)


@pytest.mark.parametrize("grad_dtype, routed", [(None, True), (torch.float32, False)], ids=["bf16", "fp32-C2"])
def test_backward_routes_packed_sequences_to_the_gluon_passes(monkeypatch, grad_dtype, routed):
    """Packed sequences reach both Gluon passes (with cu_seqlens and max_seqlen) where serves_varlen holds, except an
    fp32 dk under GProj, whose per-sequence C2 projection needs key sums those passes do not keep."""
    seen = {}

    def fake_dq_pass(*args, cu_seqlens=None, max_seqlen=0, **kw):
        seen["dq"] = (cu_seqlens, max_seqlen)

    def fake_dkdv(*args, cu_seqlens=None, max_seqlen=0, seqlens_k=None, descriptors=None):
        seen["dkdv"] = (cu_seqlens, max_seqlen)
        raise Routed

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(HF, "on_sm90", lambda x: True)  # the real predicate (packed_ok), off the GPU
    monkeypatch.setattr(HB, "dq_pass", fake_dq_pass)
    monkeypatch.setattr(HB, "dkdv", fake_dkdv)
    monkeypatch.setattr(B, "_dq_kernel", StubKernel())
    monkeypatch.setattr(B, "_dkdv_kernel", StubKernel(TlDot()))
    total, h, d = 300, 2, 128
    q, k, v, do, o = (torch.randn(total, h, d, dtype=torch.bfloat16) for _ in range(5))
    m, log2l = torch.zeros(h, total), torch.full((h, total), 8.0)
    cu = torch.tensor([0, 40, 300], dtype=torch.int32)
    vl = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=260, max_seqlen_k=260)
    with pytest.raises(Routed if routed else TlDot):
        B.backward(do, q, k, v, o, m, log2l, d ** -0.5, True, "gproj", grad_dtype=grad_dtype, **vl)
    if routed:
        assert seen == {"dq": (cu, 260), "dkdv": (cu, 260)}
    else:
        assert "dq" not in seen


@pytest.mark.parametrize("n, grad_dtype, routed", [(200, None, True), (200, torch.float32, False), (256, torch.float32, True)],
                         ids=["ragged", "ragged-fp32-C2", "fp32-C2"])
def test_backward_keeps_key_sums_off_the_edge_variant(monkeypatch, n, grad_dtype, routed):
    """A seqlen that is not a multiple of 128 reaches the Gluon dK/dV pass, except for an fp32 dk under GProj: the
    per-64-key sums of its C2 projection would include the rows past the sequence's end."""
    def fake_dkdv(*args, **kw):
        raise Routed

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(HB, "on_sm90", lambda x: True)  # the real predicate, off the GPU
    monkeypatch.setattr(HB, "dq_pass", lambda *a, **kw: None)
    monkeypatch.setattr(HB, "dkdv", fake_dkdv)
    monkeypatch.setattr(B, "_dq_kernel", StubKernel())
    monkeypatch.setattr(B, "_dkdv_kernel", StubKernel(TlDot()))
    q, k, v, do, o = (torch.randn(1, n, 2, 128, dtype=torch.bfloat16) for _ in range(5))
    m, log2l = torch.zeros(1, 2, n), torch.full((1, 2, n), 8.0)
    with pytest.raises(Routed if routed else TlDot):
        B.backward(do, q, k, v, o, m, log2l, 128 ** -0.5, True, "gproj", grad_dtype=grad_dtype)


def _record_launches(monkeypatch) -> dict:
    """Replace both passes' kernel factories by recorders: each launch stores (variant, grid, {parameter: argument})
    under the factory's name in the returned dict, after checking that every kernel parameter got one argument."""
    launched = {}

    class Launcher:
        def __init__(self, name, kernel_for, variant):
            self.name, self.variant, self.names = name, variant, kernel_for(*variant).arg_names

        def __getitem__(self, grid):
            def launch(*args, num_warps):
                assert len(args) == len(self.names), (len(args), self.names)
                launched[self.name] = (self.variant, grid, dict(zip(self.names, args)))
            return launch

    for name in ("_dq_kernel_for", "_dkdv_kernel_for"):
        monkeypatch.setattr(HB, name, lambda *variant, name=name, real=getattr(HB, name): Launcher(name, real, variant))
    return launched


@pytest.mark.parametrize("n", [256, 200], ids=["multiple of 128", "edges"])
def test_key_padding_launches_the_keypad_variants_with_the_key_lengths(monkeypatch, n):
    """dq_pass and dkdv with seqlens_k, on CPU tensors: the key-padding variant of both kernels, SEQLENS the key
    lengths, the dQ pass given k and v themselves and their 2-D views' widths (for the descriptors it makes on the
    device: (batch, seqlen, heads, headdim) memory has heads·headdim columns, (batch, heads, seqlen, headdim)
    memory headdim), every kernel parameter given once."""
    launched = _record_launches(monkeypatch)
    b, h, hk, d = 2, 4, 2, 128
    q, do, o, qr = (_t(b, n, h, d) for _ in range(4))
    k = _t(b, n, hk, d)
    v = torch.zeros(b, hk, n, d, dtype=torch.bfloat16).transpose(1, 2)  # heads-major memory
    m, log2l, delta, r = (torch.zeros(b, h, n) for _ in range(4))
    seqlens_k = torch.tensor([n, 17], dtype=torch.int32)
    HB.dq_pass(q, k, v, do, o, m, log2l, delta, torch.empty(b, n, h, d), 1.0, 0.1, True, r, qr, seqlens_k=seqlens_k)
    HB.dkdv(q, k, v, do, m, log2l, delta, qr, 1.0, 0.1, True, torch.float32, torch.bfloat16, n % 128 == 0,
            seqlens_k=seqlens_k)
    edges = n % 128 != 0
    dq_variant, dq_grid, dq_args = launched["_dq_kernel_for"]
    dkdv_variant, dkdv_grid, dkdv_args = launched["_dkdv_kernel_for"]
    assert dq_variant + (False,) == (True, True, False, False, False, edges, True, False, False) == dkdv_variant
    assert dq_grid == (2, b * h) and dkdv_grid == (2, b * hk)
    assert dq_args["SEQLENS"] is seqlens_k and dkdv_args["SEQLENS"] is seqlens_k
    assert dq_args["K"] is k and dq_args["V"] is v and (dq_args["k_cols"], dq_args["v_cols"]) == (hk * d, d)


@pytest.mark.parametrize("which, gproj, causal", [("dq", True, True), ("dkdv", True, True), ("dq", False, False)],
                         ids=["dq-gproj-causal", "dkdv-gproj-causal", "dq-none-full"])
def test_key_padding_variants_compile_for_sm90(which, gproj, causal):
    """Right key padding (bf16, d 128): the dQ pass's loader makes its K/V descriptors on the device (tensormap
    edits of the global extent, fenced before the first TMA load); the dK/dV pass makes none (its padded keys' dk
    rows are zeroed instead) but tests the key bound; a window with key padding is refused at build time."""
    compile_ = HB.compile_dq_sm90 if which == "dq" else HB.compile_sm90
    kernel = compile_(torch.bfloat16, gproj, causal, None, (), False, keypad=True)
    plain = compile_(torch.bfloat16, gproj, causal, None, (), False)
    assert_hopper_kernel(kernel, 2 * (6 if gproj else 3) if which == "dq" else 2 * (5 if gproj else 4))
    ptx = kernel.asm["ptx"]
    made = ptx.count("tensormap.replace.tile.global_dim")
    assert (made, "fence.proxy.tensormap" in ptx) == ((4, True) if which == "dq" else (0, False))
    assert ptx.count("setp.") > plain.asm["ptx"].count("setp.")
    with pytest.raises(ValueError, match="keypad"):
        compile_(torch.bfloat16, gproj, False, None, (), False, window=True, keypad=True)


def test_the_two_passes_of_a_backward_share_their_tma_descriptors(monkeypatch):
    """dq_pass then dkdv with one ``descriptors`` dict (as attention_bwd's two-pass backward hands them): q, do, k and v
    are described once (the same descriptor objects reach both launches), the dQ pass's o and the dK/dV pass's
    −ρ∘Q get their own; without a dict every launch builds its own."""
    launched = {}

    class Launcher:
        def __init__(self, name, kernel_for, variant):
            self.name, self.names = name, kernel_for(*variant).arg_names

        def __getitem__(self, grid):
            def launch(*args, num_warps):
                launched[self.name] = dict(zip(self.names, args))
            return launch

    for name in ("_dq_kernel_for", "_dkdv_kernel_for"):
        monkeypatch.setattr(HB, name, lambda *variant, name=name, real=getattr(HB, name): Launcher(name, real, variant))
    b, n, h, hk, d = 2, 256, 4, 2, 128
    q, do, o, qr = (_t(b, n, h, d) for _ in range(4))
    k, v = _t(b, n, hk, d), _t(b, n, hk, d)
    m, log2l, delta, r = (torch.zeros(b, h, n) for _ in range(4))
    for shared in ({}, None):
        HB.dq_pass(q, k, v, do, o, m, log2l, delta, torch.empty(b, n, h, d), 1.0, 0.1, True, r, qr, descriptors=shared)
        HB.dkdv(q, k, v, do, m, log2l, delta, qr, 1.0, 0.1, True, torch.bfloat16, torch.bfloat16, False,
                descriptors=shared)
        dq_args, dkdv_args = launched["_dq_kernel_for"], launched["_dkdv_kernel_for"]
        same = [dq_args[f"{x}_desc"] is dkdv_args[f"{x}_desc"] for x in ("q", "do", "k", "v")]
        assert same == [shared is not None] * 4
        assert dq_args["o_desc"] is not dkdv_args["qr_desc"]
        if shared is not None:
            assert len(shared) == 6  # q, do, o, k, v, −ρ∘Q


@pytest.mark.parametrize("which", ["dq", "dkdv"])
@pytest.mark.parametrize("gproj, causal, features", [
    (False, False, {}), (True, True, {}), (True, False, {"head_dim": 64}), (False, True, {"softcap": True}),
    (True, False, {"window": True, "varlen": True, "edges": True}), (True, True, {"keypad": True}),
], ids=["none", "gproj-causal", "gproj-d64", "none-causal-softcap", "gproj-packed-window", "gproj-causal-keypad"])
def test_dropout_variants_compile_for_sm90_with_the_philox_rounds(which, gproj, causal, features):
    """Both passes' dropout variants (bf16): the same Hopper paths (wgmma chained, TMA, register split) and wgmma count
    as without dropout, and the Philox rounds compiled in — unsigned 32-bit multiplies-high (or the mul.wide that
    fuses a round's two multiplies) — exactly where asked for. Whether the mask is the forward's needs the GPU
    (benchmarks/gpu_check.py --cases hopper_dropout)."""
    compile_ = HB.compile_dq_sm90 if which == "dq" else HB.compile_sm90
    softcap = features.pop("softcap", False)
    kernel = compile_(torch.bfloat16, gproj, causal, None, (), softcap, dropout=True, **features)
    plain = compile_(torch.bfloat16, gproj, causal, None, (), softcap, **features)
    if which == "dq":
        assert_hopper_kernel(kernel, 2 * ((4 if softcap else 6) if gproj else 3))
    else:
        assert_hopper_kernel(kernel, 2 * (5 if gproj else 4))

    def mulhi(k):
        return k.asm["ptx"].count("mul.hi.u32") + k.asm["ptx"].count("mul.wide.u32")

    # one Philox call per (query row, 16 keys): 2 (half tiles: 1) calls a thread per 64-row tile in each of the two consumers
    assert mulhi(kernel) - mulhi(plain) >= 2 * HF.PHILOX_ROUNDS
    assert mulhi(plain) < 2 * HF.PHILOX_ROUNDS
    assert "shfl.sync.idx.b32" in kernel.asm["ptx"]  # the keep bytes handed around each row's (or key group's) lanes


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_dropout_launches_both_passes_with_the_forward_mask_arguments(monkeypatch, packed):
    """dq_pass and dkdv with dropout, on CPU tensors: the dropout variant of both kernels, every parameter one
    argument, and the mask's arguments those of the tl.dot kernels (kernels/_triton_utils.dropout_args) with
    DG = ⌈n_k / 16⌉ (packed: of total_k), so that both passes regenerate the forward's mask."""
    launched = _record_launches(monkeypatch)
    b, n, h, hk, d = (1, 300, 4, 2, 128) if packed else (2, 256, 4, 2, 128)
    q, do, o, qr = (_t(b, n, h, d) for _ in range(4))
    k, v = _t(b, n, hk, d), _t(b, n, hk, d)
    m, log2l, delta, r = (torch.zeros(b, h, n) for _ in range(4))
    extra = dict(cu_seqlens=torch.tensor([0, 40, 300], dtype=torch.int32), max_seqlen=260) if packed else {}
    drop = dict(dropout_p=0.1, dropout_seed=2**40 + 7, dropout_offset=3)
    HB.dq_pass(q, k, v, do, o, m, log2l, delta, torch.empty(b, n, h, d), 1.0, 0.1, True, r, qr, **extra, **drop)
    HB.dkdv(q, k, v, do, m, log2l, delta, qr, 1.0, 0.1, True, torch.bfloat16, torch.bfloat16, False, **extra, **drop)
    for name in ("_dq_kernel_for", "_dkdv_kernel_for"):
        variant, _, args = launched[name]
        assert variant[7] is True and variant[4] == packed and variant[8:] in ((), (False,))  # dK/dV: not persistent
        assert [args[a] for a in ("DG", "seed_lo", "seed_hi", "drop_off", "drop_thr")] == [(n + 15) // 16, 7, 256, 3, 26]
        assert args["drop_scale"] == pytest.approx(256 / (256 - 26), rel=1e-6)
