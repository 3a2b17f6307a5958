"""``gproj_attn_func``: attention whose backward keeps the softmax zero-sum law (DESIGN.md §4), and
``gproj_attn_varlen_func``, the same over packed sequences (flash-attn's varlen layout).

Both run one pair of ``torch.library`` custom ops, ``lightning_gproj::attn_fwd`` and
``lightning_gproj::attn_bwd``, joined by ``register_autograd``, so ``torch.compile(fullgraph=True)`` sees
attention as one opaque op instead of breaking the graph. Packed sequences are the same ops with their
optional ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k`` given (dense calls leave
them None and may give ``seqlens_k``). Each op dispatches at run time: the Triton kernels
(:mod:`lightning_gproj.kernels.attention_fwd`, :mod:`~lightning_gproj.kernels.attention_bwd`) for 16-bit
CUDA inputs they serve, else the PyTorch reference (:mod:`lightning_gproj.kernels.reference`), which
follows the same rounding model.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import warnings
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_gproj.kernels import reference
from lightning_gproj.stats import RECORDER

__all__ = ["gproj_attn_func", "gproj_attn_varlen_func", "FIXES", "DS_FORMATS", "LAYOUTS", "MAX_HEAD_DIM"]

#: Accepted values of ``fix``.
FIXES = reference.FIXES
#: Accepted values of ``ds_format`` (how dS is rounded before the dQ/dK GEMMs).
DS_FORMATS = tuple(reference.DS_FORMATS)
#: Largest head dim accepted (as flash-attn); head dims must also be multiples of 8.
MAX_HEAD_DIM = 256
#: Accepted values of ``layout``: flash-attn's (batch, seqlen, nheads, headdim), SDPA's (batch, nheads, seqlen, headdim).
LAYOUTS = ("bshd", "bhsd")
#: With ``layout=None``, more query heads than this along dim 2, and fewer positions along dim 1, read as
#: SDPA-layout input (a warning): no released model has that many heads, many sequences are longer.
_MAX_PLAUSIBLE_HEADS = 256

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
#: Input dtypes autocast casts to its dtype (as for F.scaled_dot_product_attention).
_AUTOCAST_ELIGIBLE = (torch.bfloat16, torch.float16, torch.float32)
#: τ·log2(e) must stay finite in fp32, where the kernels scale the exponent.
_MAX_SOFTMAX_SCALE = float(torch.finfo(torch.float32).max) / math.log2(math.e)
#: Its text for error messages, formatted here: under torch.compile(dynamic=True) Dynamo reads a float
#: module constant as a SymFloat, and a format spec on one stops the trace before the ValueError is built.
_MAX_SOFTMAX_SCALE_TEXT = f"{_MAX_SOFTMAX_SCALE:.3g}"

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _triton_reason(q: Tensor, k: Tensor, v: Tensor, batch: Optional[int] = None) -> Optional[str]:
    """None if the Triton kernels serve these inputs, else why not.

    Triton is imported only for CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (how CI runs
    the kernels), so a CPU-only install never needs it.
    """
    interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpret):
        return f"{q.device.type} tensors"
    try:
        from lightning_gproj.kernels._triton_utils import supports
    except Exception as exc:  # Triton missing or broken: the reference serves everything
        return f"Triton unavailable ({exc.__class__.__name__}: {exc})"
    return supports(q, k, v, batch)


def _use_triton(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor] = None) -> bool:
    """Whether the Triton kernels serve (q, k, v in the op layout, or packed 3-D with ``cu_seqlens_q``);
    warns once per reason when a CUDA input is not served."""
    batch = None if cu_seqlens_q is None else cu_seqlens_q.numel() - 1
    reason = _triton_reason(*(x if x.dim() == 4 else x[None] for x in (q, k, v)), batch)
    if reason is None:
        return True
    if q.device.type == "cuda":
        _warn_once(
            f"gproj_attn_func: the Triton kernels do not serve this input ({reason}); using the PyTorch "
            "reference, which has the same numerics but is slower and uses O(block × seqlen) memory."
        )
    return False


def _check_seqlens_values(seqlens_k: Tensor, nk: int) -> None:
    """Raise ValueError unless 1 <= seqlens_k[b] <= nk for every b (reads the values: a device sync).

    Runs inside the forward op, so it also holds under ``torch.compile`` (the op is opaque there)."""
    lo, hi = int(seqlens_k.min()), int(seqlens_k.max())
    if lo < 1 or hi > nk:
        raise ValueError(
            f"seqlens_k values must lie in [1, seqlen_k={nk}] (right padding: key j of batch row b is masked "
            f"iff j >= seqlens_k[b]), got min {lo}, max {hi}"
        )


def _check_varlen_values(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, total_q: int, total_k: int,
                         max_seqlen_q: int, max_seqlen_k: int) -> None:
    """Raise ValueError unless each cu_seqlens starts at 0, never decreases, ends at the total and has
    no sequence longer than its max_seqlen (reads the values: one device sync). Runs inside the
    forward op, so it also holds under ``torch.compile``."""
    for name, cu, total, max_name, longest in (("cu_seqlens_q", cu_seqlens_q, total_q, "max_seqlen_q", max_seqlen_q),
                                               ("cu_seqlens_k", cu_seqlens_k, total_k, "max_seqlen_k", max_seqlen_k)):
        values = cu.tolist()
        lens = [b - a for a, b in zip(values, values[1:])]
        if values[0] != 0:
            raise ValueError(f"{name} must start at 0, got {values[0]}")
        if min(lens) < 0:
            b = next(i for i, n in enumerate(lens) if n < 0)
            raise ValueError(f"{name} must not decrease (sequence lengths are its differences), got "
                             f"{name}[{b}] = {values[b]} > {name}[{b + 1}] = {values[b + 1]}")
        if values[-1] != total:
            raise ValueError(f"{name} must end at the number of packed tokens {total} (the first dim of "
                             f"{'q' if name == 'cu_seqlens_q' else 'k and v'}), got {values[-1]}")
        if max(lens) > longest:
            raise ValueError(f"{max_name} ({longest}) is smaller than the longest sequence of {name} ({max(lens)})")


@torch.library.custom_op("lightning_gproj::attn_fwd", mutates_args=())
def _attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float,
    causal: bool,
    fix: str,
    stats_name: str,
    seqlens_k: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    compute_dtype: Optional[torch.dtype] = None,
    ds_format: str = "bf16",
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    rng: Optional[Tensor] = None,
    deterministic: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o, m, log2l, q16, k16, v16) of :func:`gproj_attn_func` (q (batch, seqlen_q, nheads, headdim), k, v (batch,
    seqlen_k, nheads_k, headdim); m, log2l (batch, nheads, seqlen_q)) or, with ``cu_seqlens_q``,
    ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k`` (all four), of :func:`gproj_attn_varlen_func`
    (q (total_q, nheads, headdim), k, v (total_k, nheads_k, headdim); m, log2l (nheads, total_q)).
    q16, k16, v16: the inputs ``compute_dtype`` cast (the backward reads these, not the uncast inputs),
    empty where an input was not cast (an op's output cannot be its input)."""
    # ``fix``, ``ds_format`` and ``deterministic`` do not change the forward; they are inputs so that the backward can
    # read them.
    inputs = (q, k, v)
    q, k, v = _cast(compute_dtype, q, k, v)
    if cu_seqlens_q is not None:
        _check_varlen_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    elif seqlens_k is not None:
        _check_seqlens_values(seqlens_k, k.shape[1])
    if RECORDER.enabled:
        record_forward_stats(stats_name, q, k, seqlens_k, cu_seqlens_q, cu_seqlens_k)
    options = _kernel_options(seqlens_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left,
                              window_right, softcap, dropout_p, rng)
    o, m, log2l = _kernel_forward(q, k, v, softmax_scale, causal, **options)
    _record_max_logit(stats_name, m, log2l, softmax_scale, softcap)
    casts = tuple(c if _is_cast(compute_dtype, x) else x.new_empty(0) for c, x in zip((q, k, v), inputs))
    return (o.contiguous(), m, log2l) + casts


def _kernel_options(seqlens_k: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                    max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], window_left: int, window_right: int,
                    softcap: float, dropout_p: float, rng: Optional[Tensor]) -> dict:
    """The kernels' key padding, packed-sequence, window, softcap and dropout arguments from the op's."""
    return dict(seqlens_k=seqlens_k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, window_size=(window_left, window_right), softcap=softcap,
                **_dropout_options(dropout_p, rng))


def _dropout_options(dropout_p: float, rng: Optional[Tensor]) -> dict:
    """The kernels' dropout arguments from the op's ``rng`` = (seed, offset) int64 tensor (read on the
    host: the op draws it on the CPU, so no device sync); {} without dropout."""
    if not dropout_p:
        return {}
    seed, offset = (int(x) for x in rng.tolist())
    return dict(dropout_p=dropout_p, dropout_seed=seed, dropout_offset=offset)


def _draw_rng(dropout_p: float) -> Optional[Tensor]:
    """A fresh Philox (seed, offset) for one call with dropout, as a CPU int64 tensor (2,): the seed is
    ``torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64)`` from torch's default CPU generator
    (so ``torch.manual_seed`` makes calls reproducible, and activation checkpointing, which restores
    that generator's state, recomputes the same mask), the offset 0. None without dropout (the
    generator is not advanced). There is deliberately no ``generator=`` argument: checkpointing does not
    restore a user's generator, and the recomputed forward would draw another mask."""
    if not dropout_p:
        return None
    seed = torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64)
    return torch.cat([seed, torch.zeros(1, dtype=torch.int64)])


def _kernel_forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, **options) -> tuple:
    """The Triton forward where it serves (:func:`_triton_reason`), else kernels/reference.py; q, k, v in
    the op layout, or packed (3-D, with ``cu_seqlens_*`` in ``options``)."""
    if _use_triton(q, k, v, options.get("cu_seqlens_q")):
        from lightning_gproj.kernels import attention_fwd

        return attention_fwd.forward(q, k, v, softmax_scale, causal, **options)
    return reference.forward(q, k, v, softmax_scale, causal, **options)


def _kernel_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, *args, deterministic: bool = False,
                     **options) -> tuple:
    """The Triton backward where it serves, else kernels/reference.py (arguments as theirs; ``deterministic`` is
    the Triton backward's: the reference is deterministic anyway)."""
    if _use_triton(q, k, v, options.get("cu_seqlens_q")):
        from lightning_gproj.kernels import attention_bwd

        return attention_bwd.backward(do, q, k, v, *args, deterministic=deterministic, **options)
    return reference.backward(do, q, k, v, *args, **options)


def _record_max_logit(stats_name: str, m: Tensor, log2l: Tensor, softmax_scale: float, softcap: float) -> None:
    """With the recorder on: max_ij s_ij·τ from the kernel's row max m (unscaled scores; with softcap m is
    already the capped logit; rows seeing no key have log2l = +inf and are left out), one reduction."""
    if RECORDER.enabled:
        scale = 1.0 if softcap > 0 else softmax_scale
        RECORDER.record(stats_name, max_logit=torch.where(torch.isinf(log2l), -math.inf, m).amax() * scale)


def record_forward_stats(
    name: str,
    q: Tensor,
    k: Tensor,
    seqlens_k: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
) -> None:
    """Record the mean-key and mean-query norms (DESIGN.md §8) of one call under ``name``: ‖mean_j k_j‖
    per (batch, kv head), over each batch row's valid keys, averaged; the same for q. q, k in the op
    layout (batch, seqlen, nheads, headdim); packed sequences (``cu_seqlens_q``, ``cu_seqlens_k``):
    q (total_q, nheads, headdim), k (total_k, nheads_k, headdim), means per non-empty sequence."""
    if cu_seqlens_q is not None:
        RECORDER.record(
            name,
            mean_key_norm=_sequence_means(k, cu_seqlens_k).norm(dim=-1).mean(),
            mean_query_norm=_sequence_means(q, cu_seqlens_q).norm(dim=-1).mean(),
        )
        return
    if seqlens_k is None:
        mean_key = k.float().mean(dim=1)
    else:  # over each batch row's valid keys; a where, not a product, so padded NaN/inf stay out
        valid = torch.arange(k.shape[1], device=k.device)[None, :] < seqlens_k[:, None].long()
        mean_key = torch.where(valid[:, :, None, None], k.float(), 0.0).sum(dim=1) / seqlens_k.float()[:, None, None]
    RECORDER.record(
        name,
        mean_key_norm=mean_key.norm(dim=-1).mean(),
        mean_query_norm=q.float().mean(dim=1).norm(dim=-1).mean(),
    )


def _sequence_means(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """(sequences, nheads, headdim) fp32 means of the packed x (total, nheads, headdim) over each
    non-empty sequence's tokens."""
    lens = cu_seqlens.diff().long()
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=x.device), lens, output_size=x.shape[0])
    sums = torch.zeros((lens.numel(),) + x.shape[1:], dtype=torch.float32, device=x.device).index_add_(0, seq, x.float())
    return (sums / lens.clamp(min=1)[:, None, None])[lens > 0]


@_attn_fwd.register_fake
def _(q, k, v, softmax_scale, causal, fix, stats_name, seqlens_k=None, cu_seqlens_q=None, cu_seqlens_k=None,
      max_seqlen_q=None, max_seqlen_k=None, compute_dtype=None, ds_format="bf16", window_left=-1, window_right=-1,
      softcap=0.0, dropout_p=0.0, rng=None, deterministic=False):
    dtype = compute_dtype or q.dtype
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    # Row statistics: packed (nheads, total_q), as flash-attn's varlen softmax_lse; else (batch, nheads, seqlen_q).
    rows = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    row = q.new_empty(rows, dtype=stat_dtype)
    casts = tuple(x.new_empty(x.shape, dtype=compute_dtype) if _is_cast(compute_dtype, x) else x.new_empty(0)
                  for x in (q, k, v))
    return (q.new_empty(q.shape[:-1] + (v.shape[-1],), dtype=dtype), row, torch.empty_like(row)) + casts


def _is_cast(compute_dtype: Optional[torch.dtype], x: Tensor) -> bool:
    """Whether the op computes with a cast copy of ``x`` (autocast set ``compute_dtype`` and ``x`` is in another)."""
    return compute_dtype is not None and x.dtype != compute_dtype


def _cast(compute_dtype: Optional[torch.dtype], *tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors in ``compute_dtype`` (as they are where :func:`_is_cast` says no). A cast copy is
    contiguous, whatever its input's strides: the forward op returns it for the backward, and its fake
    impl (which Inductor asserts the strides of) says so."""
    return tuple(t.to(compute_dtype, memory_format=torch.contiguous_format) if _is_cast(compute_dtype, t) else t
                 for t in tensors)


@torch.library.custom_op("lightning_gproj::attn_bwd", mutates_args=())
def _attn_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    m: Tensor,
    log2l: Tensor,
    softmax_scale: float,
    causal: bool,
    fix: str,
    stats_name: str,
    seqlens_k: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    fp32_grads: Optional[Sequence[bool]] = None,
    ds_format: str = "bf16",
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    rng: Optional[Tensor] = None,
    deterministic: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    # q, k, v as the forward computed with (cast under autocast). fp32_grads (dq, dk, dv): return that
    # gradient as the fp32 accumulator — for an input the forward cast, so that a gradient headed for
    # an fp32 input is not rounded to 16 bits on the way (that rounding alone breaks Σ_j dK_j = 0 by
    # ~√N·2⁻⁹); _backward casts to each input's dtype.
    grad_dtype = None if fp32_grads is None else tuple(torch.float32 if f else None for f in fp32_grads)
    want_stats = RECORDER.enabled
    dq, dk, dv, extras = _kernel_backward(
        do, q, k, v, o, m, log2l, softmax_scale, causal, fix, want_stats, grad_dtype=grad_dtype, ds_format=ds_format,
        deterministic=deterministic, **_kernel_options(seqlens_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right,
                          softcap, dropout_p, rng),
    )
    if want_stats:
        n_keys = _keys_seen(q, k, causal, (window_left, window_right), seqlens_k, cu_seqlens_q, cu_seqlens_k)
        _record_backward_stats(stats_name, fix, dq if cu_seqlens_q is None else dq[None], extras, n_keys)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_attn_bwd.register_fake
def _(do, q, k, v, o, m, log2l, softmax_scale, causal, fix, stats_name, seqlens_k=None, cu_seqlens_q=None,
      cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, fp32_grads=None, ds_format="bf16", window_left=-1,
      window_right=-1, softcap=0.0, dropout_p=0.0, rng=None, deterministic=False):
    flags = fp32_grads or (False,) * 3
    return tuple(torch.empty(x.shape, dtype=torch.float32 if f else x.dtype, device=x.device) for x, f in zip((q, k, v), flags))


def _record_backward_stats(name: str, fix: str, dq: Tensor, extras: dict[str, Tensor], n_keys: Tensor) -> None:
    """Zero-sum violation ρ_i = |r_i| / Σ_j |dS̃_ij| and leak ratio λ (DESIGN.md §8). dq (batch, seqlen_q,
    nheads, headdim) (packed: (1, total_q, nheads, headdim)); ``n_keys``: the number of keys each query row
    sees (:func:`_keys_seen`)."""
    r, abs_ds, leak = extras["r"], extras["abs_dS"], extras["leak"]
    # ρ_i is undefined where the row sees a single key (dS ≡ 0 in exact arithmetic, so any computed
    # value gives ρ_i = 1) and ill-conditioned where the row's exact dS is (near) zero for another
    # reason — one-hot attention, common in a trained causal LM — where Σ_j |dS̃_ij| is rounding noise
    # and ρ_i → 1 again. Rows whose Σ_j |dS̃_ij| is under 10⁻⁴ of the largest row's are left out, so the
    # statistics describe real rows; the cut is relative to the largest row, not the median, because
    # most rows of a trained causal LM can be one-hot.
    defined = (abs_ds > 0) & (n_keys > 1)
    if defined.any():
        defined &= abs_ds >= 1e-4 * abs_ds[defined].amax()
    rho = torch.where(defined, r.abs() / abs_ds.clamp(min=torch.finfo(abs_ds.dtype).tiny), float("nan"))
    values = {"violation_median": rho.nanmedian(), "violation_max": rho.nan_to_num(0.0).amax()}
    if fix != "gproj_uniform":
        # λ = ‖dQ̃ − dQ_gproj‖ / ‖dQ_gproj‖; dQ_gproj = dQ̃ − leak, and the op returned dQ̃ or dQ_gproj.
        # A row seeing one key has dQ ≡ 0 (its leak, e.g. from the rounding of o under dropout, is still
        # an error of dQ̃ and counts); where every row sees one key, ‖dQ_gproj‖ is rounding noise or 0 and
        # λ meaningless (it came out ~10²–10³³, a false alert): NaN then, which the detectors skip.
        # Logged as leak_ratio only where the leak stays in the returned gradient (fix="none"); where
        # GProj removed it, as leak_removed_ratio, so that an alert on leak_ratio is about the gradients.
        dq_gproj = dq.transpose(1, 2).float() - (leak if fix == "none" else 0.0)
        ratio = leak.norm() / dq_gproj.norm().clamp(min=torch.finfo(torch.float32).tiny)
        stat = "leak_ratio" if fix == "none" else "leak_removed_ratio"
        values[stat] = torch.where((n_keys > 1).any(), ratio, float("nan"))
    RECORDER.record(name, **values)


def _keys_seen(q: Tensor, k: Tensor, causal: bool, window_size: tuple[int, int], seqlens_k: Optional[Tensor],
               cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor]) -> Tensor:
    """The number of keys each query row sees (causal and window bottom-right aligned): (seqlen_q,), with
    ``seqlens_k`` (batch, 1, seqlen_q); packed, (total_q,), within the row's own sequence."""
    left, right = reference.normalize_window(causal, window_size)
    if cu_seqlens_q is not None:
        total_q = q.shape[0]
        lens_q, lens_k = cu_seqlens_q.diff().long(), cu_seqlens_k.diff().long()
        seq = torch.repeat_interleave(torch.arange(lens_q.numel(), device=lens_q.device), lens_q, output_size=total_q)
        local = torch.arange(total_q, device=lens_q.device) - cu_seqlens_q.long()[seq]
        return _visible_keys(local, lens_q[seq], lens_k[seq], left, right)
    nq, nk = q.shape[1], k.shape[1]
    i = torch.arange(nq, device=q.device)
    if seqlens_k is None:
        return _visible_keys(i, nq, nk, left, right)
    # Padding cuts each row's window from above (not its count: a window past the padding sees fewer keys).
    return _visible_keys(i[None, None, :], nq, nk, left, right,
                         n_valid=seqlens_k.to(device=q.device, dtype=torch.long)[:, None, None])


def _visible_keys(i: Tensor, nq, nk, left: int, right: int, n_valid: Optional[Tensor] = None) -> Tensor:
    """The number of keys query row i (of a sequence with nq queries, nk keys; ints or per-row tensors)
    sees under the bottom-right aligned window (left, right) (causal folded in, −1 unbounded), among
    its keys j < ``n_valid`` (right key padding, broadcast against i; default all nk)."""
    diag = i + (nk - nq)
    last = torch.as_tensor((nk if n_valid is None else n_valid) - 1, device=i.device)
    diag, last = torch.broadcast_tensors(diag, last)
    hi = torch.minimum(diag + right, last) if right >= 0 else last
    lo = (diag - left).clamp(min=0) if left >= 0 else torch.zeros_like(diag)
    return (hi - lo + 1).clamp(min=0)


def _setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, causal, fix, stats_name, seqlens_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
     max_seqlen_k, compute_dtype, ds_format, wl, wr, softcap, dropout_p, rng, deterministic) = inputs
    o, m, log2l, *casts = output
    # The backward reads the inputs as the forward computed with: the cast copies where it cast (not
    # the wider originals), and records which gradients then come back as fp32 accumulators.
    cast = [_is_cast(compute_dtype, x) for x in (q, k, v)]
    ctx.mark_non_differentiable(*casts)
    # No zero-filled gradients for the outputs only the backward reads (m, log2l, the copies): they are
    # unused, and filling the copies' would cost a pass over two of them.
    ctx.set_materialize_grads(False)
    ctx.grad_dtypes, ctx.fp32_grads = (q.dtype, k.dtype, v.dtype), cast
    q, k, v = (c if f else x for c, x, f in zip(casts, (q, k, v), cast))
    # rng (the Philox seed and offset) rides to the backward, which regenerates the forward's mask from it.
    ctx.save_for_backward(q, k, v, o, m, log2l, seqlens_k, cu_seqlens_q, cu_seqlens_k, rng)
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.softmax_scale, ctx.causal, ctx.fix, ctx.stats_name = softmax_scale, causal, fix, stats_name
    ctx.ds_format, ctx.deterministic = ds_format, deterministic
    ctx.window_left, ctx.window_right, ctx.softcap, ctx.dropout_p = wl, wr, softcap, dropout_p


def _backward(ctx, do, _dm, _dlog2l, _dq16, _dk16, _dv16):
    # m, log2l and the cast copies are for the backward; nothing differentiates through them.
    if do is None:  # a gradient for them alone (gradcheck asks): o's gradient is zero, and so are ours
        return (None,) * 20
    q, k, v, o, m, log2l, seqlens_k, cu_seqlens_q, cu_seqlens_k, rng = ctx.saved_tensors
    dq, dk, dv = _attn_bwd(
        do.contiguous(), q, k, v, o, m, log2l, ctx.softmax_scale, ctx.causal, ctx.fix, ctx.stats_name, seqlens_k,
        cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.fp32_grads, ctx.ds_format,
        ctx.window_left, ctx.window_right, ctx.softcap, ctx.dropout_p, rng, ctx.deterministic,
    )
    # Each gradient in its input's dtype (fp32 for an fp32 input, unrounded; see _attn_bwd); none for
    # the 17 other inputs.
    return tuple(g.to(dt) for g, dt in zip((dq, dk, dv), ctx.grad_dtypes)) + (None,) * 17


_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "gproj_attn_func has no second derivative: a gradient of its gradients (double backward, e.g. a "
        "gradient penalty taken with create_graph=True) is not supported; compute that term with "
        "F.scaled_dot_product_attention"
    )


# The first backward with create_graph=True works; only differentiating its result again is refused.
_attn_bwd.register_autograd(_no_double_backward)


def _check_tensors(q: object, k: object, v: object) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name} must be a bf16, fp16, fp32 or fp64 tensor, got {x.dtype}")


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, compute_dtype: Optional[torch.dtype], layout: Optional[str] = None,
                  packed: bool = False) -> None:
    """Shapes, dtypes and devices of q, k, v in the op layout (batch, seqlen, nheads, headdim), or with
    ``packed`` of q (total_q, nheads, headdim), k, v (total_k, nheads_k, headdim). The shape errors of
    the op layout say how the inputs were read (``layout``) and shapes are shown as read."""
    rank, dims = (3, "(total, nheads, headdim) packed tokens") if packed else (4, "(batch, seqlen, nheads, headdim)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {dims}, got shape {tuple(x.shape)}")
    if packed:
        reading = ""
    elif layout == "bhsd":
        reading = "shapes shown as (batch, seqlen, nheads, headdim), read from layout='bhsd' inputs"
    else:
        reading = ("inputs read as (batch, seqlen, nheads, headdim); for (batch, nheads, seqlen, headdim) "
                   "tensors pass layout='bhsd'")
    if compute_dtype is None and not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    nheads, d = q.shape[-2:]
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
                         + (f" ({reading})" if reading else ""))
    if not packed and k.shape[0] != q.shape[0]:
        raise ValueError(f"k and v must have q's batch size {q.shape[0]}, got {k.shape[0]}")
    if k.shape[-1] != d:
        raise ValueError(f"k and v must have q's head dim {d}, got {k.shape[-1]}")
    nheads_k = k.shape[-2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of k/v's nheads ({nheads_k}) (GQA/MQA"
                         + (f"; {reading})" if reading else ")"))
    if d % 8 != 0 or not 8 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"headdim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {d}")
    if q.numel() == 0 or k.numel() == 0:  # the checks above leave only batch, seqlen or q's nheads to be 0
        raise ValueError(f"q, k, v must be non-empty, got q {tuple(q.shape)}, k {tuple(k.shape)}")


def _warn_if_sdpa_layout(q: Tensor) -> None:
    """Warn once when q, read as (batch, seqlen, nheads, headdim), has implausibly many heads and
    fewer positions: the signature of an SDPA-layout tensor (see :func:`gproj_attn_func`, ``layout``)."""
    seqlen, nheads = q.shape[1], q.shape[2]
    if nheads > _MAX_PLAUSIBLE_HEADS and seqlen < nheads:
        _warn_once(
            f"gproj_attn_func: q of shape {tuple(q.shape)} read as (batch, seqlen, nheads, headdim) has {nheads} "
            f"heads and {seqlen} positions; if it is (batch, nheads, seqlen, headdim) (SDPA's layout) pass "
            f"layout='bhsd' or q.transpose(1, 2), else pass layout='bshd' to state it."
        )


def _check_seqlens_k(seqlens_k: object, q: Tensor, k: Tensor) -> Tensor:
    """Validate the metadata of ``seqlens_k`` (type, dtype, shape, device); return it as contiguous int32.

    The values (1 <= seqlens_k[b] <= seqlen_k) are checked by the forward op itself."""
    if not isinstance(seqlens_k, Tensor):
        raise TypeError(
            f"seqlens_k must be None or an int32/int64 torch.Tensor of shape (batch,), got {type(seqlens_k).__name__}"
        )
    if seqlens_k.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"seqlens_k must be an int32 or int64 tensor of shape (batch,), got dtype {seqlens_k.dtype}")
    if seqlens_k.dim() != 1 or seqlens_k.shape[0] != q.shape[0]:
        raise ValueError(
            f"seqlens_k must have shape (batch,) = ({q.shape[0]},), got {tuple(seqlens_k.shape)}"
        )
    if seqlens_k.device != q.device:
        raise ValueError(f"seqlens_k must be on q's device {q.device}, got {seqlens_k.device}")
    return seqlens_k.to(torch.int32).contiguous()


def _check_window(window_size: object) -> tuple[int, int]:
    """``window_size`` as (left, right) ints >= −1 (Python or NumPy integers), or ValueError naming it."""
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
        isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= -1 for x in window_size
    )
    if not ok:
        raise ValueError(
            f"window_size must be a pair (left, right) of ints >= -1 (-1: unbounded on that side), got {window_size!r}"
        )
    return int(window_size[0]), int(window_size[1])


def _real(x: object) -> object:
    """A real number (Python or NumPy, or a one-element float tensor with data, e.g. a buffer holding τ or
    a cap) as a float; a bool, None or anything else (a meta tensor has no value to read) as is, for the
    caller's check to refuse by name. Under torch.compile(dynamic=True) a float argument stays a SymFloat,
    which is why the checks below use comparisons: ``math.isfinite`` of one stops Dynamo's fullgraph trace.
    A tensor that requires grad stays a tensor (refused by name: the op takes these options as constants, so a
    learnable τ or cap would silently get no gradient)."""
    if (isinstance(x, Tensor) and x.numel() == 1 and x.dtype.is_floating_point and not x.is_meta
            and not x.requires_grad):
        x = x.item()
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return float(x)
    return x


def _shown(x: object) -> str:
    """``x`` for an error message: a tensor by its rank, dtype and device, else its repr. Under
    torch.compile a tensor's repr needs its values and its shape may be symbolic; Dynamo's own error
    ("repr() on tensor") would then replace ours."""
    if isinstance(x, Tensor):
        grad = (" that requires grad (the op takes it as a constant and gives it no gradient; pass a float or "
                "x.detach())") if x.requires_grad else ""
        return f"a {x.dim()}-D {x.dtype} tensor on {x.device}{grad}"
    return f"{x!r}"  # not repr(x): Dynamo formats a SymFloat in an f-string, not through repr()


def _check_softmax_scale(softmax_scale: object, head_dim: int) -> float:
    """``softmax_scale`` as a float (None: ``1 / sqrt(head_dim)``), or ValueError naming it."""
    softmax_scale = _real(softmax_scale)
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(softmax_scale, float) or not 0.0 < softmax_scale <= _MAX_SOFTMAX_SCALE:  # NaN too
        raise ValueError(
            f"softmax_scale must be a positive float ≤ {_MAX_SOFTMAX_SCALE_TEXT} (τ·log2e finite in fp32) or None, "
            f"got {_shown(softmax_scale)}"
        )
    return softmax_scale


def _check_softcap(softcap: object) -> float:
    """``softcap`` as a float >= 0 (0: off), or ValueError naming it."""
    softcap = _real(softcap)
    if not isinstance(softcap, float) or not 0.0 <= softcap < math.inf:  # refuses NaN too
        raise ValueError(f"softcap must be a finite float >= 0 (0: no capping), got {_shown(softcap)}")
    return softcap


def _autocast_off(device_type: str):
    """Autocast disabled for ``device_type``; nothing for device types autocast does not know (the meta
    device: shape-only calls such as Lightning's ``measure_flops`` run the op's fake kernel)."""
    try:
        return torch.autocast(device_type, enabled=False)
    except RuntimeError:
        return contextlib.nullcontext()


def _autocast_dtype(q: Tensor, k: Tensor, v: Tensor) -> Optional[torch.dtype]:
    """The dtype the op computes in under autocast (None: as given), as autocast casts SDPA's inputs:
    every fp16 / bf16 / fp32 input to the autocast dtype, fp64 kept.

    Raises:
        TypeError: autocast would cast some inputs and not an fp64 one."""
    device_type = q.device.type
    compute_dtype = None
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        autocast_dtype = torch.get_autocast_dtype(device_type)
        cast = [x.dtype in _AUTOCAST_ELIGIBLE for x in (q, k, v)]
        if any(c and x.dtype != autocast_dtype for c, x in zip(cast, (q, k, v))):
            compute_dtype = autocast_dtype
        if compute_dtype is not None and not all(cast):
            raise TypeError(
                f"q, k, v must share one dtype after autocast casts fp16/bf16/fp32 inputs to {autocast_dtype}; "
                f"got q {q.dtype}, k {k.dtype}, v {v.dtype} (fp64 inputs are not cast)"
            )
    return compute_dtype


def _check_dropout(dropout_p: object, warn: bool = True) -> float:
    """``dropout_p`` as a float in [0, 1) (a Python or NumPy number, or a one-element float tensor), or
    ValueError naming it; a UserWarning where the 8-bit keep test applies a p (or keeps a 1 − p) more than 10% off the
    one given (p below ~0.02 or above ~0.98: 1e-3 drops nothing, 0.01 drops 3/256, 0.999 keeps 1/256). ``warn=False``:
    validation only (the swap's pre-checks, whose op call then warns: one warning, not two)."""
    dropout_p = _real(dropout_p)
    if not isinstance(dropout_p, float) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1) (the probability of dropping an attention weight), "
                         f"got {_shown(dropout_p)}")
    applied = reference.dropout_threshold(dropout_p) / 256
    if warn and abs(applied - dropout_p) > 0.1 * min(dropout_p, 1 - dropout_p):
        warnings.warn(f"dropout_p={dropout_p!r} is applied as {applied:g}: the kernels' keep test compares one random "
                      f"byte per attention weight (flash-attn's resolution), so p is rounded to a multiple of 1/256 "
                      f"(kernels/reference.dropout_threshold); for 0.04 <= p <= 0.96 it stays within 5% of p and "
                      f"of 1 − p", stacklevel=3)
    return dropout_p


def _check_options(
    fix: object, ds_format: object, softmax_scale: object, stats_name: object, causal: object, deterministic: object,
    head_dim: int,
) -> float:
    """Validate the options both ops take; return softmax_scale (default ``1 / sqrt(head_dim)``)."""
    if fix not in FIXES:
        raise ValueError(f"fix must be one of {FIXES}, got {fix!r}")
    reference.check_ds_format(ds_format)
    softmax_scale = _check_softmax_scale(softmax_scale, head_dim)
    if stats_name is not None and not isinstance(stats_name, str):
        raise TypeError(f"stats_name must be a str or None, got {type(stats_name).__name__}")
    for arg, value in (("causal", causal), ("deterministic", deterministic)):
        if not isinstance(value, bool):
            kind = type(value)
            name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
            raise TypeError(f"{arg} must be a Python bool (True or False), got {name}")  # numpy.bool, not "bool"
    return softmax_scale


def gproj_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    fix: str = "gproj",
    dropout_p: float = 0.0,
    stats_name: Optional[str] = None,
    seqlens_k: Optional[Tensor] = None,
    ds_format: str = "bf16",
    layout: Optional[str] = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
) -> Tensor:
    """Softmax attention whose backward restores the zero-sum law of dS (GProj, DESIGN.md §4).

    Args:
        q: (batch, seqlen_q, nheads, headdim), the flash-attn layout (``layout="bhsd"``: (batch, nheads,
            seqlen_q, headdim), SDPA's); any strides.
        k, v: (batch, seqlen_k, nheads_k, headdim) (``"bhsd"``: (batch, nheads_k, seqlen_k, headdim)),
            same dtype and device; ``nheads % nheads_k == 0`` (GQA/MQA). headdim a multiple of 8, at
            most 256.
        softmax_scale: τ, multiplies q·kᵀ (a Python or NumPy number, or a one-element float tensor that does
            not require grad: τ is a constant here, it gets no gradient; its value is read on the host, which
            ``torch.compile(fullgraph=True)`` cannot trace — pass a float there); default ``1 / sqrt(headdim)``.
        causal: bottom-right aligned causal mask as in flash-attn ≥ 2.1: query i sees key j iff
            ``j <= i + seqlen_k - seqlen_q`` (for seqlen_q == seqlen_k the usual lower triangle).
            A query row that sees no key outputs 0.
        fix: ``"gproj"`` (default): the P-weighted projection of the rounded dS back onto the
            zero-sum subspace, which cut the dQ error on captured activations from 1–14% to ~0.1%
            (DESIGN.md §4 table); ``"none"``: what an FA3-class BF16 kernel computes (A/B arm);
            ``"gproj_uniform"``: the orthogonal projection (for A/B; it barely helps on real data).
            Both projections make every row of the rounded dS sum to zero (C1, DESIGN.md §2), and an
            fp32 dk (fp32 k under autocast) satisfies Σ_j dK_j = 0 (C2) to a few fp32 ulps of ‖dK‖_F
            (tests/test_gproj_numerics.py, tests/test_triton_kernels.py); a 16-bit dk carries its own
            storage rounding (~√seqlen_k · 2⁻⁹ ‖dK‖).
        dropout_p: attention dropout probability, a float in [0, 1) (flash-attn's ``dropout_p``; 0: off,
            the kernels without any dropout code). O = (P ∘ M) V / (1 − p̂) with a Philox4x32 keep mask
            M generated in the kernels (flash-attn's kind of counter-based mask, one Philox call per 16
            keys of a row, each key kept iff its random byte >= min(round(p · 2⁸), 2⁸ − 1), flash-attn's
            8-bit resolution; the counters are in :func:`lightning_gproj.kernels.reference.dropout_keep_mask`)
            and regenerated by the backward from the same seed. p̂ is p rounded to a multiple of 2⁻⁸
            (|p̂ − p| <= 2⁻⁹ ≈ 0.002 for p < 1 − 2⁻⁹, above which p̂ = 1 − 2⁻⁸; p = 0.1 gives p̂ = 0.1016;
            p <= 2⁻⁹ drops nothing), the probability
            with which a weight is dropped: with the scale 1/(1 − p̂) the op is unbiased dropout with p̂
            (``reference.dropout_scale``). The zero-sum law still holds, for the undropped P
            (dS = P ∘ (dP' − D) with dP' = M ∘ dP/(1 − p̂): Σ_j dS_ij = D_i − D_i Σ_j P_ij = 0,
            kernels/reference.py), so GProj projects along P̃ as without dropout. Apply it in training only (``p if
            self.training else 0.0``), as flash-attn's callers do.
            Each call with dropout draws its 64-bit Philox seed as
            ``torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64)`` from torch's default CPU
            generator (offset 0): ``torch.manual_seed`` makes runs reproducible (within one backend:
            under ``torch.compile`` with inductor the mask differs from eager's, as torch's own dropout
            does), activation checkpointing recomputes the same mask, and that seed given to
            ``dropout_keep_mask`` reproduces it. The draw advances the default generator, so a
            shuffled DataLoader sees a different order than a run without dropout.
        stats_name: label under which the health statistics are recorded while
            ``lightning_gproj.stats.RECORDER`` is enabled (default ``"attention"``).
        seqlens_k: None (every key valid), or an int32 / int64 tensor of shape (batch,) on q's device
            giving each batch row's number of valid keys, ``1 <= seqlens_k[b] <= seqlen_k`` (right
            padding: key j of batch row b is masked iff ``j >= seqlens_k[b]``). With ``causal``:
            query i of batch row b sees key j iff ``j <= i + seqlen_k - seqlen_q`` and
            ``j < seqlens_k[b]`` (for seqlen_q == seqlen_k the usual causal + key-padding mask).
            Values behind the padding never reach a result: keys and values j >= seqlens_k[b] are
            not read into o, dq, dk, dv or the recorded statistics (NaN, inf or any value there
            changes nothing), and get dk = dv = 0 exactly, on every path (Triton, reference). Query
            rows past the padding still attend to the valid keys (their outputs are not zeroed). Not
            differentiable. Checking the values reads them (one device sync per call). The causal
            mask is different: a key hidden from early rows is seen by later ones, so a non-finite
            value there is a non-finite input of the call (it may reach the rows that do not see it,
            as in flash-attn, whose P·V multiplies the zero weight).
        ds_format: how the backward rounds dS before the dQ and dK GEMMs. ``"bf16"`` (default): to the
            16-bit input dtype, as FA3-class kernels do (fp16 inputs: fp16; fp32 / fp64: no rounding).
            ``"e4m3"`` / ``"e5m2"``: to FP8's 4 / 3 significant bits (implicit bit included), round half
            to even, with no range limit — as a per-block-scaled FP8 operand behaves — then fed to the
            same 16-bit GEMMs (exact); for fp32 / fp64 inputs too (the one rounding they then get). For
            stress tests and FP8 research (DESIGN.md §11): the rounding
            error of dS, and with it the uncorrected leak into dQ (``fix="none"``), grows as 2⁻ᵖ for p
            significant bits, i.e. ~16× (e4m3) and ~32× (e5m2) bf16's; ``fix="gproj"`` removes the leak
            from the values the GEMMs used but not the coarser rounding noise itself, so every fix
            shares a higher error floor.
        layout: ``"bshd"`` (batch, seqlen, nheads, headdim), ``"bhsd"`` (batch, nheads, seqlen, headdim:
            the op transposes, no copy, and returns o in that layout too), or None (default): ``"bshd"``,
            with one warning when q looks like ``"bhsd"`` (more than 256 "heads" along dim 2 and fewer
            positions along dim 1). The layout cannot be read off the shapes in general: an SDPA-layout
            call with equal sequence lengths and a plausible number of heads along dim 2 is a valid
            flash-layout call too, and runs attention over the wrong axis. What is caught: shapes that
            contradict the layout (k/v heads that do not divide q's, different k and v shapes,
            mismatched batch or head dim) raise ValueError naming ``layout``.
        window_size: ``(left, right)``, flash-attn's sliding window: query i sees key j iff
            ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right`` (and the other
            masks); −1 = unbounded on that side; ``causal=True`` sets right = 0 (Mistral's sliding
            window is ``(W - 1, 0)`` with causal). Ints >= −1. A mask is invariant under adding a
            constant to a row, so C1 and C2 hold over the visible keys and GProj acts unchanged on
            them; a row with no visible key outputs 0 and gets zero gradients. The kernels skip the
            key blocks outside every row's window (the work saved is the speed-up).
        softcap: 0.0 (off) or cap > 0: logits ``cap · tanh(τ q·k / cap)``, then softmax with no
            further scale (flash-attn, Gemma 2). The zero row sum holds for the gradient w.r.t. the
            capped logits dZ, not for the GEMM operand X = dZ ∘ (1 − t²) (t = tanh(τ s / cap)); GProj
            projects the rounded X̃ so that Σ_j X̃_ij / (1 − t_ij²) = 0, along P̃ ∘ (1 − t²)
            (kernels/reference.py, docs/architecture.md). Softcap breaks C2 in exact arithmetic (a
            shared key shift moves each row's capped logits by different amounts), so no C2 projection
            is applied to dk then.
        deterministic: flash-attn's flag: True makes the backward bit-reproducible (the same inputs give the
            same dq, dk, dv, bit for bit). Every path is, but one: ``fix="none"`` on Hopper
            may run a one-pass backward that adds dq's fp32 partials in whatever order they arrive
            (kernels/attention_bwd_onepass.py); True (or ``torch.use_deterministic_algorithms(True)``) keeps
            the two passes there, whose backward took 7–25% longer on the shapes the one pass serves (H200,
            benchmarks/NOTES.md, run 43). No other effect.

    Returns:
        o: (batch, seqlen_q, nheads, headdim) (``"bhsd"``: (batch, nheads, seqlen_q, headdim)), q's dtype.

    Dtypes: bf16 / fp16 follow the FA3-class rounding model (DESIGN.md §3) — on CUDA through the Triton
    kernels, elsewhere through the PyTorch reference. fp32 and fp64 run the reference in that dtype with
    no rounding emulation, except dS with ``ds_format="e4m3"`` / ``"e5m2"`` (exact-arithmetic gradients up to the dtype's rounding; on CUDA with one
    warning, since it is slow). Under autocast, fp16 / bf16 / fp32 inputs are cast to the autocast dtype
    inside the op, as autocast casts the inputs of ``F.scaled_dot_product_attention`` (so they may
    differ in dtype; an fp64 input among them raises TypeError), and o comes out in that dtype; the
    gradients are returned in each input's own dtype, computed from the kernel's fp32 accumulators: for
    fp32 inputs they are those accumulators, never rounded to 16 bits (a bf16 copy of dK alone breaks
    Σ_j dK_j = 0 by ~√seqlen_k · 2⁻⁹ ‖dK‖, the residual that drove the key bias in
    docs/reproduction.md). For its backward the op keeps the 16-bit copies it computed with, not the wider inputs.

    Raises:
        TypeError: q, k or v not a tensor, not floating point, or of different dtypes (under autocast:
            after the cast above); ``seqlens_k``
            not None / a tensor, or not int32 / int64; ``causal`` or ``deterministic`` not a bool; ``stats_name``
            not a str.
        ValueError: wrong rank, mismatched batch / seqlen_k / heads / head dim, unsupported head dim,
            different devices, empty inputs, ``dropout_p`` not a number in [0, 1), unknown ``fix`` or ``ds_format``, bad
            ``softmax_scale``, ``window_size`` not a pair of ints >= −1, ``softcap`` not a finite float >= 0;
            ``seqlens_k`` not of shape (batch,), not on q's device, or with a value outside
            [1, seqlen_k]; ``layout`` not one of :data:`LAYOUTS` or None.
    """
    _check_tensors(q, k, v)
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout must be None or one of {LAYOUTS}, got {layout!r}")
    if layout == "bhsd":
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.dim() != 4:
                raise ValueError(f"{name} must be 4-D (batch, nheads, seqlen, headdim), got shape {tuple(x.shape)}")
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    device_type = q.device.type
    compute_dtype = _autocast_dtype(q, k, v)
    _check_inputs(q, k, v, compute_dtype, layout)
    if layout is None:
        _warn_if_sdpa_layout(q)
    softmax_scale = _check_options(fix, ds_format, softmax_scale, stats_name, causal, deterministic, q.shape[-1])
    dropout_p = _check_dropout(dropout_p)
    if seqlens_k is not None:
        seqlens_k = _check_seqlens_k(seqlens_k, q, k)
    window_left, window_right = _check_window(window_size)
    softcap = _check_softcap(softcap)
    with _autocast_off(device_type):
        o = _attn_fwd(
            q, k, v, float(softmax_scale), causal, fix, stats_name or "attention", seqlens_k=seqlens_k,
            compute_dtype=compute_dtype, ds_format=ds_format, window_left=window_left, window_right=window_right,
            softcap=softcap, dropout_p=dropout_p, rng=_draw_rng(dropout_p), deterministic=deterministic,
        )[0]
    return o.transpose(1, 2) if layout == "bhsd" else o


# ---------------------------------------------------------------------------------------------------
# Packed sequences (flash-attn's varlen interface): the same op with cu_seqlens (the tensors are
# (total, nheads, headdim) and the row statistics (nheads, total_q)).


def _check_cu_seqlens(cu_seqlens_q: object, cu_seqlens_k: object, device: torch.device) -> None:
    """Type, dtype, shape and device of cu_seqlens_q / cu_seqlens_k (the values are checked in the op)."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, Tensor):
            raise TypeError(f"{name} must be an int32 torch.Tensor of shape (batch + 1,), got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise ValueError(f"{name} must be an int32 tensor (as flash-attn's), got dtype {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got {tuple(cu.shape)}")
        if cu.device != device:
            raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
                         f"{cu_seqlens_q.shape[0] - 1} and {cu_seqlens_k.shape[0] - 1} (shapes {tuple(cu_seqlens_q.shape)} "
                         f"and {tuple(cu_seqlens_k.shape)})")


def _check_max_seqlen(name: str, value: object) -> int:
    """``value`` as a non-negative int (an integer 0-d tensor is read: a device sync; a NumPy integer converted)."""
    integer_tensor = (isinstance(value, Tensor) and value.dim() == 0 and not value.dtype.is_floating_point
                      and value.dtype != torch.bool)
    if integer_tensor or (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int (the longest sequence's length), got {value!r}")
    return value


def gproj_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    fix: str = "gproj",
    dropout_p: float = 0.0,
    stats_name: Optional[str] = None,
    ds_format: str = "bf16",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
) -> Tensor:
    """:func:`gproj_attn_func` over packed sequences (flash-attn's ``flash_attn_varlen_func`` layout).

    Sequence b is the query tokens ``cu_seqlens_q[b] <= i < cu_seqlens_q[b + 1]`` of q and the keys
    ``cu_seqlens_k[b] <= j < cu_seqlens_k[b + 1]`` of k, v; it attends to its own keys only, exactly
    as if it ran alone through :func:`gproj_attn_func` with batch 1 (the same rounding points).
    Sequences never see each other: GProj's r_i is per query row, and with an fp32 dk (fp32 k under
    autocast) the C2 projection makes Σ_j dK_j = 0 over each sequence's keys (per kv head), never
    across sequences. A sequence may be empty: its queries (if any) output 0 and get zero gradients,
    its keys (if any) get dk = dv = 0.

    Args:
        q: (total_q, nheads, headdim), bf16 / fp16 / fp32 / fp64, any strides.
        k, v: (total_k, nheads_k, headdim), same dtype and device; ``nheads % nheads_k == 0`` (GQA/MQA);
            headdim a multiple of 8, at most 256.
        cu_seqlens_q, cu_seqlens_k: int32 tensors of shape (batch + 1,) on q's device (the same batch):
            cumulative sequence lengths, starting at 0, nondecreasing, ending at total_q / total_k.
        max_seqlen_q, max_seqlen_k: ints (or integer 0-d tensors, read at once), at least the longest
            query / key sequence (the kernels' launch size: a larger value only costs idle programs).
        softmax_scale: τ, default ``1 / sqrt(headdim)``.
        causal: bottom-right aligned within each sequence, as flash-attn ≥ 2.1: query i of a sequence
            with n_q queries and n_k keys sees its key j iff ``j <= i + n_k - n_q`` (local positions).
        fix, dropout_p, stats_name, ds_format, deterministic: as :func:`gproj_attn_func` (packed sequences
            always take the bit-reproducible two passes). The dropout mask is
            drawn as one batch row over the packed query tokens i and, for each sequence, its own keys
            j = 0 .. n_k − 1 (:func:`lightning_gproj.kernels.reference.dropout_keep_mask`).
        window_size, softcap: as :func:`gproj_attn_func` (flash-attn's ``flash_attn_varlen_func`` takes
            them too), within each sequence: query i of a sequence sees its key j iff
            ``i + n_k - n_q - left <= j <= i + n_k - n_q + right`` (local positions). With softcap no
            C2 projection is applied to dk (C2 does not hold, :func:`gproj_attn_func`); with a left
            window the C2 projection of each sequence is over the keys some query of it sees.

    Returns:
        o: (total_q, nheads, headdim), q's dtype (under autocast, the autocast dtype).

    Dtypes and autocast: as :func:`gproj_attn_func` (Triton kernels for 16-bit CUDA inputs; the PyTorch
    reference, one sequence at a time, elsewhere).

    Raises:
        TypeError: q, k or v not tensors of a floating dtype listed above or of different dtypes;
            cu_seqlens not a tensor; ``causal`` or ``deterministic`` not a bool; ``stats_name`` not a str.
        ValueError: q, k, v not 3-D, mismatched heads / head dim, unsupported head dim, different
            devices, empty q or k; ``cu_seqlens_q`` / ``cu_seqlens_k`` not int32, not of shape
            (batch + 1,), not on q's device, of different lengths, not starting at 0, decreasing, or
            not ending at total_q / total_k; ``max_seqlen_q`` / ``max_seqlen_k`` not a non-negative int
            or smaller than the longest sequence; ``dropout_p`` not in [0, 1); unknown ``fix`` or ``ds_format``;
            bad ``softmax_scale``; ``window_size`` not a pair of ints >= −1, ``softcap`` not a finite
            float >= 0. The value checks read cu_seqlens (one device sync per call).
    """
    _check_tensors(q, k, v)
    compute_dtype = _autocast_dtype(q, k, v)
    _check_inputs(q, k, v, compute_dtype, packed=True)
    softmax_scale = _check_options(fix, ds_format, softmax_scale, stats_name, causal, deterministic, q.shape[-1])
    dropout_p = _check_dropout(dropout_p)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.device)
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    window_left, window_right = _check_window(window_size)
    softcap = _check_softcap(softcap)
    with _autocast_off(q.device.type):
        o = _attn_fwd(
            q, k, v, softmax_scale, causal, fix, stats_name or "attention", cu_seqlens_q=cu_seqlens_q.contiguous(),
            cu_seqlens_k=cu_seqlens_k.contiguous(), max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            compute_dtype=compute_dtype, ds_format=ds_format, window_left=window_left, window_right=window_right,
            softcap=softcap, dropout_p=dropout_p, rng=_draw_rng(dropout_p), deterministic=deterministic,
        )[0]
    return o
