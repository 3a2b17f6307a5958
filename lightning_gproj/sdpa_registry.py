"""GProj behind PyTorch's own SDPA switch: ``torch.nn.attention.activate_flash_attention_impl("GProj")``.

Recent torch keeps a registry of flash-attention implementations in ``torch.nn.attention``
(``register_flash_attention_impl``, ``activate_flash_attention_impl``, ``restore_flash_attention_impl``,
``current_flash_attention_impl``, ``list_flash_attention_impls``); torch's own FA3 and FA4 providers
register there, and activating one replaces, for the whole process, the CUDA kernels of the aten ops
that ``F.scaled_dot_product_attention``'s flash backend calls. Importing this module registers GProj
under the name ``"GProj"`` (:data:`IMPL`). While it is active, every SDPA call that reaches the flash
backend — in any library, not only in swapped modules — runs the GProj op (``lightning_gproj::attn_fwd``
and ``attn_bwd``: the kernels and numerics of :func:`lightning_gproj.gproj_attn_func`, bit for bit) with
the ``fix`` and ``ds_format`` chosen here (:func:`activate_sdpa_registry`, :func:`use_sdpa_registry`, or
``GProjPlugin(mode="sdpa_registry")``).

What is replaced: the CUDA kernels of ``aten::_scaled_dot_product_flash_attention`` and
``aten::_scaled_dot_product_flash_attention_backward`` (:func:`flash_forward`, :func:`flash_backward`),
whose schemas are checked against the installed torch before anything is registered
(:func:`missing_api`). The lower-level ``aten::_flash_attention_forward`` / ``_backward`` keep
PyTorch's FlashAttention-2 kernels: calls the op cannot serve go there, as the native SDPA-level kernel
would send them.

Which calls run GProj (docs/sdpa_registry.md has the full list):

* served: CUDA fp16 / bf16 SDPA calls that SDPA routes to its flash backend — no ``attn_mask``,
  ``is_causal`` with seqlen_q == seqlen_k or not causal, ``dropout_p`` in [0, 1) (e.g. training Hugging
  Face GPT-2 with its default ``attn_pdrop=0.1``), head dims up to 256, ``scale``, GQA (``enable_gqa=True``);
* run PyTorch's flash kernel (counted in :data:`CALLS` with the reason, one :class:`GProjFallbackWarning`
  per reason): flash-backend calls with ``return_debug_mask``;
* never reach this code: calls SDPA sends to another backend — float or boolean masks (padding), fp32 /
  fp64, CPU tensors, nested tensors, non-square ``is_causal`` — and direct callers of the
  lower-level ops (``torch.nn.attention.varlen``). These are invisible here, not counted.

While active, FLASH_ATTENTION is first in SDPA's backend priority order (``torch._C._set_sdp_priority_order``,
what ``sdpa_kernel(..., set_priority=True)`` sets), so that SDPA does not prefer cuDNN for shapes both
take; the previous order comes back on restore. cuDNN's SDPA is switched off while active
(``torch.backends.cuda.enable_cudnn_sdp(False)``) and its previous setting restored; the flash flag
(``torch.backends.cuda.enable_flash_sdp``) is left as it is: with flash disabled, nothing reaches GProj.

The log-sum-exp returned to autograd is the true ``lse = τ·m + ln2·log2l`` (natural log of Σ_j exp(τ s_ij),
fp32, (batch, nheads, seqlen_q), as FA2 returns it, so code that reads it — context-parallel merging —
stays right); the kernel's exact row statistics m and log2l (kernel contract, docs/architecture.md) ride
in the same allocation behind it, which is how the backward recovers them bit for bit. A backward handed an
lse that is not one of these (PyTorch's own, or a copy) rebuilds them from lse (m = lse/τ, log2l = 0),
correct to fp32 rounding.

Dropout: the forward draws GProj's Philox seed (:func:`lightning_gproj.gproj_attn_func`: from torch's
CPU generator) and returns it where the schema has the Philox state — ``philox_seed`` = (seed, offset)
as a (2,) uint64 tensor on the device, ``philox_offset`` a () uint64 zero, FA2's shapes — and the
backward regenerates the mask from them (reading them is one device sync). A dropout backward whose lse
is not GProj's (its forward ran PyTorch's FA2, e.g. GProj was activated in between) runs PyTorch's flash
backward, which knows FA2's Philox state. The converse cannot be caught here: a forward GProj served
whose backward runs after GProj was restored would hand GProj's seed to FA2's backward, so keep the
backward of dropout calls inside the registry's scope (:func:`use_sdpa_registry`).

Example::

    import lightning_gproj
    with lightning_gproj.use_sdpa_registry(fix="gproj") as calls:
        loss = model(batch).loss          # any F.scaled_dot_product_attention on the flash path runs GProj
        loss.backward()
    print(calls.forward, calls.backward)  # calls served
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from lightning_gproj import ops
from lightning_gproj.swap._common import GProjFallbackError, GProjFallbackWarning, check_ds_format, check_fix

__all__ = [
    "CALLS", "IMPL", "RegistryCalls", "RegistryReport", "activate_sdpa_registry", "flash_backward", "flash_forward",
    "missing_api", "restore_sdpa_registry", "serve_reason", "use_sdpa_registry",
]

#: Name under which GProj is registered in ``torch.nn.attention``'s flash-attention registry.
IMPL = "GProj"
#: ``stats_name`` of the calls served here (no module path is known at the aten level).
STATS_NAME = "sdpa_registry"
#: The ``torch.nn.attention`` functions this mode needs (detected, not inferred from the torch version).
TORCH_API = (
    "register_flash_attention_impl", "activate_flash_attention_impl", "restore_flash_attention_impl",
    "current_flash_attention_impl", "list_flash_attention_impls",
)
#: The aten ops whose CUDA kernels are replaced while GProj is active.
FORWARD_OP = "_scaled_dot_product_flash_attention"
BACKWARD_OP = "_scaled_dot_product_flash_attention_backward"
#: Input dtypes served (the flash backend's); others never reach it from SDPA.
DTYPES = (torch.float16, torch.bfloat16)

_LN2 = math.log(2.0)


@dataclass(frozen=True)
class _Settings:
    fix: str = "gproj"
    ds_format: str = "bf16"
    strict: bool = False


#: What the kernels run with; read at each call (a backward uses the settings in force when it runs).
_SETTINGS = _Settings()


@dataclass
class RegistryCalls:
    """Process-wide counts of the flash-backend calls that reached GProj's kernels.

    Attributes:
        forward: forward calls GProj served.
        backward: backward calls GProj served.
        fallbacks: ``{reason: count}`` of forward calls that ran PyTorch's flash kernel instead.
    """

    forward: int = 0
    backward: int = 0
    fallbacks: Counter = field(default_factory=Counter)

    @property
    def fallback_count(self) -> int:
        return sum(self.fallbacks.values())

    def snapshot(self) -> tuple[int, int, int]:
        """``(forward, backward, fallback_count)`` now."""
        return self.forward, self.backward, self.fallback_count


#: The counts of this process (never reset; compare :meth:`RegistryCalls.snapshot` values).
CALLS = RegistryCalls()
_lock = threading.Lock()
_warned: set[str] = set()


def _signature_names(fn: Any) -> tuple[list[str], list[str]]:
    params = inspect.signature(fn).parameters.values()
    return ([p.name for p in params if p.kind is not p.KEYWORD_ONLY], [p.name for p in params if p.kind is p.KEYWORD_ONLY])


def _schema_names(op: Any) -> tuple[list[str], list[str]]:
    args = op.default._schema.arguments
    return [a.name for a in args if not a.kwarg_only], [a.name for a in args if a.kwarg_only]


def missing_api() -> Optional[str]:
    """None when the installed torch has what this mode needs, else one sentence saying what is missing
    (naming the torch API and the torch version).

    Needs: the :data:`TORCH_API` functions in ``torch.nn.attention``, and ``aten::`` :data:`FORWARD_OP` /
    :data:`BACKWARD_OP` with the argument names and order :func:`flash_forward` / :func:`flash_backward`
    implement.
    """
    import torch.nn.attention as attention

    absent = [name for name in TORCH_API if not callable(getattr(attention, name, None))]
    if absent:
        return (f"torch {torch.__version__} has no flash-attention registry "
                f"(torch.nn.attention.{', torch.nn.attention.'.join(absent)} missing)")
    for name, fn in ((FORWARD_OP, flash_forward), (BACKWARD_OP, flash_backward)):
        op = getattr(torch.ops.aten, name, None)
        try:
            declared = _schema_names(op) if op is not None else None
        except (AttributeError, RuntimeError):
            declared = None
        if declared is None:
            return f"torch {torch.__version__} has no aten::{name}"
        if declared != _signature_names(fn):
            return (f"torch {torch.__version__}'s aten::{name} has arguments {declared[0]} (keyword-only {declared[1]}), "
                    f"not those lightning_gproj implements {_signature_names(fn)}")
    return None


# ---------------------------------------------------------------------------------------------- kernels


def serve_reason(query: Tensor, key: Tensor, value: Tensor, dropout_p: float, return_debug_mask: bool = False) -> Optional[str]:
    """None when GProj serves this flash-backend call, else why it runs PyTorch's flash kernel.

    Args are the aten op's, in SDPA's layout (batch, nheads, seqlen, headdim)."""
    if not 0.0 <= dropout_p < 1.0:
        return f"dropout_p={dropout_p:g} (GProj takes a probability in [0, 1))"
    if return_debug_mask:
        return "return_debug_mask=True"
    if query.dtype not in DTYPES or not (query.dtype == key.dtype == value.dtype):
        return f"dtype {query.dtype} (GProj serves fp16 and bf16 here)"
    if not (query.dim() == key.dim() == value.dim() == 4):
        return "not 4-D (batch, nheads, seqlen, headdim) tensors"
    head_dim = query.shape[-1]
    if key.shape[-1] != head_dim or value.shape != key.shape:
        return "k / v head dims or shapes differ from q's"
    if head_dim % 8 or not 8 <= head_dim <= ops.MAX_HEAD_DIM:
        return f"head dim {head_dim} (GProj takes multiples of 8 up to {ops.MAX_HEAD_DIM})"
    if key.shape[1] == 0 or query.shape[1] % key.shape[1] or 0 in query.shape or 0 in key.shape:
        return "empty tensors or q heads not a multiple of k/v heads"
    return None


def _fallback(reason: str) -> None:
    if _SETTINGS.strict:
        raise GProjFallbackError(f"GProj SDPA registry: GProj cannot serve a flash-backend call with {reason} (strict=True)")
    with _lock:
        CALLS.fallbacks[reason] += 1
    message = (f"GProj SDPA registry: a flash-backend call with {reason} ran PyTorch's flash kernel, without "
               f"GProj's correction")
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(message, GProjFallbackWarning, stacklevel=2)


def _scale(query: Tensor, scale: Optional[float]) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1])


def _strided_like(x: Tensor, ref: Tensor) -> Tensor:
    """``x`` with the strides ``torch.empty_like(ref)`` has (what torch's meta kernels declare for these
    outputs, and what compiled graphs assume), copied only when they differ."""
    if torch.empty_like(ref, device="meta").stride() == x.stride():
        return x
    return torch.empty_like(ref, dtype=x.dtype).copy_(x)


def _lse(m: Tensor, log2l: Tensor, softmax_scale: float) -> Tensor:
    """Natural-log log-sum-exp of the scaled scores from the kernel's row statistics (kernel contract)."""
    return m * softmax_scale + log2l * _LN2


def flash_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: Optional[float] = None,
) -> tuple:
    """GProj's kernel for ``aten::_scaled_dot_product_flash_attention`` (same schema).

    Args:
        query: (batch, nheads, seqlen_q, headdim); key, value: (batch, nheads_k, seqlen_k, headdim),
            fp16 / bf16, any strides.
        dropout_p: attention dropout in [0, 1), GProj's Philox mask (module docstring).
        return_debug_mask: served only at False (else PyTorch's flash kernel runs).
        is_causal: bottom-right aligned causal mask (as FA2; SDPA sends only seqlen_q == seqlen_k here).
        scale: τ, default 1/sqrt(headdim).

    Returns:
        ``(output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask)``:
        output like ``torch.empty_like(query)`` (query's dtype and strides); logsumexp (batch, nheads,
        seqlen_q) fp32, natural log, with the row statistics m and log2l stored behind it (module
        docstring); cum_seq_q = cum_seq_k = None; max_q = seqlen_q, max_k = seqlen_k; philox_seed
        (2,) uint64 on query's device: GProj's Philox (seed, offset) with dropout, zeros without, and
        philox_offset () uint64 zero (the shapes torch's meta kernel declares); debug_attn_mask an
        empty tensor of query's dtype.

    Raises:
        GProjFallbackError: a call it cannot serve while ``strict=True``.
    """
    reason = serve_reason(query, key, value, dropout_p, return_debug_mask)
    if reason is not None:
        _fallback(reason)
        return _native_forward(query, key, value, dropout_p, is_causal, return_debug_mask, scale)
    settings = _SETTINGS
    tau = _scale(query, scale)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    rng = ops._draw_rng(float(dropout_p))
    o, m, log2l = ops._attn_fwd(q, k, v, tau, bool(is_causal), settings.fix, STATS_NAME, ds_format=settings.ds_format,
                                dropout_p=float(dropout_p), rng=rng)[:3]
    # lse first, then m and log2l in the same allocation: autograd saves lse, and the backward finds the
    # exact row statistics behind it (see _row_stats).
    stats = torch.empty((3, *m.shape), dtype=torch.float32, device=m.device)
    stats[0] = _lse(m, log2l, tau)
    stats[1] = m
    stats[2] = log2l
    with _lock:
        CALLS.forward += 1
    device = query.device
    return (
        _strided_like(o.transpose(1, 2), query),
        stats[0],
        None,
        None,
        query.shape[2],
        key.shape[2],
        torch.zeros(2, dtype=torch.uint64, device=device) if rng is None else rng.view(torch.uint64).to(device),
        torch.zeros((), dtype=torch.uint64, device=device),
        torch.empty(0, dtype=query.dtype, device=device),
    )


def _ours(logsumexp: Tensor) -> bool:
    """Whether ``logsumexp`` is the one :func:`flash_forward` returned (its allocation holds m and log2l
    behind it; FA2's lse has an allocation of its own size). Reads no values."""
    n = logsumexp.numel()
    return (
        logsumexp.dtype == torch.float32 and logsumexp.is_contiguous() and logsumexp.storage_offset() == 0
        and logsumexp.untyped_storage().nbytes() == 3 * n * logsumexp.element_size()
    )


def _row_stats(logsumexp: Tensor, softmax_scale: float) -> tuple[Tensor, Tensor]:
    """The kernel's (m, log2l) for a backward: the exact ones :func:`flash_forward` stored behind its
    lse where they reproduce that lse bit for bit, else rebuilt from lse (m = lse/τ, log2l = 0: the same
    P up to fp32 rounding)."""
    n = logsumexp.numel()
    rebuilt_m = logsumexp / softmax_scale
    if not _ours(logsumexp):
        return rebuilt_m, torch.zeros_like(logsumexp)
    packed = logsumexp.as_strided((3, *logsumexp.shape), (n, *logsumexp.stride()), 0)
    m, log2l = packed[1], packed[2]
    exact = _lse(m, log2l, softmax_scale) == logsumexp  # elementwise: no device sync
    return torch.where(exact, m, rebuilt_m), torch.where(exact, log2l, 0.0)


def flash_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    cum_seq_q: Optional[Tensor],
    cum_seq_k: Optional[Tensor],
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    philox_seed: Tensor,
    philox_offset: Tensor,
    *,
    scale: Optional[float] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """GProj's kernel for ``aten::_scaled_dot_product_flash_attention_backward`` (same schema): the GProj
    backward with the ``fix`` and ``ds_format`` in force.

    Args: as the aten op; tensors in SDPA's layout (batch, nheads, seqlen, headdim); ``logsumexp`` as
    :func:`flash_forward` returned it (any other fp32 (batch, nheads, seqlen_q) lse works, to fp32
    rounding). Calls :func:`serve_reason` refuses run PyTorch's flash backward, as their forward did, and
    so do dropout calls whose lse is not GProj's (their forward ran FA2: ``philox_seed`` is FA2's Philox
    state). With dropout, ``philox_seed`` is GProj's (seed, offset) from :func:`flash_forward` (read: one
    device sync), from which the mask is regenerated.

    Returns:
        ``(grad_query, grad_key, grad_value)``, each like ``torch.empty_like`` of its input (dtype, strides).
    """
    if serve_reason(query, key, value, dropout_p) is not None or (dropout_p > 0 and not _ours(logsumexp)):
        return _native_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                                dropout_p, is_causal, philox_seed, philox_offset, scale)
    settings = _SETTINGS
    tau = _scale(query, scale)
    m, log2l = _row_stats(logsumexp, tau)
    q, k, v, o, do = (x.transpose(1, 2) for x in (query, key, value, out, grad_out))
    # the op's autograd saves a contiguous o and hands the kernel a contiguous dO (ops._backward)
    rng = philox_seed.view(torch.int64).cpu() if dropout_p > 0 else None
    dq, dk, dv = ops._attn_bwd(
        do.contiguous(), q, k, v, o.contiguous(), m, log2l, tau, bool(is_causal), settings.fix, STATS_NAME,
        ds_format=settings.ds_format, dropout_p=float(dropout_p), rng=rng,
    )
    with _lock:
        CALLS.backward += 1
    return tuple(_strided_like(g.transpose(1, 2), x) for g, x in ((dq, query), (dk, key), (dv, value)))


def _native_forward(query, key, value, dropout_p, is_causal, return_debug_mask, scale) -> tuple:
    """What PyTorch's own CUDA kernel of the SDPA-level op does: FA2 on (batch, seqlen, nheads, headdim) views."""
    out, lse, rng_state, unused, debug_mask = torch.ops.aten._flash_attention_forward(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None, query.shape[2], key.shape[2],
        dropout_p, is_causal, return_debug_mask, scale=scale,
    )
    return out.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2], rng_state, unused, debug_mask


def _native_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                     is_causal, philox_seed, philox_offset, scale) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out.transpose(1, 2), query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        out.transpose(1, 2), logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
        philox_offset, scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---------------------------------------------------------------------------------------------- registry


def _priority_api() -> Optional[tuple[Any, Any]]:
    get, put = (getattr(torch._C, name, None) for name in ("_get_sdp_priority_order", "_set_sdp_priority_order"))
    return (get, put) if get is not None and put is not None else None


def _prefer_flash() -> Optional[list[int]]:
    """Put FLASH_ATTENTION first in SDPA's priority order; returns the previous order (None where this
    torch has no priority order, which then tries flash first anyway)."""
    api = _priority_api()
    if api is None:
        return None
    from torch.nn.attention import SDPBackend

    previous = [int(b) for b in api[0]()]
    flash = int(SDPBackend.FLASH_ATTENTION)
    api[1]([flash] + [b for b in previous if b != flash])
    return previous


class _Handle:
    """What ``activate_flash_attention_impl("GProj")`` keeps: the ``torch.library`` registration of the two
    kernels for the CUDA key, the priority order and the cuDNN-SDPA switch to restore. ``remove`` undoes
    all three.

    The cuDNN backend is switched off while GProj is active: on the H200 with torch 2.11, SDPA picked
    cuDNN for bf16 causal calls even with FLASH_ATTENTION first in the priority order
    (``torch._fused_sdp_choice`` returned 3; benchmarks/NOTES.md, run 11), so no call reached GProj."""

    def __init__(self, dispatch_key: str = "CUDA") -> None:
        self._library: Optional[torch.library.Library] = torch.library.Library("aten", "IMPL", dispatch_key)
        with warnings.catch_warnings():
            # overriding PyTorch's kernels is the point; torch warns about it once per process
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            self._library.impl(FORWARD_OP, flash_forward, dispatch_key)
            self._library.impl(BACKWARD_OP, flash_backward, dispatch_key)
        self._priority = _prefer_flash()
        self._cudnn = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)

    def remove(self) -> None:
        if self._library is not None:
            self._library._destroy()
            self._library = None
            api = _priority_api()
            if self._priority is not None and api is not None:
                api[1](self._priority)
            torch.backends.cuda.enable_cudnn_sdp(self._cudnn)


def _register() -> _Handle:
    """The ``register_fn`` given to ``torch.nn.attention.register_flash_attention_impl``."""
    return _Handle()


def _attention_api() -> Any:
    missing = missing_api()
    if missing is not None:
        raise RuntimeError(f"GProj's SDPA registry mode is unavailable: {missing}; use the module swap (GProjPlugin's "
                           f"default mode='swap', or lightning_gproj.swap_attention)")
    import torch.nn.attention as attention

    if IMPL not in attention.list_flash_attention_impls():
        attention.register_flash_attention_impl(IMPL, register_fn=_register)
    return attention


def active() -> bool:
    """Whether GProj is the active flash-attention implementation (False where torch has no registry)."""
    if missing_api() is not None:
        return False
    import torch.nn.attention as attention

    return attention.current_flash_attention_impl() == IMPL


def activate_sdpa_registry(fix: str = "gproj", ds_format: str = "bf16", strict: bool = False) -> None:
    """Make GProj the implementation of SDPA's flash backend in this process (``activate_flash_attention_impl("GProj")``).

    Args:
        fix: ``"gproj"`` (default), ``"none"`` or ``"gproj_uniform"``, as :func:`lightning_gproj.gproj_attn_func`.
        ds_format: ``"bf16"`` (default), ``"e4m3"`` or ``"e5m2"``, as :func:`lightning_gproj.gproj_attn_func`.
        strict: a flash-backend call GProj cannot serve (``return_debug_mask``) raises
            :class:`~lightning_gproj.swap.GProjFallbackError` instead of running PyTorch's flash kernel.

    Replaces any active implementation (FA3, FA4, GProj with other settings); :func:`restore_sdpa_registry`
    returns to PyTorch's FA2, :func:`use_sdpa_registry` to whatever was active before.

    Raises:
        ValueError: unknown ``fix`` or ``ds_format``.
        TypeError: ``strict`` not a bool.
        RuntimeError: the installed torch lacks the registry or the op schemas (:func:`missing_api` says which).
    """
    global _SETTINGS
    settings = _check(fix, ds_format, strict)
    attention = _attention_api()
    _SETTINGS = settings
    attention.activate_flash_attention_impl(IMPL)


def _check(fix: object, ds_format: object, strict: object) -> _Settings:
    if not isinstance(strict, bool):
        raise TypeError(f"`strict` must be a bool, got {strict!r}")
    return _Settings(check_fix(fix), check_ds_format(ds_format), strict)


def restore_sdpa_registry() -> None:
    """Restore PyTorch's own flash kernels (and the previous backend priority order) if GProj is active,
    and the default settings (what ``torch.nn.attention.activate_flash_attention_impl("GProj")`` then
    runs); nothing when another implementation (e.g. FA4) is active."""
    global _SETTINGS
    if active():
        import torch.nn.attention as attention

        attention.restore_flash_attention_impl()
        _SETTINGS = _Settings()


@contextlib.contextmanager
def use_sdpa_registry(fix: str = "gproj", ds_format: str = "bf16", strict: bool = False) -> Iterator[RegistryCalls]:
    """Context manager: GProj serves SDPA's flash backend inside the block (:func:`activate_sdpa_registry`),
    and whatever was active before (PyTorch's FA2, FA4, GProj with other settings) is back after it.

    Yields :data:`CALLS` (process-wide counts; compare ``snapshot()`` values across the block).
    Raises as :func:`activate_sdpa_registry`.
    """
    global _SETTINGS
    settings = _check(fix, ds_format, strict)
    attention = _attention_api()
    previous_impl, previous_settings = attention.current_flash_attention_impl(), _SETTINGS
    _SETTINGS = settings
    attention.activate_flash_attention_impl(IMPL)
    try:
        yield CALLS
    finally:
        if previous_impl is None:
            attention.restore_flash_attention_impl()
        else:
            attention.activate_flash_attention_impl(previous_impl)
        _SETTINGS = previous_settings


@dataclass
class RegistryReport:
    """The plugin's report in ``mode="sdpa_registry"`` (the counterpart of
    :class:`~lightning_gproj.swap.SwapReport`): which mode, the settings, and the calls served since
    activation. ``sites`` is empty (no module is swapped)."""

    fix: str
    ds_format: str = "bf16"
    start: tuple[int, int, int] = field(default_factory=CALLS.snapshot)
    start_fallbacks: Counter = field(default_factory=lambda: Counter(CALLS.fallbacks))
    mode: str = "sdpa_registry"
    sites: dict = field(default_factory=dict)

    @property
    def swapped(self) -> list:
        return []

    def counts(self) -> tuple[int, int, int]:
        """``(forward served, backward served, forward fallbacks)`` since activation."""
        now = CALLS.snapshot()
        return tuple(a - b for a, b in zip(now, self.start))

    def _settings(self) -> str:
        return f"fix={self.fix!r}" + ("" if self.ds_format == "bf16" else f", ds_format={self.ds_format!r}")

    def table(self) -> str:
        return (
            f"GProj attention (mode='sdpa_registry', {self._settings()}): torch.nn.attention flash-attention impl "
            f"{IMPL!r} active; every F.scaled_dot_product_attention call that reaches SDPA's flash backend runs GProj, "
            f"no module swapped. Calls SDPA sends to other backends (attention masks, fp32, CPU) keep their kernels; "
            f"flash-backend calls with return_debug_mask run PyTorch's flash kernel."
        )

    def calls_table(self) -> str:
        forward, backward, fell = self.counts()
        lines = [f"GProj attention calls (mode='sdpa_registry', {self._settings()}): {forward} forward and {backward} "
                 f"backward flash-backend calls served, {fell} ran PyTorch's flash kernel"]
        if fell:
            fallbacks = CALLS.fallbacks - self.start_fallbacks
            lines.append("fell back: " + "; ".join(f"{reason} ({n}×)" for reason, n in fallbacks.items()))
        if forward == 0:
            lines.append("no SDPA call reached the flash backend: GProj served nothing (see docs/sdpa_registry.md)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


if missing_api() is None:
    _attention_api()  # registers the name; activating it is the user's choice (torch's rule for providers)
