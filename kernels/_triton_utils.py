"""Shared helpers of the Triton attention kernels (no Triton import at module level beyond what the
kernels themselves need).

The kernels run in two worlds: compiled on a CUDA GPU (autotuned over block sizes, warps and stages),
and under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors for CI, where one small fixed
configuration keeps the run short. ``triton.jit`` decides between the two when a kernel module is
*imported*, so the environment variable must be set before the first import of the kernel modules.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from lightning_gproj.kernels.reference import PHILOX_ROUNDS, dropout_scale, dropout_threshold, normalize_window

LOG2E = math.log2(math.e)

#: Head dimensions the kernels are built and tested for (DESIGN / issue 3). Others in (16, 256] that
#: are multiples of 8 also run (padded to the next power of two with masked loads), untested.
TESTED_HEAD_DIMS = (32, 64, 96, 128, 256)


def on_input_device(fn):
    """Run ``fn(x, ...)`` with x's CUDA device current. Triton launches a kernel on the *current* device, so
    without this, tensors on another GPU than the current one (``model.to("cuda:1")`` without
    ``torch.cuda.set_device``) would be handed to a kernel running on the wrong device."""

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        if x.is_cuda:
            with torch.cuda.device(x.device):
                return fn(x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    return wrapper


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def autotune_enabled() -> bool:
    """GPU autotuning over the candidate configs; GPROJ_TRITON_AUTOTUNE=0 keeps the first candidate.

    Every candidate is a separate compile of every constexpr variant (seconds each), which matters
    inside a short device lease; numerics do not depend on the config.
    """
    return os.environ.get("GPROJ_TRITON_AUTOTUNE", "1") != "0"


def padded_head_dim(d: int) -> int:
    """Power of two ≥ max(d, 16): ``tl.arange`` needs powers of two and ``tl.dot`` needs ≥ 16."""
    return max(16, 1 << (d - 1).bit_length())


#: The kernels' grids put batch·nheads on CUDA's second grid axis, which holds at most 65535 blocks.
MAX_GRID_ROWS = 65535


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int | None = None) -> str | None:
    """Whether the Triton kernels can serve these inputs.

    Args:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
        batch: the number of sequences when packed (q is then a (1, total_q, ...) view); default q's batch.

    Returns:
        None if the Triton path serves the input, else a short human-readable reason (for the op's
        dispatch warning). Never raises.
    """
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        return f"triton is not importable ({exc.__class__.__name__})"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "expected 4-D (batch, seqlen, nheads, headdim) tensors"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (the Triton kernels take bf16 / fp16)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q, k, v dtypes differ"
    if not (q.device == k.device == v.device):
        return "q, k, v on different devices"
    if q.device.type == "cuda":
        if torch.cuda.get_device_capability(q.device) < (8, 0):
            return "GPU older than sm_80"
    elif not (q.device.type == "cpu" and interpreting()):
        return f"device {q.device.type} (CUDA, or CPU under TRITON_INTERPRET=1)"
    b, nq, h, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        return "batch sizes differ"
    if k.shape != v.shape:
        return "k and v shapes differ (different value head dim is not supported)"
    if k.shape[-1] != d:
        return "q and k head dims differ"
    hk = k.shape[2]
    if hk == 0 or h % hk != 0:
        return f"nheads {h} not a multiple of nheads_k {hk}"
    if d > 256 or d < 8 or d % 8 != 0:
        return f"head dim {d} (supported: multiples of 8 up to 256)"
    if nq == 0 or k.shape[1] == 0:
        return "empty sequence"
    rows = (b if batch is None else batch) * h
    if rows > MAX_GRID_ROWS:
        return f"batch·nheads = {rows} (the kernels' grids hold at most {MAX_GRID_ROWS})"
    return None


def check_seqlens(seqlens_k: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """None, or ``seqlens_k`` as a contiguous int32 (batch,) tensor for the kernels.

    Raises:
        ValueError: not an int32/int64 tensor of shape (batch,) on q's device. The values
            (1 <= seqlens_k[b] <= seqlen_k) are the caller's contract, not read here (no device sync).
    """
    if seqlens_k is None:
        return None
    if (not isinstance(seqlens_k, torch.Tensor) or seqlens_k.dtype not in (torch.int32, torch.int64)
            or seqlens_k.shape != (q.shape[0],) or seqlens_k.device != q.device):
        raise ValueError(
            f"seqlens_k must be an int32/int64 tensor of shape ({q.shape[0]},) on {q.device}, got "
            f"{getattr(seqlens_k, 'dtype', type(seqlens_k).__name__)} {tuple(getattr(seqlens_k, 'shape', ()))}"
        )
    return seqlens_k.to(torch.int32).contiguous()


def check_varlen(
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    q: torch.Tensor,
    seqlens_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """None (no packed sequences), or ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` as
    contiguous int32 tensors and ints for the kernels.

    Raises:
        ValueError: only some of the four given, cu_seqlens not int32 (batch + 1,) tensors of one length
            on q's device, max_seqlen not non-negative ints, q not 3-D (total_q, nheads, headdim), or
            combined with ``seqlens_k``. The values (start at 0, nondecreasing, end at total, no
            sequence longer than max_seqlen) are the caller's contract, not read here (no device sync).
    """
    given = [x is not None for x in (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k must be given together")
    if seqlens_k is not None:
        raise ValueError("seqlens_k cannot be combined with cu_seqlens_q / cu_seqlens_k (packed sequences have no padding)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if (not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2
                or cu.shape != cu_seqlens_q.shape or cu.device != q.device):
            raise ValueError(f"{name} must be an int32 tensor of shape (batch + 1,) on {q.device}, as long as "
                             f"cu_seqlens_q, got {getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    if q.dim() != 3:
        raise ValueError(f"packed q must be 3-D (total_q, nheads, headdim), got shape {tuple(q.shape)}")
    return cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k


def batch_strides(x: torch.Tensor, packed: bool) -> tuple[int, ...]:
    """The strides of a (batch, seqlen, nheads, headdim) tensor for the kernels; ``packed``: ``x`` is a
    packed (1, total, nheads, headdim) view, whose batch stride is passed as 0 (the kernels add each
    sequence's start offset themselves)."""
    return (0, *x.stride()[1:]) if packed else tuple(x.stride())


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

#: Passed to the kernels as a constexpr. Triton 3.9's interpreter multiplies bf16 tiles as their raw
#: uint16 bit patterns in ``tl.dot`` (create_dot calls np.matmul on the storage view), so under the
#: interpreter the operands are widened first (see :func:`mma`).
INTERPRET = interpreting()


@triton.jit
def mma(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b with 16-bit operands and an fp32 accumulator.

    Under the interpreter the tile product is taken in fp64 and rounded to fp32 once: products of
    16-bit floats and their sums over a tile are exact or nearly so in fp64, so the result does not
    depend on the summation order of the BLAS kernel NumPy picks for the CPU (OpenBLAS chooses it by
    processor and ``OPENBLAS_CORETYPE``). An fp32 np.matmul made the interpreter's numbers differ
    between machines, and with them the outcome of tests/test_triton_kernels.py. On the GPU the
    tensor core accumulates in fp32 in its own order; the tests' bounds allow for that (one-ulp
    differences between the two backward passes, benchmarks/NOTES.md).
    """
    if INTERP:
        return acc + tl.dot(a.to(tl.float64), b.to(tl.float64), out_dtype=tl.float64).to(tl.float32)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def to16(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """Round fp32 ``x`` to ``dtype`` to nearest-even, as the GPU's conversion does.

    Triton 3.9's interpreter converts fp32 -> bf16 by truncation (``_convert_float`` with no rounding
    mode), which would make CI test a different rounding point than the GPU runs; under the
    interpreter the bf16 rounding is therefore done on the bits (round half to even; inf stays inf,
    finite values past the bf16 range round to inf as the hardware does). fp16 conversions go
    through NumPy's astype, which already rounds to nearest-even.
    """
    if INTERP:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True).to(dtype)
        else:
            return x.to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def round_ds(x, dtype: tl.constexpr, DS_BITS: tl.constexpr, INTERP: tl.constexpr):
    """fp32 dS as the 16-bit GEMM operand: rounded to ``dtype`` (DS_BITS = 0), or first to DS_BITS = 4
    (e4m3) / 3 (e5m2) significant bits, round half to even, no range limit, on the bits exactly as
    kernels/reference.round_significand does; such values are exact in bf16, so the cast adds nothing."""
    if DS_BITS == 0:
        return to16(x, dtype, INTERP)
    else:
        bits = x.to(tl.uint32, bitcast=True)
        if DS_BITS == 4:
            bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        else:
            tl.static_assert(DS_BITS == 3)
            bits = (bits + 0xFFFFF + ((bits >> 21) & 1)) & 0xFFE00000
        return bits.to(tl.float32, bitcast=True).to(dtype)


@triton.jit
def load_rows(A, rows, stride_an, offs_d, offs_da, N, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
              EVEN_D: tl.constexpr):
    """Load the tile of rows ``rows`` of a (seqlen, headdim) operand: masked past the valid row count
    ``N`` when MASKED (tile edge, key padding), and past HEAD_DIM when the head dim is padded (not
    EVEN_D). ``offs_da``: column offsets times the operand's head-dim stride."""
    ptrs = A + rows[:, None] * stride_an + offs_da[None, :]
    if MASKED:
        mask = rows[:, None] < N
        if not EVEN_D:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        return tl.load(ptrs, mask=mask, other=0.0)
    elif EVEN_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def load_pair(A, B, rows, stride_an, stride_bn, offs_d, offs_da, offs_db, N,
              HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """:func:`load_rows` of two operands read together (K and V, or Q and dO)."""
    a = load_rows(A, rows, stride_an, offs_d, offs_da, N, HEAD_DIM, MASKED, EVEN_D)
    b = load_rows(B, rows, stride_bn, offs_d, offs_db, N, HEAD_DIM, MASKED, EVEN_D)
    return a, b


@triton.jit
def seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, b):
    """Packed sequence ``b``: (start row in q, start key in k, its number of queries, its number of keys)."""
    q_start = tl.load(CU_SEQLENS_Q + b)
    k_start = tl.load(CU_SEQLENS_K + b)
    return q_start, k_start, tl.load(CU_SEQLENS_Q + b + 1) - q_start, tl.load(CU_SEQLENS_K + b + 1) - k_start


@triton.jit
def visible(offs_m, cols, N_K, CAUSAL_OFF, CAUSAL: tl.constexpr):
    """(rows, cols) mask of the keys each query row sees: cols < N_K and, if CAUSAL, the bottom-right
    aligned causal bound cols <= row + (Nk − Nq)."""
    valid = cols[None, :] < N_K
    if CAUSAL:
        valid = valid & (cols[None, :] <= offs_m[:, None] + CAUSAL_OFF)
    return valid


def window_args(causal: bool, window_size, softcap: float, nq: int, nk: int) -> dict:
    """Kernel arguments for flash-attn's ``window_size=(left, right)`` (−1 unbounded; ``causal`` sets
    right = 0) and ``softcap``: CAUSAL (the plain causal mask, no window), WINDOW with WL, WR >= 0 (an
    unbounded or wider side becomes nq + nk, wider than any sequence), SOFTCAP with cap. No window and no
    softcap give the constexpr variants WINDOW = SOFTCAP = False: the kernels' code without them."""
    left, right = normalize_window(causal, tuple(window_size))
    big = nq + nk
    window = not (left == -1 and right in (-1, 0))
    return dict(
        CAUSAL=(not window) and right == 0, WINDOW=window,
        # Clamped to nq + nk (the same mask): sizes near 2³¹ would overflow the kernels' int32 row + offset.
        WL=min(left, big) if left >= 0 else big, WR=min(right, big) if right >= 0 else big,
        SOFTCAP=softcap > 0, cap=float(softcap) if softcap > 0 else 1.0,
    )


@triton.jit
def rcp_ftz(x, INTERP: tl.constexpr):
    """1/x in fp32 as one special-function op, ``rcp.approx.ftz.f32`` (relative error ~2⁻²³); exact
    division under the interpreter. For x in normal range only (denormal x is flushed to 0 → inf; the interpreter
    returns +inf for 0 and denormal x without NumPy's divide-by-zero / overflow warnings)."""
    if INTERP:
        normal = tl.abs(x) >= 1.1754943508222875e-38
        return tl.where(normal, 1.0 / tl.where(normal, x, 1.0), float("inf"))
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


def exponent_factor(softmax_scale: float, softcap: float) -> float:
    """The kernels' ``c``, the factor of the softmax exponent exp2((logit − m)·c): τ·log2e, or log2e alone with a
    softcap (τ then sits inside the tanh of the logit z = cap·tanh(τ s / cap))."""
    return (1.0 if softcap > 0 else float(softmax_scale)) * LOG2E


def softcap_factor(softmax_scale: float, cap: float) -> float:
    """The kernels' softcap argument ``sc`` = −2·log2e·τ/cap: the exponent factor of e = 2^(sc·|s|) in
    :func:`softcap_f32` (s the raw score, τ = softmax_scale; cap is 1.0 without a softcap).

    Raises ValueError unless τ > 0, cap > 0 and sc is a finite fp32 number: with τ < 0 the compiled kernels'
    copysign would give the capped logits the wrong sign (the interpreter's would not), and an infinite sc
    makes z NaN at s = 0."""
    sc = -2.0 * LOG2E * float(softmax_scale) / float(cap) if cap > 0 else math.inf
    if not (softmax_scale > 0 and abs(sc) <= 3.4028234663852886e38):
        raise ValueError(f"softmax_scale must be > 0 and softmax_scale/softcap at most ~1e38 (softmax_scale="
                         f"{softmax_scale!r}, softcap={cap!r})")
    return sc


# The softcap's special-function ops as inline PTX (ex2 of sc·|s|, its |s| folded into the multiply by ptxas;
# the sign copy one LOP3), shared with the Gluon kernels (kernels/attention_fwd_hopper.softcap_and_grad) so that
# both families rebuild bit-identical capped logits.
SOFTCAP_EX2_ASM = tl.constexpr("{.reg .f32 a; abs.f32 a, $1; mul.f32 a, a, $2; ex2.approx.ftz.f32 $0, a;}")
COPYSIGN_ASM = tl.constexpr("copysign.f32 $0, $1, $2;")


@triton.jit
def softcap_f32(s, sc, cap, INTERP: tl.constexpr):
    """(z, g) in fp32 for the raw scores s: the capped logits z = cap·tanh(x), x = τ s / cap, and
    g = 1 − tanh² x, from one exp2 and one reciprocal (``sc`` = :func:`softcap_factor`):
    e = 2^(sc·|s|) = e^(−2|x|), r2 = 2/(1 + e) = 1/(½ + ½e), z = sign(s)·(cap·r2 − cap) (one FMA), g = e·r2².
    g has no cancellation where tanh → ±1 (1 − t² keeps no correct bit once |x| > ~8.7; kernels/reference.py
    computes 4e/(1+e)²); g is 0 or >= 2⁻¹²⁴ (e is flushed below 2⁻¹²⁶), never denormal. Absolute error of z
    ≲ 3·cap·2⁻²³, largest at |x| ≈ 0.5–8 (an emulation with ex2 off by 2⁻²² and rcp by 1 ulp,
    benchmarks/NOTES.md run 24). Six instructions per score for z (run 23)."""
    if INTERP:
        e = tl.math.exp2(tl.abs(s) * sc)
        r2 = 1.0 / tl.fma(e, 0.5, 0.5)
        z = tl.fma(r2, cap, -cap)
        z = tl.where(s < 0, -z, z)
    else:
        e = tl.inline_asm_elementwise(SOFTCAP_EX2_ASM, "=f,f,f", [s, sc], dtype=tl.float32, is_pure=True, pack=1)
        r2 = rcp_ftz(tl.fma(e, 0.5, 0.5), INTERP)
        z = tl.inline_asm_elementwise(COPYSIGN_ASM, "=f,f,f", [s, tl.fma(r2, cap, -cap)], dtype=tl.float32,
                                      is_pure=True, pack=1)
    return z, e * r2 * r2


@triton.jit
def in_window(offs_m, cols, CAUSAL_OFF, WL, WR):
    """(rows, cols) mask of the sliding window: row + off − WL <= col <= row + off + WR."""
    diag = offs_m[:, None] + CAUSAL_OFF
    return (cols[None, :] >= diag - WL) & (cols[None, :] <= diag + WR)


@triton.jit
def window_key_blocks(start_m, K_LEN, CAUSAL_OFF, WL, WR, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key ranges of the query block at ``start_m`` under a window: [lo, a) and [b, hi) cross a window
    edge or the key tail (masked), [a, b) is visible to every row of the block (unmasked); key blocks
    outside [lo, hi) are never visited (the work a window saves)."""
    lo = (tl.maximum(start_m + CAUSAL_OFF - WL, 0) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(tl.minimum(K_LEN, start_m + BLOCK_M + CAUSAL_OFF + WR), lo)
    full_lo = ((tl.maximum(start_m + BLOCK_M - 1 + CAUSAL_OFF - WL, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_hi = (tl.minimum(start_m + CAUSAL_OFF + WR + 1, K_LEN) // BLOCK_N) * BLOCK_N
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    b = tl.maximum(a, tl.minimum(full_hi, hi))
    return lo, a, b, hi


@triton.jit
def window_query_blocks(start_n, N_Q, CAUSAL_OFF, WL, WR, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query ranges of the key block at ``start_n`` under a window: [lo, a) and [b, hi) masked, [a, b)
    sees the whole key block (unmasked; the key tail is the caller's business); query blocks outside
    [lo, hi) see none of its keys and are never visited."""
    lo = (tl.maximum(start_n - CAUSAL_OFF - WR, 0) // BLOCK_M) * BLOCK_M
    hi = tl.maximum(tl.minimum(N_Q, start_n + BLOCK_N - CAUSAL_OFF + WL), lo)
    full_lo = ((tl.maximum(start_n + BLOCK_N - 1 - CAUSAL_OFF - WR, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    full_hi = (tl.minimum(start_n - CAUSAL_OFF + WL + 1, N_Q) // BLOCK_M) * BLOCK_M
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    b = tl.maximum(a, tl.minimum(full_hi, hi))
    return lo, a, b, hi


def tune_lengths(nq: int, nk: int, varlen: tuple | None) -> tuple[int, int]:
    """The sequence lengths the kernels' autotuning is keyed on (kernel arguments TUNE_NQ, TUNE_NK): the
    query and key lengths — for packed sequences (``varlen`` = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k)) the longest sequence's, not the packed totals — rounded up to a power of two. Keyed on
    the exact lengths, every new length (each batch of packed sequences has its own total) would re-run
    the autotuner's timing of every candidate config."""
    if varlen is not None:
        nq, nk = varlen[2], varlen[3]
    return 1 << max(int(nq) - 1, 0).bit_length(), 1 << max(int(nk) - 1, 0).bit_length()


def _i32(x: int) -> int:
    """A uint32 value as the int32 with the same bits (kernel scalars are then always typed i32)."""
    return x - (1 << 32) if x >= (1 << 31) else x


def dropout_args(dropout_p: float, seed: int, offset: int) -> dict:
    """Kernel arguments of attention dropout: DROPOUT (constexpr; False is the kernels' code without
    dropout), the 64-bit Philox key as two 32-bit halves, the counter offset, the 8-bit keep threshold
    (kernels/reference.dropout_threshold) and the scale 1/(1 − p̂) of the kept weights
    (kernels/reference.dropout_scale). The integers go in as int32 bit patterns (the kernels
    reinterpret them as uint32), so every seed gives the same argument types."""
    if not dropout_p:
        return dict(DROPOUT=False, seed_lo=0, seed_hi=0, drop_off=0, drop_thr=0, drop_scale=1.0)
    seed = int(seed) & ((1 << 64) - 1)
    return dict(DROPOUT=True, seed_lo=_i32(seed & 0xFFFFFFFF), seed_hi=_i32(seed >> 32),
                drop_off=_i32(int(offset) & 0xFFFFFFFF), drop_thr=dropout_threshold(dropout_p),
                drop_scale=dropout_scale(dropout_p))


#: kernels/reference.PHILOX_ROUNDS as a constexpr global, the form a jitted function can read.
_PHILOX_ROUNDS = tl.constexpr(PHILOX_ROUNDS)


@triton.jit
def dropout_groups(n_k):
    """Groups of 16 keys per query row, ⌈n_k / 16⌉ (G of kernels/reference.dropout_keep_mask)."""
    return (n_k + 15) // 16


@triton.jit
def _keep_pair(xa, xb, b: tl.constexpr, thr):
    """Byte b of the words xa and xb against the 8-bit threshold, joined (xa's first)."""
    return tl.join(((xa >> (8 * b)) & 255) >= thr, ((xb >> (8 * b)) & 255) >= thr)


@triton.jit
def dropout_keep(row_base, start_n, bh, seed_lo, seed_hi, drop_off, drop_thr, BLOCK_N: tl.constexpr):
    """Keep mask of attention dropout, [rows, BLOCK_N] bool, for query rows with group counters
    ``row_base`` = i·G (int64, G = ⌈n_k / 16⌉) and the key columns start_n + [0, BLOCK_N): the scheme of
    kernels/reference.dropout_keep_mask. One Philox4x32 call (kernels/reference.PHILOX_ROUNDS rounds;
    counters (i·G + g mod 2³², bh, offset, i·G + g div 2³²), key seed_hi·2³² + seed_lo) per group
    g = j // 16 of 16 keys; key c = j mod 16 of the group is kept iff byte c mod 4 (0: the lowest) of
    output word c // 4 is >= the 8-bit threshold ``drop_thr``. ``start_n`` must be a multiple of 16
    (every caller's is a multiple of BLOCK_N), so a tile holds whole groups."""
    tl.static_assert(BLOCK_N % 16 == 0)
    grp = row_base[:, None] + (start_n // 16 + tl.arange(0, BLOCK_N // 16)).to(tl.int64)[None, :]
    c0 = grp.to(tl.uint32)
    c3 = (grp >> 32).to(tl.uint32)
    zero = c0 * 0
    seed = (seed_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | seed_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    x0, x1, x2, x3 = tl.philox(seed, c0, zero + bh.to(tl.uint32), zero + drop_off.to(tl.uint32, bitcast=True), c3,
                               n_rounds=_PHILOX_ROUNDS)
    thr = drop_thr.to(tl.uint32)
    # Each tl.join appends an axis of 2, so the last join is the fastest-varying place: joined innermost over word
    # bit 1, then word bit 0, then byte bit 1, then byte bit 0, place 8·(m >> 1) + 4·(m & 1) + 2·(b >> 1) + (b & 1)
    # = 4m + b of a group holds byte b of word m — key c = 4m + b, as the reference spends them.
    keep = tl.join(tl.join(tl.join(_keep_pair(x0, x2, 0, thr), _keep_pair(x1, x3, 0, thr)),
                           tl.join(_keep_pair(x0, x2, 2, thr), _keep_pair(x1, x3, 2, thr))),
                   tl.join(tl.join(_keep_pair(x0, x2, 1, thr), _keep_pair(x1, x3, 1, thr)),
                           tl.join(_keep_pair(x0, x2, 3, thr), _keep_pair(x1, x3, 3, thr))))
    return tl.reshape(keep, [row_base.shape[0], BLOCK_N])
