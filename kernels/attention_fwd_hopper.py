"""A warp-specialized attention forward for Hopper (sm_90), written in Gluon (issue 12, lever 4).

The same contract and rounding points as :func:`lightning_gproj.kernels.attention_fwd.forward`, which
dispatches here when :func:`serves` says so; every other input (and every machine that is not an sm_90
GPU, CI's interpreter included) keeps the ``tl.dot`` kernel there.

Layout (FA3's forward in Gluon's explicit partitions): a tile is (128 query rows, batch·head); a
1-warp loader partition streams Q and the K and V tiles (128 keys) by TMA into shared memory (K and V on rings of
NUM_STAGES slots, mbarriers ``ready`` / ``empty``); two 4-warp consumer partitions (the default partition and one
worker) each own 64 of the 128 query rows, share every K/V slot (``empty`` counts both arrivals), and
run S = Q Kᵀ, the online softmax and O += P V on asynchronous wgmma; the warp scheduler overlaps one
consumer's softmax with the other's GEMMs. Dense inputs without a window run persistent (:func:`schedule`): one
program per SM loops over items of two tiles — a causal head's heaviest query block with its lightest, so every item
has the same work — loading the next Q while the last P̃·V and the o store of the previous tile run; windows, packed
sequences and key padding run one tile per program, causal ones heaviest first.

FMA-safe (DESIGN.md §5): P = exp2((s − m)·τ·log2e) with s the raw fp32 scores and m their row max, so
the row's maximum gets exp2(0) = 1 exactly (q = k = v = 133120 gives o = 133120). Rounding points as
kernels/reference.py: P fp32, rounded to the input dtype as the A operand of P·V; l = Σ_j of the fp32 P;
O = acc / l rounded once.

Served (:func:`serves`): bf16 / fp16, (batch, seqlen, nheads, headdim) tensors whose memory is contiguous
in that order or in (batch, nheads, seqlen, headdim) order (each tensor its own), 16-byte aligned,
seqlen_q = seqlen_k (a multiple of 128, or any with the edge variant: the last block's rows and keys past the
sequence are masked and its o stored row by row), head dim 64 or 128, GQA, causal or not, sliding windows (each block
visits only the key tiles its rows' windows touch; a half that sees none of a tile releases it unread), logit
softcap (its tanh as the tl.dot kernels form it), packed sequences that share one cu_seqlens between queries and
keys (:func:`serves_varlen`: a tile per (query block, sequence · head), a tile's rows and keys past its sequence's end
masked, o stored row by row there; the next sequence's values in such a tile are multiplied by an exact 0, so they
change nothing unless they are inf or NaN, as in any FlashAttention kernel), right key padding (``seqlens_k``, not
with a window: tiles past a batch row's last key are skipped, the last one masked, and its K/V tiles come through
TMA descriptors made on the device that end at that key, so the padded values, NaN or inf included, are never read
into a product), attention dropout (the P̃·V operand is P̃ ∘ M with the Philox keep mask of
kernels/reference.dropout_keep_mask, bit for bit the tl.dot kernels' — :func:`philox_keep`: one Philox call per 16 keys
of a row, run by one lane of the quad that holds the row in the wgmma accumulator, the keep bits handed to the other
three by warp shuffles —, o scaled by 1/(1 − p̂); m and log2l of the undropped P; one tile per program:
:func:`persistent`). Speed on the H200: benchmarks/NOTES.md (runs 18, 21, 24, 26; with dropout run 34).
"""

from __future__ import annotations

import contextvars
import functools
import os

import torch
import triton

from lightning_gproj.kernels._triton_utils import (
    COPYSIGN_ASM, SOFTCAP_EX2_ASM, dropout_args, exponent_factor, interpreting, softcap_factor,
)
from lightning_gproj.kernels.reference import PHILOX_ROUNDS

try:  # Gluon ships with Triton >= 3.4; the TMA copies were renamed after 3.6.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )

    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    GLUON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the Triton build
    GLUON_ERROR = f"{exc.__class__.__name__}: {exc}"

__all__ = ["forward", "dropout_enabled", "serves", "serves_varlen", "packed_ok", "accepts", "on_sm90", "tma_descriptor", "feature_args", "compile_sm90", "aot_compile_sm90",
           "sass", "tensordesc_type", "pointer_type", "BLOCK_M"]

#: The kernels' dropout scalars that vary between calls (not specialized on their values).
DROPOUT_SCALARS = ("seed_lo", "seed_hi", "drop_off", "drop_thr")

#: Query rows per program (two consumers of 64) and keys per K/V tile; the served seqlen's multiple.
BLOCK_M = 128
HEAD_DIMS = (64, 128)

def persistent(window: bool, varlen: bool, keypad: bool, dropout: bool = False) -> bool:
    """Whether the forward kernel of these features is persistent (its partitions loop over the program's items of
    tiles, :func:`schedule`): all but windows, packed sequences and key padding, which run one tile per program with
    no loop (with the loop, the window variant's consumers spilled: 243 spill stores with Triton 3.6; key padding's
    loader makes a TMA descriptor per tile, which a second tile would rewrite while the first one's loads may be in
    flight), and dropout (with the loop its consumers spilled: d 128 full / causal, 249 / 269 spill stores (STL) with
    Triton 3.9 against 6 / 8 without the loop, 6 / 6 with Triton 3.6 against 0 / 0)."""
    return not (window or varlen or keypad or dropout)


if GLUON_ERROR is None:
    # Module constants: the partitions of gl.warp_specialize receive their arguments as IR values, so
    # constexpr arguments would not stay constexpr there.
    _BLOCK_M = gl.constexpr(BLOCK_M)
    _HALF_M = gl.constexpr(BLOCK_M // 2)
    _BLOCK_N = gl.constexpr(128)
    _NUM_STAGES = gl.constexpr(2)

    @gluon.jit
    def ring_load_pair(a_desc, b_desc, a_smem, b_smem, ready, empty, i, a_row, a_col, b_row, b_col,
                       NUM_STAGES: gl.constexpr):
        """Fill slot i % NUM_STAGES of a ring that two consumers share: wait until both released it (a
        fresh barrier passes the first round), then TMA-load an a tile at (a_row, a_col) and a b tile at
        (b_row, b_col) into it."""
        s = i % NUM_STAGES
        mbarrier.wait(empty.index(s), ((i // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma_load(a_desc, [a_row, a_col], ready.index(s), a_smem.index(s))
        tma_load(b_desc, [b_row, b_col], ready.index(s), b_smem.index(s))

    @gluon.jit
    def ring_load(desc, smem, ready, empty, i, row, col, NUM_STAGES: gl.constexpr):
        """Fill slot i % NUM_STAGES of a one-tile ring that two consumers share, as :func:`ring_load_pair`."""
        s = i % NUM_STAGES
        mbarrier.wait(empty.index(s), ((i // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), desc.block_type.nbytes)
        tma_load(desc, [row, col], ready.index(s), smem.index(s))

    @gluon.jit
    def ring_barriers(NUM_STAGES: gl.constexpr):
        """The ``ready`` / ``empty`` mbarriers of a NUM_STAGES-slot ring that a TMA loader fills (one arrival
        with the bytes expected) and two consumers release (``empty`` counts both arrivals)."""
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)
        return ready, empty

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, i, k_row, k_col, v_row, v_col, lo,
                 hi):
        """The K and V tiles of key positions [lo, hi) on rings of their own, from ring position i on: a consumer
        releases K_j once S_j is computed and V_j once P̃_j·V_j is, so K_{j+1} can load while P̃_{j-1}·V_{j-1} still
        reads its slot. Returns the ring position after the last tile."""
        for start_n in range(lo, hi, _BLOCK_N):
            ring_load(k_desc, k_smem, k_ready, k_empty, i, k_row + start_n, k_col, _NUM_STAGES)
            ring_load(v_desc, v_smem, v_ready, v_empty, i, v_row + start_n, v_col, _NUM_STAGES)
            i += 1
        return i

    @gluon.jit
    def _produce(t, i, it, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,
                 v_empty, CU, SEQLENS, K, V, k_cols, v_cols, H, GROUP, N_CTX, M_BLOCKS, PER, causal, q_rb, q_rh, q_ch, k_rb,
                 k_rh, k_ch, v_rb, v_rh, v_ch, wl, wr, WINDOW: gl.constexpr, VARLEN: gl.constexpr, KEYPAD: gl.constexpr):
        """The loads of tile t (:func:`tile_span`): Q once both consumers released the previous one (``q_empty``, its
        it-th use), then its K and V tiles from ring position i on (:func:`_load_kv`). With KEYPAD the K and V tiles
        come through descriptors of the batch row's valid keys [0, kend) (:func:`keys_descriptor`; K, V point at k, v,
        whose 2-D TMA views have k_cols, v_cols columns), zero past them. Returns (i, it) after the tile."""
        b, h, start, row0, seqlen, lo, hi, kend = tile_span(t, M_BLOCKS, PER, H, N_CTX, causal, CU, SEQLENS, wl, wr,
                                                            WINDOW, VARLEN, KEYPAD)
        if row0 < seqlen:  # VARLEN: the tiles span the longest sequence
            hk = h // GROUP
            q_row = b * q_rb + h * q_rh + start + row0
            mbarrier.wait(q_empty, (it & 1) ^ 1)
            mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
            tma_load(q_desc, [q_row, h * q_ch], q_bar, q_smem.index(0))
            tma_load(q_desc, [q_row + _HALF_M, h * q_ch], q_bar, q_smem.index(1))
            k_row = b * k_rb + hk * k_rh + start
            v_row = b * v_rb + hk * v_rh + start
            if KEYPAD:
                i = _load_kv(keys_descriptor(K, k_row, kend, k_cols, k_desc), keys_descriptor(V, v_row, kend, v_cols, v_desc),
                             k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, i, 0, hk * k_ch, 0, hk * v_ch, lo, hi)
            else:
                i = _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, i, k_row, hk * k_ch,
                             v_row, hk * v_ch, lo, hi)
            it += 1
        return i, it

    def _loader_for(window: bool, varlen: bool, keypad: bool, dropout: bool = False):
        """The loader partition, with WINDOW, VARLEN and KEYPAD compiled in (closure constants, as
        :func:`_partition`'s): :func:`_produce` for each of the program's tiles (persistent: items p, p + P, … of PER
        tiles each, the rings' positions running on across tiles), or for tile p."""
        WINDOW, VARLEN, KEYPAD = gl.constexpr(window), gl.constexpr(varlen), gl.constexpr(keypad)
        PERSISTENT = gl.constexpr(persistent(window, varlen, keypad, dropout))

        @gluon.jit
        def loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                   CU, SEQLENS, K, V, k_cols, v_cols, H, GROUP, N_CTX, M_BLOCKS, TILES, PER, causal, q_rb, q_rh, q_ch, k_rb,
                   k_rh, k_ch, v_rb, v_rh, v_ch, wl, wr):
            args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                    CU, SEQLENS, K, V, k_cols, v_cols, H, GROUP, N_CTX, M_BLOCKS, PER, causal, q_rb, q_rh, q_ch, k_rb,
                    k_rh, k_ch, v_rb, v_rh, v_ch, wl, wr)
            i = 0  # K/V ring position
            it = 0  # tiles done (the Q buffer's phase)
            if PERSISTENT:
                for item in range(gl.program_id(0) * PER, TILES, gl.num_programs(0) * PER):
                    for t in range(item, gl.minimum(item + PER, TILES)):
                        i, it = _produce(t, i, it, *args, WINDOW, VARLEN, KEYPAD)
            else:
                _produce(gl.program_id(0), i, it, *args, WINDOW, VARLEN, KEYPAD)

        return loader

    @gluon.jit
    def tile_span(t, M_BLOCKS, PER, H, N_CTX, causal, CU, SEQLENS, wl, wr, WINDOW: gl.constexpr, VARLEN: gl.constexpr,
                  KEYPAD: gl.constexpr):
        """Tile t of the forward's (query block, batch row or sequence · head) tiles: (b, h, start, row0, seqlen, lo,
        hi, kend) — the TMA views' batch row, the head, the sequence's first row in it, the block's first query
        position, the sequence's length, the key positions [lo, hi) the block visits and the key bound kend. Tiles
        run query block fastest, so programs that run together share a head's K and V in L2. With PER = 2 each head
        has an even number of tile slots (M_BLOCKS rounded up; an odd head's last slot is a block past the sequence,
        skipped), so no item spans two heads; causal blocks come in pairs heaviest and lightest first ((M−1, 0),
        (M−2, 1), …: M + 1 key tiles per pair, the middle block of an odd M alone), so that items balance; with
        PER = 1 causal blocks run heaviest first (the most keys) for the block scheduler."""
        slots = M_BLOCKS + (M_BLOCKS % 2) * (PER - 1)
        idx = t % slots
        pid_m = idx
        if causal != 0:
            if PER == 2:
                pid_m = gl.where(idx % 2 == 0, M_BLOCKS - 1 - idx // 2, idx // 2)
            else:
                pid_m = M_BLOCKS - 1 - idx
        pid_m = gl.where(idx < M_BLOCKS, pid_m, M_BLOCKS)  # the padding slot: row0 >= seqlen, skipped
        pid_bh = t // slots
        b, start, seqlen = sequence_span(CU, pid_bh // H, N_CTX, VARLEN)
        row0 = pid_m * _BLOCK_M
        lo, hi, kend = block_keys(row0, seqlen, causal, SEQLENS, b, wl, wr, _BLOCK_M, _BLOCK_N, WINDOW, KEYPAD)
        return b, pid_bh % H, start, row0, seqlen, lo, hi, kend

    @gluon.jit
    def block_keys(row0, seqlen, causal, SEQLENS, b, wl, wr, ROWS: gl.constexpr, TILE: gl.constexpr,
                   WINDOW: gl.constexpr, KEYPAD: gl.constexpr):
        """(lo, hi, kend) of the query block of ROWS rows from row0 in a sequence of ``seqlen`` (seqlen_q = seqlen_k):
        the key positions [lo, hi) it visits in tiles of TILE keys — all, up to its last row with ``causal``, the
        window's band with WINDOW — and the key bound kend (KEYPAD: batch row b's SEQLENS[b], clamped; hi stops there)."""
        lo = 0
        hi = seqlen
        if causal:  # no row of the block sees a key past its last row
            hi = gl.minimum(seqlen, row0 + ROWS)
        if WINDOW:  # the key tiles some row of the block sees
            lo, hi = window_tiles(row0, ROWS, wl, wr, seqlen, TILE)
        kend = seqlen
        if KEYPAD:  # no tile past the last valid key (seqlens_k >= 1: every block keeps one)
            kend = key_end(SEQLENS, b, seqlen)
            hi = gl.minimum(hi, kend)
        return lo, hi, kend

    @gluon.jit
    def key_end(SEQLENS, b, seqlen):
        """Batch row b's key count SEQLENS[b], clamped to [1, seqlen]: the callers promise that range (the public op
        checks it) but the kernels do not read it on the host; out of it a row without keys would leave the consumers
        waiting for a tile never loaded (a hang), and one past seqlen a descriptor reaching past the tensor."""
        return gl.minimum(gl.maximum(gl.load(SEQLENS + b), 1), seqlen)

    @gluon.jit
    def keys_descriptor(X, row, klen, cols, desc):
        """A TMA descriptor, made on the device, of one (batch row, kv head)'s keys: X points at k (or v), whose 2-D
        view as desc's has ``cols`` columns and that key 0 at row ``row``; rows [0, klen) from there are the valid keys
        (right key padding); a tile reaching past klen gets zeros there from the TMA unit, so the padded keys' values
        (NaN, inf) are never read into a product."""
        return tma.make_tensor_descriptor(X + row.to(gl.int64) * cols, [klen, cols], [cols, 1], desc.block_type.shape,
                                          desc.layout)

    @gluon.jit
    def softcap_and_grad(s, sc, cap):
        """(z, g): the capped logits z = cap·tanh(τ s/cap) of the raw scores s and g = 1 − tanh², by the ops of
        kernels/_triton_utils.softcap_f32 (its inline PTX, then the same FMAs), so that these kernels and the
        tl.dot ones rebuild bit-identical capped logits from the same scores."""
        e = gl.inline_asm_elementwise(SOFTCAP_EX2_ASM, "=f,f,f", [s, sc], dtype=gl.float32, is_pure=True, pack=1)
        r2 = rcp_approx(gl.fma(e, 0.5, 0.5))
        z = gl.inline_asm_elementwise(COPYSIGN_ASM, "=f,f,f", [s, gl.fma(r2, cap, -cap)], dtype=gl.float32,
                                      is_pure=True, pack=1)
        return z, e * r2 * r2

    @gluon.jit
    def rcp_approx(x):
        """1/x as ``rcp.approx.ftz.f32`` (kernels/_triton_utils.rcp_ftz)."""
        return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)

    _PHILOX_ROUNDS = gl.constexpr(PHILOX_ROUNDS)
    _SHFL_IDX = gl.constexpr("shfl.sync.idx.b32 $0, $1, $2, 31, -1;")

    def keep_layout(tile: int):
        """The layout of :func:`keep_bits`'s [64, U, AL, 2, 2, 4, 2] keep mask (row, u, a, jh, k', q, e) of 64 rows and
        the keys 64u + 32a + 16jh + 8k' + 2q + e of a tile of ``tile`` keys (U = max(1, tile // 64), AL = min(2,
        tile // 32)): reshaped to [64, tile] it is the accumulator layout of a 4-warp wgmma (NVMMA v3, warps_per_cta [4,
        1]; thread (warp w, lane 4r + q) holds rows 16w + r, 16w + r + 8 and keys 8k + 2q + e), so the mask reaches the
        scores without a layout conversion. Its slices place the Philox rounds (row, u, q: lane q runs the calls of its
        rows' groups q mod 4 + 4u of 16 keys) and the quad exchange (row, a, jh, q: lane q receives the word of lane
        2a + jh, the one that drew the group 2a + jh mod 4)."""
        U, AL = max(1, tile // 64), min(2, tile // 32)
        regs = [[0, 0, 0, 0, 0, 0, 1], [8, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 0, 0, 0]]
        regs += [[0, 0, 1, 0, 0, 0, 0]] if AL == 2 else []
        regs += [[0, 1, 0, 0, 0, 0, 0]] if U == 2 else []
        lanes = [[0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 2, 0], [1, 0, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0],
                 [4, 0, 0, 0, 0, 0, 0]]
        return gl.DistributedLinearLayout(regs, lanes, [[16, 0, 0, 0, 0, 0, 0], [32, 0, 0, 0, 0, 0, 0]], [],
                                          [64, U, AL, 2, 2, 4, 2])

    @gluon.jit
    def philox_rounds(c0, c1, c2, c3, k0, k1):
        """PHILOX_ROUNDS rounds of Philox4x32 on uint32 counters (c0, c1, c2, c3), key (k0, k1): the rounds and
        constants of triton.language.random.philox_impl (what tl.philox runs in the tl.dot kernels)."""
        for _ in gl.static_range(_PHILOX_ROUNDS):
            _c0 = c0
            _c2 = c2
            c0 = gl.umulhi(_c2, 0xCD9E8D57) ^ c1 ^ k0
            c2 = gl.umulhi(_c0, 0xD2511F53) ^ c3 ^ k1
            c1 = _c2 * 0xCD9E8D57
            c3 = _c0 * 0xD2511F53
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        return c0, c1, c2, c3

    _KEEP_BYTE_ASM = gl.constexpr("{ .reg .b32 t; or.b32 t, $1, 0x80808080; sub.u32 t, t, $2; "
                                  "lop3.b32 $0, $1, t, $3, 0xE8; }")

    @gluon.jit
    def keep_msbs(x, tlo, hi):
        """The keep test of the 4 random bytes of a Philox word at once: bit 7 of byte b of the result is 1 iff byte b
        of x >= the 8-bit threshold thr, given tlo = (thr mod 128)·0x01010101 and hi = ~0 if thr < 128 else 0. With
        x's byte = 128h + l and t = (l | 128) − thr mod 128 (no borrow crosses a byte: l | 128 >= 128 > thr mod 128),
        bit 7 of t is l >= thr mod 128, so byte >= thr iff h | t₇ (thr < 128) or h & t₇ (thr >= 128): the majority
        function of (h, t₇, hi), one LOP3. The other bits are garbage."""
        return gl.inline_asm_elementwise(_KEEP_BYTE_ASM, "=r,r,r,r", [x, tlo, hi], dtype=gl.uint32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def keep_word(grp, bh, seed_lo, seed_hi, drop_off, drop_thr, u):
        """The 16 keep bits of the groups of 16 keys with (int64) group counters ``grp`` (i·G + g): one Philox call
        (:func:`philox_rounds`; counters (grp mod 2³², bh, offset, grp div 2³²), key seed_hi·2³² + seed_lo) each; key
        c = 4m + b of the group (byte b of output word m) kept iff that byte >= drop_thr (kernels/reference.
        dropout_keep_mask), its bit at 8b + 7 − m − 4u of the result (u, a tensor broadcast with grp: the call's place
        in its lane's word, 0 or 1). uint32, in grp's layout."""
        c0 = grp.to(gl.uint32)
        c3 = (grp >> 32).to(gl.uint32)
        zero = c0 * 0
        x0, x1, x2, x3 = philox_rounds(c0, zero + bh.to(gl.uint32), zero + drop_off.to(gl.uint32, bitcast=True), c3,
                                       seed_lo.to(gl.uint32, bitcast=True), seed_hi.to(gl.uint32, bitcast=True))
        thr = drop_thr.to(gl.uint32)
        tlo = zero + (thr & 127) * 0x01010101
        hi = zero + ((thr >> 7) - 1)  # ~0 if thr < 128, else 0
        s = (4 * u).to(gl.uint32)
        msb = 0x80808080
        return (((keep_msbs(x0, tlo, hi) & msb) >> s) | ((keep_msbs(x1, tlo, hi) & msb) >> (s + 1))
                | ((keep_msbs(x2, tlo, hi) & msb) >> (s + 2)) | ((keep_msbs(x3, tlo, hi) & msb) >> (s + 3)))

    _ROTR_ASM = gl.constexpr("shf.r.wrap.b32 $0, $1, $1, $2;")

    @gluon.jit
    def rotr(x, n):
        """x rotated right by n (uint32; n taken mod 32), broadcast together."""
        x, n = gl.broadcast(x, n.to(gl.uint32))
        return gl.inline_asm_elementwise(_ROTR_ASM, "=r,r,r", [x, n], dtype=gl.uint32, is_pure=True, pack=1)

    @gluon.jit
    def philox_keep(first_row, G, start_n, bh, seed_lo, seed_hi, drop_off, drop_thr, A: gl.constexpr,
                    L7: gl.constexpr):
        """The keep mask of attention dropout for the 64 query rows first_row … and the key columns start_n … start_n +
        32·A − 1 (start_n a multiple of 32·A), as the words :func:`keep_bits` turns into the [64, 32·A] bool mask in the
        layout of a 4-warp wgmma accumulator (L7 = :func:`keep_layout`): the scheme of kernels/reference.dropout_keep_mask
        and kernels/_triton_utils.dropout_keep, the tl.dot kernels' mask, bit for bit — one Philox4x32 call
        (:func:`philox_rounds`) per group g of 16 keys of row i, counters (i·G + g mod 2³², bh, offset, i·G + g div
        2³²), key seed_hi·2³² + seed_lo; key c = 4m + b of the group is kept iff byte b of output word m is >= drop_thr.
        G = ⌈n_k / 16⌉; seeds, offset as int32 bit patterns (dropout_args).

        Each group's call runs in lane q = g mod 4 of the quad of lanes that holds the row (with A = 1, the row's two
        groups in lanes 0, 1 and the row 8 below's in lanes 2, 3); its 16 keep bits, tested 4 at a time (:func:`keep_msbs`), go into that lane's word (:func:`keep_word`),
        and one warp shuffle per (row, source lane) hands every lane of the quad the words of the others, from which it
        takes the bits of its own keys. No shared memory: with the mask converted through it, ptxas of Triton 3.6
        serialized every wgmma of the forward (C7513)."""
        NL: gl.constexpr = 4 if A >= 2 else 2  # the groups a row's lanes draw: lane q the group q mod NL
        Lx: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(4, gl.SliceLayout(6, L7)))  # (row, a, jh, q): the exchange
        Lr: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(6, L7))))  # (row, u, q)
        U: gl.constexpr = L7.shape[1]
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, Lr)))
        u_r = gl.arange(0, U, layout=gl.SliceLayout(0, gl.SliceLayout(2, Lr)))
        q_r = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, Lr)))
        u3 = gl.expand_dims(gl.expand_dims(u_r, 0), 2)
        q3 = gl.expand_dims(gl.expand_dims(q_r, 0), 1)
        row3 = gl.expand_dims(gl.expand_dims(rows, 1), 2)
        if A == 1:  # lane q draws group q & 1 of row r + 8(q >> 1): its two rows' registers hold the same call (one)
            row3 = (row3 & ~8) + 8 * (q3 >> 1)
        grp = (first_row + row3).to(gl.int64) * G + (start_n // 16 + q3 % NL + 4 * u3).to(gl.int64)
        word = gl.sum(keep_word(grp, bh, seed_lo, seed_hi, drop_off, drop_thr, u3), axis=1)  # disjoint bits: the OR
        word = gl.convert_layout(word, gl.SliceLayout(1, gl.SliceLayout(1, Lx)))  # the same placement (row, q)
        AL: gl.constexpr = L7.shape[2]
        a_x = gl.arange(0, AL, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, Lx))))
        jh_x = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, Lx))))
        q_x = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, Lx))))
        rows_x = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, Lx))))
        # Lane 4r + q reads, for each (a, jh), lane 4r + 2a + jh's word (r = row mod 8 in the warp's 16 rows); with A = 1
        # row r + 8h's group jh from lane 4r + 2h + jh.
        if A == 1:
            lane_hi = (rows_x >> 3) & 1
        else:
            lane_hi = rows_x * 0
        src = (gl.expand_dims(gl.expand_dims(gl.expand_dims(4 * (rows_x % 8) + 2 * lane_hi, 1), 2), 3)
               + gl.expand_dims(gl.expand_dims(gl.expand_dims(2 * a_x, 0), 2), 3)
               + gl.expand_dims(gl.expand_dims(gl.expand_dims(jh_x, 0), 1), 3))
        words = gl.expand_dims(gl.expand_dims(word, 1), 1)
        words, src = gl.broadcast(words, src)
        got = gl.inline_asm_elementwise(_SHFL_IDX, "=r,r,r", [words, src], dtype=gl.uint32, is_pure=True, pack=1)
        # Key 16g + 8k' + 2q + e (c = 8k' + 2q + e: byte 2(q & 1) + e of word 2k' + (q >> 1)) of the word's call u is
        # bit 16(q & 1) + 8e + 7 − 2k' − (q >> 1) − 4u: rotated right by 16(q & 1) − (q >> 1), each key's bit is
        # 8e + 7 − 2k' − 4u, the same in every lane.
        q4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(q_x, 0), 1), 2)
        return rotr(got, 16 * (q4 & 1) - (q4 >> 1))

    @gluon.jit
    def keep_bits(got, A: gl.constexpr, L7: gl.constexpr):
        """The [64, 32·A] keep mask (layout: L7 reshaped, a wgmma accumulator's) from :func:`philox_keep`'s words: key
        64u + 32a + 16jh + 8k' + 2q + e is bit 8e + 7 − 2k' − 4u of the word got from lane 2a + jh. Kept apart from the
        Philox rounds so that only the words (2A registers a thread) stay live from where the rounds run to where the
        mask is used."""
        U: gl.constexpr = L7.shape[1]
        u7 = gl.arange(0, U, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(5, gl.SliceLayout(6, L7)))))))
        k7 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(5, gl.SliceLayout(6, L7)))))))
        e7 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(5, L7)))))))
        u7 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(u7, 0), 2), 3), 4), 5), 6)
        k7 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(k7, 0), 1), 2), 3), 5), 6)
        e7 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(e7, 0), 1), 2), 3), 4), 5)
        got = gl.expand_dims(gl.expand_dims(gl.expand_dims(got, 1), 4), 6)
        keep = ((got >> (8 * e7 + 7 - 2 * k7 - 4 * u7).to(gl.uint32)) & 1) != 0
        return gl.reshape(keep, [64, 32 * A])

    def keep_layout_t(rows: int):
        """The layout of :func:`keep_bits_t`'s mask, over [4, 2, 8, rows // 32, 4, 4, 2] = (w, rh, r, kh, klo, q, e) for
        the key 16w + 8rh + r of 64 keys and the query row 32kh + 8klo + 2q + e of ``rows`` — reshaped to [64, rows]
        the accumulator layout of a 4-warp wgmma over [keys, queries] (thread (warp w, lane 4r + q) holds keys 16w + r,
        16w + r + 8 and queries 8k + 2q + e). Its slices place the Philox rounds (w, r, q[, e]: lane 4r + q draws the
        group of keys 16w … 16w + 15 for the query rows 8r + 2q + e, or with 32 rows the row 8(r >> 1) + 2q + (r & 1))
        and the exchange."""
        kh = [[0, 0, 0, 1, 0, 0, 0]] if rows > 32 else []
        return gl.DistributedLinearLayout(
            [[0, 0, 0, 0, 0, 0, 1], [0, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 2, 0, 0]] + kh,
            [[0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 2, 0], [0, 0, 1, 0, 0, 0, 0], [0, 0, 2, 0, 0, 0, 0], [0, 0, 4, 0, 0, 0, 0]],
            [[1, 0, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0]], [], [4, 2, 8, rows // 32, 4, 4, 2])

    @gluon.jit
    def philox_keep_t(first_row, G, key0, bh, seed_lo, seed_hi, drop_off, drop_thr, KH: gl.constexpr, L7: gl.constexpr):
        """:func:`philox_keep` transposed: the keep mask of the 64 keys key0 … (a multiple of 64) and the 32·KH query rows
        first_row … (dropout counter rows: packed rows when packed) as the words :func:`keep_bits_t` turns into the
        [64 keys, 32·KH queries] mask in a 4-warp wgmma accumulator's layout (L7: :func:`keep_layout_t`) — the same
        Philox calls and bits as kernels/reference.dropout_keep_mask, one call per (query row, group of 16 keys: a
        warp's) in one of the 8 lanes that hold the group's keys for that row (:func:`keep_word`, two calls a lane with
        64 rows, one with 32), and 8 warp shuffles a thread hand every lane the words of the other seven (lanes 4r' + q,
        same q)."""
        Lr: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(2, gl.SliceLayout(1, L7)))  # (w, r, q, e)
        w_ = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, Lr))))
        r_ = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, Lr))))
        q_ = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, Lr))))
        w3 = gl.expand_dims(gl.expand_dims(w_, 1), 2)
        r3 = gl.expand_dims(gl.expand_dims(r_, 0), 2)
        q3 = gl.expand_dims(gl.expand_dims(q_, 0), 1)
        g3 = (key0 // 16 + w3).to(gl.int64)
        if KH == 2:  # lane 4r + q: the rows 8r + 2q + e, e = 0, 1 (its calls u = e)
            e_ = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, Lr))))
            e4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(e_, 0), 1), 2)
            query = first_row + gl.expand_dims(8 * r3 + 2 * q3, 3) + e4
            grp = query.to(gl.int64) * G + gl.expand_dims(g3, 3)
            word = gl.sum(keep_word(grp, bh, seed_lo, seed_hi, drop_off, drop_thr, e4), axis=3)  # disjoint bits: the OR
        else:  # lane 4r + q: the row 8(r >> 1) + 2q + (r & 1)
            query = first_row + 8 * (r3 >> 1) + 2 * q3 + (r3 & 1)
            word = keep_word(query.to(gl.int64) * G + g3, bh, seed_lo, seed_hi, drop_off, drop_thr, 0 * r3)
        if KH == 2:  # register (kh, klo) reads lane 4(4kh + klo) + q: the rows 8(4kh + klo) + 2q + e
            Lx: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(6, L7))  # (w, r, kh, klo, q)
            word = gl.convert_layout(word, gl.SliceLayout(2, gl.SliceLayout(3, Lx)))  # the same placement (w, r, q)
            kh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, Lx)))))
            klo = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, Lx)))))
            qs = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, Lx)))))
            src = (4 * (4 * gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(kh, 0), 1), 3), 4)
                        + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(klo, 0), 1), 2), 4))
                   + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(qs, 0), 1), 2), 3))
            words = gl.expand_dims(gl.expand_dims(word, 2), 3)
        else:  # register (klo, e) reads lane 4(2klo + e) + q: the row 8klo + 2q + e
            Lx: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, L7))  # (w, r, klo, q, e)
            word = gl.convert_layout(word, gl.SliceLayout(2, gl.SliceLayout(4, Lx)))  # the same placement (w, r, q)
            klo = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, Lx)))))
            qs = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, Lx)))))
            e_ = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, Lx)))))
            src = (4 * (2 * gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(klo, 0), 1), 3), 4)
                        + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(e_, 0), 1), 2), 3))
                   + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(qs, 0), 1), 2), 4))
            words = gl.expand_dims(gl.expand_dims(word, 2), 4)
        rr = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, Lx)))))
        rr = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(rr, 0), 2), 3), 4)  # the receiving lane's r
        words, src = gl.broadcast(words, src)
        got = gl.inline_asm_elementwise(_SHFL_IDX, "=r,r,r", [words, src], dtype=gl.uint32, is_pure=True, pack=1)
        # Key 16w + r + 8rh (c = r + 8rh: byte r & 3 of word (r >> 2) + 2rh) of the word's call u is bit 8(r & 3) + 7 −
        # (r >> 2) − 2rh − 4u: rotated right by 8(r & 3) − (r >> 2) (r: the receiving lane's), each key's bit is
        # 7 − 2rh − 4u in every lane.
        return rotr(got, 8 * (rr & 3) - (rr >> 2))

    @gluon.jit
    def keep_bits_t(got, KH: gl.constexpr, L7: gl.constexpr):
        """The [64 keys, 32·KH queries] keep mask from :func:`philox_keep_t`'s words: key 16w + 8rh + r of query row
        32kh + 8klo + 2q + e is bit 7 − 2rh − 4e of the word got from lane 4(4kh + klo) + q (64 rows), or bit 7 − 2rh
        of the word got from lane 4(2klo + e) + q (32 rows)."""
        rh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(5, gl.SliceLayout(6, L7)))))))
        rh7 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(rh, 0), 2), 3), 4), 5), 6)
        if KH == 2:
            e_ = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(5, L7)))))))
            e7 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(e_, 0), 1), 2), 3), 4), 5)
            got = gl.expand_dims(gl.expand_dims(got, 1), 6)
            keep = ((got >> (7 - 2 * rh7 - 4 * e7).to(gl.uint32)) & 1) != 0
        else:
            got = gl.expand_dims(gl.expand_dims(got, 1), 3)
            keep = ((got >> (7 - 2 * rh7).to(gl.uint32)) & 1) != 0
        return gl.reshape(keep, [64, 32 * KH])

    # Sliding windows (row i sees keys i − wl … i + wr), shared with kernels/attention_bwd_hopper.py.
    @gluon.jit
    def window_tiles(first, count, before, after, N_CTX, TILE: gl.constexpr):
        """[lo, hi) of the tiles (of TILE positions along the other axis) that positions first … first + count − 1
        reach, ``before`` back and ``after`` ahead: (wl, wr) for query rows reaching keys, (wr, wl) for keys."""
        return (gl.maximum(first - before, 0) // TILE) * TILE, gl.minimum(N_CTX, first + count + after)

    @gluon.jit
    def window_sees(r0, nr, k0, nk, wl, wr):
        """Whether some row of r0 … r0 + nr − 1 sees some key of k0 … k0 + nk − 1."""
        return (k0 + nk - 1 >= r0 - wl) & (k0 <= r0 + nr - 1 + wr)

    @gluon.jit
    def window_crosses(r0, nr, k0, nk, wl, wr):
        """Whether some (row, key) pair of the tile (rows r0 …, keys k0 …) lies outside the window: the tile needs the
        mask."""
        return (k0 + nk - 1 > r0 + wr) | (k0 < r0 + nr - 1 - wl)

    @gluon.jit
    def window_mask(rows, keys, wl, wr):
        """The window's mask of broadcast row and key positions."""
        return (keys >= rows - wl) & (keys <= rows + wr)

    @gluon.jit
    def _softmax(s, m_i, l_i, offs_m, start_n, diag_from, c, causal, sc, cap, wl, wr, kend, keep,
                 HEAD_DIM: gl.constexpr, dtype: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr,
                 KEYMASK: gl.constexpr, DROPOUT: gl.constexpr):
        """One key block of the online softmax: with SOFTCAP the capped logits z = cap·tanh(τ s/cap) replace the
        scores; mask them on and past the diagonal (rows from ``diag_from``), or with WINDOW outside the sliding
        window row − wl <= key <= row + wr, and with KEYMASK the keys from ``kend`` on (the next sequence's or head's,
        or key padding);
        update the row max m and sum l. With DROPOUT the A operand is P̃ ∘ M (M from ``keep``, :func:`_tile_keep`), m and
        l stay the undropped P's, as the tl.dot forward's. Returns (P̃ as the A operand of P̃·V, the factor α that rescales the accumulator (in its row layout),
        m, l)."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, _BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        if SOFTCAP:
            s, _ = softcap_and_grad(s, sc, cap)
        if causal != 0:
            if start_n + _BLOCK_N > diag_from:  # a tile on or past the diagonal
                offs_n = start_n + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s = gl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        if WINDOW:  # rows diag_from … diag_from + 63
            if window_crosses(diag_from, _HALF_M, start_n, _BLOCK_N, wl, wr):
                offs_n = start_n + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s = gl.where(window_mask(offs_m[:, None], offs_n[None, :], wl, wr), s, float("-inf"))
        if KEYMASK:  # the tile reaches past the last key
            if start_n + _BLOCK_N > kend:
                offs_n = start_n + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s = gl.where(offs_n[None, :] < kend, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = m_new
        if WINDOW:  # a row that has seen no key yet keeps m = −inf and shifts by 0 (its weights are all 0)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        # FMA-safe: (s − m) is exactly 0 at the row max, so that entry's weight is exactly 1.
        alpha = gl.exp2((m_i - m_use) * c)
        p = gl.exp2((s - m_use[:, None]) * c)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        if DROPOUT:
            p = gl.where(gl.convert_layout(keep_bits(keep, 4, _KEEP_LAYOUT), s_layout), p, 0.0)
        return gl.convert_layout(p.to(dtype), p_layout), gl.convert_layout(alpha, row_o), m_new, l_i

    _KEEP_LAYOUT = gl.constexpr(keep_layout(128))

    @gluon.jit
    def _tile_keep(drow, DG, start_n, bh, seed_lo, seed_hi, drop_off, drop_thr, DROPOUT: gl.constexpr):
        """With DROPOUT the keep mask of a consumer's 64 rows (dropout counter rows drow …) and the key tile at start_n
        as :func:`philox_keep`'s words (:func:`_softmax` takes the bits); else 0 (unused). Drawn at the top of each step,
        before its S wgmma is issued (of three placements of the whole mask — there, after that issue, in the softmax —
        the one ptxas of Triton 3.6 spilled least with); with only the words live from there to the softmax, d 128
        compiles without spills with Triton 3.6 (6 / 8 STL full / causal with 3.9)."""
        if DROPOUT:
            return philox_keep(drow, DG, start_n, bh, seed_lo, seed_hi, drop_off, drop_thr, 4, _KEEP_LAYOUT)
        else:
            return 0

    @gluon.jit
    def sequence_span(CU, b, N_CTX, VARLEN: gl.constexpr):
        """(batch row of the TMA views, first row, length) of program row b: with VARLEN sequence b of the packed
        (1, total, …) views, from cu_seqlens CU; else batch row b, its N_CTX rows."""
        if VARLEN:
            start = gl.load(CU + b)
            return 0, start, gl.load(CU + b + 1) - start
        else:
            return b, 0, N_CTX

    @gluon.jit
    def release_unread(k_ready, k_empty, v_ready, v_empty, i):
        """Release tile i of the K and V rings without reading it (waited for first, so that the rings' phases stay
        in step)."""
        st = i % _NUM_STAGES
        mbarrier.wait(k_ready.index(st), (i // _NUM_STAGES) & 1)
        mbarrier.arrive(k_empty.index(st), count=1)
        mbarrier.wait(v_ready.index(st), (i // _NUM_STAGES) & 1)
        mbarrier.arrive(v_empty.index(st), count=1)

    @gluon.jit
    def _consumer_tile(q_smem, k_smem, v_smem, o_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, O, M,
                       LOG2L, half: gl.constexpr, i, it, o_row, row0, o_col, o_stride, lo, hi, seqlen, kend, c, causal,
                       sc, cap, wl, wr, drow, DG, bh, seed_lo, seed_hi, drop_off, drop_thr, drop_scale,
                       SOFTCAP: gl.constexpr, WINDOW: gl.constexpr, EDGES: gl.constexpr, KEYMASK: gl.constexpr,
                       DROPOUT: gl.constexpr):
        """One tile of a consumer: its 64 query rows (``half``) of the block at row0 against the key tiles [lo, hi),
        the K/V rings from position i on, the Q buffer in its it-th use (released once the last S is computed); o, m,
        log2l stored (M, LOG2L point at the (batch, head)'s statistics, o_row at the block's first row of o). DROPOUT:
        the block's first row has dropout counter row drow (its packed row), o is scaled by drop_scale = 1/(1 − p̂)
        after the division by the undropped l, as the tl.dot forward does. Returns the ring position after the
        tile."""
        HEAD_DIM: gl.constexpr = o_desc.block_type.shape[1]
        dtype: gl.constexpr = o_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, _BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        offs_m = row0 + half * _HALF_M + gl.arange(0, _HALF_M, layout=row_s)  # query positions
        m_i = gl.full([_HALF_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([_HALF_M], gl.float32, layout=row_s)
        acc = gl.zeros([_HALF_M, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([_HALF_M, _BLOCK_N], gl.float32, layout=s_layout)
        q = q_smem.index(half)
        mbarrier.wait(q_bar, it & 1)
        first = row0 + half * _HALF_M
        # This half's tiles [lo_h, last]: all of the block's, but with WINDOW the ones its 64 rows see (a band);
        # the others are released unread.
        lo_h = lo
        hi_h = hi
        if WINDOW:
            lo_h, hi_h = window_tiles(first, _HALF_M, wl, wr, hi, _BLOCK_N)
        last = lo_h + ((hi_h - lo_h - 1) // _BLOCK_N) * _BLOCK_N
        for start_n in range(lo, lo_h, _BLOCK_N):
            release_unread(k_ready, k_empty, v_ready, v_empty, i)
            i += 1
        # Pipelined as FA3 (Shah et al. 2024, §3.2): P̃_{j-1}·V_{j-1} runs on the tensor cores during the softmax of
        # tile j, right after S_j = Q·K_jᵀ; the accumulator is complete again at the end of each step.
        st = i % _NUM_STAGES
        mbarrier.wait(k_ready.index(st), (i // _NUM_STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_empty.index(st), count=1)
        drow_h = drow + half * _HALF_M  # this half's first row in the dropout counters
        keep = _tile_keep(drow_h, DG, lo_h, bh, seed_lo, seed_hi, drop_off, drop_thr, DROPOUT)
        p16, alpha, m_i, l_i = _softmax(s, m_i, l_i, offs_m, lo_h, first, c, causal, sc, cap, wl, wr, kend, keep,
                                        HEAD_DIM, dtype, SOFTCAP, WINDOW, KEYMASK, DROPOUT)
        for start_n in range(lo_h + _BLOCK_N, last + _BLOCK_N, _BLOCK_N):  # tile j = i + 1 at start_n
            st = i % _NUM_STAGES
            nx = (i + 1) % _NUM_STAGES
            keep = _tile_keep(drow_h, DG, start_n, bh, seed_lo, seed_hi, drop_off, drop_thr, DROPOUT)
            mbarrier.wait(k_ready.index(nx), ((i + 1) // _NUM_STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(nx).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(st), (i // _NUM_STAGES) & 1)
            acc = warpgroup_mma(p16, v_smem.index(st), acc * alpha[:, None], is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S_j (P̃_{j-1}·V_{j-1} may still run)
            mbarrier.arrive(k_empty.index(nx), count=1)
            p16, alpha, m_i, l_i = _softmax(s, m_i, l_i, offs_m, start_n, first, c, causal, sc, cap, wl, wr, kend, keep,
                                            HEAD_DIM, dtype, SOFTCAP, WINDOW, KEYMASK, DROPOUT)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(v_empty.index(st), count=1)
            i += 1
        mbarrier.arrive(q_empty, count=1)  # every S of the tile is computed: the loader may bring the next Q
        st = i % _NUM_STAGES
        mbarrier.wait(v_ready.index(st), (i // _NUM_STAGES) & 1)
        acc = warpgroup_mma(p16, v_smem.index(st), acc * alpha[:, None], is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(st), count=1)
        i += 1
        for start_n in range(last + _BLOCK_N, hi, _BLOCK_N):
            release_unread(k_ready, k_empty, v_ready, v_empty, i)
            i += 1
        o = acc / gl.convert_layout(l_i, row_o)[:, None]
        if DROPOUT:
            o = o * drop_scale  # 1/(1 − p̂) on the fp32 output, after the undropped normalizer l (as the tl.dot forward)
        if EDGES:  # rows past the sequence's end are the next sequence's (or head's): masked stores, not a TMA tile
            rows_o = half * _HALF_M + gl.arange(0, _HALF_M, layout=row_o)
            offs_o = ((o_row + rows_o).to(gl.int64)[:, None] * o_stride + o_col
                      + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))[None, :])
            gl.store(O + offs_o, o.to(dtype), mask=(row0 + rows_o < seqlen)[:, None])
            gl.store(M + offs_m, m_i, mask=offs_m < seqlen)
            gl.store(LOG2L + offs_m, gl.log2(l_i), mask=offs_m < seqlen)
        else:
            tma.store_wait(pendings=0)  # the previous tile's o has left o_smem
            o_smem.store(o.to(dtype))
            fence_async_shared()
            tma_store(o_desc, [o_row + half * _HALF_M, o_col], o_smem)
            gl.store(M + offs_m, m_i)
            gl.store(LOG2L + offs_m, gl.log2(l_i))
        return i

    @gluon.jit
    def _consume(t, i, it, q_smem, k_smem, v_smem, o_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, O,
                 M, LOG2L, CU, SEQLENS, H, N_CTX, M_BLOCKS, PER, causal, c, sc, cap, wl, wr, DG, seed_lo, seed_hi,
                 drop_off, drop_thr, drop_scale, half: gl.constexpr, SOFTCAP: gl.constexpr, WINDOW: gl.constexpr,
                 EDGES: gl.constexpr, KEYMASK: gl.constexpr, VARLEN: gl.constexpr, KEYPAD: gl.constexpr,
                 DROPOUT: gl.constexpr):
        """A consumer's share of tile t (:func:`tile_span`, :func:`_consumer_tile`). Returns (i, it) after the tile.
        Dropout counters (kernels/reference.dropout_keep_mask): row start + row0 + r of the TMA view's batch row b (the
        packed row when VARLEN, where b = 0) and bh = b·H + h (h when packed), DG = ⌈n_k / 16⌉ (of total_k when packed)."""
        HEAD_DIM: gl.constexpr = o_desc.block_type.shape[1]
        b, h, start, row0, seqlen, lo, hi, kend = tile_span(t, M_BLOCKS, PER, H, N_CTX, causal, CU, SEQLENS, wl, wr,
                                                            WINDOW, VARLEN, KEYPAD)
        if row0 < seqlen:  # VARLEN: the tiles span the longest sequence
            stats = (b * H + h).to(gl.int64) * N_CTX + start
            # o is (batch, seqlen, nheads, headdim) contiguous
            i = _consumer_tile(q_smem, k_smem, v_smem, o_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc,
                               O, M + stats, LOG2L + stats, half, i, it, b * N_CTX + start + row0, row0, h * HEAD_DIM,
                               H * HEAD_DIM, lo, hi, seqlen, kend, c, causal, sc, cap, wl, wr, start + row0, DG, b * H + h,
                               seed_lo, seed_hi, drop_off, drop_thr, drop_scale, SOFTCAP, WINDOW, EDGES, KEYMASK,
                               DROPOUT)
            it += 1
        return i, it

    def _partition(half: int, softcap: bool, window: bool, edges: bool, varlen: bool = False, keypad: bool = False,
                   dropout: bool = False):
        """A consumer partition of gl.warp_specialize for one half of the rows: :func:`_consume` for each of the
        program's tiles (persistent: items p, p + P, … of PER tiles each) or for tile p, with SOFTCAP, WINDOW, EDGES
        (sequence ends inside tiles), VARLEN, key padding (keys from ``kend`` on masked) and DROPOUT compiled in:
        constexpr arguments do not survive gl.warp_specialize, closure constants do."""
        HALF, SOFTCAP, WINDOW = gl.constexpr(half), gl.constexpr(softcap), gl.constexpr(window)
        EDGES, KEYMASK = gl.constexpr(edges), gl.constexpr(edges or keypad)
        VARLEN, KEYPAD, DROPOUT = gl.constexpr(varlen), gl.constexpr(keypad), gl.constexpr(dropout)
        PERSISTENT = gl.constexpr(persistent(window, varlen, keypad, dropout))

        @gluon.jit
        def consumer(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, O, M, LOG2L, CU,
                     SEQLENS, H, N_CTX, M_BLOCKS, TILES, PER, causal, c, sc, cap, wl, wr, DG, seed_lo, seed_hi, drop_off,
                     drop_thr, drop_scale):
            HEAD_DIM: gl.constexpr = o_desc.block_type.shape[1]
            o_smem = gl.allocate_shared_memory(o_desc.dtype, [_HALF_M, HEAD_DIM], o_desc.layout)
            args = (q_smem, k_smem, v_smem, o_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, O, M,
                    LOG2L, CU, SEQLENS, H, N_CTX, M_BLOCKS, PER, causal, c, sc, cap, wl, wr, DG, seed_lo, seed_hi, drop_off,
                    drop_thr, drop_scale)
            i = 0  # K/V ring position
            it = 0  # tiles done (the Q buffer's phase)
            if PERSISTENT:
                for item in range(gl.program_id(0) * PER, TILES, gl.num_programs(0) * PER):
                    for t in range(item, gl.minimum(item + PER, TILES)):
                        i, it = _consume(t, i, it, *args, HALF, SOFTCAP, WINDOW, EDGES, KEYMASK, VARLEN, KEYPAD,
                                         DROPOUT)
            else:
                _consume(gl.program_id(0), i, it, *args, HALF, SOFTCAP, WINDOW, EDGES, KEYMASK, VARLEN, KEYPAD, DROPOUT)
            tma.store_wait(pendings=0)

        return consumer

    @functools.lru_cache(maxsize=None)
    def _kernel_for(softcap: bool, window: bool, varlen: bool = False, edges: bool = False, keypad: bool = False,
                    dropout: bool = False):
        """The forward kernel, with or without the logit softcap, the sliding window, packed sequences (varlen),
        sequence ends inside tiles (edges: a seqlen that is not a multiple of 128; implied by varlen), right key
        padding (keypad: batch row b's keys from SEQLENS[b] on masked, not with window or varlen) and attention
        dropout (the P̃·V operand is P̃ ∘ M, :func:`philox_keep`; o scaled by 1/(1 − p̂))."""
        if keypad and (window or varlen):
            raise ValueError("keypad: not with window or varlen")
        edges = edges or varlen
        consumer0, consumer1 = (_partition(half, softcap, window, edges, varlen, keypad, dropout) for half in (0, 1))
        loader = _loader_for(window, varlen, keypad, dropout)

        # The dropout key, offset and threshold change from call to call: not specialized (a value of 1 or a multiple
        # of 16 would compile another kernel), as the tl.dot kernels' do_not_specialize.
        @gluon.jit(do_not_specialize=DROPOUT_SCALARS)
        def _hopper_fwd_kernel(q_desc, k_desc, v_desc, o_desc, O, M, LOG2L, CU, SEQLENS, K, V, c, H, GROUP, N_CTX,
                               M_BLOCKS, TILES, PER, causal, q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, k_cols, v_cols,
                               sc, cap, wl, wr, DG, seed_lo, seed_hi, drop_off, drop_thr, drop_scale):
            # Persistent variants: program p runs items p, p + P, … of PER tiles each, of the TILES = M_BLOCKS · (batch
            # or sequences) · H tiles (:func:`tile_span`, :func:`schedule`; P = the grid); the others tile p. Tile (row, col) of a
            # tensor's 2-D TMA view for batch b, head h, position n: (b·rb + h·rh + n, h·ch); (batch, seqlen, heads,
            # headdim) memory has rb = seqlen, rh = 0, ch = headdim; (batch, heads, seqlen, headdim) memory rb =
            # heads·seqlen, rh = seqlen, ch = 0 (see _tma_view); the last tile of a seqlen that is not a multiple of
            # 128 reads the next batch row's or head's rows (masked). VARLEN: b is the sequence, the tensors are
            # packed (1, total, heads, headdim) views (N_CTX = total), its rows start at CU[b], and m, log2l are
            # (nheads, total). KEYPAD: keys [0, SEQLENS[b]) of batch row b are valid; K, V point at k, v, whose 2-D
            # views have k_cols, v_cols columns (for the loader's descriptors of them). Dropout (unused without it):
            # DG = ⌈n_k / 16⌉ dropout groups a row, the Philox key, offset and threshold, drop_scale = 1/(1 − p̂)
            # (:func:`dropout_kernel_args`).
            HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
            dtype: gl.constexpr = q_desc.dtype
            q_smem = gl.allocate_shared_memory(dtype, [2, _HALF_M, HEAD_DIM], q_desc.layout)
            k_smem = gl.allocate_shared_memory(dtype, [_NUM_STAGES, _BLOCK_N, HEAD_DIM], k_desc.layout)
            v_smem = gl.allocate_shared_memory(dtype, [_NUM_STAGES, _BLOCK_N, HEAD_DIM], v_desc.layout)
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bar, count=1)
            mbarrier.init(q_empty, count=2)
            k_ready, k_empty = ring_barriers(_NUM_STAGES)
            v_ready, v_empty = ring_barriers(_NUM_STAGES)

            consumer_args = (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, O, M,
                             LOG2L, CU, SEQLENS, H, N_CTX, M_BLOCKS, TILES, PER, causal, c, sc, cap, wl, wr, DG, seed_lo,
                             seed_hi, drop_off, drop_thr, drop_scale)
            gl.warp_specialize([
                (consumer0, consumer_args),
                (consumer1, consumer_args),
                (loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,
                          v_empty, CU, SEQLENS, K, V, k_cols, v_cols, H, GROUP, N_CTX, M_BLOCKS, TILES, PER, causal, q_rb,
                          q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, wl, wr)),
            ], [4, 1], [232, 24])

        return _hopper_fwd_kernel


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


@functools.lru_cache(maxsize=None)
def _layouts(head_dim: int, dtype: torch.dtype):
    """The shared-memory layouts of the q / o tiles (64 rows) and the k / v tiles (128 rows); cached: building
    them took ~18 µs of host time per call (benchmarks/NOTES.md, run 19)."""
    g = _gl_dtype(dtype)
    return (gl.NVMMASharedLayout.get_default_for([_HALF_M.value, head_dim], g),
            gl.NVMMASharedLayout.get_default_for([_BLOCK_N.value, head_dim], g))


def enabled() -> bool:
    """GPROJ_HOPPER_FWD=0 keeps every call on the ``tl.dot`` forward (for A/B timing and as an escape hatch)."""
    return os.environ.get("GPROJ_HOPPER_FWD", "1") != "0"


def dropout_enabled() -> bool:
    """GPROJ_HOPPER_DROPOUT=0 keeps the calls with dropout (only those) on the ``tl.dot`` kernels, forward and backward
    (for A/B timing of the Gluon dropout variants and as an escape hatch)."""
    return os.environ.get("GPROJ_HOPPER_DROPOUT", "1") != "0"


def _tma_view(x: torch.Tensor):
    """The 2-D TMA view of x (batch, seqlen, heads, headdim) — its (shape, strides) — and the (rb, rh, ch) that
    locate its tiles, or None. Served memory orders: (batch, seqlen, heads, headdim) contiguous (view
    (batch·seqlen, heads·headdim)) and (batch, heads, seqlen, headdim) contiguous (view (batch·heads·seqlen,
    headdim)), the layout Hugging Face models hand over q, k, v in; 16-byte aligned. Plain integers, no view
    tensor: this runs several times per call on the host path (benchmarks/NOTES.md, run 31)."""
    b, n, h, d = x.shape
    if x.data_ptr() % 16 != 0 or x.stride(3) != 1:
        return None
    if x.stride(2) == d and x.stride(1) == h * d and x.stride(0) == n * h * d:
        return [b * n, h * d], [h * d, 1], n, 0, d
    if x.stride(1) == d and x.stride(2) == n * d and x.stride(0) == h * n * d:
        return [b * h * n, d], [d, 1], h * n, n, 0
    return None


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether this forward serves the (already validated, dense) inputs; the caller checks the rest (key padding
    only without a window).

    Args:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), as
            :func:`lightning_gproj.kernels.attention_fwd.forward` takes them.

    Returns:
        True on an sm_90 GPU (not under the interpreter, Gluon importable, GPROJ_HOPPER_FWD not 0) for
        the inputs of :func:`accepts`. Never raises.
    """
    return enabled() and on_sm90(q) and accepts(q, k, v)


def on_sm90(x: torch.Tensor) -> bool:
    """Whether Gluon kernels can run on x: x on an sm_90 GPU, Gluon importable, not under the interpreter."""
    return (GLUON_ERROR is None and not interpreting() and x.device.type == "cuda"
            and torch.cuda.get_device_capability(x.device) == (9, 0))


def accepts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: bool = False) -> bool:
    """The shape, dtype and layout half of :func:`serves` (any device): bf16 / fp16, each tensor in
    (batch, seqlen, heads, headdim) or (batch, heads, seqlen, headdim) memory order, contiguous there and
    16-byte aligned, seqlen_q = seqlen_k >= 128 (not a multiple of 128: the kernels' edge variant; below 128 a TMA
    tile would be taller than the tensor, a case not run on a GPU yet) (``packed``: (1, total, heads, headdim) views
    of packed sequences, total_q = total_k >= 128), head dim 64 or 128, nheads a multiple of nheads_k. Never raises
    (False for other ranks and for nheads_k = 0)."""
    if not q.dim() == k.dim() == v.dim() == 4:
        return False
    b, n, h, d = q.shape
    return (q.numel() > 0 and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype and d in HEAD_DIMS
            and k.shape == v.shape and k.shape[0] == b and k.shape[1] == n and k.shape[3] == d and k.shape[2] > 0
            and h % k.shape[2] == 0 and (b == 1 or not packed) and n >= BLOCK_M
            and all(_tma_view(x) is not None for x in (q, k, v)))


def serves_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen) -> bool:
    """Whether :func:`forward` serves packed sequences: GPROJ_HOPPER_FWD not 0 and :func:`packed_ok`. Never raises."""
    return enabled() and packed_ok(q, k, v, varlen)


def packed_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen) -> bool:
    """Whether these kernels can take packed sequences: ``varlen`` = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k) as kernels/_triton_utils.check_varlen returns them, q, k, v their (1, total, heads, headdim) views,
    on an sm_90 GPU; the sequences must be the same for queries and keys (one cu_seqlens tensor for both, as packed
    self-attention passes it: then seqlen_q = seqlen_k per sequence, as the kernels' causal mask assumes), and
    :func:`accepts` (packed) holds. Never raises."""
    cu_q, cu_k, max_q, max_k = varlen
    return (cu_q.data_ptr() == cu_k.data_ptr() and max_q == max_k and (cu_q.numel() - 1) * q.shape[2] <= 65535
            and on_sm90(q) and accepts(q, k, v, packed=True))


def tma_descriptor(x: torch.Tensor, rows: int, layout):
    """The TMA descriptor of :func:`_tma_view`'s 2-D view of x ((batch, seqlen, heads, headdim), accepted) with
    [rows, headdim] tiles in ``layout``, and x's tile locators [rb, rh, ch]. Also builds on CPU (no driver)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    shape, strides, rb, rh, ch = _tma_view(x)
    # x itself is the base (its data pointer and dtype are what the descriptor takes from it)
    return TensorDescriptor(x, shape, strides, [rows, x.shape[3]], layout), [rb, rh, ch]


def _descriptors(q, k, v, o):
    """The kernel's TMA descriptors of q, k, v, o (:func:`accepts`'d inputs; o (batch, seqlen, nheads,
    headdim) contiguous) and the tile locators (rb, rh, ch) of q, k, v, in the kernel's argument order. Also
    builds on CPU (no driver needed), which the tests use."""
    qo_layout, kv_layout = _layouts(q.shape[3], q.dtype)
    descs, where = [], []
    for x, rows, layout in ((q, _HALF_M.value, qo_layout), (k, _BLOCK_N.value, kv_layout),
                            (v, _BLOCK_N.value, kv_layout)):
        desc, loc = tma_descriptor(x, rows, layout)
        descs.append(desc)
        where += loc
    # o is ours, (batch, seqlen, nheads, headdim) contiguous: the kernel knows its tiles
    descs.append(tma_descriptor(o, _HALF_M.value, qo_layout)[0])
    return descs, where


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, softcap: float = 0.0,
            window: tuple[int, int] | None = None, cu_seqlens: torch.Tensor | None = None, max_seqlen: int = 0,
            seqlens_k: torch.Tensor | None = None, dropout_p: float = 0.0, dropout_seed: int = 0,
            dropout_offset: int = 0):
    """FMA-safe attention forward on Hopper; call only where :func:`serves` is True.

    Args:
        q: (batch, seqlen, nheads, headdim) bf16 / fp16; k, v: (batch, seqlen, nheads_k, headdim), same
            dtype, nheads % nheads_k == 0; each contiguous in (batch, seqlen, heads, headdim) or (batch,
            heads, seqlen, headdim) memory order (:func:`accepts`).
        softmax_scale: τ, multiplies q·k inside the softmax.
        causal: causal mask (seqlen_q = seqlen_k, so top-left and bottom-right alignment agree).
        softcap: 0 (off) or cap > 0: the logits are z = cap·tanh(τ q·k / cap) (Gemma 2), softmax(z) unscaled.
        window: None, or (wl, wr) >= 0: row i sees keys i − wl … i + wr only (flash-attn's ``window_size`` after
            kernels/_triton_utils.window_args: an unbounded side as a width past the sequence; ``causal`` False).
        cu_seqlens, max_seqlen: packed sequences (:func:`serves_varlen`): q, k, v (1, total, nheads[_k], headdim)
            views, cu_seqlens int32 (nseq + 1,) (0, …, total; the queries' and the keys'), max_seqlen >= every
            sequence's length. Each sequence attends within itself (causal, window per sequence).
        seqlens_k: None, or int32 (batch,) contiguous on q's device, each in [1, seqlen] (not checked): right key
            padding, keys j >= seqlens_k[b] of batch row b masked (and with ``causal``); not with ``window`` or packed
            sequences. The padded keys' values are never read into o (the loads come from device-made TMA
            descriptors that end at seqlens_k[b]: :func:`launch`).
        dropout_p, dropout_seed, dropout_offset: attention dropout (0: off, the kernel without it) with the keep mask
            of kernels/reference.dropout_keep_mask (packed: over the packed rows, keys within each sequence), as
            attention_fwd.forward: O = (P ∘ M) V / l / (1 − p̂); m and log2l are the undropped P's.

    Returns:
        o (batch, seqlen, nheads, headdim) in q's dtype; m, log2l (batch, nheads, seqlen) fp32: the row max
        of the logits (the raw scores q·k, or z with softcap) and log2 Σ_j exp2((logit_ij − m_i)·c) with
        c = τ·log2e (log2e with softcap), as attention_fwd.forward. Packed: o (1, total, nheads, headdim),
        m, log2l (1, nheads, total).
    """
    b, n, h, d = q.shape
    hk = k.shape[2]
    o = torch.empty((b, n, h, d), dtype=q.dtype, device=q.device)  # not empty_like: q may be heads-major
    m = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    log2l = torch.empty_like(m)
    descs, where = _descriptors(q, k, v, o)
    c = exponent_factor(softmax_scale, softcap)
    packed = cu_seqlens is not None
    keypad = seqlens_k is not None
    m_blocks = triton.cdiv(max_seqlen if packed else n, BLOCK_M)
    rows = (cu_seqlens.numel() - 1 if packed else b) * h
    per, tiles, programs = schedule(m_blocks, rows, window is not None, packed, keypad, q.device, dropout_p > 0)
    kernel = _kernel_for(softcap > 0, window is not None, packed, n % BLOCK_M != 0, keypad, dropout_p > 0)
    # k_cols, v_cols: the widths of k's and v's 2-D TMA views, as their descriptors have them
    launch(kernel, (programs,), q.device, keypad, *descs, o, m, log2l, cu_seqlens if packed else m,
           seqlens_k if keypad else m, k, v, c, h, h // hk, n, m_blocks, tiles, per, int(bool(causal)), *where,
           descs[1].shape[1], descs[2].shape[1], *feature_args(softmax_scale, softcap, window),
           *dropout_kernel_args(dropout_p, dropout_seed, dropout_offset, n))
    return o, m, log2l


def schedule(m_blocks: int, rows: int, window: bool, packed: bool, keypad: bool,
             device: torch.device, dropout: bool = False) -> tuple[int, int, int]:
    """(PER, TILES, programs): how the forward runs ``m_blocks`` query blocks of ``rows`` (batch rows or sequences) ·
    heads. Where the kernel is persistent (:func:`persistent`: dense inputs, causal or not, softcap or not) items of
    PER = 2 tile slots, each head's slots an even number (m_blocks rounded up; :func:`tile_span`: a causal head's
    blocks paired heaviest with lightest, so that items balance), one program per SM of ``device`` looping over them
    where they fill it (:func:`paired_items`); elsewhere, or with GPROJ_FWD_PERSISTENT=0 (for A/B timing), one tile
    per program (PER = 1), heaviest first, balanced by the block scheduler. Measured on an H200: benchmarks/NOTES.md,
    run 33."""
    paired = None
    if os.environ.get("GPROJ_FWD_PERSISTENT", "1") != "0" and persistent(window, packed, keypad, dropout):
        paired = paired_items(m_blocks, rows, device)
    if paired is None:
        return 1, m_blocks * rows, m_blocks * rows
    return (2, *paired)


def paired_items(m_blocks: int, rows: int, device: torch.device) -> tuple[int, int] | None:
    """(TILES, programs) of a persistent kernel over items of two block slots, ``m_blocks`` blocks of each of ``rows``
    heads (each head's slots an even number, m_blocks rounded up): TILES slots, one program per SM of ``device`` (one
    per item on a device that is not CUDA, so that CPU runs exercise the loop); None where the items do not give every
    SM one at least. With fewer items than SMs the loop gains no round over the kernel without it (both take about two
    block times), and with fewer than half as many it loses one: an item's two blocks run one after the other on one
    SM where the kernel without the loop runs them on two SMs at once (fix none's backward at 4×16×2048×128 GQA 8:1,
    64 items: 304–308 TFLOP/s with the loop, 475 without; benchmarks/NOTES.md, run 42). Used by this forward and by
    kernels/attention_bwd_hopper.dkdv_schedule."""
    items = (m_blocks + m_blocks % 2) * rows // 2
    if device.type != "cuda":
        return 2 * items, items
    sms = _sm_count(device)
    return (2 * items, sms) if items >= sms else None


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch(kernel, grid, device: torch.device, keypad: bool, *args) -> None:
    """Launch a Gluon kernel of this family with 4 warps in its default partition. With ``keypad`` its loader makes
    TMA descriptors on the device (:func:`keys_descriptor`), which take global scratch memory from Triton's
    allocator: one of ours (torch's caching allocator on ``device``) is set in a copy of the current context, so an
    allocator the caller set stays as it was."""
    if not keypad:
        kernel[grid](*args, num_warps=4)
        return

    def run():
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
        kernel[grid](*args, num_warps=4)

    contextvars.copy_context().run(run)


def compile_sm90(head_dim: int, dtype: torch.dtype = torch.bfloat16, ones: tuple[str, ...] = (), softcap: bool = False,
                 window: bool = False, varlen: bool = False, edges: bool = False, keypad: bool = False,
                 dropout: bool = False):
    """Compile the kernel (its softcap, window, packed-sequence, key-padding and / or dropout variant) for sm_90 without a GPU
    (Triton's ahead-of-time path), as CI does.

    ``ones`` names integer arguments compiled as the constant 1, as Triton specializes them at launch
    (``causal`` = 1 for every causal call; ``H``, ``GROUP`` for one head or no GQA sharing).
    Returns the compiled kernel (``.asm["ptx"]``, ``.metadata.shared``). Raises RuntimeError if Gluon is
    not importable.
    """
    _require_gluon()
    qo_layout, kv_layout = _layouts(head_dim, dtype)
    qo = tensordesc_type(dtype, _HALF_M.value, head_dim, qo_layout)
    kv = tensordesc_type(dtype, _BLOCK_N.value, head_dim, kv_layout)
    sig = {"q_desc": qo, "k_desc": kv, "v_desc": kv, "o_desc": qo, "O": pointer_type(dtype), "M": "*fp32", "LOG2L": "*fp32",
           "CU": "*i32" if varlen else "*fp32", "SEQLENS": "*i32" if keypad else "*fp32", "K": pointer_type(dtype),
           "V": pointer_type(dtype), "c": "fp32", "H": "i32", "GROUP": "i32", "N_CTX": "i32", "M_BLOCKS": "i32",
           "TILES": "i32", "PER": "i32", "causal": "i32",
           **{f"{t}_{w}": "i32" for t in "qkv" for w in ("rb", "rh", "ch")}, "k_cols": "i32", "v_cols": "i32",
           "sc": "fp32", "cap": "fp32", "wl": "i32", "wr": "i32", **DROPOUT_SIGNATURE}
    return aot_compile_sm90(_kernel_for(bool(softcap), bool(window), bool(varlen), bool(edges), bool(keypad),
                                        bool(dropout)), sig, {arg: 1 for arg in ones})


#: The signature types of :func:`dropout_kernel_args`, as the kernels take them.
DROPOUT_SIGNATURE = {"DG": "i32", "seed_lo": "i32", "seed_hi": "i32", "drop_off": "i32", "drop_thr": "i32",
                     "drop_scale": "fp32"}


def dropout_kernel_args(dropout_p: float, seed: int, offset: int, n_k: int) -> tuple:
    """The Gluon kernels' dropout arguments (DG, seed_lo, seed_hi, drop_off, drop_thr, drop_scale): DG = ⌈n_k / 16⌉
    groups of 16 keys a query row (n_k: seqlen_k, or total_k when packed) and the rest as
    kernels/_triton_utils.dropout_args gives them to the tl.dot kernels (zeros and 1.0 without dropout, unused)."""
    drop = dropout_args(dropout_p, seed, offset)
    return ((int(n_k) + 15) // 16, drop["seed_lo"], drop["seed_hi"], drop["drop_off"], drop["drop_thr"],
            float(drop["drop_scale"]))


def feature_args(softmax_scale: float, softcap: float, window) -> tuple[float, float, int, int]:
    """The kernels' (sc, cap, wl, wr) arguments: the softcap's exponent factor sc = −2·log2e·τ/cap
    (_triton_utils.softcap_factor) and the cap (1.0 when softcap is 0, unused), the window's (wl, wr) (0, 0 without
    one, unused)."""
    cap = float(softcap) if softcap > 0 else 1.0
    wl, wr = window if window is not None else (0, 0)
    return softcap_factor(softmax_scale, cap), cap, int(wl), int(wr)


def _require_gluon() -> None:
    if GLUON_ERROR is not None:
        raise RuntimeError(f"Gluon is not available in this Triton: {GLUON_ERROR}")


def pointer_type(dtype: torch.dtype) -> str:
    """The signature type of a pointer argument to a bf16 / fp16 / fp32 tensor."""
    return {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]


def tensordesc_type(dtype: torch.dtype, rows: int, head_dim: int, layout) -> str:
    """The signature type of a bf16 / fp16 [rows, head_dim] tensor-descriptor argument with that shared layout."""
    return f"tensordesc<{'bf16' if dtype == torch.bfloat16 else 'fp16'}[{rows}, {head_dim}],{layout!r}>"


def aot_compile_sm90(kernel, signature: dict, constants: dict | None = None):
    """Compile a Gluon kernel for sm_90 without a GPU (Triton's ahead-of-time path, its bundled ptxas), 4 warps
    in the default partition; ``constants`` maps arguments to the values compiled in (their signature type
    becomes constexpr). Raises RuntimeError if Gluon is not importable."""
    _require_gluon()
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    constants = constants or {}
    signature = {**signature, **{arg: "constexpr" for arg in constants}}
    return triton.compile(GluonASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})


def sass(kernel) -> str:
    """The SASS of a compiled kernel (e.g. :func:`aot_compile_sm90`'s), disassembled from its cubin by the cuobjdump
    that ships with Triton. Raises RuntimeError if that tool is missing, CalledProcessError if it fails."""
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        raise RuntimeError(f"cuobjdump not found at {tool}")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
