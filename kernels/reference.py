"""PyTorch reference of FlashAttention-class numerics with the GProj corrections.

This is the numerics model of DESIGN.md §3 written out step by step: for 16-bit inputs every rounding
point of an FA3-class kernel is emulated in fp32 (P rounded to the input dtype as the operand of P·V
and Pᵀ·dO, O stored in the input dtype, D built from the stored O, dS rounded to the input dtype as the
operand of dS·K and dSᵀ·Q). On top of it, the GProj projections of DESIGN.md §4:

* ``fix="none"``: what an FA3-class kernel computes (rows of the rounded dS do not sum to zero);
* ``fix="gproj"``: the P-weighted (oblique) projection, dŜ_ij = dS̃_ij − r_i w_ij with w_ij = P̃_ij / p̃_i
  and p̃_i = Σ_j P̃_ij (P̃ = the 16-bit P the GEMMs consume; its rows miss 1 by ~2⁻⁹, so they are
  renormalized to make Σ_j w_ij = 1 to fp32 rounding), i.e. with ρ_i = r_i / p̃_i
  dQ_i = τ (Σ_j dS̃_ij k_j − ρ_i (P̃ K)_i) and dK_j = τ (Σ_i dS̃_ij q_i − Σ_i P̃_ij ρ_i q_i);
* ``fix="gproj_uniform"``: the orthogonal projection, dŜ_ij = dS̃_ij − r_i / n_i over Valid(i).

Sliding windows and logit softcapping (flash-attn's ``window_size=(left, right)`` and ``softcap``):

* a window only changes which keys row i sees (Valid(i) = {j: i + Nk − Nq − left <= j <= i + Nk − Nq + right},
  −1 = unbounded; ``causal`` sets right = 0). A mask is invariant under adding a constant to a row, so
  C1 (Σ_j dS_ij = 0) and C2 (Σ_j dK_j = 0) hold over the visible keys and GProj acts unchanged on them.
* softcap (cap > 0) replaces the logit τ s_ij by z_ij = cap · t_ij, t_ij = tanh(τ s_ij / cap), and P =
  softmax(z). The zero row sum holds for dZ = P ∘ (dP − D), the gradient w.r.t. the *capped* logits;
  the GEMM operand is X = dZ ∘ g with g = 1 − t² (the tanh derivative; dQ = τ X K, dK = τ Xᵀ Q), and it
  is X that is rounded: X̃ = bf16(X). Its exact invariant is Σ_j X_ij / g_ij = 0, so r_i = Σ_j X̃_ij / g_ij
  (fp32, from the rounded values; the unrounded dZ where X̃ is not a normal number of the operand dtype or
  1/g is not finite: there 1/g would blow up X̃'s absolute rounding, docs/architecture.md) and
  the P-weighted projection acts in the capped domain: X̂_ij = X̃_ij − ρ_i W̃_ij with W̃ = bf16(P̃ ∘ g) the
  correction's GEMM operand (entries below the normal range set to 0) and ρ_i = r_i / Σ_j (W̃_ij / g_ij) (0
  where that sum is 0), so that Σ_j X̂_ij / g_ij = 0 to fp32 rounding. The D error (−δ_i P_ij in dZ) lies exactly
  along this direction, as without softcap. C2
  does not hold with softcap even in exact arithmetic (a shared key shift changes each row's capped
  logits by different amounts), so the fp32 C2 projection (:func:`project_key_sum_`) is skipped; the dK
  correction only applies the same projected X̂ to dK as to dQ.
* with a window or softcap, ``fix="gproj_uniform"`` runs the same in-loop projection with W = the
  visible-key mask instead of P̃ (W̃ = bf16(g); without softcap the uniform projection, with ρ_i = r_i/n_i
  and the dK operand bf16(ρ_i q_i) — the O(N·d) prefix-mean form needs constant weights and a causal band).

Attention dropout (flash-attn's ``dropout_p``, ``nn.MultiheadAttention(dropout=p)``, Hugging Face's
``attn_pdrop``): with the keep mask M ∈ {0, 1} (:func:`dropout_keep_mask`, kept with probability 1 − p,
where p here is the probability the 8-bit keep test applies, the given one rounded to a multiple of
2⁻⁸ (:func:`dropout_threshold`); the scale 1/(1 − p) uses the same p (:func:`dropout_scale`), so
E[M] / (1 − p) = 1 exactly)

    O = (P ∘ M) V / (1 − p),   P = softmax(S) undropped (the row max m and the sum l are P's).

Its backward, with dP' = ∂L/∂P = (M / (1 − p)) ∘ (dO Vᵀ):

    dV = ((P ∘ M) / (1 − p))ᵀ dO
    D_i = Σ_j P_ij dP'_ij = Σ_j P_ij M_ij (dO_i·v_j) / (1 − p) = dO_i·O_i = rowsum(dO ∘ O)
          (O the dropped output: D is computed as without dropout)
    dS = P ∘ (dP' − D)    (softmax's Jacobian acts on the undropped P)
    Σ_j dS_ij = Σ_j P_ij dP'_ij − D_i Σ_j P_ij = D_i − D_i · 1 = 0.

So the zero-sum law C1 (and with it C2) holds with dropout, for the *undropped* P: dropped entries have
dS_ij = −P_ij D_i, not 0 (the same expression with P ∘ M in place of P does not sum to zero). GProj
is unchanged: r_i = Σ_j dS̃_ij of the rounded dS, projected along P̃ (the rounded undropped P). Under
softcap the same holds for dZ, the gradient w.r.t. the capped logits. Rounding points: the P·V operand
is bf16(P) ∘ M (the mask commutes with the rounding), the 1/(1 − p) scale is applied in fp32 to the
output (O = acc / l · 1/(1 − p)) and to the dV accumulator, and dP' = M ∘ (dP · 1/(1 − p)) in fp32.

For fp32 and fp64 inputs nothing is rounded: the same steps run in the input dtype (the corrections
are then at that dtype's rounding level).

It serves as the oracle of the Triton kernels (same signatures, see docs/architecture.md) and as the
CPU / unsupported-GPU path of :func:`lightning_gproj.gproj_attn_func`. It is chunked over query blocks,
so its memory is O(batch × heads × block_m × Nk), never N × N for long sequences.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = [
    "forward", "backward", "FIXES", "DS_FORMATS", "round_significand", "normalize_window", "project_key_sum_",
    "philox4x32", "PHILOX_ROUNDS", "dropout_threshold", "dropout_scale", "dropout_keep_mask",
]

#: Accepted values of ``fix``.
FIXES = ("none", "gproj", "gproj_uniform")

#: Accepted values of ``ds_format`` and the significant bits (implicit bit included) dS keeps before the
#: dQ and dK GEMMs; 0 = the GEMM operand dtype itself (bf16: 8 bits, fp16: 11), as FA3-class kernels do.
DS_FORMATS = {"bf16": 0, "e4m3": 4, "e5m2": 3}

_LOG2E = math.log2(math.e)

_M32 = 0xFFFFFFFF
#: Rounds of the Philox4x32 generator behind the dropout mask, read by :func:`dropout_keep_mask` and the
#: Triton kernels (kernels/_triton_utils.dropout_keep): editing this one line changes both together.
#: 7, as flash-attn's dropout (csrc/flash_attn/src/philox.cuh: 6 rounds + a final one); Salmon et al.
#: (SC'11) give 7 as Philox4x32's fewest rounds that pass TestU01's BigCrush and add 3 as a safety margin
#: in their default of 10. The mask generator is most of dropout's cost in the ALU-bound kernels, so the
#: rounds are worth saving (measured in benchmarks/NOTES.md, run 14).
PHILOX_ROUNDS = 7
# Philox4x32 constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), as in
# triton.language.random.philox_impl.
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85


def _mul32(a: int, x: Tensor) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit halves of the 64-bit product a·x of a uint32 constant and uint32 values held
    in int64 (the product itself would overflow int64: it is taken in 16-bit halves of x)."""
    t = a * (x & 0xFFFF)  # < 2^48
    u = a * (x >> 16) + (t >> 16)  # < 2^48 + 2^32
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def philox4x32(seed: int, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, rounds: int = 10) -> tuple[Tensor, ...]:
    """Philox4x32-``rounds`` of the counters (c0, c1, c2, c3) under the 64-bit key ``seed``, in PyTorch.

    Bit for bit Triton's ``tl.philox(seed, c0, c1, c2, c3, n_rounds=rounds)`` with 32-bit counters (key
    k0 = the low 32 bits of the seed, k1 = the high 32; checked against Triton in tests/test_dropout.py).
    Counters are int64 tensors holding uint32 values (broadcast together); returns the four uint32
    outputs as int64.
    """
    seed = int(seed) & ((1 << 64) - 1)
    k0, k1 = seed & _M32, seed >> 32
    c0, c1, c2, c3 = torch.broadcast_tensors(*(c.to(torch.int64) & _M32 for c in (c0, c1, c2, c3)))
    for _ in range(rounds):
        hi_b, lo_b = _mul32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul32(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _M32, (k1 + _PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def dropout_threshold(dropout_p: float) -> int:
    """The 8-bit threshold of the keep test ``random byte >= threshold`` (:func:`dropout_keep_mask`):
    thr8 = min(round(p · 2⁸), 2⁸ − 1), round half to even — flash-attn's resolution (its kernels compare
    one random byte per element too, csrc/flash_attn/src/dropout.h). An element is dropped with
    probability p̂ = thr8 / 2⁸, p rounded to a multiple of 2⁻⁸: |p̂ − p| <= 2⁻⁹ ≈ 0.002 for
    p < 1 − 2⁻⁹ (p = 0.1 drops with p̂ = 26/256 = 0.1016); from there on the threshold saturates
    (p̂ = 1 − 2⁻⁸); p <= 2⁻⁹ drops nothing. The kept weights are scaled by :func:`dropout_scale` =
    1/(1 − p̂). An integer comparison: exactly reproducible."""
    return min(round(float(dropout_p) * 2.0**8), 0xFF)


def dropout_scale(dropout_p: float) -> float:
    """1/(1 − p̂), the scale of the kept attention weights, p̂ = :func:`dropout_threshold` (p) / 2⁸ the
    probability with which the keep test drops one: E[M] / (1 − p̂) = 1 exactly (dropout with p̂,
    unbiased). 1/(1 − p) of the p given would bias the output by (1 − p̂)/(1 − p): up to 2⁻⁹/(1 − p)
    relative, and 2⁻⁸ · 1e9 ≈ 3.9e6× at p = 1 − 1e-9, where the threshold saturates."""
    return 2.0**8 / (2**8 - dropout_threshold(dropout_p))


def dropout_keep_mask(
    seed: int, offset: int, dropout_p: float, batch: int, nheads: int, n_k: int,
    rows: tuple[int, int], cols: tuple[int, int], device=None,
) -> Tensor:
    """The attention-dropout keep mask the kernels use, (batch, nheads, rows[1] − rows[0], cols[1] − cols[0]) bool.

    One Philox4x32-:data:`PHILOX_ROUNDS` call (:func:`philox4x32`, key ``seed``) gives 4 × 32 random bits
    = 16 random bytes, spent on 16 consecutive keys of one query row (as flash-attn spends one byte per
    element). Element (b, h, i, j) — query row i, key column j of a call with ``n_k`` keys per row — lies
    in group g = ⌊j / 16⌋ at place c = j mod 16; with G = ⌈n_k / 16⌉ groups per row its counters are

        c0 = (i · G + g) mod 2³²,  c1 = b · nheads + h,  c2 = offset mod 2³²,  c3 = ⌊(i · G + g) / 2³²⌋

    and its random value is byte c mod 4 (0: the lowest) of output word ⌊c / 4⌋. It is kept iff that
    value >= :func:`dropout_threshold` (p): dropped with probability p rounded to a multiple of 2⁻⁸.
    ``rows`` / ``cols``: the half-open ranges of i and j wanted.
    Packed sequences (varlen) are one batch row: i indexes the packed query rows (0 <= i < total_q), j
    the key within its sequence (0 <= j < that sequence's length: groups then start at the sequence's
    first key, wherever it is packed), n_k = total_k and c1 = h. Counters stay distinct: a packed row
    belongs to one sequence, whose ⌈n_k_seq / 16⌉ groups fit in G.
    """
    g0, g1 = cols[0] // 16, -(-cols[1] // 16)  # the groups covering the columns
    i = torch.arange(rows[0], rows[1], device=device, dtype=torch.int64)
    g = torch.arange(g0, g1, device=device, dtype=torch.int64)
    lin = (i[:, None] * -(-n_k // 16) + g[None, :])[None, None]
    bh = torch.arange(batch * nheads, device=device, dtype=torch.int64).view(batch, nheads, 1, 1)
    words = philox4x32(seed, lin & _M32, bh, torch.tensor(int(offset), device=device), lin >> 32, PHILOX_ROUNDS)
    # Place c of a group: byte c mod 4 of word c // 4.
    values = torch.stack([(x >> (8 * b)) & 0xFF for x in words for b in range(4)], dim=-1).flatten(-2)
    return values[..., cols[0] - 16 * g0: cols[1] - 16 * g0] >= dropout_threshold(dropout_p)


class _Dropout(NamedTuple):
    """Dropout of one (dense) reference call: p, the Philox seed and offset, and where the call's rows
    sit in the counter space (packed sequences: their first packed row, and total_k; keys are counted
    within the sequence, :func:`dropout_keep_mask`)."""

    p: float
    seed: int
    offset: int
    row0: int = 0
    n_k: Optional[int] = None

    def keep(self, batch: int, nheads: int, i0: int, i1: int, nk: int, dtype, device) -> Tensor:
        """(batch, nheads, i1 − i0, nk) keep mask of query rows i0 <= i < i1 as 0/1 in ``dtype``."""
        mask = dropout_keep_mask(self.seed, self.offset, self.p, batch, nheads, self.n_k or nk,
                                 (self.row0 + i0, self.row0 + i1), (0, nk), device)
        return mask.to(dtype)


def _dropout(dropout_p: float, seed: int, offset: int) -> Optional[_Dropout]:
    return _Dropout(float(dropout_p), int(seed), int(offset)) if dropout_p > 0 else None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation for 16-bit inputs (the tensor-core model), else the input dtype."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _rounder(dtype: torch.dtype):
    """Return the function that rounds a compute-dtype tensor to a GEMM operand of ``dtype``."""
    if dtype in (torch.bfloat16, torch.float16):
        return lambda x: x.to(dtype).to(torch.float32)
    return lambda x: x


def round_significand(x: Tensor, bits: int) -> Tensor:
    """``x`` rounded to ``bits`` significant bits (implicit bit included), round half to even, in x's dtype.

    No range limit: the exponent is x's own, as a per-block-scaled FP8 operand behaves (DESIGN.md §11);
    ``bits`` = 4 is e4m3's significand, 3 is e5m2's. Done on the bit pattern (fp32 / fp64; 16-bit input
    goes through fp32), exactly as the Triton kernels do, so the two paths agree bit for bit. Values with
    at most 8 significant bits are exact in bf16, so the result feeds a bf16 GEMM unchanged. Zeros and
    infinities pass through; values within half an ulp of the dtype's largest round to infinity.
    """
    if x.dtype not in (torch.float32, torch.float64):
        return round_significand(x.float(), bits).to(x.dtype)
    itype, drop = (torch.int32, 24 - bits) if x.dtype == torch.float32 else (torch.int64, 53 - bits)
    b = x.contiguous().view(itype)
    b = (b + ((1 << (drop - 1)) - 1) + ((b >> drop) & 1)) & ~((1 << drop) - 1)
    return b.view(x.dtype).view(x.shape)


def check_ds_format(ds_format: object) -> int:
    """The significant bits of ``ds_format`` (0: the operand dtype's own), or ValueError naming the accepted values."""
    if not isinstance(ds_format, str) or ds_format not in DS_FORMATS:
        raise ValueError(f"ds_format must be one of {tuple(DS_FORMATS)}, got {ds_format!r}")
    return DS_FORMATS[ds_format]


def _heads_first(x: Tensor, nheads: int, dtype: torch.dtype) -> Tensor:
    """(batch, seqlen, nheads_x, d) -> (batch, nheads, seqlen, d) in ``dtype``; GQA heads repeated."""
    x = x.transpose(1, 2).to(dtype)
    if x.shape[1] != nheads:
        x = x.repeat_interleave(nheads // x.shape[1], dim=1)
    return x


def _hide_padded_keys(kh: Tensor, vh: Tensor, seqlens_k: Tensor | None) -> tuple[Tensor, Tensor]:
    """Heads-first k, v with the rows of keys j >= seqlens_k[b] set to 0 (``torch.where``, not a product).

    A padded key's score is masked to −inf, so its P is 0, but the products P·V, dO·Vᵀ, P̃·K and dSᵀ·Q
    still multiply that 0 by the padded values: a NaN or inf there (or a value whose product overflows)
    would turn the whole row into NaN. The kernels never load those rows; zeroing them here gives the
    reference the same rule: values behind the key padding never reach a result or a gradient.
    """
    if seqlens_k is None:
        return kh, vh
    keep = torch.arange(kh.shape[2], device=kh.device)[None, :] < seqlens_k.to(kh.device).long()[:, None]
    keep = keep[:, None, :, None]
    return torch.where(keep, kh, 0.0), torch.where(keep, vh, 0.0)


def normalize_window(causal: bool, window_size: tuple[int, int] = (-1, -1)) -> tuple[int, int]:
    """flash-attn's ``(left, right)`` window with ``causal`` folded in (causal sets right = 0); −1 = unbounded."""
    left, right = window_size
    return (left, 0) if causal else (left, right)


def _scores(
    qh: Tensor, kh: Tensor, i0: int, i1: int, causal: bool, seqlens_k: Tensor | None,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, softmax_scale: float = 1.0,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Logits of query rows i0 <= i < i1 (heads-first qh, kh), −inf where key j is not seen, the mask
    (None: every key seen) and, with ``softcap``, g = 1 − tanh(τ s / cap)², the tanh derivative (else None).

    Without softcap the logits are the raw scores s = q_i·k_j (τ applied in the exponent); with it,
    the capped logits z = cap · t (τ inside the tanh)."""
    s = qh[:, :, i0:i1] @ kh.transpose(-1, -2)
    g = None
    if softcap > 0:
        x = s * (softmax_scale / softcap)
        # g = 1 − tanh(x)² as 4e / (1 + e)², e = exp(−2|x|): no cancellation where tanh(x) → ±1
        # (1 − t² in fp32 keeps no correct bit once |x| > ~8.7; the kernels use the same form).
        e = torch.exp(-2 * x.abs())
        g = 4 * e / ((1 + e) * (1 + e))
        s = softcap * torch.tanh(x)
    valid = _valid(i0, i1, qh.shape[2], kh.shape[2], causal, qh.device, seqlens_k, window)
    return (s if valid is None else s.masked_fill(~valid, float("-inf"))), valid, g


def _valid(
    i0: int, i1: int, nq: int, nk: int, causal: bool, device, seqlens_k: Tensor | None = None,
    window: tuple[int, int] = (-1, -1),
) -> Tensor | None:
    """Boolean mask of the keys each query row i0 <= i < i1 sees, or None when every key is seen.

    (i1 − i0, nk) without ``seqlens_k``: the bottom-right aligned causal mask j <= i + nk − nq and the
    window i + nk − nq − left <= j <= i + nk − nq + right (``window`` = (left, right), −1 unbounded).
    (batch, 1, i1 − i0, nk) with ``seqlens_k`` (batch,): that mask and j < seqlens_k[b].
    """
    cols = torch.arange(nk, device=device)[None, :]
    rows = torch.arange(i0, i1, device=device)[:, None]
    left, right = normalize_window(causal, window)
    valid = None
    if right >= 0:
        valid = cols <= rows + (nk - nq) + right
    if left >= 0:
        lower = cols >= rows + (nk - nq) - left
        valid = lower if valid is None else valid & lower
    if seqlens_k is not None:
        keys = cols < seqlens_k.to(device=device, dtype=torch.long)[:, None]  # (batch, nk)
        keys = keys[:, None, None, :]
        valid = keys if valid is None else keys & valid
    return valid


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float,
    causal: bool,
    block_m: int = 256,
    seqlens_k: Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
    _dropout_at: Optional[_Dropout] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention forward with FA3-class rounding points and an FMA-safe exponent.

    Args:
        q: (batch, seqlen_q, nheads, headdim), bf16 / fp16 / fp32 / fp64.
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype; ``nheads % nheads_k == 0`` (GQA/MQA).
        softmax_scale: τ, multiplies q·k before the softmax.
        causal: bottom-right aligned mask (query i sees key j iff j ≤ i + seqlen_k − seqlen_q).
        block_m: query rows per chunk (memory knob only; results do not depend on it).
        seqlens_k: None, or an integer tensor (batch,) of key lengths (right padding): key j of batch
            row b is masked iff j >= seqlens_k[b]; combined with ``causal`` as
            valid(i, j) = (not causal or j <= i + seqlen_k − seqlen_q) and j < seqlens_k[b]. Expected
            in [1, seqlen_k] (not checked here; :func:`lightning_gproj.gproj_attn_func` validates).
            The values of masked keys are never used: NaN, inf or any value there changes nothing.
        window_size: (left, right) ints >= −1 (flash-attn's sliding window, −1 = unbounded): query i
            sees key j iff i + Nk − Nq − left <= j <= i + Nk − Nq + right, and-ed with the rest;
            ``causal`` sets right = 0.
        softcap: 0 (off) or cap > 0: logits z = cap · tanh(τ s / cap), softmax(z) with no further scale.

        cu_seqlens_q, cu_seqlens_k: packed sequences (flash-attn's varlen layout), or None. int32
            (batch + 1,) cumulative lengths: sequence b is the query rows cu_seqlens_q[b] <= i <
            cu_seqlens_q[b + 1] of q (total_q, nheads, headdim) and the keys cu_seqlens_k[b] <= j <
            cu_seqlens_k[b + 1] of k, v (total_k, nheads_k, headdim); each sequence is its own batch row
            (causal bottom-right aligned per sequence; sequences never see each other; a sequence may be
            empty). Expected to start at 0, not to decrease and to end at total_q / total_k (not checked
            here; :func:`lightning_gproj.ops.gproj_attn_varlen_func` validates). Not combined with
            ``seqlens_k``; ``window_size`` and ``softcap`` apply within each sequence (its own
            bottom-right alignment i + Nk_seq − Nq_seq).
        max_seqlen_q, max_seqlen_k: the longest sequence lengths (launch sizes of the Triton kernels;
            accepted for the same signature, not needed here).
        dropout_p: attention dropout probability in [0, 1) (0: off): O = (P ∘ M) V / (1 − p) with the
            keep mask M = :func:`dropout_keep_mask` (``dropout_seed``, ``dropout_offset``); m and log2l
            stay those of the undropped P (module docstring).
        dropout_seed, dropout_offset: the Philox key (a 64-bit int) and counter offset (32-bit) of the mask.

    Returns:
        o: like q. m: (batch, nheads, seqlen_q) fp32 (fp64 for fp64 input), the row max of the unscaled
        scores (with softcap: of the capped logits z); 0 for a row with no visible key. log2l: same shape,
        log2 of Σ_j exp2((s_ij − m_i)·τ·log2e); +inf for a row with no visible key (its P is then 0 and
        its output 0). Packed sequences: m and log2l are (nheads, total_q), as flash-attn's varlen
        softmax_lse.

    The exponent is ``(s − m)·(τ·log2e)`` with s and m the same fp32 numbers, so the row's maximum gets
    exactly exp2(0) = 1 (DESIGN.md §5): no FMA can move it, and q = k = v = constant returns the
    constant (no NaN even for 133120 in bf16).
    """
    if cu_seqlens_q is not None:
        return _forward_varlen(q, k, v, softmax_scale, causal, block_m, cu_seqlens_q, cu_seqlens_k, window_size,
                               softcap, _dropout(dropout_p, dropout_seed, dropout_offset))
    drop = _dropout_at or _dropout(dropout_p, dropout_seed, dropout_offset)
    dtype = q.dtype
    cdt = _compute_dtype(dtype)
    rnd = _rounder(dtype)
    batch, nq, nheads, _ = q.shape
    qh, kh, vh = (_heads_first(x, nheads, cdt) for x in (q, k, v))
    kh, vh = _hide_padded_keys(kh, vh, seqlens_k)
    # The exponent's factor: τ·log2e on raw scores, log2e on capped logits (τ is inside the tanh).
    c = torch.tensor((1.0 if softcap > 0 else softmax_scale) * _LOG2E, dtype=cdt)

    o = torch.empty(batch, nheads, nq, v.shape[-1], dtype=cdt, device=q.device)
    m = torch.empty(batch, nheads, nq, dtype=cdt, device=q.device)
    log2l = torch.empty_like(m)
    for i0 in range(0, nq, block_m):
        i1 = min(i0 + block_m, nq)
        s, _, _ = _scores(qh, kh, i0, i1, causal, seqlens_k, window_size, softcap, softmax_scale)
        m_blk = s.amax(dim=-1)
        m_blk = torch.where(torch.isinf(m_blk), torch.zeros_like(m_blk), m_blk)
        p = torch.exp2((s - m_blk[..., None]) * c)
        l_blk = p.sum(dim=-1)
        # P is a 16-bit GEMM operand of P·V; the normalizer l stays fp32 (sum of the fp32 p).
        p16 = rnd(p)
        if drop is not None:  # the dropped operand bf16(P) ∘ M; l above is the undropped P's
            p16 = p16 * drop.keep(batch, nheads, i0, i1, kh.shape[2], cdt, q.device)
        acc = p16 @ vh
        empty = l_blk == 0
        o_blk = acc / l_blk[..., None]
        if drop is not None:
            o_blk = o_blk * torch.tensor(dropout_scale(drop.p), dtype=cdt)
        o[:, :, i0:i1] = torch.where(empty[..., None], torch.zeros_like(acc), o_blk)
        m[:, :, i0:i1] = m_blk
        log2l[:, :, i0:i1] = torch.where(empty, torch.full_like(l_blk, float("inf")), torch.log2(l_blk))
    return o.transpose(1, 2).to(dtype), m, log2l


def sequences(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor) -> list[tuple[int, int, int, int]]:
    """``[(q0, q1, k0, k1)]`` per packed sequence: its query rows q0 <= i < q1 and keys k0 <= j < k1
    (reads the values: a device sync)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _forward_varlen(q, k, v, softmax_scale, causal, block_m, cu_seqlens_q, cu_seqlens_k, window_size, softcap,
                    drop=None):
    """:func:`forward` over packed sequences, one sequence at a time (each its own batch row of 1); the
    dropout mask of the packed query rows and the sequence's own keys (:func:`dropout_keep_mask`)."""
    nheads = q.shape[1]
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    # A sequence with no keys keeps the contract of a row with no visible key: o = 0, m = 0, log2l = +inf.
    m = torch.zeros(nheads, q.shape[0], dtype=stat, device=q.device)
    log2l = torch.full_like(m, float("inf"))
    for q0, q1, k0, k1 in sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        at = None if drop is None else drop._replace(row0=q0, n_k=k.shape[0])
        ob, mb, lb = forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, causal, block_m,
                             window_size=window_size, softcap=softcap, _dropout_at=at)
        o[q0:q1], m[:, q0:q1], log2l[:, q0:q1] = ob[0], mb[0], lb[0]
    return o, m, log2l


def backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    m: Tensor,
    log2l: Tensor,
    softmax_scale: float,
    causal: bool,
    fix: str = "gproj",
    want_stats: bool = False,
    dk_fold: bool = False,
    grad_dtype: torch.dtype | tuple | None = None,
    block_m: int = 256,
    seqlens_k: Tensor | None = None,
    ds_format: str = "bf16",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
    _dropout_at: Optional[_Dropout] = None,
) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
    """Attention backward with FA3-class rounding points and the GProj corrections.

    Args:
        do: (batch, seqlen_q, nheads, headdim), the incoming gradient, same dtype as q.
        q, k, v, o, m, log2l: as in / as returned by :func:`forward`.
        softmax_scale, causal: as in :func:`forward`.
        fix: ``"none"`` | ``"gproj"`` | ``"gproj_uniform"`` (DESIGN.md §4).
        want_stats: also return the health statistics (DESIGN.md §8) in ``extras``.
        dk_fold: for ``fix="gproj"``, fold the dK term into dS before its rounding
            (dS' = P ∘ (dP − D − r), rounded, then dK = τ dS'ᵀ Q: zero extra GEMMs, as a kernel that runs
            its dQ pass first can do) instead of the separate product P̃ᵀ(ρ ∘ Q) (DESIGN.md §4.1).
        grad_dtype: dtype dq, dk, dv are returned in (default: the input dtype, as a kernel stores them);
            ``torch.float32`` returns the fp32 accumulators, where the conservation laws can be checked
            to fp32 rounding; or a (dq, dk, dv) triple of dtypes (None: the input dtype), one per
            gradient. With either projection (``fix != "none"``) an fp32 / fp64 dk ends with
            :func:`project_key_sum_`, so Σ_j dK_j = 0 (C2) holds to a few units of that dtype's
            rounding relative to ‖dK‖_F.
        block_m: query rows per chunk (memory knob only).
        seqlens_k: as in :func:`forward` (the same value the forward ran with). Masked keys get
            dk = dv = 0 exactly, whatever their values (NaN and inf included); ``gproj_uniform``
            averages over each row's valid keys.
        ds_format: how dS is rounded before the dQ and dK GEMMs (:data:`DS_FORMATS`): ``"bf16"`` the
            GEMM operand dtype (the input dtype; nothing for fp32 / fp64 inputs), ``"e4m3"`` / ``"e5m2"``
            4 / 3 significant bits with no range limit (:func:`round_significand`), then the operand
            dtype (exact). r sums the values the GEMMs use, whatever the format.
        window_size, softcap: as in :func:`forward` (the values the forward ran with). With softcap the
            projection acts in the capped domain (module docstring) and dk gets no C2 projection;
            with a window or softcap, ``gproj_uniform`` runs in the loop with W = the visible-key mask.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: packed sequences, as in :func:`forward`
            (the same values the forward ran with; m, log2l then (nheads, total_q)). Each sequence is
            its own batch row: r_i per query row, and the fp32 dk projection (C2) and
            ``gproj_uniform``'s dK correction per sequence — Σ over each sequence's keys, never across
            sequences (with a left window, over the keys some query of the sequence sees). A sequence with no keys gets dq = 0; one with no queries dk = dv = 0.
        dropout_p, dropout_seed, dropout_offset: as the forward ran with: the backward regenerates its
            keep mask M (:func:`dropout_keep_mask`) and computes dV = ((P ∘ M)/(1 − p))ᵀ dO,
            dP' = M ∘ dP/(1 − p), dS = P ∘ (dP' − D) with the undropped P (module docstring: its rows
            still sum to zero, and GProj projects along P̃ as without dropout).

    Returns:
        dq like q; dk, dv like k, v (GQA: summed over the query heads of each kv head); extras with,
        when ``want_stats``, fp32 tensors ``r`` and ``abs_dS`` (batch, nheads, seqlen_q): the row sums
        Σ_j dS̃_ij and Σ_j |dS̃_ij| of the rounded dS before any projection, and ``leak``
        (batch, nheads, seqlen_q, headdim): τ ρ_i (P̃ K)_i, the part of dQ̃ that GProj removes. Packed
        sequences: dq (total_q, nheads, headdim), dk, dv (total_k, nheads_k, headdim); r, abs_dS
        (nheads, total_q), leak (nheads, total_q, headdim).

    Raises:
        ValueError: ``fix`` not one of :data:`FIXES`, ``ds_format`` not one of :data:`DS_FORMATS`.
    """
    if fix not in FIXES:
        raise ValueError(f"fix must be one of {FIXES}, got {fix!r}")
    ds_bits = check_ds_format(ds_format)
    if cu_seqlens_q is not None:
        return _backward_varlen(
            do, q, k, v, o, m, log2l, softmax_scale, causal, fix, want_stats, dk_fold, grad_dtype, block_m,
            ds_format, cu_seqlens_q, cu_seqlens_k, window_size, softcap,
            _dropout(dropout_p, dropout_seed, dropout_offset),
        )
    drop = _dropout_at or _dropout(dropout_p, dropout_seed, dropout_offset)
    dtype = q.dtype
    cdt = _compute_dtype(dtype)
    rnd = _rounder(dtype)

    def rnd_ds(x: Tensor) -> Tensor:
        return rnd(round_significand(x, ds_bits) if ds_bits else x)
    batch, nq, nheads, d = q.shape
    nk, nheads_k = k.shape[1], k.shape[2]
    qh, kh, vh, oh, doh = (_heads_first(x, nheads, cdt) for x in (q, k, v, o, do))
    kh, vh = _hide_padded_keys(kh, vh, seqlens_k)
    c = torch.tensor((1.0 if softcap > 0 else softmax_scale) * _LOG2E, dtype=cdt)
    m, log2l = m.to(cdt), log2l.to(cdt)
    left, right = normalize_window(causal, window_size)
    # Windows and softcap run the uniform projection in the loop (module docstring).
    in_loop_uniform = fix == "gproj_uniform" and (softcap > 0 or (left, right) != normalize_window(causal))
    weighted = fix == "gproj" or in_loop_uniform

    # D from the stored 16-bit O and dO (DESIGN.md §3): its error is one source of the residual r.
    delta = (doh * oh).sum(dim=-1)
    dq = torch.empty(batch, nheads, nq, d, dtype=cdt, device=q.device)
    dk = torch.zeros(batch, nheads, nk, d, dtype=cdt, device=q.device)
    dv = torch.zeros(batch, nheads, nk, v.shape[-1], dtype=cdt, device=q.device)
    r = torch.empty(batch, nheads, nq, dtype=cdt, device=q.device)
    abs_ds = torch.empty_like(r)
    need_pk = weighted or want_stats
    pk = torch.empty_like(dq) if need_pk else None  # ρ_i (W̃ K)_i

    for i0 in range(0, nq, block_m):
        i1 = min(i0 + block_m, nq)
        s, valid, g = _scores(qh, kh, i0, i1, causal, seqlens_k, window_size, softcap, softmax_scale)
        p = torch.exp2((s - m[:, :, i0:i1, None]) * c - log2l[:, :, i0:i1, None])
        p16 = rnd(p)
        dp = doh[:, :, i0:i1] @ vh.transpose(-1, -2)
        if drop is None:
            dv += p16.transpose(-1, -2) @ doh[:, :, i0:i1]
        else:
            # dV = ((P̃ ∘ M) / (1 − p))ᵀ dO (the scale after the sum, as the kernel); dP' = M ∘ dP / (1 − p).
            keep = drop.keep(batch, nheads, i0, i1, nk, cdt, q.device)
            dv += (p16 * keep).transpose(-1, -2) @ doh[:, :, i0:i1]
            dp = torch.where(keep > 0, dp * torch.tensor(dropout_scale(drop.p), dtype=cdt), 0.0)
        ds = p * (dp - delta[:, :, i0:i1, None])  # w.r.t. the logits (capped ones with softcap)
        # Correction direction W̃ (P̃, or the visible-key mask for the in-loop uniform projection).
        w16 = p16 if not in_loop_uniform else (torch.ones_like(p16) if valid is None else valid.to(cdt).expand_as(p16))
        if g is None:
            # The rounding that breaks the zero-sum law (C1): r is taken from the very values the GEMMs use.
            ds16 = rnd_ds(ds)
            r_blk = ds16.sum(dim=-1)
            ws = w16.sum(dim=-1)
            abs_blk = ds16.abs().sum(dim=-1)
        else:
            # Softcap: the GEMM operand is X = dZ ∘ g (g = 1 − t², the tanh derivative), rounded; the
            # zero-sum law holds for X / g, so r and Σ_j W̃_ij / g_ij are taken in the capped domain.
            ds16 = rnd_ds(ds * g)
            # X̃ / g is the rounded dZ only where X̃ is a normal number of the operand dtype (a relative rounding) and
            # 1/g is finite. Below the operand dtype's normal range (fp16: 2⁻¹⁴, reached where tanh saturates) X̃ is
            # off by up to its spacing, negligible in dS but blown up by 1/g in dZ: there r takes the unrounded dZ
            # (the entry adds no rounding error to the row sum), and the direction W̃ = rnd(W∘g) drops such entries
            # (W̃ / g would be as wrong), so that Σ_j W̃_ij / g_ij is either 0 (no direction: ρ = 0) or ≥ 2⁻¹⁴.
            tiny16 = torch.finfo(dtype).tiny  # bf16: fp32's; fp32 inputs: no rounding at all
            live = g >= torch.finfo(torch.float32).tiny
            inv_g = torch.where(live, 1 / g, 0.0)
            dz16 = torch.where(live & (ds16.abs() >= tiny16), ds16 * inv_g, ds)
            w16 = rnd(w16 * g)
            w16 = torch.where(w16 >= tiny16, w16, 0.0)
            r_blk = dz16.sum(dim=-1)
            ws = (w16 * inv_g).sum(dim=-1)
            abs_blk = dz16.abs().sum(dim=-1)
        rho_blk = torch.where(ws > 0, r_blk / ws.clamp(min=torch.finfo(cdt).tiny), 0.0)  # 0: no direction
        r[:, :, i0:i1] = r_blk
        abs_ds[:, :, i0:i1] = abs_blk
        dq[:, :, i0:i1] = ds16 @ kh
        if need_pk:
            pk[:, :, i0:i1] = rho_blk[..., None] * (w16 @ kh)
        if fix == "gproj" and dk_fold:
            ds_dk = rnd_ds(p * (dp - delta[:, :, i0:i1, None] - r_blk[..., None]) * (1 if g is None else g))
            dk += ds_dk.transpose(-1, -2) @ qh[:, :, i0:i1]
        else:
            dk += ds16.transpose(-1, -2) @ qh[:, :, i0:i1]
            if weighted:
                # −W̃ᵀ(ρ∘Q) with ρ∘Q rounded, as the kernel's B operand (kernels/attention_bwd.py).
                dk -= w16.transpose(-1, -2) @ rnd(rho_blk[..., None] * qh[:, :, i0:i1])

    extras: dict[str, Tensor] = {}
    if want_stats:
        extras = {"r": r.float(), "abs_dS": abs_ds.float(), "leak": (softmax_scale * pk).float()}
    if weighted:
        dq -= pk
    elif fix == "gproj_uniform":
        if seqlens_k is None:
            dq_corr, dk_corr = _uniform_corrections(qh, kh, r, causal, nk)
            dq -= dq_corr
            dk -= dk_corr
        else:  # one batch row at a time: each has its own valid-key set
            for b_i, n_b in enumerate(seqlens_k.tolist()):
                sl = slice(b_i, b_i + 1)
                dq_corr, dk_corr = _uniform_corrections(qh[sl], kh[sl], r[sl], causal, int(n_b))
                dq[sl] -= dq_corr
                dk[sl] -= dk_corr
    dq *= softmax_scale
    dk *= softmax_scale
    if drop is not None:
        dv *= torch.tensor(dropout_scale(drop.p), dtype=cdt)

    if nheads_k != nheads:
        group = nheads // nheads_k
        dk = dk.view(batch, nheads_k, group, nk, d).sum(dim=2)
        dv = dv.view(batch, nheads_k, group, nk, dv.shape[-1]).sum(dim=2)
    out_q, out_k, out_v = grad_dtypes(grad_dtype, dtype)
    dk = dk.transpose(1, 2).to(out_k)
    if fix != "none" and out_k in (torch.float32, torch.float64) and softcap == 0:
        # C2 holds with a window (over the keys some query sees) but not with softcap (module docstring).
        project_key_sum_(dk, seqlens_k, key_start=max(0, nk - nq - left) if left >= 0 else 0)
    return dq.transpose(1, 2).to(out_q), dk, dv.transpose(1, 2).to(out_v), extras


def grad_dtypes(grad_dtype, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(dq, dk, dv) dtypes of ``grad_dtype`` (None, a dtype, or a triple of those; None: ``dtype``)."""
    triple = grad_dtype if isinstance(grad_dtype, tuple) else (grad_dtype,) * 3
    return tuple(g or dtype for g in triple)


def project_key_sum_(
    dk: Tensor, seqlens_k: Tensor | None = None, key_start: int = 0, cu_seqlens_k: Tensor | None = None,
    key_sums: Tensor | None = None,
) -> Tensor:
    """In place: subtract from every valid key's gradient the mean over the valid keys, per batch row
    (per packed sequence) and kv head, so that Σ_j dK_j = 0 (C2, DESIGN.md §2) holds to the rounding
    of this step.

    The exact gradient satisfies C2, so this orthogonal projection never moves dk away from it. It
    cleans up what the projections (fix="gproj" and "gproj_uniform") leave when dk is returned in
    fp32: the 16-bit rounding of the P-weighted dK correction's operand and, in the kernels, single-ulp
    differences between the dQ pass (where r and ρ are computed) and the dK pass, which round a few
    dS elements differently (benchmarks/NOTES.md, run 6). Used only for fp32 / fp64 dk: a 16-bit dk's
    own storage rounding breaks C2 by far more (~√N·2⁻⁹).

    Args:
        dk: (batch, seqlen_k, nheads_k, headdim), fp32 or fp64, any strides; modified and returned.
            With ``cu_seqlens_k``: (total_k, nheads_k, headdim).
        seqlens_k: None, or (batch,) integer key lengths (right padding): masked keys keep dk = 0.
        key_start: keys j < key_start are seen by no query (a left window with seqlen_q < seqlen_k:
            key_start = Nk − Nq − left): they keep dk = 0 and the mean is over the others. With
            ``cu_seqlens_k``: an int or a (batch,) integer tensor, per sequence and counted from the
            sequence's first key.
        cu_seqlens_k: None, or the (batch + 1,) cumulative key lengths of packed sequences: the mean
            is taken over each sequence's keys, so each sequence's Σ_j dK_j = 0 on its own (an empty
            sequence has nothing to project).
        key_sums: None (summed here, in fp64), or Σ_j dK_j over the valid keys of ``dk`` as given,
            (batch, nheads_k, headdim) (packed: per sequence), any float dtype — as the Triton dK/dV
            kernel accumulates it while writing dk, which saves this step a pass over dk. Keys outside
            the valid ones must hold 0 (as every path leaves them).
    """
    if cu_seqlens_k is not None:
        cu = cu_seqlens_k.to(device=dk.device, dtype=torch.long)
        lens = cu.diff()
        seq = torch.repeat_interleave(torch.arange(lens.numel(), device=dk.device), lens, output_size=dk.shape[0])
        starts = torch.as_tensor(key_start, device=dk.device, dtype=torch.long).expand(lens.numel())
        valid = (torch.arange(dk.shape[0], device=dk.device) - cu[seq] >= starts[seq])[:, None, None]
        if key_sums is None:
            # one fp64 reduction per sequence, in a fixed order (an index_add_ on CUDA adds in any order: the gradients
            # would not be bit-reproducible, which deterministic=True promises)
            bounds = cu.tolist()
            total = torch.zeros((lens.numel(),) + dk.shape[1:], dtype=torch.float64, device=dk.device)
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                if b > a:
                    total[i] = (dk[a:b] * valid[a:b]).sum(0, dtype=torch.float64)
        else:
            total = key_sums.double()
        count = torch.zeros(lens.numel(), dtype=torch.float64, device=dk.device)
        count.index_add_(0, seq, valid[:, 0, 0].double())
        mean = total / count.clamp(min=1)[:, None, None]
        return dk.sub_(mean.to(dk.dtype)[seq] * valid)
    if seqlens_k is None and key_start == 0:
        total = dk.sum(dim=1, keepdim=True, dtype=torch.float64) if key_sums is None else key_sums[:, None].double()
        return dk.sub_((total / dk.shape[1]).to(dk.dtype))
    lens = torch.full((dk.shape[0],), dk.shape[1], device=dk.device) if seqlens_k is None else seqlens_k.to(dk.device)
    cols = torch.arange(dk.shape[1], device=dk.device)[None, :]
    valid = (cols < lens[:, None].long()) & (cols >= key_start)
    valid = valid[:, :, None, None]
    total = (dk * valid).sum(dim=1, keepdim=True, dtype=torch.float64) if key_sums is None else key_sums[:, None].double()
    count = valid.sum(dim=1, keepdim=True).to(torch.float64).clamp(min=1)
    return dk.sub_((total / count).to(dk.dtype) * valid)


def _backward_varlen(do, q, k, v, o, m, log2l, softmax_scale, causal, fix, want_stats, dk_fold, grad_dtype,
                     block_m, ds_format, cu_seqlens_q, cu_seqlens_k, window_size, softcap, drop=None):
    """:func:`backward` over packed sequences, one sequence at a time: every correction (and the fp32
    dk projection) then acts within the sequence."""
    out_q, out_k, out_v = grad_dtypes(grad_dtype, q.dtype)
    nheads, d = q.shape[1], q.shape[2]
    dq = torch.zeros(q.shape, dtype=out_q, device=q.device)
    dk = torch.zeros(k.shape, dtype=out_k, device=q.device)
    dv = torch.zeros(v.shape, dtype=out_v, device=q.device)
    stats = {"r": torch.zeros(nheads, q.shape[0], device=q.device), "abs_dS": torch.zeros(nheads, q.shape[0], device=q.device),
             "leak": torch.zeros(nheads, q.shape[0], d, device=q.device)} if want_stats else {}
    for q0, q1, k0, k1 in sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue  # no query sees a key: every gradient (and statistic) of the sequence is 0
        g = backward(
            do[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], o[None, q0:q1], m[None, :, q0:q1],
            log2l[None, :, q0:q1], softmax_scale, causal, fix, want_stats, dk_fold, grad_dtype, block_m,
            ds_format=ds_format, window_size=window_size, softcap=softcap,
            _dropout_at=None if drop is None else drop._replace(row0=q0, n_k=k.shape[0]),
        )
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
        for name, x in g[3].items():
            stats[name][:, q0:q1] = x[0]
    return dq, dk, dv, stats


def _uniform_corrections(qh: Tensor, kh: Tensor, r: Tensor, causal: bool, n_valid: int) -> tuple[Tensor, Tensor]:
    """The orthogonal projection's corrections (before the factor τ), DESIGN.md §4 "uniform".

    Keys j >= ``n_valid`` are masked (key padding of these batch rows; ``n_valid`` = Nk: none).
    dq_i: r_i k̄_i with k̄_i the mean of the keys row i sees. dk_j: Σ_{i sees j} (r_i / n_i) q_i, and 0
    for masked keys. Row i sees the prefix j < n_i = min(i + Nk − Nq + 1, n_valid) (causal) or
    j < n_valid, so k̄ is a prefix mean and the dk sum a suffix sum over rows: O(N·d), no N × N work.
    """
    nq, nk = qh.shape[2], kh.shape[2]
    if not causal:
        kbar = kh[:, :, :n_valid].mean(dim=2, keepdim=True)
        dk_corr = torch.zeros_like(kh)
        dk_corr[:, :, :n_valid] = ((r / n_valid)[..., None] * qh).sum(dim=2, keepdim=True)
        return r[..., None] * kbar, dk_corr
    offset = nk - nq
    n = (torch.arange(nq, device=qh.device) + offset + 1).clamp(min=0, max=n_valid)  # keys row i sees
    seen = n > 0
    prefix = kh.cumsum(dim=2)
    kbar = torch.zeros_like(qh[..., : kh.shape[-1]])
    kbar[:, :, seen] = prefix[:, :, n[seen] - 1] / n[seen, None].to(kh.dtype)
    w = torch.zeros_like(qh)
    w[:, :, seen] = (r[:, :, seen] / n[seen].to(r.dtype))[..., None] * qh[:, :, seen]
    # Key j < n_valid is seen by rows i >= j − offset: a suffix sum over i starting there.
    suffix = w.flip(2).cumsum(dim=2).flip(2)
    suffix = torch.cat([suffix, torch.zeros_like(suffix[:, :, :1])], dim=2)
    first = (torch.arange(nk, device=qh.device) - offset).clamp(min=0, max=nq)
    first[n_valid:] = nq  # masked keys: the empty suffix
    return r[..., None] * kbar, suffix[:, :, first]
