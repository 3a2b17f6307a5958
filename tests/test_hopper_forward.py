"""The sm_90 Gluon forward (kernels/attention_fwd_hopper.py) on a machine without a GPU.

Its numerics need an H200 (benchmarks/gpu_check.py --cases hopper: o, m, log2l against reference.py and
the tl.dot forward, the backward fed its statistics, the constants of DESIGN.md §5); Gluon kernels do
not run under Triton's interpreter. What CI can check: the kernel compiles for sm_90 with this Triton
(ahead of time, Triton's bundled ptxas), its machine code uses the Hopper paths it was written for and
fits the H100/H200 shared memory, and the dispatch predicate sends exactly the inputs the kernel
handles (a wrongly accepted shape would run it on rows it cannot mask).
"""

from __future__ import annotations

import pytest
import torch

from lightning_gproj.kernels import attention_fwd_hopper as H

from _hopper import assert_hopper_kernel, assert_softcap_code


@pytest.mark.parametrize("head_dim", H.HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ones", [(), ("causal",), ("causal", "H", "GROUP")], ids=["runtime", "causal", "causal-1head"])
@pytest.mark.parametrize("softcap, window", [(False, False), (True, False), (True, True)],
                         ids=["plain", "softcap", "softcap-window"])
def test_compiles_for_sm90_with_wgmma_tma_and_register_split(head_dim, dtype, ones, softcap, window):
    """Also the variants Triton builds at launch when an integer argument is 1 (every causal call)."""
    # Two consumers × (QKᵀ + PV) per K/V tile, each an asynchronous warp-group MMA; TMA loads of q, k, v, store of o.
    kernel = H.compile_sm90(head_dim, dtype, ones, softcap, window)
    assert_hopper_kernel(kernel, 4)
    assert_softcap_code(kernel.asm["ptx"], softcap)


@pytest.mark.parametrize("head_dim, dtype, ones, features", [
    (128, torch.bfloat16, (), {}),
    (128, torch.float16, ("causal",), {}),
    (64, torch.bfloat16, ("causal", "H", "GROUP"), {}),
    (128, torch.bfloat16, ("causal",), {"varlen": True, "edges": True}),
    (128, torch.bfloat16, (), {"softcap": True, "window": True}),
    (64, torch.bfloat16, ("causal",), {"keypad": True, "edges": True}),
], ids=["d128", "d128-fp16-causal", "d64-causal-1head", "packed-causal", "softcap-window", "d64-keypad-edges"])
def test_dropout_variant_compiles_for_sm90_with_the_philox_rounds(head_dim, dtype, ones, features):
    """The dropout variant: the same Hopper paths (wgmma chained, TMA, register split, shared memory within sm_90's),
    and the Philox rounds compiled in — unsigned 32-bit multiplies-high (PHILOX_ROUNDS × 2 per call, 4 calls a thread
    per tile) — exactly where asked for (the kernel without dropout has none). Whether they draw the tl.dot kernels'
    mask needs the GPU (benchmarks/gpu_check.py --cases hopper_dropout)."""
    kernel = H.compile_sm90(head_dim, dtype, ones, dropout=True, **features)
    plain = H.compile_sm90(head_dim, dtype, ones, **features)
    assert_hopper_kernel(kernel, 4)
    # mul.hi.u32, or mul.wide.u32 where LLVM fuses a round's mul.hi and mul.lo of the same operands (the kernel without
    # dropout has a few of its own where it divides by a constant: packed, edges)
    def mulhi(k):
        return k.asm["ptx"].count("mul.hi.u32") + k.asm["ptx"].count("mul.wide.u32")

    assert mulhi(kernel) - mulhi(plain) >= 2 * 4 * H.PHILOX_ROUNDS
    assert mulhi(plain) < 2 * H.PHILOX_ROUNDS
    assert kernel.metadata.shared >= plain.metadata.shared


def _qkv(b=2, n=256, h=4, hk=2, d=128, dtype=torch.bfloat16):
    return (torch.zeros(b, n, h, d, dtype=dtype), torch.zeros(b, n, hk, d, dtype=dtype),
            torch.zeros(b, n, hk, d, dtype=dtype))


def test_accepts_the_shapes_it_is_written_for():
    assert H.accepts(*_qkv())
    assert H.accepts(*_qkv(d=64, dtype=torch.float16, hk=1))
    assert H.accepts(*_qkv(n=128, hk=4))
    assert H.accepts(*_qkv(n=200)) and H.accepts(*_qkv(n=129))  # the edge variant: seqlen not a multiple of 128


@pytest.mark.parametrize("why, q, k, v", [
    ("seqlen below one 128-row tile (not run on a GPU)", *_qkv(n=100)),
    ("head dim 96", *_qkv(d=96)),
    ("head dim 32", *_qkv(d=32)),
    ("fp32", *_qkv(dtype=torch.float32)),
    ("seqlen_q != seqlen_k", _qkv()[0][:, :128], *_qkv()[1:]),
    ("nheads not a multiple of nheads_k", _qkv(h=4)[0], *_qkv(hk=3)[1:]),
    ("k and v dtypes differ", *_qkv()[:2], _qkv()[2].half()),
    ("batch 0", *_qkv(b=0)),
    ("nheads_k 0", *_qkv(hk=0)),
    ("3-D tensors", *(x[0] for x in _qkv())),
])
def test_rejects_what_it_cannot_serve(why, q, k, v):
    assert not H.accepts(q, k, v), why


def test_accepts_heads_major_memory_per_tensor():
    """Hugging Face models hand q, k, v over as (B, H, N, d) memory; each tensor may differ."""
    q, k, v = _qkv()
    bhsd = torch.zeros(2, 2, 256, 128, dtype=torch.bfloat16).transpose(1, 2)
    assert H.accepts(q, k, bhsd) and H.accepts(q, bhsd, bhsd)
    assert H.accepts(torch.zeros(2, 4, 256, 128, dtype=torch.bfloat16).transpose(1, 2), k, v)


def test_rejects_non_contiguous_and_misaligned_layouts():
    q, k, v = _qkv()
    strided = torch.zeros(2, 256, 4, 144, dtype=torch.bfloat16)[..., :128]
    assert not H.accepts(strided, k, v)
    seq_major = torch.zeros(256, 2, 4, 128, dtype=torch.bfloat16).transpose(0, 1)  # (N, B, H, d) memory
    assert not H.accepts(seq_major, k, v)
    sliced_heads = torch.zeros(2, 8, 256, 128, dtype=torch.bfloat16)[:, :4].transpose(1, 2)  # gaps between batches
    assert not H.accepts(sliced_heads, k, v)
    flat = torch.zeros(2 * 256 * 4 * 128 + 1, dtype=torch.bfloat16)
    shifted = flat[1:].view(2, 256, 4, 128)  # contiguous, but 2 bytes off a 16-byte boundary
    assert shifted.is_contiguous() and not H.accepts(shifted, k, v)


def test_not_served_off_hopper():
    """On CPU (and under the interpreter) every call keeps the tl.dot kernel."""
    assert not H.serves(*_qkv())


def _heads_major(b, n, h, d, extra_batch=0):
    """(b, n, h, d) in (batch, heads, seqlen, headdim) memory; extra_batch > 0: batch rows 1..b of a longer
    buffer (a nonzero storage offset)."""
    x = torch.randn(b + extra_batch, h, n, d).bfloat16()
    return x[extra_batch:].transpose(1, 2)


@pytest.mark.parametrize("layout", ["seq-major", "heads-major", "mixed", "batch slices (storage offset)",
                                    "batch 1, nheads_k 1 heads-major"])
def test_tma_tiles_address_the_tensor(layout):
    """forward's TMA descriptors (built on CPU) and the tile coordinates the kernel computes from (rb, rh,
    ch), row b·rb + h·rh + position and column h·ch, address exactly x[b, :, h, :] of q, k, v and o, for every
    layout accepts() takes: a wrongly accepted layout would have the kernel read other heads' or batches'
    rows with no error."""
    b, n, h, hk, d = 2, 128, 4, 2, 64
    if layout == "seq-major":
        q, k, v = torch.randn(b, n, h, d).bfloat16(), torch.randn(b, n, hk, d).bfloat16(), torch.randn(b, n, hk, d).bfloat16()
    elif layout == "heads-major":
        q, k, v = _heads_major(b, n, h, d), _heads_major(b, n, hk, d), _heads_major(b, n, hk, d)
    elif layout == "mixed":
        q, k, v = _heads_major(b, n, h, d), torch.randn(b, n, hk, d).bfloat16(), _heads_major(b, n, hk, d)
    elif layout == "batch slices (storage offset)":
        q = torch.randn(b + 1, n, h, d).bfloat16()[1:]
        k, v = _heads_major(b, n, hk, d, extra_batch=1), _heads_major(b, n, hk, d, extra_batch=2)
        assert q.storage_offset() > 0 and k.storage_offset() > 0
    else:
        b, hk = 1, 1
        q, k, v = _heads_major(b, n, h, d), _heads_major(b, n, hk, d), torch.randn(b, n, hk, d).bfloat16()
    assert H.accepts(q, k, v)
    o = torch.randn(b, n, h, d).bfloat16()  # as forward allocates it
    descs, where = H._descriptors(q, k, v, o)
    locators = [where[0:3], where[3:6], where[6:9], (n, 0, d)]  # o's are fixed in the kernel
    for x, desc, (rb, rh, ch) in zip((q, k, v, o), descs, locators):
        x2 = desc.base.as_strided(desc.shape, desc.strides)
        for bi in range(x.shape[0]):
            for hi in range(x.shape[2]):
                tile = x2[bi * rb + hi * rh + torch.arange(n), hi * ch:hi * ch + d]
                assert torch.equal(tile, x[bi, :, hi, :]), (bi, hi)


@pytest.mark.parametrize("kwargs, causal, gluon_causal", [
    ({}, False, False),
    ({}, True, True),
    ({"window_size": (-1, 0)}, False, True),  # flash-attn's spelling of causal
    ({"window_size": (-1, -1)}, True, True),
    ({"window_size": (4, 0)}, False, False),
    ({"window_size": (-1, 3)}, False, False),
    ({"softcap": 5.0}, False, False),
    ({"softcap": 5.0}, True, True),
    ({"dropout_p": 0.1, "dropout_seed": 2**40 + 7, "dropout_offset": 3}, True, True),
    ({"dropout_p": 0.2, "dropout_seed": 5, "window_size": (4, 0), "softcap": 5.0}, False, False),
    ({"seqlens_k": torch.tensor([100, 128], dtype=torch.int32)}, False, False),
    ({"seqlens_k": torch.tensor([100, 128], dtype=torch.int32), "dropout_p": 0.1, "dropout_seed": 9}, True, True),
    ({"seqlens_k": torch.tensor([100, 128], dtype=torch.int32), "window_size": (4, 0)}, False, None),
    ({"seqlens_k": torch.tensor([100, 128], dtype=torch.int32), "window_size": (4, 0), "dropout_p": 0.1}, False, None),
    ({"cu_seqlens_q": torch.tensor([0, 128, 256], dtype=torch.int32), "max_seqlen_q": 128,
      "cu_seqlens_k": torch.tensor([0, 128, 256], dtype=torch.int32), "max_seqlen_k": 128}, False, None),
], ids=["dense", "causal", "window (-1, 0)", "window (-1, -1) causal", "left window", "right window", "softcap",
        "softcap causal", "dropout", "dropout with a window and softcap", "seqlens_k", "seqlens_k with dropout",
        "seqlens_k with a window", "seqlens_k with a window and dropout", "packed"])
def test_forward_dispatch_sends_only_dense_inputs_to_the_gluon_kernel(monkeypatch, kwargs, causal, gluon_causal):
    """attention_fwd.forward hands a dense call to the Gluon kernel (where serves() says it can) unless it has key
    padding and a window together — which that kernel does not implement —, with the causal flag the window spelling
    implies (gluon_causal; None: the tl.dot kernel runs instead), the softcap, the window bounds, the key lengths and
    the dropout arguments (given only with dropout: the kernel without it is the one compiled without its code)."""
    from lightning_gproj.kernels import attention_fwd as F

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # F.supports' CPU condition; nothing below launches a kernel
    calls = []
    monkeypatch.setattr(H, "serves", lambda q, k, v: True)
    monkeypatch.setattr(H, "forward", lambda q, k, v, scale, c, softcap, window, seqlens_k=None, **drop:
                        calls.append(("gluon", c, softcap, window, seqlens_k, drop)) or (q, None, None))

    class TlDot:
        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append(("tl.dot", meta["CAUSAL"]))

    monkeypatch.setattr(F, "_fwd_kernel", TlDot())
    q, k, v = _qkv()
    if "cu_seqlens_q" in kwargs:
        q, k, v = (x.flatten(0, 1) for x in (q, k, v))
    F.forward(q, k, v, 0.125, causal, **kwargs)
    if gluon_causal is None:
        assert [c[0] for c in calls] == ["tl.dot"]
    else:
        # A window reaches the kernel as (wl, wr) >= 0 (an unbounded side: nq + nk = 512 here) with causal off.
        window = {(4, 0): (4, 0), (-1, 3): (512, 3)}.get(kwargs.get("window_size"))
        assert calls[0][:4] == ("gluon", gluon_causal, kwargs.get("softcap", 0.0), window) and len(calls) == 1
        if "seqlens_k" in kwargs:
            assert calls[0][4].tolist() == kwargs["seqlens_k"].tolist()
        else:
            assert calls[0][4] is None
        drop = {name: kwargs.get(name, 0) for name in ("dropout_p", "dropout_seed", "dropout_offset")}
        assert calls[0][5] == (drop if "dropout_p" in kwargs else {})


def test_benchmark_variants_still_apply_and_compile():
    """benchmarks/hopper_fwd_ab.py edits this module's source to build its variants; an edit that no longer
    matches (or a variant that no longer compiles) would only show on the GPU, costing a device call."""
    from _scripts import load_script

    ab = load_script("benchmarks/hopper_fwd_ab.py", "hopper_fwd_ab")
    for name in ab.VARIANTS:
        kernel = ab.variant_module(name).compile_sm90(64, torch.bfloat16, ("causal",))
        assert "wgmma.mma_async" in kernel.asm["ptx"], name


@pytest.mark.parametrize("head_dim", H.HEAD_DIMS)
@pytest.mark.parametrize("ones, softcap, window, varlen", [
    ((), False, False, True), (("causal",), False, False, True), ((), True, True, True), (("causal",), False, False, False),
], ids=["packed", "packed-causal", "packed-softcap-window", "edges-causal"])  # edges: the same code without cu_seqlens
def test_packed_and_edge_variants_compile_for_sm90_with_masked_stores(head_dim, ones, softcap, window, varlen):
    """Packed sequences, and a seqlen that is not a multiple of 128 (edges): the same Hopper paths, o written by
    masked stores (a tile's rows past its sequence's end belong to the next sequence, batch row or head) instead of
    the TMA store, and the key bound tested."""
    kernel = H.compile_sm90(head_dim, torch.bfloat16, ones, softcap, window, varlen=varlen, edges=True)
    dense = H.compile_sm90(head_dim, torch.bfloat16, ones, softcap, window)
    assert_hopper_kernel(kernel, 4)
    ptx, dense_ptx = kernel.asm["ptx"], dense.asm["ptx"]
    assert "cp.async.bulk.tensor.2d.global.shared" not in ptx and "cp.async.bulk.tensor.2d.global.shared" in dense_ptx
    assert ptx.count("setp.") > dense_ptx.count("setp.")


def _packed(total=300, h=4, hk=2, d=128, dtype=torch.bfloat16):
    return tuple(torch.zeros(1, total, n, d, dtype=dtype) for n in (h, hk, hk))


@pytest.mark.parametrize("why, qkv, varlen, ok", [
    ("one cu_seqlens for both", _packed(), "same", True),
    ("head dim 64, fp16", _packed(d=64, dtype=torch.float16), "same", True),
    ("equal values in two tensors (could differ: not compared on the host)", _packed(), "copy", False),
    ("max_seqlen_q != max_seqlen_k", _packed(), "max", False),
    ("head dim 96", _packed(d=96), "same", False),
    ("total_q != total_k", (_packed()[0], *_packed(total=200)[1:]), "same", False),
    ("total below one 128-row tile", _packed(total=100), "same", False),
    ("batch·nheads over the grid's 65535", _packed(h=4096, hk=4096), "many", False),
])
def test_packed_ok_takes_one_cu_seqlens_for_queries_and_keys(monkeypatch, why, qkv, varlen, ok):
    """The Gluon kernels' causal mask and tile bounds assume seqlen_q = seqlen_k per sequence, which only sharing
    one cu_seqlens tensor guarantees without reading it (a device sync)."""
    monkeypatch.setattr(H, "on_sm90", lambda x: True)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    args = {"same": (cu, cu, 200, 200), "copy": (cu, cu.clone(), 200, 200), "max": (cu, cu, 200, 256),
            "many": (torch.zeros(17, dtype=torch.int32),) * 2 + (200, 200)}[varlen]
    assert H.packed_ok(*qkv, args) == ok, why


def test_forward_dispatch_sends_packed_sequences_to_the_gluon_kernel(monkeypatch):
    """Where serves_varlen holds, attention_fwd.forward hands packed sequences to the Gluon kernel as (1, total, …)
    views with cu_seqlens and max_seqlen, and returns its o, m, log2l without the leading 1."""
    from lightning_gproj.kernels import attention_fwd as F

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    monkeypatch.setattr(H, "serves_varlen", lambda q, k, v, varlen: True)

    def fake(q, k, v, scale, causal, softcap, window, cu_seqlens=None, max_seqlen=0, **drop):
        calls.append((q.shape, causal, window, cu_seqlens, max_seqlen, drop))
        return torch.zeros(q.shape), torch.zeros(1, q.shape[2], q.shape[1]), torch.zeros(1, q.shape[2], q.shape[1])

    monkeypatch.setattr(H, "forward", fake)
    q, k, v = (x[0] for x in _packed())
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    o, m, log2l = F.forward(q, k, v, 0.125, True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200,
                            window_size=(31, 0))
    assert calls == [((1, 300, 4, 128), False, (31, 0), cu, 200, {})]
    assert o.shape == (300, 4, 128) and m.shape == log2l.shape == (4, 300)
    # with dropout too (the packed rows' counters, kernels/attention_fwd_hopper._consume)
    F.forward(q, k, v, 0.125, True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200,
              dropout_p=0.1, dropout_seed=2**33, dropout_offset=4)
    assert calls[1] == ((1, 300, 4, 128), True, None, cu, 200,
                        {"dropout_p": 0.1, "dropout_seed": 2**33, "dropout_offset": 4})


@pytest.mark.parametrize("n, packed, keypad, dropout, grid, variant", [
    (256, False, False, False, (8,), (False, False, False, False, False, False)),  # 16 tiles in items of 2
    (200, False, False, False, (8,), (False, False, False, True, False, False)),
    (300, True, False, False, (16,), (False, False, True, True, False, False)),  # max_seqlen 200: 2 blocks; 2 seqs × 4 heads
    (256, False, True, False, (16,), (False, False, False, False, True, False)),
    (200, False, True, False, (16,), (False, False, False, True, True, False)),
    (256, False, False, True, (16,), (False, False, False, False, False, True)),  # dropout: one tile per program
    (200, False, True, True, (16,), (False, False, False, True, True, True)),
    (300, True, False, True, (16,), (False, False, True, True, False, True)),
], ids=["multiple of 128", "edges", "packed", "key padding", "key padding, edges", "dropout",
        "dropout, key padding, edges", "dropout, packed"])
def test_forward_launches_the_edge_variant_where_seqlen_is_ragged(monkeypatch, n, packed, keypad, dropout, grid,
                                                                  variant):
    """forward up to the launch on CPU tensors: the grid covers every row (cdiv), the edge variant is compiled in
    exactly where a block can end past the sequence, the key-padding variant exactly with seqlens_k, the dropout
    variant exactly with dropout_p > 0 (not persistent: one tile per program), and every kernel parameter gets one
    argument."""
    launched = []

    real = H._kernel_for

    class Launcher:
        def __init__(self, *v):
            self.v, self.names = v, real(*v).arg_names

        def __getitem__(self, g):
            def launch(*args, num_warps):
                assert len(args) == len(self.names)
                launched.append((g, self.v))
                by_name = dict(zip(self.names, args))
                if dropout:  # seed 2**40 + 7, offset 3, p 0.1: the tl.dot kernels' arguments (dropout_args)
                    assert [by_name[a] for a in ("DG", "seed_lo", "seed_hi", "drop_off", "drop_thr")] == [
                        (n + 15) // 16, 7, 256, 3, 26]
                    assert by_name["drop_scale"] == pytest.approx(256 / (256 - 26), rel=1e-6)
            return launch

    monkeypatch.setattr(H, "_kernel_for", Launcher)
    b = 1 if packed else 2
    q, k, v = (torch.zeros(b, n, h, 128, dtype=torch.bfloat16) for h in (4, 2, 2))
    cu = torch.tensor([0, 100, 300], dtype=torch.int32) if packed else None
    seqlens_k = torch.tensor([n, 17], dtype=torch.int32) if keypad else None
    drop = dict(dropout_p=0.1, dropout_seed=2**40 + 7, dropout_offset=3) if dropout else {}
    H.forward(q, k, v, 0.1, False, cu_seqlens=cu, max_seqlen=200 if packed else 0, seqlens_k=seqlens_k, **drop)
    assert launched == [(grid, variant)]


def test_launch_lends_an_allocator_for_device_made_descriptors_and_takes_it_back():
    """With key padding the kernels make TMA descriptors on the device, whose scratch memory Triton's launcher asks
    its allocator for: launch() sets one (torch memory on the tensors' device) for that launch only, in a copy of
    the context, so that no allocator (or the caller's own) is what Triton sees after it."""
    from triton.runtime import _allocation

    seen = []

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, num_warps):
                seen.append((grid, args, num_warps))
                if args[0]:  # the keypad launch: the allocator Triton's launcher would call
                    buffer = _allocation._allocator.get()(256 * 8, 128, None)
                    seen.append((buffer.device, buffer.dtype, buffer.numel()))
            return run

    before = _allocation._allocator.get()
    H.launch(Kernel(), (8, 2), torch.device("cpu"), True, True, 7)
    assert seen == [((8, 2), (True, 7), 4), (torch.device("cpu"), torch.int8, 2048)]
    assert _allocation._allocator.get() is before
    seen.clear()
    H.launch(Kernel(), (1, 1), torch.device("cpu"), False, False)
    assert seen == [((1, 1), (False,), 4)]


@pytest.mark.parametrize("ones", [(), ("causal",)], ids=["full", "causal"])
def test_key_padding_variant_compiles_for_sm90_with_device_made_descriptors(ones):
    """Right key padding (bf16, d 128): the loader makes the K and V descriptors on the device (two global
    dimensions each, edited in a tensormap and fenced before use), o keeps its TMA store, and the key bound is
    tested; with a window or packed sequences the variant is refused at build time."""
    kernel = H.compile_sm90(128, torch.bfloat16, ones, keypad=True)
    dense = H.compile_sm90(128, torch.bfloat16, ones)
    assert_hopper_kernel(kernel, 4)
    ptx = kernel.asm["ptx"]
    assert ptx.count("tensormap.replace.tile.global_dim") == 4 and "fence.proxy.tensormap" in ptx
    assert "cp.async.bulk.tensor.2d.global.shared" in ptx
    assert ptx.count("setp.") > dense.asm["ptx"].count("setp.")
    for feature in ("window", "varlen"):
        with pytest.raises(ValueError, match="keypad"):
            H.compile_sm90(128, torch.bfloat16, ones, keypad=True, **{feature: True})


@pytest.mark.parametrize("window, packed, keypad, m_blocks, rows, expected", [
    (False, False, False, 16, 64, (2, 1024, 132)), (False, False, False, 3, 33, (1, 99, 99)),
    (False, False, False, 5, 60, (2, 360, 132)), (False, False, False, 261, 1, (1, 261, 261)),
    (False, False, False, 131, 2, (2, 264, 132)),
    (True, False, False, 16, 64, (1, 1024, 1024)),
    (False, True, False, 16, 64, (1, 1024, 1024)), (False, False, True, 5, 8, (1, 40, 40)),
], ids=["dense", "dense, fewer items than SMs", "dense, odd blocks", "dense, one item short of the SMs",
        "dense, one item per SM", "window",
        "packed", "key padding"])
def test_schedule_is_persistent_over_pairs_of_tiles_where_the_kernel_loops(monkeypatch, window, packed, keypad,
                                                                           m_blocks, rows, expected):
    """(PER, TILES, programs). Dense inputs: items of two tile slots, each head's slots an even number (an odd head's
    last one is skipped, so a causal head's heaviest block pairs with its lightest and no item spans two heads), one
    program per SM looping over them; windows, packed sequences and key padding: the kernel variants without the
    loop, one program per tile for the block scheduler (the grid must match the variant: a loop-less kernel on fewer
    programs than tiles would leave tiles unwritten). Fewer items than SMs (a small batch, few heads): no loop either —
    it would run two tiles one after the other on one SM where two SMs run them at once."""
    monkeypatch.delenv("GPROJ_FWD_PERSISTENT", raising=False)
    monkeypatch.setattr(H, "_sm_count", lambda device: 132)
    assert H.persistent(window, packed, keypad) == (not (window or packed or keypad))
    assert H.schedule(m_blocks, rows, window, packed, keypad, torch.device("cuda", 0)) == expected
