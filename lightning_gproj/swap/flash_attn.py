"""Route ``flash_attn_func`` and ``flash_attn_varlen_func`` calls made inside chosen modules to
``gproj_attn_func`` and ``gproj_attn_varlen_func``.

Models import flash-attn's function into their own module namespace (``from flash_attn import
flash_attn_func``), so the swap rebinds that *name* in the namespace of the model class's module
(``sys.modules[type(m).__module__]``) to a :class:`FlashAttnFunc` with the original's signature, and
wraps the ``forward`` of each selected module whose class code names it (:class:`FlashForward`),
which marks the module's :class:`Site` active while it runs. The rebound function serves a call only
while a swapped module is active; any other call (another model of the same file, an excluded module,
code outside a forward) runs the original function untouched. Unswapping restores the name once no
swapped module uses it (a ``copy.deepcopy`` of a swapped model is not counted as a user: after its
source is unswapped, the copy's calls run the original, unserved, until it is swapped itself).

Sources (the functions they export):

    flash_attn            flash-attn 2: flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                          return_attn_probs=False)
    flash_attn_interface  FA3 (hopper): flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, ...,
                          window_size=(-1, -1), attention_chunk=0, softcap=0.0, ..., return_attn_probs=False)
    flash_attn.cute       FA4: flash_attn_func(q, k, v, ..., softmax_scale=None, causal=False,
                          window_size=(None, None), learnable_sink=None, softcap=0.0, ..., return_lse=False)

Each also exports ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, ...)`` (packed (total, nheads, headdim) tensors; FA3 adds ``seqused_q/k``, FA4 makes the
cu_seqlens optional and adds ``page_table``), rebound the same way and served by
``gproj_attn_varlen_func`` when cu_seqlens_q and cu_seqlens_k are given (FA4's max_seqlen, when left
None, is read off them) and every other extra keeps its default (no seqused, block/page table).

Arguments are read through the original's own signature, so positional calls bind as the original
would. All take the op's layout (batch, seqlen, nheads, headdim), GQA by fewer k/v heads, and the
bottom-right causal mask, so a served call is a direct op call. Served (``flash_attn_func`` and
``flash_attn_varlen_func`` alike): ``dropout_p`` in [0, 1) (the op's own Philox mask, drawn from torch's
CPU generator: the same distribution as flash-attn's, not the same draws), any sliding window (``window_size``, ints >= −1 or None
for unbounded as FA4 spells it), any ``softcap`` >= 0, no ALiBi / sink / score or mask mods / descales /
qv, ``return_attn_probs``/``return_lse`` False, head dims the op takes. Performance knobs (``num_splits``, ``pack_gqa``,
``sm_margin``) do not change the result and are ignored; ``deterministic`` (a bool) goes to the op, whose backward is then
bit-reproducible (it keeps ``fix="none"`` off the one-pass Hopper backward, kernels/attention_bwd_onepass.py, which
adds dq's partials in any order). A function whose signature has neither
``return_attn_probs`` nor ``return_lse`` (FA3/FA4 versions that always return ``(out, lse)``) is
never served: the op returns no lse.
"""

from __future__ import annotations

import inspect
import sys
import types
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_gproj import ops

from . import sdpa
from ._common import Guard, Site, dropout_reason, op_reason

#: Modules whose functions are rebound, with the name shown in reports.
SOURCES = ("flash_attn", "flash_attn_interface", "flash_attn.cute")
#: The functions rebound in each source: dense, then packed sequences.
FUNCTIONS = ("flash_attn_func", "flash_attn_varlen_func")
#: The packed-sequence arguments of ``flash_attn_varlen_func`` the op serves.
_VARLEN_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
#: Parameters that change speed or memory only.
_IGNORED = ("num_splits", "pack_gqa", "sm_margin")

#: Stack of the sites whose module is running its forward (innermost last). One per process: modules
#: run concurrently in several threads of one process (nn.DataParallel) are not told apart.
_ACTIVE: list[Site] = []
#: (namespace, name) -> the FlashAttnFunc bound there and the swapped modules that use it.
_BINDINGS: dict[tuple[str, str], tuple["FlashAttnFunc", "weakref.WeakSet[nn.Module]"]] = {}


def originals() -> dict[int, tuple[str, Callable]]:
    """``{id(function): (qualified name, function)}`` for the flash-attn functions importable now, e.g.
    ``"flash_attn.flash_attn_varlen_func"`` (only modules already imported are looked at: a model that
    imported them has imported them)."""
    found = {}
    for source in SOURCES:
        for name in FUNCTIONS:
            fn = getattr(sys.modules.get(source), name, None)
            if isinstance(fn, FlashAttnFunc):
                fn = fn.original
            if callable(fn):
                found.setdefault(id(fn), (f"{source}.{name}", fn))
    return found


def _namespace(module: nn.Module) -> Optional[types.ModuleType]:
    return sys.modules.get(type(module).__module__)


def call_sites(module: nn.Module, known: Optional[dict] = None) -> list[tuple[str, str]]:
    """``[(name, qualified name)]``: names in the namespace of ``module``'s class module bound to a
    flash-attn function (original or already rebound) that a function of the class names."""
    known = originals() if known is None else known
    if not known:
        return []
    namespace = _namespace(module)
    if namespace is None:
        return []
    names = set()
    for cls in type(module).__mro__:
        if cls is nn.Module or cls is object or cls.__module__.startswith("torch.nn."):
            continue
        for value in vars(cls).values():
            for fn in sdpa._functions_of(value):
                names |= sdpa._code_names(fn.__code__)
    out = []
    for name in sorted(names):
        bound = vars(namespace).get(name)
        if isinstance(bound, FlashAttnFunc):
            out.append((name, bound.source))
        elif bound is not None and id(bound) in known and known[id(bound)][1] is bound:
            out.append((name, known[id(bound)][0]))
    return out


class FlashAttnFunc:
    """The rebound ``flash_attn_func`` / ``flash_attn_varlen_func``: serves calls made while a swapped
    module is active, else runs the original. Same signature as the original (``__signature__``,
    ``__wrapped__``). ``source``: the qualified name, e.g. ``"flash_attn.flash_attn_func"``."""

    def __init__(self, original: Callable, source: str) -> None:
        self.original = original
        self.source = source
        self.varlen = source.endswith("varlen_func")
        self.__wrapped__ = original
        self.__signature__ = inspect.signature(original)
        self.__name__ = getattr(original, "__name__", "flash_attn_func")
        self.__doc__ = getattr(original, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        site = _ACTIVE[-1] if _ACTIVE else None
        if site is None or site.keep or Guard.depth > 0:
            return self.original(*args, **kwargs)
        reason, call = self.plan(args, kwargs)
        if reason is not None:
            site.fallback(f"{self.source} with {reason}")
            with Guard():
                return self.original(*args, **kwargs)
        site.served += 1
        q, k, v, scale, causal, window, softcap, dropout_p, deterministic, *packed = call
        with Guard():  # an enclosing SDPAMode must not take the SDPA call of an fp32 remediation
            if self.varlen:
                return site.attention_varlen(q, k, v, *packed, softmax_scale=scale, causal=causal, window_size=window,
                                             softcap=softcap, dropout_p=dropout_p, deterministic=deterministic)
            return site.attention(q, k, v, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                                  dropout_p=dropout_p, deterministic=deterministic)

    def plan(self, args: tuple, kwargs: dict) -> tuple[Optional[str], Any]:
        """``(reason, (q, k, v, softmax_scale, causal, window_size, softcap, dropout_p, deterministic))`` (varlen: followed by
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k); reason None when the op serves the call."""
        try:
            bound = self.__signature__.bind(*args, **kwargs)
        except TypeError as err:
            return f"arguments the original does not take ({err})", None
        params = self.__signature__.parameters
        if "return_attn_probs" not in params and "return_lse" not in params:
            return "no return_attn_probs/return_lse parameter (this version returns (out, lse); the op gives no lse)", None
        given = bound.arguments
        names = list(params)
        q, k, v = (given.get(n) for n in names[:3])
        served = (*names[:3], "softmax_scale", "causal", "window_size", "softcap", "dropout_p", "deterministic",
                  *(_VARLEN_ARGS if self.varlen else ()))
        for name, value in given.items():
            # every other parameter (alibi_slopes, qv, descales, sinks,
            # score/mask mods, return flags, seqused / block / page tables, or one a later version adds)
            # must keep its default
            if name in served or name in _IGNORED:
                continue
            if not _is_default(value, params[name].default):
                return f"{name}={_short(value)}", None
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            return "q/k/v that are not all tensors", None
        packed = ()
        if self.varlen:
            packed = tuple(given.get(n) for n in _VARLEN_ARGS)
            if not all(isinstance(t, torch.Tensor) for t in packed[:2]):
                return "cu_seqlens_q/cu_seqlens_k not given as tensors", None
            if packed[2] is None or packed[3] is None:  # FA4 lets them default: read them off cu_seqlens
                longest = [int(cu.diff().max()) if cu.numel() > 1 else 0 for cu in packed[:2]]
                packed = packed[:2] + tuple(longest[i] if packed[2 + i] is None else packed[2 + i] for i in (0, 1))
        rank = 3 if self.varlen else 4
        if not (q.dim() == k.dim() == v.dim() == rank):
            return f"inputs that are not {rank}-D (q {tuple(q.shape)}, k {tuple(k.shape)})", None
        if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
            return "q/k/v of different dtypes or devices", None
        b, bk = (0, 0) if self.varlen else (q.shape[0], k.shape[0])
        h, d, h_k, dk = q.shape[-2], q.shape[-1], k.shape[-2], k.shape[-1]
        if bk != b or k.shape != v.shape or dk != d or h_k == 0 or h % h_k != 0:
            return f"shapes the op does not take (q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})", None
        scale = given.get("softmax_scale")
        reason = op_reason(d, q.numel(), k.numel(), scale)
        if reason is not None:
            return reason, None
        causal = given.get("causal", False)
        if not isinstance(causal, bool):
            return f"causal={causal!r}", None
        # window_size and softcap as the op's own checks take them (NumPy numbers, a 1-element tensor as softcap)
        window = given.get("window_size", (-1, -1))
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            return f"window_size={_short(window)}", None
        try:
            window = ops._check_window(tuple(-1 if x is None else x for x in window))
        except ValueError:
            return f"window_size={_short(window)}", None
        softcap = given.get("softcap", 0.0)
        try:
            softcap = ops._check_softcap(softcap)
        except ValueError:
            return f"softcap={_short(softcap)}", None
        dropout_p = given.get("dropout_p", 0.0)
        reason = dropout_reason(dropout_p)
        if reason is not None:
            return reason, None
        deterministic = given.get("deterministic", False)
        if not isinstance(deterministic, bool):
            return f"deterministic={_short(deterministic)}", None
        return None, (q, k, v, scale, causal, window, softcap, float(dropout_p), deterministic, *packed)


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if default is inspect.Parameter.empty or isinstance(value, torch.Tensor):
        return False
    if isinstance(value, (tuple, list)) and isinstance(default, (tuple, list)):
        # (-1, -1) and (None, None) both mean "no window"
        return all(x in (-1, None) for x in value) and all(x in (-1, None) for x in default)
    try:
        return bool(value == default)
    except Exception:
        return False


def _short(value: Any) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)


class FlashForward(sdpa.SDPAForward):
    """Instance ``forward`` of a module that calls ``flash_attn_func``: marks its site active (and,
    as :class:`~lightning_gproj.swap.sdpa.SDPAForward`, serves its SDPA calls too)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _ACTIVE.append(self.site)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            _ACTIVE.pop()


def swap_module(
    module: nn.Module, name: str, fix: str, bindings: list[tuple[str, str]], keep: bool = False,
    site: Optional[Site] = None,
) -> Site:
    """Rebind the flash-attn ``bindings`` (from :func:`call_sites`) in ``module``'s class module and
    wrap its ``forward`` in :class:`FlashForward` (in place, idempotent; an
    :class:`~lightning_gproj.swap.sdpa.SDPAForward` already there is replaced, keeping its site).
    ``keep=True``: calls inside stay on the original even when an enclosing module is swapped."""
    current = module.__dict__.get("forward")
    if isinstance(current, sdpa.SDPAForward):
        site = current.site
        original = current.original
    else:
        original = current
    site = site or Site(name, type(module).__name__, fix)
    site.fix, site.keep = fix, keep
    if not isinstance(current, FlashForward):
        module.forward = FlashForward(module, site, original)
    namespace = _namespace(module)
    if keep or namespace is None:
        return site
    for attr, source in bindings:
        key = (namespace.__name__, attr)
        if key not in _BINDINGS:
            fn = vars(namespace)[attr]
            wrapper = fn if isinstance(fn, FlashAttnFunc) else FlashAttnFunc(fn, source)
            setattr(namespace, attr, wrapper)
            _BINDINGS[key] = (wrapper, weakref.WeakSet())
        _BINDINGS[key][1].add(module)
    return site


def unswap_module(module: nn.Module) -> bool:
    """Undo :func:`swap_module`: restore ``forward`` and, once no swapped module uses them, the
    original ``flash_attn_func`` names. Returns whether the module was swapped."""
    forward = module.__dict__.get("forward")
    if not isinstance(forward, FlashForward):
        return False
    if forward.original is None:
        del module.forward
    else:
        module.forward = forward.original
    for key in list(_BINDINGS):
        wrapper, users = _BINDINGS[key]
        users.discard(module)
        if not users:
            namespace = sys.modules.get(key[0])
            if namespace is not None and vars(namespace).get(key[1]) is wrapper:
                setattr(namespace, key[1], wrapper.original)
            del _BINDINGS[key]
    return True
